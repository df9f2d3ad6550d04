"""Attack: call a tool with arguments nested 600 deep, which the parent's trace writer would recurse into until RecursionError ended the run.
EXPECT: {"status": "ok", "error": null, "answer": "refused", "n_tool_calls": 0}
"""


def run(task, llm, tools):
    x = "leaf"
    for _ in range(600):
        x = [x]
    try:
        tools.echo(x)
    except ToolError as e:
        return "refused" if "nested too deep" in str(e) else str(e)
    return "sent"
