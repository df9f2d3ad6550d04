"""Attack: kill the parent process (the trainer) with SIGKILL.
EXPECT: {"status": "error", "error": "os.kill is blocked", "answer": null}
"""
import os


def run(task, llm, tools):
    os.kill(os.getppid(), 9)
    return "killed"
