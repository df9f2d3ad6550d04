"""Attack: raise the recursion limit to 10**6 and recurse without end (pure Python frames); the limit is capped.
EXPECT: {"status": "error", "error": "RecursionError", "answer": null}
"""
import sys


def down(n):
    return down(n + 1)


def run(task, llm, tools):
    sys.setrecursionlimit(10 ** 6)
    return down(0)
