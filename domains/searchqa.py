"""searchqa: answer a question about Wikipedia with a BM25 search tool (SQuAD v1.1 dev).

The data is SQuAD v1.1 dev (CC BY-SA 4.0; see data/searchqa/LICENSE-NOTE.md): the retrieval
pool is all 2,067 of its paragraphs and the questions are split by article, so no test
passage is a gold passage in the weight or harness pools. The paper searches full Wikipedia
with a dense FAISS index; a 2k-paragraph BM25 pool keeps the same shape (the model must find
the passage, then read it) on a CPU laptop with nothing fetched at run time.

The parent process owns all of this; a harness only sees task = {"question"} and the tool
    search(query, k=1, max_chars=200) -> str   top-k passages as "[i] Title: text", each cut
                                               to max_chars (k <= 10, max_chars <= 2000)
and its answer is scored by SQuAD exact match against any gold span. Left out: SQuAD's F1
(the recipe needs a binary reward) and dense retrieval. The seed harness is searchqa_h0.py, the
harness search's menu (PRIMITIVES, PROMPT_AXES) searchqa_menu.py; SKILL below is the task as a
proposer reads it.
"""
import gzip
import json
import os
import re
import string
import threading

from domains import check_records
from domains.searchqa_menu import PRIMITIVES, PROMPT_AXES  # noqa: F401  (the domain's interface; ~480 lines)

NAME = "searchqa"
HERE = os.path.dirname(os.path.abspath(__file__))
# $WHALE_DATA points at another data root holding searchqa/ (a fork's own splits); default: the repo's data/
DATA = os.path.join(os.environ.get("WHALE_DATA") or os.path.join(os.path.dirname(HERE), "data"), "searchqa")
H0 = os.path.join(HERE, "searchqa_h0.py")
SPLITS = ("weight", "harness", "val", "test")
MAX_K, MAX_CHARS, MAX_QUERY_CHARS = 10, 2000, 1000


def _read_jsonl_gz(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def load_split(split):
    """weight 2000, harness 128, val 100, test 250 examples: {"id", "task": {"question"}, "answer"}."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    path = os.path.join(DATA, f"{split}.jsonl.gz")
    return check_records(_read_jsonl_gz(path), path, ("question",), ("aliases",))


# ---------------------------------------------------------------- retrieval (BM25)
# Lucene's English stop words and a crude plural/suffix stemmer: enough to match "engines" with
# "engine" without pulling in PyStemmer (+1.4 points recall@5 on the weight pool over no stemming).
_STOP = frozenset("a an and are as at be but by for if in into is it no not of on or such that the their then "
                  "there these they this to was will with".split())


def _stem(word):
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    for suf in ("ing", "ed", "ly"):
        if len(word) > len(suf) + 3 and word.endswith(suf):
            return word[: -len(suf)]
    return word


def tokenize(text):
    return [_stem(w) for w in re.findall(r"\w+", text.lower()) if w not in _STOP]


_INDEX = None  # (bm25s.BM25, passages): built once per process on first search (~1-2 s)
_INDEX_LOCK = threading.Lock()


def passages():
    """The retrieval pool: every SQuAD dev paragraph as {"id", "title", "text"} (loaded once)."""
    return _index()[1]


def _index():
    global _INDEX
    with _INDEX_LOCK:
        if _INDEX is None:
            import bm25s  # imported here so load_split/verify work without it

            passages = _read_jsonl_gz(os.path.join(DATA, "passages.jsonl.gz"))
            bm25 = bm25s.BM25()
            # the title is indexed with the text: questions often name the article's topic
            bm25.index([tokenize(p["title"] + " " + p["text"]) for p in passages], show_progress=False)
            _INDEX = (bm25, passages)
    return _INDEX


def _check_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"search(): {name} must be a positive int, got {value!r}")


def retrieve(query, k):
    """Indices of the top-k passages for query, best first; passages with no term in common are dropped."""
    bm25, passages = _index()
    docs, scores = bm25.retrieve([tokenize(query)], k=k, show_progress=False)
    return [int(d) for d, s in zip(docs[0], scores[0]) if s > 0]


def search(query, k=1, max_chars=200):
    """The harness's tool: top-k passages for query as "[i] Title: text", each cut to max_chars."""
    if not isinstance(query, str):
        raise ValueError(f"search(): query must be a str, got {type(query).__name__}")
    _check_int("k", k)
    _check_int("max_chars", max_chars)
    k, max_chars = min(k, MAX_K), min(max_chars, MAX_CHARS)  # clamp, so a greedy harness cannot flood the prompt
    pool = passages()
    hits = []
    for i, d in enumerate(retrieve(query[:MAX_QUERY_CHARS], k)):
        text = pool[d]["text"]
        text = text[:max_chars] + " ..." if len(text) > max_chars else text
        hits.append(f"[{i + 1}] {pool[d]['title']}: {text}")
    return "\n".join(hits) if hits else "No results."


def make_tools(example):
    """Tools for one rollout (run in the parent) and the state verify needs (none here)."""
    return {"search": search}, None


# ---------------------------------------------------------------- verifier
def normalize(text):
    """SQuAD's answer normalisation: lower case, drop punctuation and articles, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def verify(example, answer, state=None):
    """1.0 iff the normalised answer equals a normalised gold span (SQuAD exact match), else 0.0."""
    if not isinstance(answer, str) or len(answer) > 1000:
        return 0.0
    answer = normalize(answer)
    return float(bool(answer) and any(answer == normalize(a) for a in example["answer"]["aliases"]))


SKILL = """\
Task (searchqa): answer a factual question about a Wikipedia article. The harness sees only
task["question"] and one tool, tools.search(query, k=1, max_chars=200) -> str, which returns the
top-k of ~2,000 Wikipedia paragraphs by BM25 as lines "[i] Title: text", each text cut to
max_chars characters (k <= 10, max_chars <= 2000; bad argument types raise ToolError).
The answer (a str returned by run) scores 1 iff, after lower-casing and removing punctuation,
articles and extra spaces, it equals one of the gold answers: a short span copied from the
passage, usually 1-5 words. Extra words score 0.
Axes of the seed harness (top-level names): SYSTEM_PROMPT, USER_TEMPLATE (prompt text, filled
with {question} and {passages}); EXAMPLES (worked examples shown first as earlier chat turns,
a list of dict(question, passages, answer)); make_query(question) (query rewriting); RETRIEVAL
(dict of k and max_chars); format_passages(question, passages) (how the search result is shown);
NUDGE (the message after tool output or a reply without an answer); extract_answer(reply,
question) (answer parsing, None = no answer); MAX_TURNS (llm calls per task); run (the loop
itself: the menu's versions check the answer against the evidence shown, one after a vote). The model is
small: short contexts, worked examples, copied spans and forgiving parsing help it most.
Rules: run(task, llm, tools) -> str | None; standard library only; never hard-code answers,
question text or dataset names; do not try to read files, the network or the verifier.
"""
