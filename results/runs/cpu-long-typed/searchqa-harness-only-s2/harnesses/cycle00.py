"""run: alternative 3/3 on cand_020 (failures of the parent: wrong x50, unsupported x47, truncated x12)

extract_answer: alternative 1/4 on cand_011 (failures of the parent: wrong x48, unsupported x40, truncated x12, no_answer x9)

run: alternative 2/3 on cand_009 (failures of the parent: wrong x50, unsupported x40, truncated x12, no_answer x9)

SYSTEM_PROMPT: alternative 1/2 on cand_005 (failures of the parent: unsupported x47, wrong x46, truncated x11, no_answer x9)

format_passages: alternative 3/4 on cand_001 (failures of the parent: wrong x44, unsupported x42, truncated x15, no_answer x14)

RETRIEVAL: alternative 1/5 on cand_000 (failures of the parent: truncated x99, no_answer x24, wrong x1)

Seed harness h0 for searchqa: deliberately weak, like the paper's.

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
    import re
    m = re.search(r"<answer>(.*?)(?:</answer>|$)", reply, re.DOTALL)
    lines = [l.strip() for l in (m.group(1) if m else reply).splitlines() if l.strip()]
    if not lines:
        return None
    answer = re.sub(r"^(the )?(final )?answer( is)?[:\s]*", "", lines[0], flags=re.IGNORECASE)
    return answer.strip(" .\"'") or None


def run(task, llm, tools):
    """The third alternative's vote, checked against the evidence shown when the question asks for
    a number ("how many/much") or a time ("when", "what year"): a reply counts only with a span of
    that kind that is in the evidence (the span alone: "20,000 warriors" -> "20,000"; a year
    widened to the evidence's whole date), and when no reply has one, the evidence's span of that
    kind with most of the question's words around it answers. Other questions: the plain vote."""
    import collections
    import re
    question = task["question"]
    votes = 5  # replies to the first turn: one llm call, sampled together
    shown = []
    months = "January|February|March|April|May|June|July|August|September|October|November|December"
    words = "one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|twenty|thirty|forty|fifty|hundred"
    spans = {  # what an answer of each kind looks like
        "number": rf"\b(?:\d[\d,]*(?:\.\d+)?%?|(?:{words})(?:-(?:one|two|three|four|five|six|seven|eight|nine))?)"
                  r"(?:\s+(?:million|billion|thousand|hundred|percent|per cent))?\b",
        "time": rf"\b(?:\d{{1,2}} (?:{months}) \d{{4}}|(?:{months}) \d{{1,2}}, \d{{4}}|(?:{months}) \d{{4}}"
                rf"|(?:early |mid-|late )?\d{{4}}s?|\d{{1,2}}(?:st|nd|rd|th) century)\b",
    }
    q = question.lower()
    kind = ("number" if re.search(r"\bhow (?:many|much)\b", q) else
            "time" if re.search(r"\b(?:when|what year|which year|what date|what day)\b", q) else None)

    def look_up(query):
        text = format_passages(question, tools.search(query, **RETRIEVAL))
        shown.append(text)
        return text

    def evidence():
        return " ".join(line.partition(": ")[2] for text in shown for line in text.splitlines())

    def repair(answer):
        text = evidence()
        at = text.lower().find(answer.lower())
        if at >= 0 and re.search(r"(^|\s)[A-Z]$", answer):  # "John D" -> "John D. Rockefeller"
            tail = re.match(r"\.?(?:\s+[A-Z][\w'-]*)+", text[at + len(answer):])
            answer = answer + tail.group(0) if tail else answer
        return answer

    def key(answer):
        return " ".join(re.findall(r"\w+", answer.lower()))

    def given(span):  # a number or year the question gives is not its answer
        return f" {key(span)} " in f" {key(question)} "

    def of_kind(answer):
        """The span of the asked kind in an answer, if the evidence has it and the question does not;
        a year -> its whole date."""
        text = evidence()
        for m in re.finditer(spans[kind], answer, re.IGNORECASE):
            span = m.group(0)
            if key(span) and f" {key(span)} " in f" {key(text)} " and not given(span):
                wider = [d.group(0) for d in re.finditer(spans[kind], text) if key(span) in key(d.group(0))]
                return max(wider, key=len) if kind == "time" and wider else span
        return None

    def from_evidence():
        """The span of the asked kind in the evidence closest to the question's words (each of them
        within 6 words counts 1 / its distance: "seven millers" for "how many millers"; its
        numbers do not count, they are not the answer)."""
        text = evidence()
        asked = set(re.findall(r"[^\W\d]+", q)) - {"how", "many", "much", "when", "what", "which", "year", "the",
                                                  "a", "an", "of", "in", "did", "was", "is", "do", "does"}
        best, score = None, 0
        for m in re.finditer(spans[kind], text, re.IGNORECASE):
            if given(m.group(0)):
                continue
            before = re.findall(r"\w+", text[:m.start()].lower())[-6:][::-1]  # nearest first
            after = re.findall(r"\w+", text[m.end():].lower())[:6]
            s = sum(1 / (d + 1) for side in (before, after) for d, w in enumerate(side) if w in asked)
            if best is None or s > score:
                best, score = m.group(0), s
        return best

    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for ex in EXAMPLES:
        messages += [{"role": "user", "content": USER_TEMPLATE.format(question=ex["question"], passages=ex["passages"])},
                     {"role": "assistant", "content": f"<answer>{ex['answer']}</answer>"}]
    passages = look_up(make_query(question))
    messages.append({"role": "user", "content": USER_TEMPLATE.format(question=question, passages=passages)})
    for turn in range(MAX_TURNS):
        replies = llm(messages, max_tokens=MAX_TOKENS, n=votes if turn == 0 else 1)
        answers = [repair(a) for a in (extract_answer(r, question) for r in replies) if a is not None]
        if kind:
            typed = [s for s in map(of_kind, answers) if s]
            answers = typed or [s for s in [from_evidence()] if s] or answers
        if answers:
            counts = collections.Counter(key(a) for a in answers)
            return max(answers, key=lambda a: counts[key(a)])  # max keeps the first of equals
        m = re.search(r"<search>(.*?)</search>", replies[0], re.DOTALL)
        result = f"Search result:\n{look_up(m.group(1).strip())}\n\n" if m else ""
        messages += [{"role": "assistant", "content": replies[0]}, {"role": "user", "content": result + NUDGE}]
    return None
