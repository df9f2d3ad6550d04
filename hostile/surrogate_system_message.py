"""Attack: a lone surrogate in a system message, an assistant turn and a stop string of llm() (the first two reach the tokenizer through the chat template); each call is refused.
EXPECT: {"status": "ok", "error": null, "answer": "refused|refused|refused", "n_calls": 0, "engine": "real", "rollout_timeout": 5.0}
"""


def run(task, llm, tools):
    out = []
    for messages, stop in (([{"role": "system", "content": "Be brief. \udfff"}, {"role": "user", "content": "Hi"}], None),
                           ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\udc80"},
                             {"role": "user", "content": "Again"}], None),
                           ("Hi", ["\ud83d"])):
        try:
            llm(messages, max_tokens=4, stop=stop)
            out.append("sampled")
        except ToolError as e:
            out.append("refused" if "not valid Unicode" in str(e) else str(e)[:80])
    return "|".join(out)
