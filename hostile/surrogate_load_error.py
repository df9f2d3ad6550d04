"""Attack: fail while the harness module loads, with a lone surrogate in the error (what validation reports for a candidate); the record keeps it as U+FFFD.
EXPECT: {"status": "error", "error": "RuntimeError: \ufffd at import", "answer": null}
"""

raise RuntimeError("\udfff at import")


def run(task, llm, tools):
    return "never"
