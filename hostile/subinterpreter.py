"""Attack: run code in a sub-interpreter, where the parent interpreter's audit hook does not apply.
EXPECT: {"status": "error", "error": "import of _xxsubinterpreters is blocked", "answer": null}
"""


def run(task, llm, tools):
    import _xxsubinterpreters as interpreters
    interp = interpreters.create()
    interpreters.run_string(interp, "open('/tmp/whale_pwned', 'w').write('x')")
    return "ran"
