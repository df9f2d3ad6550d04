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

SYSTEM_PROMPT = "Answer math questions. The final answer is a single whole number. Always end your reply with \\boxed{number}."

USER_TEMPLATE = "Problem: {problem}\n\nWrite a short Python program that computes the answer and prints it, in one ```python code block."

MAX_TURNS = 2

MAX_TOKENS = 384


def normalize_code(text):
    """Run the first ```python block exactly as written (no print is added)."""
    m = re.search(r"```python\n(.*?)```", text, re.S)
    return m.group(1) if m else None


def format_feedback(output):
    """Different nudges for an error, an empty output and a good run."""
    out = output.strip()
    if not out:
        return "Your code printed nothing. Add print(...) for the answer and send the code again."
    if "Error" in out.splitlines()[-1]:
        return "Your code failed:\n" + out + "\nFix the mistake and send the corrected ```python code."
    return "Output: " + out + "\nThe final answer is this number. Reply with \\boxed{" + out.splitlines()[-1] + "}."


def recover_answer(text, output):
    """Without a box, trust the code's last printed number, then the reply's last number."""
    if "\\boxed" in text:
        return text
    for source in (output or "", text):
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", source)
        if numbers:
            return numbers[-1].replace(",", "")
    return None


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
