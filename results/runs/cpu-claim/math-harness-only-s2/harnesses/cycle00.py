"""Seed harness h0 for the math domain: deliberately weak, like the paper's.

The problem goes in as the only user message (no system prompt), with a request
for the answer in \\boxed{}. If the reply contains a ```python block and no
boxed answer, the block is run once with tools.python and its output is shown
back to the model; nothing else helps the model along. The return value is the
model's last reply, which the verifier reads strictly: no \\boxed{} = wrong.

The axes, each one top-level name that a search may replace:
  SYSTEM_PROMPT, USER_TEMPLATE  prompts ("" = no system message; the template
                                gets .format(problem=...), so braces are doubled)
  normalize_code(text)          model reply -> code to run, or None (no code)
  format_feedback(output)       interpreter output -> next user message (nudges)
  recover_answer(text, output)  last reply (+ last code output or None) -> answer
  MAX_TURNS                     model calls per problem
Harnesses may import only the standard library; `re` is the only import here,
so a replacement that needs more imports it inside its own function.
"""
import re

SYSTEM_PROMPT = "You are a careful math tutor. Solve the problem step by step, one short calculation per line, then write the final answer as \\boxed{number}."

USER_TEMPLATE = "{problem}\nPut your final answer within \\boxed{{}}."

MAX_TURNS = 2

MAX_TOKENS = 384


def normalize_code(text):
    """Run the first ```python block exactly as written (no print is added)."""
    m = re.search(r"```python\n(.*?)```", text, re.S)
    return m.group(1) if m else None


def format_feedback(output):
    """Show the raw interpreter output, with no hint of what to do next."""
    return "Output:\n" + output


def recover_answer(text, output):
    """Without a box, take the last number in the reply."""
    if "\\boxed" in text:
        return text
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return numbers[-1].replace(",", "") if numbers else None


def run(task, llm, tools):
    messages = []
    if SYSTEM_PROMPT:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    messages.append({"role": "user", "content": USER_TEMPLATE.format(problem=task["problem"])})
    text, output = "", None
    for _ in range(MAX_TURNS):
        text = llm(messages, max_tokens=MAX_TOKENS)
        if "\\boxed" in text:
            break  # the model has answered
        code = normalize_code(text)
        if code is None:
            break  # no answer and no code: nothing left to do
        try:
            output = tools.python(code)
        except Exception as e:  # a tool error is feedback too, not a crash
            output = f"Error: {e}"
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": format_feedback(output)})
    return recover_answer(text, output)
