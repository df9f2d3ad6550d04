"""Attack: run a shell command through subprocess (creates /tmp/whale_pwned if it works); fails at import, so no rollout runs.
EXPECT: {"status": "error", "error": "import of _posixsubprocess is blocked", "answer": null}
"""
import subprocess


def run(task, llm, tools):
    subprocess.run(["sh", "-c", "touch /tmp/whale_pwned"])
    return "ran"
