"""Attack: start helper threads (a thread bomb; threads are processes to the kernel's RLIMIT_NPROC).
EXPECT: {"status": "error", "error": "can't start new thread", "answer": null}
"""
import threading


def run(task, llm, tools):
    for _ in range(1000):
        threading.Thread(target=lambda: None).start()
    return "spawned"
