"""Attack: raise an exception whose __str__ itself raises, to break error reporting.
EXPECT: {"status": "error", "error": "Nasty", "answer": null}
"""


class Nasty(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


def run(task, llm, tools):
    raise Nasty()
