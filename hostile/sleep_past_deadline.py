"""Attack: sleep far past the rollout deadline.
EXPECT: {"status": "timeout", "error": "rollout timeout", "answer": null}
"""
import time


def run(task, llm, tools):
    time.sleep(3600)
    return "late"
