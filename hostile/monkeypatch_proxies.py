"""Attack: tamper with the llm/tools proxies: raise max_tokens via __defaults__, smuggle a temperature through the raw call function, replace a tool locally.
EXPECT: {"status": "ok", "error": null, "answer": "fake|fake|patched", "n_calls": 2, "n_tool_calls": 0}
"""


def run(task, llm, tools):
    llm.__defaults__ = (10 ** 9, None, None)
    a = llm("hi")  # the parent caps max_tokens whatever the proxy sends
    call = next(c.cell_contents for c in llm.__closure__ if callable(c.cell_contents))
    b = call({"kind": "llm", "messages": "hi", "max_tokens": 10 ** 9, "stop": None, "temperature": 0.0,
                   "seed": 1, "completion_ids": [1, 2, 3]})
    tools.echo = lambda text: "patched"  # only changes the child's view; nothing reaches the parent
    return "|".join([a, b, tools.echo("x")])
