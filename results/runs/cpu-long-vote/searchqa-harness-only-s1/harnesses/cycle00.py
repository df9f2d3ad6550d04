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
    import re
    q = set(re.findall(r"\w+", question.lower())) - {"the", "a", "an", "of", "in", "to", "and", "is", "was",
                                                       "what", "which", "who", "when", "where", "how", "did"}
    lines = []
    for line in passages.splitlines():
        head, _, text = line.partition(": ")
        if not text:  # "No results."
            lines.append(line)
            continue
        sentences = re.split(r"(?<=[.!?])\s+", text)
        best = max(sentences, key=lambda s: len(q & set(re.findall(r"\w+", s.lower()))))
        lines.append(f"{head}: {best}")
    return "\n".join(lines)


def extract_answer(reply, question):
    import re
    m = re.search(r"<answer>(.*?)(?:</answer>|$)", reply, re.DOTALL)
    text = (m.group(1) if m else reply).strip()
    text = re.sub(r"^(the )?(final )?answer( is)?[:\s]*", "", text, flags=re.IGNORECASE)
    words = re.split(r"\n|[.;] |, (?:which|who|and|but) ", text)[0].split()
    return " ".join(words[:8]).strip(" \"',.") or None


def run(task, llm, tools):
    """The second alternative's loop and repair, 5 replies to its first turn: the answer most
    replies give wins (compared without case and punctuation; a tie goes to the earliest reply).
    No answer in any of them: the next turn follows the first reply (its search request, NUDGE)."""
    import collections
    import re
    question = task["question"]
    votes = 5  # replies to the first turn: one llm call, sampled together
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

    def key(answer):
        return " ".join(re.findall(r"\w+", answer.lower()))

    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for ex in EXAMPLES:
        messages += [{"role": "user", "content": USER_TEMPLATE.format(question=ex["question"], passages=ex["passages"])},
                     {"role": "assistant", "content": f"<answer>{ex['answer']}</answer>"}]
    passages = look_up(make_query(question))
    messages.append({"role": "user", "content": USER_TEMPLATE.format(question=question, passages=passages)})
    for turn in range(MAX_TURNS):
        replies = llm(messages, max_tokens=MAX_TOKENS, n=votes if turn == 0 else 1)
        answers = [repair(a) for a in (extract_answer(r, question) for r in replies) if a is not None]
        if answers:
            counts = collections.Counter(key(a) for a in answers)
            return max(answers, key=lambda a: counts[key(a)])  # max keeps the first of equals
        m = re.search(r"<search>(.*?)</search>", replies[0], re.DOTALL)
        result = f"Search result:\n{look_up(m.group(1).strip())}\n\n" if m else ""
        messages += [{"role": "assistant", "content": replies[0]}, {"role": "user", "content": result + NUDGE}]
    return None
