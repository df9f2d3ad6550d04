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

SYSTEM_PROMPT = ("You answer questions by copying the answer from the search result. "
                 "The answer is a short span of one to five words, copied exactly. Do not explain.")
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
    import math
    import re
    stem = lambda w: w[:5]
    q = {stem(w) for w in re.findall(r"\w+", question.lower()) if len(w) > 2} - \
        {"what", "which", "when", "where", "whom", "whose", "how", "the", "and", "did", "does", "was", "were"}
    lines = []
    for line in passages.splitlines():
        head, _, text = line.partition(": ")
        if not text:  # "No results."
            lines.append(line)
            continue
        title = {stem(w) for w in re.findall(r"\w+", head.lower())}
        sentences = [x for x in re.split(r"(?<=[.!?])\s+", text) if x.strip()] or [text]
        bags = [{stem(w) for w in re.findall(r"\w+", x.lower())} for x in sentences]
        weight = lambda w: math.log((1 + len(bags)) / sum(w in b for b in bags)) + (0.2 if w in title else 1.0)
        scores = [sum(weight(w) for w in q & b) for b in bags]
        lines.append(f"{head}: {sentences[scores.index(max(scores))]}")
    return "\n".join(lines)


def extract_answer(reply, question):
    m = re.search(r"<answer>(.*?)</answer>", reply, re.DOTALL)
    return m.group(1).strip() if m else None


def run(task, llm, tools):
    """h0's loop; the answer is completed from the evidence shown: a name cut at an initial
    gets the rest of the name, and a year the text's whole date when the question asks for one."""
    import re
    question = task["question"]
    shown = []

    def look_up(query):
        text = format_passages(question, tools.search(query, **RETRIEVAL))
        shown.append(text)
        return text

    def repair(answer):
        evidence = " ".join(line.partition(": ")[2] for text in shown for line in text.splitlines())
        at = evidence.lower().find(answer.lower())
        if at >= 0 and re.search(r"(^|\s)[A-Z]$", answer):  # "John D" -> "John D. Rockefeller"
            tail = re.match(r"\.?(?:\s+[A-Z][\w'-]*)+", evidence[at + len(answer):])
            answer = answer + tail.group(0) if tail else answer
        if re.fullmatch(r"\d{4}", answer) and re.search(r"\b(date|day)\b", question.lower()):
            month = r"(?:January|February|March|April|May|June|July|August|September|October|November|December)"
            date = re.search(month + r" \d{1,2}, " + answer + r"|\d{1,2} " + month + " " + answer, evidence)
            answer = date.group(0) if date else answer
        return answer

    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for ex in EXAMPLES:
        messages += [{"role": "user", "content": USER_TEMPLATE.format(question=ex["question"], passages=ex["passages"])},
                     {"role": "assistant", "content": f"<answer>{ex['answer']}</answer>"}]
    passages = look_up(make_query(question))
    messages.append({"role": "user", "content": USER_TEMPLATE.format(question=question, passages=passages)})
    for _ in range(MAX_TURNS):
        reply = llm(messages, max_tokens=MAX_TOKENS)
        answer = extract_answer(reply, question)
        if answer is not None:
            return repair(answer)
        m = re.search(r"<search>(.*?)</search>", reply, re.DOTALL)
        result = f"Search result:\n{look_up(m.group(1).strip())}\n\n" if m else ""
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": result + NUDGE}]
    return None
