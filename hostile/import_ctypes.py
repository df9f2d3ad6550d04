"""Attack: import ctypes to call libc directly (fork, open, ptrace) behind the audit hook's back.
EXPECT: {"status": "error", "error": "import of ctypes is blocked", "answer": null}
"""


def run(task, llm, tools):
    import ctypes
    return str(ctypes.CDLL(None).getpid())
