"""Attack: plant a symlink in scratch that points at the repository, then read through it.
EXPECT: {"status": "error", "error": "os.symlink is blocked", "answer": null}
"""
import os


def run(task, llm, tools):
    os.symlink(task["repo"], "repo")
    return open("repo/jail/sandbox.py").read()[:100]
