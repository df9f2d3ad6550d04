"""
The domains (domains/searchqa.py, math.py, chess.py; data/): data, verifiers, h0 and its
primitives, reproducible builds; one contract checked on every domains/*.py (the template too).
"""
import ast
import filecmp
import gzip
import hashlib
import re
import importlib.util
import subprocess
import sys
import time
import types
from pathlib import Path

import chess as pychess
import pytest

import domains
from domains import chess as chessdom
from domains import math as M
from domains import searchqa
from harness_search import harness_source as hsrc
from harness_search import primitives
from jail import sandbox
from lm import models
from tests.helpers import FakeTools, ROOT, load_harness, scripted_llm


# ==============================================================================================
# THE DOMAINS (domains/searchqa.py, math.py, chess.py; data/)
# ==============================================================================================
# Guarantee: each domain's splits have their documented sizes, are disjoint (by article, problem,
# position) and keep the answer out of the task; its verifier scores every gold answer 1,
# forgives notation but not a wrong answer, and scores junk 0 without raising; its seed harness
# h0 runs, and every primitive splices into h0, compiles and runs; the committed data files are
# rebuilt byte for byte from their sources.

@pytest.fixture(scope="session")
def bigbench_sdist():
    """The bigbench==1.0.0 sdist (358 MB) that searchqa and chess data are cut from:
    a local copy if there is one, else fetched once with pip into the WHALE cache."""
    for p in (Path("/tmp/dl/bigbench-1.0.0.tar.gz"), models.cache_dir() / "sdists" / "bigbench-1.0.0.tar.gz"):
        if p.exists():
            return str(p)
    dest = models.cache_dir() / "sdists"
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "bigbench==1.0.0", "-d", str(dest)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"bigbench==1.0.0 sdist not available: {r.stderr.strip()[-200:]}")
    return str(dest / "bigbench-1.0.0.tar.gz")


# ---- searchqa: SQuAD questions over a passage index, answered with a search tool ---------------

SQ_SIZES = {"weight": 2000, "harness": 128, "val": 100, "test": 250}


def test_searchqa_splits():
    passages = searchqa.passages()
    assert len(passages) == 2067 and len({p["id"] for p in passages}) == 2067
    pids = {p["id"] for p in passages}
    seen, articles = set(), {}
    for split, n in SQ_SIZES.items():
        rows = searchqa.load_split(split)
        assert len(rows) == n, split
        for ex in rows:
            assert set(ex) == {"id", "task", "answer"}
            assert set(ex["task"]) == {"question"} and ex["task"]["question"].strip()
            assert ex["answer"]["aliases"] and all(isinstance(a, str) and a for a in ex["answer"]["aliases"])
            assert ex["answer"]["passage_id"] in pids
            assert ex["id"] not in seen
            seen.add(ex["id"])
        articles[split] = {ex["answer"]["passage_id"].split("#")[0] for ex in rows}
    # split by article: no test gold passage (or article) is seen by the weight or harness pools
    for other in ("weight", "harness", "val"):
        assert not articles["test"] & articles[other], other
    with pytest.raises(ValueError):
        searchqa.load_split("train")


def test_searchqa_verify():
    for split in SQ_SIZES:
        for ex in searchqa.load_split(split):
            for alias in ex["answer"]["aliases"]:
                assert searchqa.verify(ex, alias, None) == 1.0
            gold = ex["answer"]["aliases"][0]
            assert searchqa.verify(ex, gold + " zqxj", None) == 0.0
    ex = searchqa.load_split("test")[0]
    gold = ex["answer"]["aliases"][0]
    assert searchqa.verify(ex, f"  The {gold.upper()}. ", None) == 1.0  # SQuAD normalisation
    for junk in (None, "", "   ", 42, [gold], {"a": gold}, "x" * 5000, "the"):
        assert searchqa.verify(ex, junk, None) == 0.0
    assert searchqa.normalize("The  Denver-Broncos!") == "denverbroncos"


def test_searchqa_search():
    passages = searchqa.passages()
    for i in range(0, len(passages), 97):  # a question made from a passage's own words finds it
        text = passages[i]["text"]
        assert searchqa.retrieve(text[:300], 1) == [i]
        out = searchqa.search(text[:300], k=3, max_chars=50)
        assert out.startswith(f"[1] {passages[i]['title']}: {text[:50]}")
        assert len(out.splitlines()) == 3 and all(len(l) < 50 + 100 for l in out.splitlines())
    assert len(searchqa.search("history of the city", k=50).splitlines()) == 10  # k clamped
    assert len(searchqa.search("history", k=1, max_chars=10**6)) <= 2000 + 200  # max_chars clamped
    assert searchqa.search("") == "No results." and searchqa.search("zzqx qqzx") == "No results."
    for args, kw in [((3,), {}), ((None,), {}), (("x",), {"k": "2"}), (("x",), {"k": 0}), (("x",), {"k": True}),
                     (("x",), {"max_chars": -1}), (("x",), {"max_chars": 2.5})]:
        with pytest.raises(ValueError):
            searchqa.search(*args, **kw)
    tools, state = searchqa.make_tools(searchqa.load_split("val")[0])
    assert tools["search"]("Super Bowl 50", k=1).startswith("[1] Super Bowl 50")


def test_searchqa_h0_and_primitives_splice():
    h0 = Path(searchqa.H0).read_text()
    top = {n.name for n in ast.parse(h0).body if isinstance(n, ast.FunctionDef)} | \
          {t.id for n in ast.parse(h0).body if isinstance(n, ast.Assign) for t in n.targets}
    assert set(searchqa.PRIMITIVES) <= top and searchqa.PROMPT_AXES <= set(searchqa.PRIMITIVES)
    assert "import " not in h0.replace("import re\n", "")  # standard library only: just re
    ex = searchqa.load_split("harness")[0]
    tools = types.SimpleNamespace(**searchqa.make_tools(ex)[0])
    gold = ex["answer"]["aliases"][0]
    # h0 itself: answers from the tag, gives up after MAX_TURNS without one, follows <search>
    assert load_harness(h0).run(ex["task"], scripted_llm(then=f"<answer>{gold}</answer>"), tools) == gold
    llm = scripted_llm(then="I think <search>steam engine</search>")
    assert load_harness(h0).run(ex["task"], llm, tools) is None and len(llm.calls) == 2
    assert "Search result:\n[1] Steam engine" in llm.calls[1][-1]["content"]
    for axis, alts in searchqa.PRIMITIVES.items():
        assert len(alts) >= 2, axis
        for alt in alts:
            src = hsrc.splice(h0, axis, alt)
            assert src != h0
            compile(src, "<candidate>", "exec")
            mod = load_harness(src)
            assert callable(mod.run) and hasattr(mod, axis)
            scores = []
            for reply in (f"<answer>{gold}</answer>", f"The answer is {gold}.", "", "<search>x</search>"):
                answer = mod.run(ex["task"], scripted_llm(then=reply), tools)
                assert answer is None or isinstance(answer, str)
                scores.append(searchqa.verify(ex, answer, None))
            # a tagged answer scores with every variant, an untagged one only with the forgiving parsers
            assert scores == [1.0, float(axis == "extract_answer"), 0.0, 0.0], (axis, alt[:60], scores)
            if axis == "extract_answer":  # the forgiving parsers recover untagged answers
                for reply in ("<answer>Leonardo da Vinci</answer>", "The answer is: Leonardo da Vinci.\nHe painted"):
                    assert mod.extract_answer(reply, "Who painted the Mona Lisa?") == "Leonardo da Vinci"
                assert mod.extract_answer("", "Who painted the Mona Lisa?") is None


def test_headroom_base_is_a_candidate_of_a_committed_run(tmp_path):
    """tools/headroom.py --base reads a harness from a file or from a run's archive (packed) (how the
    checked vote was measured against cpu-long-vote s0's cand_026); a wrong one is one line."""
    from tools import headroom
    run_dir = ROOT / "results/runs/cpu-long-vote/searchqa-harness-only-s0"
    vote = headroom.read_base(f"{run_dir}:phase00/cand_026")
    assert hsrc.static_check(vote) is None
    assert "n=votes" in vote and hsrc.static_check(hsrc.splice(vote, "run", searchqa.PRIMITIVES["run"][2])) is None
    (tmp_path / "h.py").write_text(vote)
    assert headroom.read_base(str(tmp_path / "h.py")) == vote
    for bad in (f"{run_dir}:phase00/cand_999", f"{tmp_path}:phase00/cand_001", str(tmp_path / "missing.py")):
        with pytest.raises(SystemExit, match=r"^headroom.py: cannot read --base [^\n]+$"):
            headroom.read_base(bad)


def test_searchqa_primitives_reach_where_designed():
    """Issue 33's alternatives do what their comments say, on made-up passages (the search tool
    is a stand-in here: what is under test is the harness code, not retrieval)."""
    h0 = Path(searchqa.H0).read_text()
    P = searchqa.PRIMITIVES
    passage = ("[1] Old Mill: The Old Mill is a watermill on the river. The Old Mill was sold in 1890. "
               "Its paternity was claimed by the brothers Ivo and Marek Hal. A donation from the banker John D. "
               "Rockefeller paid for the roof, finished on March 3, 1901.")
    # evidence selection by rare words: the title's words ("Old Mill") do not decide
    rare = load_harness(hsrc.splice(h0, "format_passages", P["format_passages"][2]))
    assert "Ivo and Marek" in rare.format_passages("Whose paternity of the Old Mill was claimed?", passage)
    across = load_harness(hsrc.splice(h0, "format_passages", P["format_passages"][3]))
    two = across.format_passages("When was the roof finished?", passage + "\n[2] Roof: A roof covers a building.")
    assert two.splitlines()[0].startswith("[1] Old Mill:") and "March 3, 1901" in two and len(two.splitlines()) == 2
    # a reply repeating a worked example's answer is no answer; the question's words are trimmed
    ex = load_harness(hsrc.splice(h0, "extract_answer", P["extract_answer"][3]))
    assert ex.extract_answer("<answer>2.1 million</answer>", "How many live here?") is None
    assert ex.extract_answer("<answer>the Old Mill brothers</answer>", "Who owned the Old Mill?") == "brothers"
    tools = types.SimpleNamespace(search=lambda query, k=1, max_chars=200: passage)
    for alt in P["run"]:
        mod = load_harness(hsrc.splice(h0, "run", alt))
        # a name cut at an initial is completed from the text; a year becomes the whole date
        assert mod.run({"question": "Who paid for the roof?"}, scripted_llm(then="<answer>John D</answer>"),
                       tools) == "John D. Rockefeller"
        assert mod.run({"question": "On what date was the roof finished?"},
                       scripted_llm(then="<answer>1901</answer>"), tools) == "March 3, 1901"
    # the first run alternative corrects an answer that is not in the text, once
    fix = load_harness(hsrc.splice(h0, "run", P["run"][0]))
    llm = scripted_llm(["<answer>2.1 million</answer>", "<answer>Ivo</answer>"])
    assert fix.run({"question": "Who claimed it?"}, llm, tools) == "Ivo" and len(llm.calls) == 2
    assert "is not in the search result" in llm.calls[1][-1]["content"]
    llm = scripted_llm(then="<answer>Old Mill</answer>")  # only the question's words, twice: kept
    assert fix.run({"question": "What is the Old Mill?"}, llm, tools) == "Old Mill" and len(llm.calls) == 2
    # the third votes over its first turn's 5 replies: the answer most give (any case or punctuation)
    vote = load_harness(hsrc.splice(h0, "run", P["run"][2]))
    llm = scripted_llm(["<answer>Ivo</answer>", "<answer>Marek Hal</answer>", "no tag", "<answer>marek hal.</answer>",
                        "<answer>Ivo Hal</answer>"], then="<answer>never asked</answer>")
    assert vote.run({"question": "Who claimed it?"}, llm, tools) == "Marek Hal" and len(llm.calls) == 5
    llm = scripted_llm(["<answer>Ivo</answer>", "<answer>Hal</answer>"], then="no tag")  # a tie: the earlier reply
    assert vote.run({"question": "Who claimed it?"}, llm, tools) == "Ivo" and len(llm.calls) == 5
    llm = scripted_llm(["<search>roof</search>", "", "", "", ""], then="<answer>Hal</answer>")  # no answer: next turn
    assert vote.run({"question": "Who claimed it?"}, llm, tools) == "Hal" and len(llm.calls) == 6
    # ... checked against the evidence when the question asks for a number or a time: the span of
    # that kind alone, a year widened to the text's date, and none in any reply: the text's span
    # of that kind nearest the question's words (a number the question gives is not the answer)
    mill = types.SimpleNamespace(search=lambda query, k=1, max_chars=200: (
        "[1] Old Mill: In 1850 the mill had 20,000 visitors, four owners and seven millers. "
        "It was sold on 8 February 1890 to the town."))
    asked = [("How many visitors did the mill have?", "<answer>20,000 visitors</answer>", "20,000"),
             ("How many millers worked at the mill?", "<answer>1.4</answer>", "seven"),
             ("How many millers worked at the mill in 1850?", "<answer>1850</answer>", "seven"),
             ("When was the mill sold?", "<answer>1890</answer>", "8 February 1890"),
             ("Who bought the mill?", "<answer>the town</answer>", "the town")]  # no kind: the plain vote
    for question, reply, answer in asked:
        assert vote.run({"question": question}, scripted_llm(then=reply), mill) == answer, question
    assert "Search result:" in llm.calls[5][-1]["content"]
    # the new make_query repeats names and numbers; the new EXAMPLES and USER_TEMPLATE fill in
    mq = load_harness(hsrc.splice(h0, "make_query", P["make_query"][2]))
    assert mq.make_query("Who sold the Old Mill in 1890?") == "sold the Old Mill in 1890 Old Mill 1890"
    for axis in ("EXAMPLES", "USER_TEMPLATE"):
        mod = load_harness(hsrc.splice(h0, axis, P[axis][2]))
        assert "{question}" in mod.USER_TEMPLATE and all(e["answer"] in e["passages"] for e in mod.EXAMPLES)


@pytest.mark.slow
def test_searchqa_build_reproducible(tmp_path, bigbench_sdist):
    subprocess.run([sys.executable, str(ROOT / "data" / "build_searchqa.py"), "--src", bigbench_sdist, "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("passages", *SQ_SIZES):
        committed = (ROOT / "data" / "searchqa" / f"{name}.jsonl.gz").read_bytes()
        rebuilt = (tmp_path / f"{name}.jsonl.gz").read_bytes()
        assert hashlib.sha256(committed).hexdigest() == hashlib.sha256(rebuilt).hexdigest(), name


# ---- math: integer word problems, a python tool, a \boxed{} answer -----------------------------

MATH_SIZES = {"test": 250, "val": 100, "harness": 128, "weight": 2000}


# ---------------------------------------------------------------- data
@pytest.mark.parametrize("split", list(MATH_SIZES))
def test_math_splits_sizes_tiers_and_no_answer_in_task(split):
    data = M.load_split(split)
    assert len(data) == MATH_SIZES[split]
    assert sum(ex["answer"]["tier"] == "hard" for ex in data) == MATH_SIZES[split] // 2
    assert {ex["answer"]["tier"] for ex in data} == {"hard", "easy"}
    for ex in data:
        assert set(ex) == {"id", "task", "answer"} and set(ex["task"]) == {"problem"}
        assert int(ex["answer"]["value"]) == float(ex["answer"]["value"])  # integers only


def test_math_splits_are_disjoint():
    ids, problems = [], []
    for split in MATH_SIZES:
        for ex in M.load_split(split):
            ids.append(ex["id"])
            problems.append(ex["task"]["problem"])
    assert len(set(ids)) == len(ids) and len(set(problems)) == len(problems)


def test_math_unknown_split_raises():
    with pytest.raises(ValueError):
        M.load_split("train")


# ---------------------------------------------------------------- verifier
@pytest.mark.parametrize("split", list(MATH_SIZES))
def test_math_gold_answers_verify(split):
    for ex in M.load_split(split):
        v = ex["answer"]["value"]
        assert M.verify(ex, "\\boxed{%s}" % v, None) == 1.0
        assert M.verify(ex, v, None) == 1.0
        assert M.verify(ex, "Some reasoning... so the answer is \\boxed{%s}." % v, None) == 1.0
        assert M.verify(ex, "\\boxed{%d}" % (int(v) + 1), None) == 0.0
        assert M.verify(ex, str(int(v) * 10 + 1), None) == 0.0


def ex_of(value):
    return {"id": "x", "task": {"problem": "?"}, "answer": {"value": value, "tier": "easy"}}


@pytest.mark.parametrize("answer", [
    "\\boxed{1234}", "\\boxed{1,234}", "\\boxed{\\$1,234}", "$1,234", "\\boxed{1234 \\text{ dollars}}",
    "\\boxed{\\frac{2468}{2}}", "\\boxed{x = 1234}", "\\boxed {1234.0}", "1234 apples", " 1234. ",
    "\\boxed{5} no wait \\boxed{1234}", "\\boxed{1234} then a cut-off \\boxed{12", "\\boxed{{1234}}",
])
def test_math_notation_is_forgiven(answer):
    assert M.verify(ex_of("1234"), answer, None) == 1.0


@pytest.mark.parametrize("answer", [
    "The answer is 1234", "1234 is the answer I think", "\\boxed{1234} and \\boxed{}", "\\boxed{1235}",
    "\\boxed{12,34}", "12 34", "\\boxed{1234 + 1}", "", "   ", "\\boxed{", "\\boxed{\\boxed{",
])
def test_math_strictness(answer):
    assert M.verify(ex_of("1234"), answer, None) == 0.0


def test_math_negative_and_fraction_tolerance():
    assert M.verify(ex_of("-17"), "\\boxed{-17}", None) == 1.0
    assert M.verify(ex_of("-17"), "\\boxed{17}", None) == 0.0
    assert M.verify(ex_of("0"), "\\boxed{0.0000001}", None) == 1.0  # within 1e-6
    assert M.verify(ex_of("0"), "\\boxed{0.001}", None) == 0.0


@pytest.mark.parametrize("junk", [
    None, 42.5, True, [], {"a": 1}, b"\\boxed{42}", object(), "x" * 10_000_000,
    "\\boxed{" * 200_000, "{" * 100_000 + "}" * 99_999, "\\boxed{" + "{" * 5000 + "42" + "}" * 4000,
    "\\boxed{}}}}}", "9" * 100_000, "\\boxed{" + "9" * 5000 + "}", "\\boxed{1/0}", "nan", "inf",
])
def test_math_junk_scores_zero_without_raising(junk):
    t = time.time()
    assert M.verify(ex_of("42"), junk, None) == 0.0
    assert time.time() - t < 2.0


def test_math_int_answer_and_broken_example():
    assert M.verify(ex_of("42"), 42, None) == 1.0
    assert M.verify({"answer": None}, "\\boxed{42}", None) == 0.0


# ---------------------------------------------------------------- seed harness and primitives
def test_math_h0_defines_every_axis_and_runs():
    source = Path(M.H0).read_text()
    h = load_harness(source)
    for axis in M.PRIMITIVES:
        assert hasattr(h, axis)
    assert M.PROMPT_AXES <= set(M.PRIMITIVES)
    ex = M.load_split("val")[0]
    # code first, then a boxed answer: the tool is run once and its output fed back
    tools = FakeTools()
    llm = scripted_llm(["```python\nprint(6*7)\n```", "So \\boxed{42}."])
    out = h.run(ex["task"], llm, tools)
    assert tools.calls == ["print(6*7)\n"] and "\\boxed{42}" in out
    assert "42" in llm.calls[1][-1]["content"]
    # h0 is strict: no box, no answer
    assert M.verify(ex_of("42"), h.run({"problem": "6*7?"}, scripted_llm(["It is 42."]), FakeTools()), None) == 0.0


def test_math_every_primitive_splices_compiles_and_runs():
    h0 = Path(M.H0).read_text()
    # code then a boxed answer; an unboxed answer; code that fails; a bare statement; nothing
    scripts = [["```python\nx = 6 * 7\nx\n```", "\\boxed{42}"], ["The answer is 42."],
               ["```py\nprint(1/0)\n```"] * 5, ["total = 6 * 7"] * 5, [""] * 5]
    for axis, alts in M.PRIMITIVES.items():
        assert len(alts) >= 2, axis
        for alt in alts:
            tree = ast.parse(alt)
            assert len(tree.body) == 1
            source = hsrc.splice(h0, axis, alt)
            assert source != h0
            h = load_harness(source)
            scores = []
            for script in scripts:
                out = h.run({"problem": "What is 6 * 7?"}, scripted_llm(script), FakeTools())
                assert out is None or isinstance(out, str)
                scores.append(M.verify(ex_of("42"), out, None))
            # every variant answers the boxed reply (unless it allows one turn: no turn to read the
            # tool output in), only the answer-recovering ones the unboxed one, none of the others
            boxed = 0.0 if axis == "MAX_TURNS" and h.MAX_TURNS == 1 else 1.0
            assert scores == [boxed, float(axis == "recover_answer"), 0.0, 0.0, 0.0], (axis, alt[:60], scores)


def test_math_primitives_help_where_designed():
    h0 = Path(M.H0).read_text()
    rec = load_harness(hsrc.splice(h0, "recover_answer", M.PRIMITIVES["recover_answer"][1]))
    out = rec.run({"problem": "What is 6 * 7?"}, scripted_llm(["```python\nprint(6*7)\n```", "I ran it."]),
                     FakeTools())
    assert M.verify(ex_of("42"), out, None) == 1.0
    norm = load_harness(hsrc.splice(h0, "normalize_code", M.PRIMITIVES["normalize_code"][0]))
    assert norm.normalize_code("```\nx = 6 * 7\nx\n```") == "x = 6 * 7\nprint(x)"
    norm = load_harness(hsrc.splice(h0, "normalize_code", M.PRIMITIVES["normalize_code"][1]))
    assert norm.normalize_code("First, total = 6 * 7\ntotal = 6 * 7") == "total = 6 * 7\nprint(total)"
    # issue 33's code-first and answer-recovery alternatives
    rec = load_harness(hsrc.splice(h0, "recover_answer", M.PRIMITIVES["recover_answer"][2]))
    assert rec.recover_answer("so \\boxed{x = 1,200 apples}", None) == "1200"
    assert rec.recover_answer("The answer is 7, not 9", "NameError: name 'x' is not defined") == "7"
    assert rec.recover_answer("no idea", "") is None
    out = rec.run({"problem": "What is 6 * 7?"}, scripted_llm(["```python\nprint(6*7)\n```", "Done."]), FakeTools())
    assert M.verify(ex_of("42"), out, None) == 1.0
    fb = load_harness(hsrc.splice(h0, "format_feedback", M.PRIMITIVES["format_feedback"][2]))
    assert "print(answer)" in fb.format_feedback("NameError: name 'x' is not defined")
    assert "printed: 42" in fb.format_feedback("42\n") and fb.format_feedback("42\n").endswith("\\boxed{number}.")
    code_first = load_harness(hsrc.splice(h0, "USER_TEMPLATE", M.PRIMITIVES["USER_TEMPLATE"][3]))
    assert code_first.USER_TEMPLATE.format(problem="P").startswith("P\n") and "print(answer)" in code_first.USER_TEMPLATE


def test_math_skill_names_every_axis():
    for axis in M.PRIMITIVES:
        assert axis in M.SKILL


# ---------------------------------------------------------------- the python tool (sandbox.run_python)
@pytest.mark.slow
def test_math_python_tool():
    tools, state = M.make_tools(M.load_split("val")[0])
    py = tools["python"]
    assert py("print(6 * 7)").strip() == "42"
    assert py("print('a')\n1/0").strip().splitlines() == ["a", "ZeroDivisionError: division by zero"]
    assert "SyntaxError" in py("print(")
    t = time.time()
    out = py("while True:\n    pass")
    assert time.time() - t < 30 and out.strip()  # some error text, not a hang
    assert len(py("print('x' * 100000)")) < 2100
    assert py("x = 1") == ""
    assert "Error" in py(None)


# ---------------------------------------------------------------- the build is reproducible
@pytest.mark.slow
def test_math_build_reproduces_committed_files(tmp_path):
    if importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("reasoning-gym==0.1.25 not installed (data-build dependency only)")
    subprocess.run([sys.executable, str(ROOT / "data" / "build_math.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=600)
    for split in MATH_SIZES:
        committed = ROOT / "data" / "math" / f"{split}.jsonl.gz"
        assert filecmp.cmp(committed, tmp_path / f"{split}.jsonl.gz", shallow=False), split
        with gzip.open(committed) as f:
            assert f.read().endswith(b"\n")


# ---- chess: mate-in-1 and mate-in-2 puzzles played through tools -------------------------------

CHESS_SIZES = {"weight": 3637, "harness": 128, "val": 100, "test": 250}


def _chess_solve(example):
    """Play the solution's own moves through the tools; return (messages, state)."""
    tools, state = chessdom.make_tools(example)
    line = example["answer"]["line"]
    msgs = []
    for i in range(0, len(line), 2):
        assert line[i] in tools["legal_moves"]()
        msgs.append(tools["play"](line[i]))
    return msgs, state


def test_chess_splits():
    seen, positions = set(), {}
    for split, n in CHESS_SIZES.items():
        rows = chessdom.load_split(split)
        assert len(rows) == n, split
        plies = {ex["task"]["plies"] for ex in rows}
        assert plies == {1, 3}, split  # a mix of mate-in-1 and mate-in-2 everywhere
        keys = set()
        for ex in rows:
            assert set(ex) == {"id", "task", "answer"} and ex["id"] not in seen
            seen.add(ex["id"])
            task, line = ex["task"], ex["answer"]["line"]
            assert set(task) == {"fen", "plies", "side"}  # the public part holds no answer
            assert len(line) == task["plies"] and not any(m in str(task) for m in line)
            board = pychess.Board(task["fen"])
            assert task["side"] == ("white" if board.turn else "black")
            for move in line:  # every position the line passes through belongs to this split
                keys.add(board.epd())
                board.push(pychess.Move.from_uci(move))
            assert board.is_checkmate()
        positions[split] = keys
    for other in ("weight", "harness", "val"):  # no evaluation line is visible from another split
        assert not positions["test"] & positions[other], other
    assert not positions["harness"] & positions["weight"] and not positions["val"] & positions["weight"]
    with pytest.raises(ValueError):
        chessdom.load_split("train")


def test_chess_solutions_replay_to_1():
    for split in ("test", "val", "harness"):
        for ex in chessdom.load_split(split):
            msgs, state = _chess_solve(ex)
            assert msgs[-1].startswith("solved:") and all(m.startswith("ok: the opponent replied ") for m in msgs[:-1])
            if len(msgs) == 2:  # the environment played the stored reply
                assert msgs[0].split()[-1] == ex["answer"]["line"][1]
            assert state.solved and not state.failed and chessdom.verify(ex, None, state) == 1.0
            assert chessdom.verify(ex, "junk", state) == 1.0  # the answer string is ignored


def test_chess_wrong_move_ends_rollout():
    rows = chessdom.load_split("test")
    m1 = next(ex for ex in rows if ex["task"]["plies"] == 1)
    m2 = next(ex for ex in rows if ex["task"]["plies"] == 3)
    for ex in (m1, m2):  # a wrong legal first move
        tools, state = chessdom.make_tools(ex)
        wrong = next(u for u in tools["legal_moves"]() if u != ex["answer"]["line"][0])
        assert tools["play"](wrong).startswith("over:") and state.failed and not state.solved
        assert chessdom.verify(ex, ex["answer"]["line"], state) == 0.0
        with pytest.raises(RuntimeError):  # over means over, even for the right move
            tools["play"](ex["answer"]["line"][0])
    # mate in 2: right first move, then a legal move that does not mate
    tools, state = chessdom.make_tools(m2)
    assert tools["play"](m2["answer"]["line"][0]).startswith("ok:")
    board = pychess.Board(tools["fen"]())
    quiet = next(m.uci() for m in list(board.legal_moves) if not _chess_mates(board, m))
    assert tools["play"](quiet).startswith("over:") and chessdom.verify(m2, None, state) == 0.0
    # the final move may be ANY mate, not only the stored one. The data never needs this (every line ends in a
    # position with a single mate), so use a hand-made position where Rd8# and Rh8# both mate.
    two = {"id": "x", "task": {"fen": "k7/8/1K6/8/8/8/8/3R3R w - - 0 1", "plies": 1, "side": "white"},
           "answer": {"line": ["d1d8"]}}
    tools, state = chessdom.make_tools(two)
    assert tools["play"]("h1h8").startswith("solved:") and chessdom.verify(two, None, state) == 1.0
    assert chessdom.verify(m1, None, None) == 0.0 and chessdom.verify(m1, None, object()) == 0.0


def _chess_mates(board, move):
    board.push(move)
    mate = board.is_checkmate()
    board.pop()
    return mate


def test_chess_illegal_and_garbage_moves():
    ex = next(ex for ex in chessdom.load_split("test") if ex["task"]["plies"] == 3)
    tools, state = chessdom.make_tools(ex)
    fen = tools["fen"]()
    for junk in ("", "hello", "e2e9", "Nf3", "e2-e4", 42, None, ["e2e4"]):  # not UCI: a tool error, nothing played
        with pytest.raises(ValueError):
            tools["play"](junk)
    assert tools["fen"]() == fen and not state.failed and state.bad_calls == 8
    line = ex["answer"]["line"]
    assert tools["play"](" " + line[0].upper() + "\n").startswith("ok:")  # whitespace and case forgiven
    assert tools["play"](line[2]).startswith("solved:") and chessdom.verify(ex, None, state) == 1.0
    # a parseable but illegal move (here: the null move, and a move from an empty square) ends the rollout
    board = pychess.Board(ex["task"]["fen"])
    empty = next(pychess.square_name(s) for s in pychess.SQUARES if board.piece_at(s) is None)
    for bad in ("0000", empty + ("a1" if empty != "a1" else "b1")):
        tools, state = chessdom.make_tools(ex)
        assert tools["play"](bad).startswith("over:") and state.failed
        assert chessdom.verify(ex, None, state) == 0.0
    # legal_moves_san lines up with legal_moves and never shows '#'
    tools, _ = chessdom.make_tools(ex)
    tools["play"](line[0])
    sans = tools["legal_moves_san"]()
    assert len(sans) == len(tools["legal_moves"]()) and not any("#" in s for s in sans)
    assert sans[tools["legal_moves"]().index(line[2])].endswith("+")


def _chess_mate_in_1_moves(board):
    """Brute force, on purpose without the build's 'only checks can mate' shortcut."""
    out = []
    for move in list(board.legal_moves):
        board.push(move)
        if board.is_checkmate():
            out.append(move.uci())
        board.pop()
    return out


def _chess_wins_in_2(board, move):
    board.push(move)
    try:
        replies = list(board.legal_moves)
        if not replies:
            return board.is_checkmate()
        for reply in replies:
            board.push(reply)
            ok = bool(_chess_mate_in_1_moves(board))
            board.pop()
            if not ok:
                return False
        return True
    finally:
        board.pop()


def test_chess_first_moves_are_unique():
    rows = chessdom.load_split("test")
    sample = [ex for ex in rows if ex["task"]["plies"] == 1][:10] + [ex for ex in rows if ex["task"]["plies"] == 3][:10]
    for ex in sample:
        board, line = pychess.Board(ex["task"]["fen"]), ex["answer"]["line"]
        if len(line) == 1:
            assert _chess_mate_in_1_moves(board) == line, ex["id"]
        else:
            assert _chess_mate_in_1_moves(board) == [], ex["id"]  # no faster mate
            winners = [m.uci() for m in list(board.legal_moves) if _chess_wins_in_2(board, m)]
            assert winners == [line[0]], ex["id"]


def _chess_run(source, ex, replies):
    tools, state = chessdom.make_tools(ex)
    llm = scripted_llm(replies)
    answer = load_harness(source).run(ex["task"], llm, types.SimpleNamespace(**tools))
    return answer, state, llm.calls


def test_chess_h0_and_primitives_splice():
    h0 = Path(chessdom.H0).read_text()
    tree = ast.parse(h0)
    top = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} | \
          {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets}
    assert set(chessdom.PRIMITIVES) <= top and chessdom.PROMPT_AXES <= set(chessdom.PRIMITIVES)
    imports = [a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names]
    assert imports == ["re"]  # standard library only
    rows = chessdom.load_split("harness")
    m1 = next(ex for ex in rows if ex["task"]["plies"] == 1)
    m2 = next(ex for ex in rows if ex["task"]["plies"] == 3)
    good = lambda ex: [f"<move>{u}" for u in ex["answer"]["line"][::2]]  # noqa: E731 (stop string cut </move>)
    # h0: a model that knows the answer solves both kinds, one call per move
    for ex in (m1, m2):
        answer, state, calls = _chess_run(h0, ex, good(ex))
        assert state.solved and chessdom.verify(ex, answer, state) == 1.0
        assert len(calls) == len(ex["answer"]["line"]) // 2 + 1
        assert ex["task"]["fen"] in calls[0][-1]["content"] and "Legal moves:" in calls[0][-1]["content"]
    assert "The opponent played " + m2["answer"]["line"][1] in calls[1][-1]["content"]
    # format problem, then an illegal move: the harness retries and never sends them to play()
    answer, state, calls = _chess_run(h0, m1, ["I like e4", "<move>a1a1"])
    assert len(calls) == 2 and not state.failed and not state.played and answer is None
    answer, state, calls = _chess_run(h0, m1, ["no idea"] + good(m1))
    assert state.solved and len(calls) == 2 and calls[1][-1]["content"] == "Invalid move. Answer with <move>uci</move>."
    for axis, alts in chessdom.PRIMITIVES.items():
        assert len(alts) >= 2, axis
        for alt in alts:
            src = hsrc.splice(h0, axis, alt)
            assert src != h0
            compile(src, "<candidate>", "exec")
            mod = load_harness(src)
            assert callable(mod.run) and hasattr(mod, axis)
            assert not [a for n in ast.walk(ast.parse(alt)) if isinstance(n, (ast.Import, ast.ImportFrom))
                        for a in n.names]  # alternatives add no imports
            for ex in (m1, m2):
                answer, state, calls = _chess_run(src, ex, good(ex))
                assert state.solved, (axis, alt[:60], ex["id"])
                answer, state, calls = _chess_run(src, ex, ["", "???", "<move>zz"] * 4)
                assert not state.played and (answer is None or isinstance(answer, str))
    # the SAN-reading parser understands SAN; the lenient one forgives 'e2-e4' without a tag
    san_src = hsrc.splice(h0, "parse_move", chessdom.PRIMITIVES["parse_move"][1])
    board = pychess.Board(m1["task"]["fen"])
    san = board.san(pychess.Move.from_uci(m1["answer"]["line"][0]))
    assert _chess_run(san_src, m1, [f"I play {san}"])[1].solved
    u = m1["answer"]["line"][0]
    lenient = hsrc.splice(h0, "parse_move", chessdom.PRIMITIVES["parse_move"][0])
    assert _chess_run(lenient, m1, [f"My move is {u[:2]}-{u[2:]}."])[1].solved
    # issue 33's move-format recovery: a promotion without its piece, SAN, never a guess (a piece and a
    # square, "queen to h5", is not read: play() would refuse a move the reply does not name)
    rec = load_harness(hsrc.splice(h0, "parse_move", chessdom.PRIMITIVES["parse_move"][2]))
    legal = ["e7e8q", "e7e8n", "g1f3", "d1h5"]
    table = types.SimpleNamespace(legal_moves_san=lambda: ["e8=Q+", "e8=N", "Nf3", "Qh5"])
    assert rec.parse_move("<move>e7e8", legal, table) == "e7e8q"
    assert rec.parse_move("Knight to Nf3!", legal, table) == "g1f3"
    assert rec.parse_move("I move the queen to h5", legal, table) is None
    # the first-named parser reads the move the reply names first, in either notation
    first = load_harness(hsrc.splice(h0, "parse_move", chessdom.PRIMITIVES["parse_move"][3]))
    assert first.parse_move("The best move is d1-h5 g1f3 e7e8q", legal, table) == "d1h5"
    assert first.parse_move("Nf3, then maybe d1h5", legal, table) == "g1f3"
    assert first.parse_move("no move here: e7e9, Kf3", legal, table) is None
    retry = load_harness(hsrc.splice(h0, "format_retry", chessdom.PRIMITIVES["format_retry"][2]))
    assert "d1h5" in retry.format_retry("d1h6", legal) and "g1f3" not in retry.format_retry("d1h6", legal)


@pytest.mark.slow
def test_chess_h0_in_sandbox():
    """Through the real sandbox: tools cross the pipe, garbage is a ToolError, python-chess cannot be imported."""
    rows = chessdom.load_split("harness")[:2]
    states = {}

    def make_tools_for(rid):
        tools, states[rid] = chessdom.make_tools(rows[rid])
        return tools

    def llm_batch(calls):  # a model that knows the solution: the next move of our side
        return [{"text": "<move>" + rows[c["rid"]]["answer"]["line"][2 * len(states[c["rid"]].played)],
                 "prompt_ids": [1], "completion_ids": [2], "finish": "stop"} for c in calls]

    jobs = [{"rid": i, "task": ex["task"], "seed": i} for i, ex in enumerate(rows)]
    for rec, ex in zip(sandbox.run_rollouts(Path(chessdom.H0).read_text(), jobs, llm_batch, make_tools_for), rows):
        assert rec["status"] == "ok" and chessdom.verify(ex, rec["answer"], states[rec["rid"]]) == 1.0
    hostile = ("def run(task, llm, tools):\n"
               "    import importlib\n"
               "    try:\n"
               "        importlib.import_module('ch' + 'ess')\n"
               "        out = 'imported'\n"
               "    except ImportError:\n"
               "        out = 'blocked'\n"
               "    try:\n"
               "        tools.play(42)\n"
               "    except Exception as e:\n"
               "        out += ' ' + type(e).__name__\n"
               "    return out\n")
    rec = sandbox.run_rollouts(hostile, jobs[:1], llm_batch, make_tools_for)[0]
    assert rec["status"] == "ok" and rec["answer"] == "blocked ToolError" and not states[0].played


def _menu_prompts(ex, source):
    """The first prompt (system + user messages) a harness source builds for puzzle ex, and its board."""
    mod = {}
    exec(compile(source, "harness.py", "exec"), mod)
    tools, state = chessdom.make_tools(ex)
    t = types.SimpleNamespace(**tools)
    obs = mod["format_observation"](ex["task"], t.fen(), t.board(), mod["annotate_moves"](t.legal_moves(), t), None)
    user = mod["USER_TEMPLATE"].format(observation=obs, side=ex["task"]["side"].capitalize(),
                                       mate_in=(ex["task"]["plies"] + 1) // 2)
    return [{"role": "system", "content": mod["SYSTEM_PROMPT"]}, {"role": "user", "content": user}], state.board


def test_chess_a_prompt_that_singles_out_a_move_is_seen_and_the_menus_lists_are_not():
    """Issue 66: a harness that works the move out itself and shows the model only that move (or puts
    it first, or hints it) leads; every list on the menu is a list the parent fixes, and the only moves
    it singles out are the example moves its own prompt texts write (e2e4, g1f3, d1h5 today) when legal."""
    h0 = Path(chessdom.H0).read_text()
    sources = [h0] + [hsrc.splice(h0, axis, alt) for axis in ("SYSTEM_PROMPT", "USER_TEMPLATE", "format_observation",
                                                               "annotate_moves") for alt in chessdom.PRIMITIVES[axis]]
    for ex in chessdom.load_split("harness")[:20]:
        for source in sources:
            messages, board = _menu_prompts(ex, source)
            flagged = {m.uci() for m in board.legal_moves if chessdom.singled_out(m, board, messages)}
            mod = {}
            exec(compile(source, "harness.py", "exec"), mod)  # the example moves its own prompt texts write
            examples = set(re.findall(r"\b[a-h][1-8][a-h][1-8]\b", mod["SYSTEM_PROMPT"] + mod["USER_TEMPLATE"]))
            assert flagged <= examples, (flagged, source[:200])
    ex = next(e for e in chessdom.load_split("harness")
              if sorted(m.uci() for m in pychess.Board(e["task"]["fen"]).legal_moves)[0] != e["answer"]["line"][0]
              and "x" not in pychess.Board(e["task"]["fen"]).san(pychess.Move.from_uci(e["answer"]["line"][0])))
    board, sol = pychess.Board(ex["task"]["fen"]), ex["answer"]["line"][0]
    legal = sorted(m.uci() for m in board.legal_moves)
    led = chessdom.singled_out
    move = pychess.Move.from_uci(sol)
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    assert "not a list the parent fixes" in led(move, board, user(f"Legal moves: {sol}"))
    assert "not a list the parent fixes" in led(move, board, user("Moves: " + " ".join([sol] + legal[:3])))
    assert "times" in led(move, board, user("Moves: " + " ".join(legal) + f". Hint: {sol} looks strong."))
    first = " ".join([sol] + [u for u in legal if u != sol])
    assert "before" in led(move, board, user("Moves: " + first))
    assert led(move, board, user("Moves: " + " ".join(legal))) is None
    retry = user("Moves: " + " ".join(legal)) + [{"role": "assistant", "content": f"<move>{sol[:2]}{sol[:2]}</move>"},
                                                 {"role": "user", "content": f"Not legal. Moves of that piece: {sol}"}]
    assert led(move, board, retry) is None  # a retry may list the moves of the piece the model named


@pytest.mark.slow
def test_chess_a_leading_harness_plays_nothing_and_scores_no_more_than_h0_with_the_same_model():
    """End to end under rollout.run and the sandbox, with a model that copies the first move of its
    prompt: a harness that knows each solution and shows the model only that move gets every play
    refused ("play: led") and scores 0; the same model under h0 scores what copying the first legal
    move scores, and a leading harness is never better than that."""
    import json as _json
    import re as _re
    import rollout
    examples = chessdom.load_split("harness")[:12]

    class CopyFirst:  # an engine whose model copies the first UCI move of the last user message
        max_model_len, prompts = 4096, []

        def chat_ids(self, messages):
            self.prompts.append(messages)
            return [len(self.prompts) - 1]

        def sample(self, reqs):
            out = []
            for r in reqs:
                last = [m["content"] for m in self.prompts[r["prompt_ids"][0]] if m["role"] == "user"][-1]
                found = _re.findall(r"\b([a-h][1-8][a-h][1-8][qrbn]?)\b", last)
                out.append({"text": f"<move>{found[0] if found else 'a1a1'}", "completion_ids": [1], "finish": "stop"})
            return out
    solutions = {ex["task"]["fen"]: ex["answer"]["line"][0] for ex in examples}
    leading = ("SOLUTIONS = " + _json.dumps(solutions) + "\n"
               "def run(task, llm, tools):\n"
               "    move = SOLUTIONS[task['fen']]\n"
               "    llm([{'role': 'user', 'content': 'Legal moves: ' + move + '. Reply <move>uci</move>.'}])\n"
               "    return tools.play(move)\n")
    sampling = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    led = rollout.run(CopyFirst(), chessdom, leading, examples, 1, seed=0, sampling=sampling, max_tokens=16)
    h0 = rollout.run(CopyFirst(), chessdom, Path(chessdom.H0).read_text(), examples, 1, seed=0, sampling=sampling,
                     max_tokens=16)
    assert all(r["score"] == 0 and r["status"] == "error" and "play: led" in r["error"] for r in led), led[0]["error"]
    assert sum(r["score"] for r in led) <= sum(r["score"] for r in h0)


def test_chess_named_in_reads_uci_and_san_as_words():
    start = pychess.Board()
    named = lambda uci, *texts, board=start: chessdom.named_in(pychess.Move.from_uci(uci), board, texts)  # noqa: E731
    assert named("e2e4", "I play e2e4") and named("e2e4", "E2-E4!") and named("e2e4", "e2 e4") and named("e2e4", "e4")
    assert named("g1f3", "<move>Nf3") and named("g1f3", "so Nf3+") and named("g1f3", "maybe later", "g1-f3")
    assert not named("g1f3", "nf3") and not named("g1f3", "Nf3e") and not named("e2e4", "e2e45", "d2e4")
    assert not named("e2e4", "e3e4 then be4") and not named("g1f3", "")
    castle = pychess.Board("r3k2r/8/8/8/8/8/8/R3K2R w KQkq - 0 1")
    assert named("e1g1", "O-O", board=castle) and named("e1g1", "0-0!", board=castle)
    assert not named("e1g1", "O-O-O", board=castle) and named("e1c1", "O-O-O", board=castle)
    promo = pychess.Board("8/4P3/8/8/8/8/k7/7K w - - 0 1")
    assert named("e7e8q", "e7e8", board=promo) and named("e7e8q", "e8=Q", board=promo)
    assert not named("e7e8n", "e7e8", board=promo) and named("e7e8n", "e7e8n", board=promo)
    assert named("a1a3", "a1a3") and not named("a1a3", "Ra3")  # an illegal move: its UCI only


@pytest.mark.slow
def test_chess_play_takes_only_a_move_the_models_latest_reply_names(hf):
    """Under rollout.run (the real model, greedy), play() refuses a move before any reply, a move the
    harness picked that the reply does not name, and a move an older reply named; and a move the
    model was told to echo, as led (singled_out: the prompt named that one move alone)."""
    import rollout
    harness = ("import re\n"
               "def run(task, llm, tools):\n"
               "    legal, out = tools.legal_moves(), []\n"
               "    def tried(move):\n"
               "        try:\n"
               "            return tools.play(move).split(':')[0]\n"
               "        except Exception as e:\n"
               "            return 'refused' if 'does not name' in str(e) else str(e)\n"
               "    out.append(tried(legal[0]))\n"
               "    reply = llm([{'role': 'user', 'content': 'Write this move: ' + legal[-1]}], max_tokens=12)\n"
               "    named = [u for u in legal if re.search(r'(?<![a-z0-9])' + u + r'(?![a-z0-9])', reply.lower())]\n"
               "    pick = [u for u in legal if u[:2] not in reply.lower() and u[2:4] not in reply.lower()][0]\n"
               "    out.append(tried(pick))\n"
               "    llm([{'role': 'user', 'content': 'Say hello.'}], max_tokens=4)\n"
               "    out.append(tried(named[0]) if named else 'named nothing')\n"
               "    llm([{'role': 'user', 'content': 'Write this move: ' + legal[-1]}], max_tokens=12)\n"
               "    out.append(tried(legal[-1]))\n"
               "    return ' '.join(out)\n")
    ex = chessdom.load_split("harness")[0]
    rec = rollout.run(hf, chessdom, harness, [ex], 1, seed=0, max_tokens=16,
                      sampling={"temperature": 0.0, "top_k": 0, "top_p": 1.0})[0]
    assert rec["status"] == "ok", rec["error"]
    assert rec["answer"].split()[:3] == ["refused", "refused", "refused"], rec["answer"]
    plays = [t for t in rec["tool_calls"] if t["name"] == "play"]
    assert len(plays) == 4 and all("does not name" in t["error"] for t in plays[:3])
    assert "play: led" in plays[3]["error"], plays[3]  # the echoed move: named, but singled out by the prompt


@pytest.mark.slow
def test_chess_build_reproducible(tmp_path, bigbench_sdist):
    script = ROOT / "data" / "build_chess.py"
    subprocess.run([sys.executable, str(script), "--src", bigbench_sdist, "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for name in CHESS_SIZES:
        committed = (ROOT / "data" / "chess" / f"{name}.jsonl.gz").read_bytes()
        rebuilt = (tmp_path / f"{name}.jsonl.gz").read_bytes()
        assert hashlib.sha256(committed).hexdigest() == hashlib.sha256(rebuilt).hexdigest(), name


# ---------------------------------------------------------------- every domain file, one contract
# Guarantee: every domains/<name>.py (a fork's new one too, and the commented template) is a domain
# the loop can run: the names the loop and the proposers read exist; the splits load, are
# disjoint and hold id, task and answer; the seed harness validates and defines every axis; every
# PRIMITIVES alternative splices into it and validates as the search would check it (a prompt
# axis passes the prompt-only rule); verify scores junk 0.0 or 1.0 without raising; a domain's own
# failure_signature names only signatures the primitives proposer knows.

JUNK_ANSWERS = [None, "", "   ", "junk", "\x00\ud800", "9" * 5000, "x" * 100_000, 0, -1, 10**30, 3.5, float("nan"),
                True, b"bytes", {"answer": 1}, ["a1", 1], object()]


@pytest.mark.parametrize("name", domains.names())
def test_every_domain_file_keeps_the_domain_contract(name):
    dom = importlib.import_module(f"domains.{name}")
    for attr in ("load_split", "make_tools", "verify", "H0", "PRIMITIVES", "PROMPT_AXES", "SKILL"):
        assert hasattr(dom, attr), f"domains/{name}.py has no {attr}"
    splits = {s: dom.load_split(s) for s in ("weight", "harness", "val", "test")}
    ids = [r["id"] for recs in splits.values() for r in recs]
    assert all(splits.values()) and len(ids) == len(set(ids))  # none empty, ids unique across splits
    for recs in splits.values():
        domains.check_records(recs, name, (), ())  # str id, dict task, dict answer
    h0 = Path(dom.H0).read_text()
    assert hsrc.static_check(h0) is None
    axes = hsrc.top_level_names(h0)
    assert set(dom.PRIMITIVES) <= set(axes) and set(dom.PROMPT_AXES) <= set(dom.PRIMITIVES)
    load_harness(h0)  # its top level runs
    for axis, alts in dom.PRIMITIVES.items():
        assert alts, axis
        for alt in alts:
            src = hsrc.splice(h0, axis, alt)
            assert hsrc.static_check(src) is None, (axis, alt[:60])
            assert hsrc.normalized(src) != hsrc.normalized(h0), (axis, alt[:60])  # not a duplicate of h0
            if axis in dom.PROMPT_AXES:
                assert hsrc.differs_only_in(h0, src, sorted(dom.PROMPT_AXES))[0], (axis, alt[:60])
            assert callable(load_harness(src).run)
    for ex in (splits["val"][0], splits["test"][-1]):
        state = dom.make_tools(ex)[1]
        for junk in JUNK_ANSWERS:
            assert dom.verify(ex, junk, state) in (0.0, 1.0), (name, repr(junk)[:40])
    if hasattr(dom, "failure_signature"):
        for rec in ({"status": "ok", "answer": None, "score": 0.0, "tool_calls": []},
                    {"status": "ok", "answer": "junk 1", "score": 0.0, "tool_calls": []},
                    {"status": "crash", "answer": None, "error": "boom", "score": 0.0, "tool_calls": []}):
            assert dom.failure_signature(rec) in (None, *primitives.SIGNATURE_KEYWORDS), rec
