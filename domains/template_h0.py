"""Seed harness h0 for the template domain: one model call, the reply as the answer.

A harness is one file, standard library only, defining run(task, llm, tools) -> the answer
(README, "The harness contract"). Each top-level name below is an axis the harness search may
replace whole, one at a time (domains/template.py's PRIMITIVES lists the alternatives):
  SYSTEM_PROMPT, USER_TEMPLATE   prompt text; the template gets .format(question=...)
  extract_answer(reply)          the model's reply -> the answer string, or None
Keep h0 weak on purpose, as in the paper: the search should have something to find.
"""
import re  # for the extract_answer alternatives in PRIMITIVES

SYSTEM_PROMPT = ""
USER_TEMPLATE = "{question}"
MAX_TOKENS = 32


def extract_answer(reply):
    """No parsing: the whole reply (the verifier reads its last integer)."""
    return reply


def run(task, llm, tools):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if SYSTEM_PROMPT else []
    messages.append({"role": "user", "content": USER_TEMPLATE.format(question=task["question"])})
    return extract_answer(llm(messages, max_tokens=MAX_TOKENS))
