"""Attack: raise an exception whose message holds a lone surrogate; in phase B this error text is what invalid.txt would hold. The record keeps it as U+FFFD.
EXPECT: {"status": "error", "error": "ValueError: bad \ufffd", "answer": null}
"""


def run(task, llm, tools):
    raise ValueError("bad \ud800")
