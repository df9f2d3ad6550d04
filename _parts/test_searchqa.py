"""Tests for the searchqa domain: data, verifier, search tool, seed harness and its primitives."""
import ast
import hashlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
if ROOT.name == "_parts":  # this file is merged into test_whale.py at the repo root later
    ROOT = ROOT.parent
sys.path.insert(0, str(ROOT))
from domains import searchqa  # noqa: E402

SQ_SIZES = {"weight": 2000, "harness": 128, "val": 100, "test": 250}


def splice_def(source, new_src):
    """Replace the top-level definition of the one name new_src defines (minimal local AST splice)."""
    new_nodes = ast.parse(new_src).body
    names = {t.id for n in new_nodes if isinstance(n, ast.Assign) for t in n.targets} | \
            {n.name for n in new_nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert len(names) == 1, names
    name, = names
    old = [n for n in ast.parse(source).body
           if (isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
           or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) == name for t in n.targets))]
    assert len(old) == 1, f"{name} defined {len(old)} times at top level"
    node = old[0]
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
    lines = source.splitlines(keepends=True)
    return "".join(lines[:start]) + new_src.rstrip("\n") + "\n" + "".join(lines[node.end_lineno:])


def test_searchqa_splits():
    passages = searchqa._read_jsonl_gz(os.path.join(searchqa.DATA, "passages.jsonl.gz"))
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
    passages = searchqa._index()[1]
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


def _stub_llm(reply):
    calls = []

    def llm(messages, max_tokens=256, stop=None):
        assert isinstance(messages, (str, list))
        calls.append(messages)
        return reply
    return llm, calls


def _load_harness(source):
    mod = types.ModuleType("harness")
    exec(compile(source, "<harness>", "exec"), mod.__dict__)
    return mod


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
    assert _load_harness(h0).run(ex["task"], _stub_llm(f"<answer>{gold}</answer>")[0], tools) == gold
    llm, calls = _stub_llm("I think <search>steam engine</search>")
    assert _load_harness(h0).run(ex["task"], llm, tools) is None and len(calls) == 2
    assert "Search result:\n[1] Steam engine" in calls[1][-1]["content"]
    for axis, alts in searchqa.PRIMITIVES.items():
        assert len(alts) >= 2, axis
        for alt in alts:
            src = splice_def(h0, alt)
            assert src != h0
            compile(src, "<candidate>", "exec")
            mod = _load_harness(src)
            assert callable(mod.run) and hasattr(mod, axis)
            for reply in (f"<answer>{gold}</answer>", f"The answer is {gold}.", "", "<search>x</search>"):
                answer = mod.run(ex["task"], _stub_llm(reply)[0], tools)
                assert answer is None or isinstance(answer, str)
            if axis == "extract_answer":  # the forgiving parsers recover untagged answers
                assert searchqa.verify(ex, mod.extract_answer(f"The answer is {gold}."), None) == 1.0


SDIST = "/tmp/dl/bigbench-1.0.0.tar.gz"


@pytest.mark.skipif(not os.path.exists(SDIST), reason=f"needs {SDIST} (358 MB)")
def test_searchqa_build_reproducible(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "data" / "build_searchqa.py"), "--src", SDIST, "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("passages", *SQ_SIZES):
        committed = (ROOT / "data" / "searchqa" / f"{name}.jsonl.gz").read_bytes()
        rebuilt = (tmp_path / f"{name}.jsonl.gz").read_bytes()
        assert hashlib.sha256(committed).hexdigest() == hashlib.sha256(rebuilt).hexdigest(), name
