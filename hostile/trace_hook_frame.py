"""Attack: install a trace function to rewrite the audit hook's local variables while it runs.
EXPECT: {"status": "error", "error": "sys.settrace is blocked", "answer": null}
"""
import sys


def tracer(frame, event, arg):
    if frame.f_code.co_name == "hook":
        frame.f_locals["blocked"] = frozenset()
    return tracer


def run(task, llm, tools):
    sys.settrace(tracer)
    return open("/tmp/whale_pwned", "w").write("pwned")
