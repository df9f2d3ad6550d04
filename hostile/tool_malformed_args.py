"""Attack: call tools with non-JSON args, a bad signature, a private tool name forged through the raw call function, and a tool that does not exist.
EXPECT: {"status": "ok", "error": null, "answer": "ToolError|ToolError|ToolError|AttributeError", "n_tool_calls": 2}
"""


def run(task, llm, tools):
    out = []
    call = next(c.cell_contents for c in tools.echo.__closure__ if callable(c.cell_contents))
    attempts = [lambda: tools.echo(object()),                       # not JSON: refused in the child
                lambda: tools.echo("a", "b", nonsense=1),           # TypeError in the parent's tool
                lambda: call({"kind": "tool", "name": "_secret", "args": [], "kwargs": {}}),
                lambda: tools.nope("x")]
    for attempt in attempts:
        try:
            attempt()
            out.append("ok")
        except Exception as e:
            out.append(type(e).__name__)
    return "|".join(out)
