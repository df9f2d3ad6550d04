"""Attack: read the parent's environment and memory, and our own fd table, through /proc.
EXPECT: {"status": "ok", "error": null, "answer": "none"}
"""
import os


def run(task, llm, tools):
    ppid = os.getppid()
    for path in (f"/proc/{ppid}/environ", f"/proc/{ppid}/mem", f"/proc/{ppid}/cmdline", "/proc/self/environ",
                 "/proc/1/environ", "/etc/shadow"):
        try:
            with open(path, "rb") as f:
                return "leaked:" + path + repr(f.read(64))
        except OSError:
            pass
    try:
        return "listed:" + ",".join(os.listdir("/proc/self/fd"))
    except OSError:
        return "none"
