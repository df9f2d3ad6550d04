"""Attack: find the RPC pipe by trying fds 3..63 and write garbage into it.
EXPECT: {"status": "protocol", "error": "protocol violation", "answer": null}
"""
import os


def run(task, llm, tools):
    for fd in range(3, 64):
        try:
            os.write(fd, b"garbage garbage garbage")
        except OSError:
            pass
    return "wrote"
