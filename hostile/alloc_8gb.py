"""Attack: allocate 8 GB at once.
EXPECT: {"status": "error", "error": "MemoryError", "answer": null}
"""


def run(task, llm, tools):
    hog = bytearray(8 << 30)
    return str(len(hog))
