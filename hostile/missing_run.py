"""Attack (by accident): the harness defines main() instead of run().
EXPECT: {"status": "error", "error": "harness defines no run", "answer": null}
"""


def main(task, llm, tools):
    return "x"
