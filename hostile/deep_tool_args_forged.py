"""Attack: the same 600-deep tool arguments, written straight into the pipe so that the child's own check is skipped.
EXPECT: {"status": "protocol", "error": "nested deeper than 32 levels", "answer": null, "n_tool_calls": 0}
"""
import json
import os


def run(task, llm, tools):
    x = "leaf"
    for _ in range(600):
        x = [x]
    body = json.dumps({"t": "call", "rid": 0, "kind": "tool", "name": "echo", "args": [x], "kwargs": {}}).encode()
    for fd in range(3, 64):
        try:
            os.write(fd, len(body).to_bytes(4, "big") + body)
        except OSError:
            pass
    return "wrote"
