"""Seed harness h0 for searchqa: deliberately weak, like the paper's.

It searches once with the question as the query, shows the model only the top-1 passage cut
to 200 characters, and gives it at most two turns to answer inside <answer></answer>. Instead
of answering, the model may ask for one more search with <search>query</search>; the result
comes back followed by NUDGE. No tag in the last turn means no answer (None).
One worked example comes first as an earlier chat turn: without it a 135M model never writes
the tag at all, so every reward would be 0 and weight training would have nothing to learn from.

Axes: the top-level names the harness search replaces, one at a time:
  SYSTEM_PROMPT, USER_TEMPLATE   prompt text; the template gets {question} and {passages}
  EXAMPLES                       worked examples shown before the real question
  make_query(question)           query rewriting
  RETRIEVAL                      search parameters: k passages, max_chars of each
  format_passages(question, p)   how the search result is shown to the model
  NUDGE                          the message after tool output or a reply without an answer
  extract_answer(reply, question)  answer parsing: str, or None when there is no answer
  MAX_TURNS                      llm calls per task
Standard library only. Contract: run(task, llm, tools) -> str | None.
"""
import re

SYSTEM_PROMPT = "You are a helpful assistant."
USER_TEMPLATE = (
    "Answer the question using the search result.\n\n"
    "Search result:\n{passages}\n\n"
    "Question: {question}\n\n"
    "If you need more information, write <search>query</search>. "
    "Otherwise give your final answer inside <answer></answer>."
)
EXAMPLES = [
    dict(question="How many people live in Paris?",
         passages="[1] Paris: Paris is the capital and most populous city of France, with 2.1 million residents.",
         answer="2.1 million"),
]
RETRIEVAL = dict(k=1, max_chars=1000)  # the whole top passage: most paragraphs are < 1000 chars
NUDGE = "Give your final answer inside <answer></answer>."
MAX_TURNS = 2
MAX_TOKENS = 64  # per llm call; answers are a few words


def make_query(question):
    return question


def format_passages(question, passages):
    return passages


def extract_answer(reply, question):
    m = re.search(r"<answer>(.*?)</answer>", reply, re.DOTALL)
    return m.group(1).strip() if m else None


def run(task, llm, tools):
    question = task["question"]

    def look_up(query):
        return format_passages(question, tools.search(query, **RETRIEVAL))

    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for ex in EXAMPLES:  # worked examples, as earlier turns of the chat
        messages += [{"role": "user", "content": USER_TEMPLATE.format(question=ex["question"], passages=ex["passages"])},
                     {"role": "assistant", "content": f"<answer>{ex['answer']}</answer>"}]
    passages = look_up(make_query(question))
    messages.append({"role": "user", "content": USER_TEMPLATE.format(question=question, passages=passages)})
    for _ in range(MAX_TURNS):
        reply = llm(messages, max_tokens=MAX_TOKENS)
        answer = extract_answer(reply, question)
        if answer is not None:
            return answer
        # no answer yet: run the search the model asked for, if any, then nudge it to answer
        m = re.search(r"<search>(.*?)</search>", reply, re.DOTALL)
        result = f"Search result:\n{look_up(m.group(1).strip())}\n\n" if m else ""
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": result + NUDGE}]
    return None
