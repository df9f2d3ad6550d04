"""Attack: hard-exit the sandbox process (os._exit, no cleanup) after the first batch of llm() calls.
EXPECT: {"status": "crash", "error": "exited with code 0", "answer": null}
"""
import os


def run(task, llm, tools):
    llm("hi")
    os._exit(0)
