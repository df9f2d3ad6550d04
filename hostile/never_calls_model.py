"""Attack: answer without ever calling the model (allowed; the verifier decides, and nothing is recorded).
EXPECT: {"status": "ok", "error": null, "answer": "42", "n_calls": 0}
"""


def run(task, llm, tools):
    return 42
