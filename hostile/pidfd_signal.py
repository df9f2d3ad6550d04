"""Attack: signal a process outside the sandbox through a pidfd (os.pidfd_open + signal.pidfd_send_signal), which the audit hook's os.kill rule does not see; then try to import the module again to get the functions back.
EXPECT: {"status": "ok", "error": null, "answer": "pidfd_open: gone|pidfd_send_signal: gone|reimport: blocked"}
"""
import os
import signal
import sys


def run(task, llm, tools):
    out = []
    for module, name in ((os, "pidfd_open"), (signal, "pidfd_send_signal")):
        out.append(f"{name}: " + ("there" if hasattr(module, name) else "gone"))
    if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
        signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGTERM)
    try:
        sys.modules.pop("_signal", None)
        import _signal  # noqa: F401
        out.append("reimport: " + ("there" if hasattr(_signal, "pidfd_send_signal") else "gone"))
    except PermissionError:
        out.append("reimport: blocked")
    return "|".join(out)
