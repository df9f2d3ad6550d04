"""Template domain: the smallest complete domain, commented to be copied. Task: add two numbers.

To fork: copy this file to domains/<name>.py and template_h0.py to domains/<name>_h0.py, then
change what each section below says. `python whale.py --domain <name>` finds it by its file
name; `python -m pytest -q -m "not slow" test_whale.py -k every_domain` checks it (the seed
harness validates, every PRIMITIVES alternative splices in and validates, verify scores junk
0.0 or 1.0, the splits load and are disjoint).

What a domain file holds, and who reads it:
  load_split(split)      -> list of {"id": str, "task": {...}, "answer": {...}}   (whale.py)
  make_tools(example)    -> ({name: function}, state)                 (rollout.py, per rollout)
  verify(example, answer, state) -> 0.0 or 1.0, never raises          (rollout.py)
  H0                     the seed harness file                        (whale.py)
  PRIMITIVES, PROMPT_AXES, SKILL   the harness search's menu and brief (primitives.py)
  DATA (optional)        the folder of data files; hashed into the initial-evaluation cache key
  failure_signature(record) (optional) -> which kind of failure a failed rollout is (primitives.py)

This one generates its data (no DATA, no files to ship: the examples come from a fixed seed, so
this file's bytes fix them) and gives the harness no tools, so its failures are told apart by
failure_signature below rather than by the tool-based default. What it leaves out: everything a
real task needs (real data, licences, tools, a careful verifier: see math.py or searchqa.py).
"""
import random
import re
from pathlib import Path

NAME = "template"
SPLITS = ("weight", "harness", "val", "test")
SIZES = {"weight": 400, "harness": 32, "val": 32, "test": 64}
H0 = str(Path(__file__).resolve().with_name("template_h0.py"))


# ---------------------------------------------------------------- data

def load_split(split):
    """All pairs (a, b) of 10..99, shuffled once with a fixed seed and cut into the splits in
    order: the splits are disjoint by construction and the same on every machine. The task is
    what the harness (and so the model) may see; the answer is what only verify reads."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random("template-data-v1").shuffle(pairs)
    start = sum(SIZES[s] for s in SPLITS[:SPLITS.index(split)])
    return [{"id": f"{split}-{i}", "task": {"question": f"What is {a} + {b}?"}, "answer": {"value": a + b}}
            for i, (a, b) in enumerate(pairs[start:start + SIZES[split]])]


# ---------------------------------------------------------------- tools

def make_tools(example):
    """No tools: the harness only calls the model. A domain with tools returns them here, with a
    state object its verify reads (e.g. a game board), built fresh for every rollout. A state
    with a `latest_replies` attribute gets, under rollout.run, the texts of the rollout's latest
    llm() call, so a tool can check an argument against what the model wrote (chess's play())."""
    return {}, None


# ---------------------------------------------------------------- verifier

def verify(example, answer, state=None):
    """1.0 iff the last integer in the answer is the sum. Junk (None, a dict, a huge string)
    scores 0.0: a broken harness costs its rollout, never the run."""
    try:
        numbers = re.findall(r"-?\d+", str(answer)[-1000:]) if isinstance(answer, (str, int)) else []
        return 1.0 if numbers and int(numbers[-1]) == example["answer"]["value"] else 0.0
    except Exception:
        return 0.0


def failure_signature(record):
    """Which kind of failure a failed rollout is, as one of primitives.SIGNATURE_KEYWORDS' names
    (its keywords pick the axes the primitives proposer tries first), or None for the default
    rules. Without tools the default would call every failure "no_tool"; here it is "error"
    (the harness crashed), "no_answer" (no number came back: parsing lost it) or "wrong"."""
    if record.get("status") not in (None, "ok"):
        return "error"
    if not re.search(r"\d", str(record.get("answer") or "")):
        return "no_answer"
    return "wrong"


# ---------------------------------------------------------------- harness search space

# The names a prompt-only search (--method fst) may change.
PROMPT_AXES = {"SYSTEM_PROMPT", "USER_TEMPLATE"}

# The primitives proposer's menu: for each axis (a top-level name of the seed harness) the whole
# replacement definitions it may splice in, one at a time. Each must validate in the harness.
PRIMITIVES = {
    "SYSTEM_PROMPT": [
        'SYSTEM_PROMPT = "You are a calculator. Reply with the number only."',
        'SYSTEM_PROMPT = "Add the two numbers. Answer with one integer and nothing else."',
    ],
    "USER_TEMPLATE": [
        'USER_TEMPLATE = "{question}\\nAnswer with a single number."',
        'USER_TEMPLATE = "{question}\\nThink step by step, then write: The answer is <number>."',
    ],
    "extract_answer": [
        '''def extract_answer(reply):
    """The last number in the reply."""
    numbers = re.findall(r"-?\\d+", reply)
    return numbers[-1] if numbers else None
''',
        '''def extract_answer(reply):
    """The number after "answer is", else the first number."""
    m = re.search(r"answer is\\D*(-?\\d+)", reply, re.I) or re.search(r"-?\\d+", reply)
    return m.group(m.lastindex or 0) if m else None
''',
    ],
}

# What a proposer is told about the task (it never sees answers or the test split).
SKILL = """\
Domain: template (a teaching example). Each task is {"question": "What is A + B?"} with A, B in 10..99.
The verifier reads the LAST integer in the string run() returns. There are no tools.
The seed harness h0 (domains/template_h0.py) has the axes SYSTEM_PROMPT, USER_TEMPLATE
(.format(question=...)) and extract_answer(reply) -> str or None.
Rules: one mechanism per candidate; only the standard library; never compute the answer in harness code.
"""
