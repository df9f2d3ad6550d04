"""Attack: print and return text with lone surrogates, which the trace, the archive and the log would carry on; the record keeps them as U+FFFD.
EXPECT: {"status": "ok", "error": null, "answer": "yes \ufffd", "stdout": "out \ufffd\ufffd\n"}
"""


def run(task, llm, tools):
    print("out \udfff\ud800")  # low then high: two lone surrogates, not a pair (high then low is one character)
    return "yes \udc80"
