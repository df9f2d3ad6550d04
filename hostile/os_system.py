"""Attack: os.system a shell command (creates /tmp/whale_pwned if it works).
EXPECT: {"status": "error", "error": "os.system is blocked", "answer": null}
"""
import os


def run(task, llm, tools):
    os.system("touch /tmp/whale_pwned")
    return "ran"
