"""Attack: write a file outside the scratch directory.
EXPECT: {"status": "error", "error": "'/tmp/whale_pwned' is blocked", "answer": null}
"""


def run(task, llm, tools):
    with open("/tmp/whale_pwned", "w") as f:
        f.write("pwned")
    return "written"
