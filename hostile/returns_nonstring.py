"""Attack: return an object that is not a string (a dict with a __str__ trap); the answer must become None.
EXPECT: {"status": "ok", "error": null, "answer": null}
"""


class Sneaky(dict):
    def __str__(self):
        return "the right answer"


def run(task, llm, tools):
    return Sneaky(answer=42)
