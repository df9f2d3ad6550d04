"""Attack (a common bug): __getattr__ that recurses forever, at the default recursion limit, in a rollout thread.
EXPECT: {"status": "error", "error": "RecursionError", "answer": null}
"""


class Proxy:
    def __getattr__(self, name):
        return getattr(Proxy(), name)


def run(task, llm, tools):
    return Proxy().answer
