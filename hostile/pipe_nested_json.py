"""Attack: send the parent a frame of absurdly nested JSON, hoping its decoder blows the parent's stack.
EXPECT: {"status": "protocol", "error": "undecodable message (RecursionError)", "answer": null}
"""
import os


def run(task, llm, tools):
    body = b"[" * 2000 + b"]" * 2000  # under PIPE_BUF, so each write lands whole
    for fd in range(3, 64):
        try:
            os.write(fd, len(body).to_bytes(4, "big") + body)
        except OSError:
            pass
    return "wrote"
