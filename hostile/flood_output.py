"""Attack: flood stdout and stderr (print, sys.stderr, raw fd writes) with 50 MB.
EXPECT: {"status": "ok", "error": null, "answer": "flooded", "stdout_len": 2000}
"""
import os
import sys


def run(task, llm, tools):
    chunk = "x" * 1_000_000
    for _ in range(20):
        print(chunk)
        sys.stderr.write(chunk)
    for _ in range(10):
        os.write(1, chunk.encode())
        os.write(2, chunk.encode())
    return "flooded"
