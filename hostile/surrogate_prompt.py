"""Attack: an llm() prompt with a lone surrogate (U+D800), which the tokenizer raised TypeError on in the parent, ending the run and every resume; it is refused, and a clean prompt after it is sampled.
EXPECT: {"status": "ok", "error": null, "answer": "refused|sampled", "n_calls": 1, "engine": "real", "rollout_timeout": 5.0}
"""


def run(task, llm, tools):
    out = []
    for prompt in ("Say yes. \ud800", "Say yes."):
        try:
            llm(prompt, max_tokens=4)
            out.append("sampled")
        except ToolError as e:
            out.append("refused" if "not valid Unicode" in str(e) else str(e)[:80])
    return "|".join(out)
