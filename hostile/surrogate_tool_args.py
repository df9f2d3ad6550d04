"""Attack: lone surrogates in a tool's argument and in a keyword name, which would reach the tool, the trace and the archive; both calls are refused and recorded without their arguments.
EXPECT: {"status": "ok", "error": null, "answer": "refused|refused", "n_tool_calls": 2}
"""


def run(task, llm, tools):
    out = []
    for args, kwargs in ((["x \ud800"], {}), ([], {"text\udfff": "x"})):
        try:
            tools.echo(*args, **kwargs)
            out.append("called")
        except ToolError as e:
            out.append("refused" if "not valid Unicode" in str(e) else str(e)[:80])
    return "|".join(out)
