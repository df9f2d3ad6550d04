"""Attack (by accident): a Python 2 file with a print statement.
EXPECT: {"status": "error", "error": "SyntaxError", "answer": null}
"""


def run(task, llm, tools):
    print "hello"
    return "x"
