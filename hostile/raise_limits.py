"""Attack: lift the process and memory limits with resource.setrlimit.
EXPECT: {"status": "error", "error": "resource.setrlimit is blocked", "answer": null}
"""
import resource


def run(task, llm, tools):
    resource.setrlimit(resource.RLIMIT_NPROC, (10 ** 6, 10 ** 6))
    return "raised"
