"""Attack: raise the recursion limit to 10**6 and recurse through C (str() -> __str__) to overflow the thread's C stack; the capped limit turns it into a RecursionError.
EXPECT: {"status": "error", "error": "RecursionError", "answer": null}
"""
import sys


class Deep:
    def __str__(self):
        return str(Deep())


def run(task, llm, tools):
    sys.setrecursionlimit(10 ** 6)
    return str(Deep())
