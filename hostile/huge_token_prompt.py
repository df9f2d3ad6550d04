"""Attack: llm() prompts under the character cap that are huge in tokens: 100,000 tiny messages (~700k tokens of chat template), 256 long messages, one 240k-character message; the parent's prefill would take gigabytes.
EXPECT: {"status": "ok", "error": null, "answer": "messages|tokens|tokens", "n_calls": 0, "engine": "real", "rollout_timeout": 5.0}
"""


def run(task, llm, tools):
    out = []
    for messages in ([{"role": "user", "content": "a"}] * 100_000,
                     [{"role": "user", "content": "word " * 200}] * 256,
                     "hello " * 40_000):
        try:
            llm(messages, max_tokens=8)
            out.append("sampled")
        except ToolError as e:
            out.append("tokens" if "token cap" in str(e) else "messages" if "256 messages" in str(e) else str(e)[:80])
    return "|".join(out)
