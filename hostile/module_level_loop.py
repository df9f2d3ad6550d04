"""Attack: hang at import time, before run() is ever called.
EXPECT: {"status": "timeout", "error": "took longer", "answer": null}
"""
while True:
    pass


def run(task, llm, tools):
    return "x"
