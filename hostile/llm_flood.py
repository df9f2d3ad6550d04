"""Attack: call llm() in a loop, so that the model's time (not charged before) keeps the rollout going long past its deadline.
EXPECT: {"status": "timeout", "error": "rollout timeout", "answer": null, "engine": "real"}
"""


def run(task, llm, tools):
    while True:
        try:
            llm("Count from one to one hundred.", max_tokens=16)
        except ToolError as e:
            if "timed out" in str(e):
                raise
