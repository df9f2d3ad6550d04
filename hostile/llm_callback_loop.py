"""Attack: pass llm() a message object whose serialisation spins forever, hoping the busy loop lands in the parent.
EXPECT: {"status": "timeout", "error": "rollout timeout", "answer": null}
"""


class Spin(dict):
    def items(self):  # json.dumps calls this for dict subclasses: it runs in the child, not the parent
        while True:
            pass


def run(task, llm, tools):
    return llm([Spin(role="user", content="hi")])
