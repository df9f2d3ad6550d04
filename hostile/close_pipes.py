"""Attack: close every inherited descriptor, the RPC pipes included, so the child can no longer talk.
EXPECT: {"status": "crash", "error": "rollout process exited", "answer": null}
"""
import os


def run(task, llm, tools):
    for fd in range(3, 64):
        try:
            os.close(fd)
        except OSError:
            pass
    return llm("still there?")
