"""Attack: spin forever in run() without ever calling the model.
EXPECT: {"status": "timeout", "error": "rollout timeout", "answer": null}
"""


def run(task, llm, tools):
    while True:
        pass
