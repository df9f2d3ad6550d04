"""Attack: return a 10 MB answer string (bigger than the pipe's message cap).
EXPECT: {"status": "ok", "error": null, "answer_len": 10000}
"""


def run(task, llm, tools):
    return "y" * 10_000_000
