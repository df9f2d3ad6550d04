"""Attack: open a network socket to phone home.
EXPECT: {"status": "error", "error": "socket.__new__ is blocked", "answer": null}
"""
import socket


def run(task, llm, tools):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.connect(("127.0.0.1", 22))
    return "connected"
