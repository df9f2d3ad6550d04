"""Attack: classic fork bomb.
EXPECT: {"status": "error", "error": "os.fork is blocked", "answer": null}
"""
import os


def run(task, llm, tools):
    while True:
        os.fork()
