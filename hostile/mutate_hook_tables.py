"""Attack: switch the audit hook off by rewriting what it reads: its tables and constants in sys.modules["__main__"], os.path.realpath and posixpath's helpers, builtins.
EXPECT: {"status": "ok", "error": null, "answer": "listdir: blocked|open: blocked|socket: blocked"}
"""
import builtins
import os
import posixpath
import socket
import sys


def run(task, llm, tools):
    main = sys.modules["__main__"]  # the sandbox's own module, in the child
    main._PATH_EVENTS.clear()
    main._BLOCKED_EVENTS, main._BLOCKED_PREFIXES, main._BLOCKED_MODULES = frozenset(), ("-",), frozenset()
    main._WRITE_FLAGS = 0
    scratch = os.getcwd()
    posixpath._joinrealpath = lambda path, rest, strict, seen: (scratch, True)
    os.path.realpath = posixpath.realpath = lambda path, strict=False: scratch
    os.fsdecode = lambda path: "."
    real_type, builtins.type = builtins.type, lambda x: int  # the hook's "already-open descriptor" test
    out = []
    data = task["data"] + "/searchqa/test.jsonl.gz"
    for name, attempt in (("listdir", lambda: os.listdir("/")), ("open", lambda: open(data, "rb")),
                          ("socket", socket.socket)):
        try:
            attempt()
            out.append(name + ": done")
        except PermissionError as e:
            out.append(name + (": blocked" if "sandbox:" in str(e) else ": " + str(e)[:40]))
    builtins.type = real_type
    return "|".join(out)
