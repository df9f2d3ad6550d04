"""Tests for meta_harness.py (no model, no sandbox; a few seconds). To be merged into test_whale.py.

A tiny fake domain and a fake evaluate whose success depends on the source: example i is
solved iff u_i < QUALITY, where QUALITY is a constant in the harness and u_i a fixed uniform
per example (common random numbers), so a higher QUALITY solves a superset of examples.
"""

import ast
import http.server
import json
import os
import random
import socket
import sys
import textwrap
import threading
import types
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import meta_harness as mh  # noqa: E402

H0 = '''"""Toy harness."""
import re

# The prompt, one axis.
SYSTEM_PROMPT = "Answer."

TOP_K = 1  # retrieval depth
QUALITY = 0.2


def extract_answer(text):
    """Take the whole reply."""
    return text.strip()


def run(task, llm, tools):
    return extract_answer(llm(SYSTEM_PROMPT + task["question"]))
'''

DOMAIN = types.SimpleNamespace(
    NAME="toy",
    PRIMITIVES={
        "SYSTEM_PROMPT": ['SYSTEM_PROMPT = "Answer briefly."', 'SYSTEM_PROMPT = "Think, then answer."'],
        "TOP_K": ["TOP_K = 3", "TOP_K = 5"],
        "QUALITY": ["QUALITY = 0.5", "QUALITY = 0.8"],
        "extract_answer": ['def extract_answer(text):\n    return text.strip().split("\\n")[-1]\n'],
    },
    PROMPT_AXES={"SYSTEM_PROMPT"},
    SKILL="Toy task: answer the question. Tools: tools.search(query, k). Axes: SYSTEM_PROMPT, TOP_K.",
)

EXAMPLES = [{"id": f"ex{i}", "task": {"question": f"q{i}"}, "answer": "a"} for i in range(40)]
U = [random.Random(i).random() for i in range(len(EXAMPLES))]


def constant(source, name, default=0.0):
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value)
    return default


def record(ex, ok, answer=None, tool_result="nothing here"):
    return dict(example_id=ex["id"], score=float(ok), turns=2, tokens=100, status="ok", error=None,
                calls=[{"messages": [{"role": "user", "content": ex["task"]["question"]}], "text": "x",
                        "prompt_ids": [1, 2, 3], "completion_ids": [4]}],
                tool_calls=[{"name": "search", "args": ["q"], "kwargs": {}, "result": tool_result, "error": None}],
                answer=("a" if ok else answer))


def make_evaluate(log=None, fail_at=None):
    """Quality-driven evaluate; counts calls in `log`; raises on call number `fail_at` (a crash)."""
    log = [] if log is None else log

    def evaluate(source, examples, tag):
        if fail_at is not None and len(log) + 1 == fail_at:
            raise RuntimeError("simulated crash")
        log.append((tag, source))
        q = constant(source, "QUALITY")
        return [record(ex, U[i] < q) for i, ex in enumerate(examples)]
    return evaluate


def ok_validate(source):
    return None


def stop_after(n):
    return lambda history: len(history) >= n


def quiet(_):
    pass


# ---- source surgery -----------------------------------------------------------

def test_splice_replaces_exactly_one_definition():
    src = textwrap.dedent('''\
        """doc"""
        import functools

        PROMPT = """line one
        line two"""  # trailing comment

        @functools.lru_cache(None)
        def helper(x):
            # comment inside
            return x + 1


        def run(task, llm, tools):
            return helper(1)
        ''')
    lines = src.splitlines(keepends=True)
    out = mh.splice(src, "helper", "def helper(x):\n    return x * 2\n")
    out_lines = out.splitlines(keepends=True)
    assert out_lines[:6] == lines[:6]                      # up to the blank line before the decorator
    assert out_lines[6:8] == ["def helper(x):\n", "    return x * 2\n"]
    assert out_lines[8:] == lines[10:]                     # everything after, byte-identical
    out2 = mh.splice(src, "PROMPT", 'PROMPT = "short"')
    assert out2.splitlines(keepends=True) == lines[:3] + ['PROMPT = "short"\n'] + lines[5:]
    assert mh.top_level_names(out2)["PROMPT"] == (4, 4)
    with pytest.raises(KeyError):
        mh.splice(src, "missing", "missing = 1")
    with pytest.raises(ValueError):
        mh.splice(src, "helper", "other = 1")              # defines the wrong name
    with pytest.raises(ValueError):
        mh.splice("A = 1; B = 2\ndef run(t, l, x): pass\n", "A", "A = 3")  # shares a line


def test_top_level_names_spans():
    names = mh.top_level_names(H0)
    assert list(names) == ["SYSTEM_PROMPT", "TOP_K", "QUALITY", "extract_answer", "run"]
    assert names["extract_answer"] == (11, 13)


def test_differs_only_in_prompt_axes():
    ok, why = mh.differs_only_in(H0, mh.splice(H0, "SYSTEM_PROMPT", 'SYSTEM_PROMPT = "New."'), {"SYSTEM_PROMPT"})
    assert ok, why
    ok, _ = mh.differs_only_in(H0, H0.replace("# The prompt, one axis.", "# reworded comment"), {"SYSTEM_PROMPT"})
    assert ok                                              # comments/layout are not changes
    ok, why = mh.differs_only_in(H0, mh.splice(H0, "TOP_K", "TOP_K = 5"), {"SYSTEM_PROMPT"})
    assert not ok and "TOP_K" in why
    ok, why = mh.differs_only_in(H0, H0 + "\ndef helper():\n    return 1\n", {"SYSTEM_PROMPT"})
    assert not ok and "added" in why
    ok, why = mh.differs_only_in(H0, H0.replace("import re", "import re\nimport json"), {"SYSTEM_PROMPT"})
    assert not ok


# ---- search: archive, invalid candidates, proposers ------------------------------

def test_search_archives_everything_and_primitives_never_repeats(tmp_path):
    d = str(tmp_path / "arch")
    prop = mh.make_proposer("primitives", DOMAIN, rng_seed=1)
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=d, k=3,
                          should_stop=stop_after(8), log=quiet)
    arch = mh.load_archive(d)
    norms = [mh.normalized(c["source"]) for c in arch]
    assert len(norms) == len(set(norms)) > 7               # no archived source proposed twice
    assert not any(c["invalid"] for c in arch)
    assert res["iterations"] == 8 and len(res["history"]) == 8
    assert constant(res["best_source"], "QUALITY") == 0.8
    s = json.load(open(os.path.join(d, "cand_000", "scores.json")))
    assert s["example_ids"] == [e["id"] for e in EXAMPLES] and len(s["per_example"]) == 40
    assert s["proposer"] == "incoming" and s["n"] == 40 and s["status_counts"] == {"ok": 40}
    c1 = json.load(open(os.path.join(d, "cand_001", "scores.json")))
    assert c1["parent"] == "cand_000" and c1["axis"] in DOMAIN.PRIMITIVES and c1["note"]
    trace = open(os.path.join(d, "cand_000", "traces.jsonl")).readline()
    assert "prompt_ids" not in trace and "example_id" in trace
    summary = [json.loads(x) for x in open(os.path.join(d, "summary.jsonl"))]
    assert [x["cand"] for x in summary] == [c["name"] for c in arch]
    front = json.load(open(os.path.join(d, "frontier.json")))
    assert front["success_vs_turns"][0]["success"] == max(x["success"] for x in summary)
    its = [json.loads(x) for x in open(os.path.join(d, "iterations.jsonl"))]
    assert all("paper_choice" in x and "incumbent" in x for x in its)
    assert res["counters"]["evaluated"] == len(arch) and res["counters"]["rollouts"] == 40 * len(arch)
    assert res["counters"]["iterations"] == 8 and res["counters"]["proposer_calls"] == 7
    # once the alternatives run out, the proposer says so instead of repeating itself
    assert all(mh.normalized(c["source"]) not in set(norms) for c in prop(d, 3))


def test_primitives_axis_follows_failure_signature(tmp_path):
    def run_iter0(d, answer, tool_result):
        def evaluate(source, examples, tag):
            return [record(ex, i < 5, answer=answer, tool_result=tool_result) for i, ex in enumerate(examples)]
        mh.search_phase(H0, DOMAIN, EXAMPLES, evaluate, ok_validate, None, archive_dir=d,
                        should_stop=stop_after(1), log=quiet)
        return mh.make_proposer("primitives", DOMAIN)(d, 1)[0]["axis"]
    # no answer extracted -> the answer-extraction axis
    assert run_iter0(str(tmp_path / "a"), None, "") == "extract_answer"
    # an answer the tool output does not contain -> a retrieval axis
    assert run_iter0(str(tmp_path / "b"), "made up", "unrelated passage") == "TOP_K"
    # deterministic given rng_seed
    p1 = mh.make_proposer("primitives", DOMAIN, rng_seed=3)(str(tmp_path / "a"), 3)
    p2 = mh.make_proposer("primitives", DOMAIN, rng_seed=3)(str(tmp_path / "a"), 3)
    assert [c["source"] for c in p1] == [c["source"] for c in p2]
    assert len({c["axis"] for c in p1}) == 3                # k different axes first


def test_invalid_candidates_are_archived_and_search_continues(tmp_path):
    good = mh.splice(H0, "QUALITY", "QUALITY = 0.9")
    batches = [["", "def run(:\n", "X = 1\n", "import numpy\n" + H0, H0,
                H0.replace("QUALITY = 0.2", "QUALITY = 0.3")],
               [good]]

    def propose(archive_dir, k):
        return [dict(source=s, proposer="fake", note="n") for s in batches.pop(0)] if batches else []

    def validate(source):
        return "sandbox: crashed on the validation task" if "QUALITY = 0.3" in source else None

    d = str(tmp_path / "arch")
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), validate, propose, archive_dir=d, k=6,
                          should_stop=stop_after(4), log=quiet)
    reasons = {c["name"]: (c["invalid"] or "").strip() for c in mh.load_archive(d)}
    assert reasons["cand_001"].startswith("empty source")
    assert reasons["cand_002"].startswith("syntax error")
    assert reasons["cand_003"].startswith("no top-level function run")
    assert "standard library" in reasons["cand_004"]
    assert reasons["cand_005"] == "duplicate of cand_000"
    assert reasons["cand_006"].startswith("sandbox")
    assert reasons["cand_007"] == "" and res["incumbent"] == "cand_007"
    assert res["iterations"] == 4 and res["counters"]["invalid"] == 6


def test_prompt_only_search_rejects_other_changes(tmp_path):
    d = str(tmp_path / "fst")
    prim = mh.make_proposer("primitives", DOMAIN)
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prim, archive_dir=d, k=3,
                    should_stop=stop_after(2), prompt_only_base=H0, log=quiet)
    arch = mh.load_archive(d)
    assert {c["meta"]["axis"] for c in arch[1:]} == {"SYSTEM_PROMPT"} and not any(c["invalid"] for c in arch)

    def sneaky(archive_dir, k):
        return [dict(source=mh.splice(H0, "QUALITY", "QUALITY = 0.9"), proposer="x", note="n"),
                dict(source=mh.splice(H0, "SYSTEM_PROMPT", 'SYSTEM_PROMPT = "Be exact."'), proposer="x", note="n")]
    d2 = str(tmp_path / "fst2")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, sneaky, archive_dir=d2, k=2,
                    should_stop=stop_after(2), prompt_only_base=H0, log=quiet)
    arch = mh.load_archive(d2)
    assert "prompt-only" in arch[1]["invalid"] and "QUALITY" in arch[1]["invalid"]
    assert arch[2]["invalid"] is None and arch[2]["scores"] is not None


# ---- LLM proposers ------------------------------------------------------------

REPLY = "Mechanism: ask for a short answer.\n```python\n" + mh.splice(H0, "QUALITY", "QUALITY = 0.7") + "```\n"


def serve(mode, requests):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = b"<html>502 nonsense" if mode == "garbage" else json.dumps(
                {"choices": [{"message": {"role": "assistant", "content": REPLY}}],
                 "usage": {"prompt_tokens": 11, "completion_tokens": 7}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            body = json.dumps({"data": [{"id": "served-model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_openai_proposer_against_local_server(tmp_path):
    d = str(tmp_path / "arch")
    requests = []
    server = serve("ok", requests)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        prop = mh.make_proposer("openai", DOMAIN, base_url=url, api_key="k", timeout=10)
        res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=d, k=2,
                              should_stop=stop_after(2), log=quiet)
    finally:
        server.shutdown()
    arch = mh.load_archive(d)
    assert arch[1]["scores"] is not None and arch[1]["meta"]["note"] == "ask for a short answer."
    assert arch[2]["invalid"].startswith("duplicate of cand_001")  # the server always says the same
    assert requests[0]["model"] == "served-model" and DOMAIN.SKILL in requests[0]["messages"][0]["content"]
    assert "### example" in requests[0]["messages"][0]["content"]  # traces are in the digest
    assert res["incumbent"] == "cand_001"
    assert res["counters"]["proposer_prompt_tokens"] == 22 and res["counters"]["proposer_calls"] == 2


def test_openai_proposer_survives_garbage_and_down_endpoint(tmp_path):
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=d,
                    should_stop=stop_after(1), log=quiet)
    requests = []
    server = serve("garbage", requests)
    try:
        prop = mh.make_proposer("openai", DOMAIN, base_url=f"http://127.0.0.1:{server.server_address[1]}/v1",
                                model="m", timeout=5)
        assert prop(d, 3) == [] and len(prop.errors) == 3 and len(requests) == 3
    finally:
        server.shutdown()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prop = mh.make_proposer("openai", DOMAIN, base_url=f"http://127.0.0.1:{port}/v1", model="m", timeout=5)
    assert prop(d, 3) == [] and len(prop.errors) == 1  # gives up after the first refused connection
    # and inside a search: an iteration with zero candidates, logged, no crash
    events = []
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=d,
                          should_stop=stop_after(2), log=events.append)
    assert res["iterations"] == 2 and any(e["event"] == "proposer_error" for e in events)


def test_self_proposer_prompt_and_bad_replies(tmp_path):
    d = str(tmp_path / "arch")
    prompts = []
    replies = [REPLY, "I would rather not write code.", "```python\nX = 1\n```"]

    def llm_text(prompt, max_tokens):
        prompts.append(prompt)
        return replies.pop(0)
    prop = mh.make_proposer("self", DOMAIN, llm_text=llm_text)
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=d, k=3,
                    should_stop=stop_after(2), log=quiet)
    assert DOMAIN.SKILL in prompts[0] and "No pure parameter tweaks" in prompts[0]
    assert "cand_000" in prompts[0] and "### example" in prompts[0]
    assert "ask for a short answer." in prompts[1]  # later calls see earlier mechanisms
    arch = mh.load_archive(d)
    assert arch[1]["scores"] is not None
    assert arch[2]["invalid"].startswith("empty source") and os.path.exists(os.path.join(arch[2]["dir"], "reply.txt"))
    assert arch[3]["invalid"].startswith("no top-level function run")


def test_command_proposer_collects_files_and_survives_timeout(tmp_path):
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=d,
                    should_stop=stop_after(1), log=quiet)
    script = tmp_path / "agent.py"
    body = mh.splice(H0, "QUALITY", "QUALITY = 0.6").replace('"""Toy harness."""', '"""Higher quality."""')
    script.write_text(textwrap.dedent(f'''\
        import os, sys
        assert os.path.exists("PROPOSE.md") and "new/cand_" in sys.stdin.read()
        open("new/cand_1.py", "w").write({body!r})
        open("new/cand_2.py", "w").write("broken(")
        '''))
    prop = mh.make_proposer("command", DOMAIN, command=f"{sys.executable} {script}", timeout=30)
    cands = prop(d, 2)
    assert [c["note"] for c in cands][0] == "Higher quality." and len(cands) == 2
    assert prop.stats["calls"] == 1 and prop.stats["prompt_chars"] > 0
    slow = mh.make_proposer("command", DOMAIN, command="sleep 30", timeout=0.5)
    assert slow(d, 2) == [] and any("timed out" in e for e in slow.errors)


# ---- acceptance -----------------------------------------------------------------

def test_sign_test_values():
    assert mh.sign_test([1, 1, 0], [0, 0, 0]) == (2, 0, 0.25)
    assert mh.sign_test([1, 0], [1, 0])[2] == 1.0
    b, c, p = mh.sign_test([1] * 10 + [0] * 2, [0] * 10 + [1] * 2)
    assert (b, c) == (10, 2) and abs(p - 79 / 4096) < 1e-12


def test_paired_acceptance_controls_false_accepts():
    n, alpha = 128, 0.1
    false_accepts = sum(mh.accept((rng.random(n) < 0.3).astype(float), (rng.random(n) < 0.3).astype(float), alpha)[0]
                        for rng in (np.random.default_rng(seed) for seed in range(200)))
    assert false_accepts / 200 <= alpha + 0.03  # exact test: at most alpha, up to Monte-Carlo noise
    true_accepts = sum(mh.accept((rng.random(n) < 0.6).astype(float), (rng.random(n) < 0.3).astype(float), alpha)[0]
                       for rng in (np.random.default_rng(1000 + seed) for seed in range(50)))
    assert true_accepts >= 48


def test_search_logs_paper_choice_but_keeps_incumbent_on_noise(tmp_path):
    # Every candidate has true success 0.3; scores are independent per (source, example).
    def evaluate(source, examples, tag):
        seed = zlib.crc32(mh.normalized(source).encode())
        rng = random.Random(seed)
        return [record(ex, rng.random() < 0.3) for ex in examples]
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, evaluate, ok_validate, mh.make_proposer("primitives", DOMAIN),
                    archive_dir=d, k=3, should_stop=stop_after(4), log=quiet)
    its = [json.loads(x) for x in open(os.path.join(d, "iterations.jsonl"))]
    assert any(x["paper_choice"] != x["incumbent"] for x in its)  # the argmax chased a lucky draw
    assert all(x["test"] is None or x["test"]["p"] > 0.1 or x["accepted"] for x in its)


# ---- resume ---------------------------------------------------------------------

@pytest.mark.parametrize("fail_at", [5, 6])  # 5: at the start of iteration 2; 6: inside it
def test_resume_after_crash_reuses_archive(tmp_path, fail_at):
    ref_calls = []
    ref = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(ref_calls), ok_validate,
                          mh.make_proposer("primitives", DOMAIN), archive_dir=str(tmp_path / "ref"), k=3,
                          should_stop=stop_after(5), log=quiet)
    d = str(tmp_path / "crashy")
    first_calls = []
    with pytest.raises(RuntimeError):
        mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(first_calls, fail_at=fail_at), ok_validate,
                        mh.make_proposer("primitives", DOMAIN), archive_dir=d, k=3,
                        should_stop=stop_after(5), log=quiet)
    assert len(first_calls) == fail_at - 1
    proposer_calls = []
    prim = mh.make_proposer("primitives", DOMAIN)

    def counting(archive_dir, k):
        proposer_calls.append(1)
        return prim(archive_dir, k)
    second_calls = []
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(second_calls), ok_validate, counting,
                          archive_dir=d, k=3, should_stop=stop_after(5), log=quiet)
    assert len(second_calls) == len(ref_calls) - len(first_calls)   # nothing evaluated twice
    assert not {t for t, _ in first_calls} & {t for t, _ in second_calls}
    assert len(proposer_calls) == 2        # iteration 2 was already proposed: only 3 and 4 ask
    assert res["best_source"] == ref["best_source"] and res["history"] == ref["history"]
    no_time = {k: v for k, v in res["counters"].items() if not k.endswith("seconds")}
    assert no_time == {k: v for k, v in ref["counters"].items() if not k.endswith("seconds")}
    summary = [json.loads(x)["cand"] for x in open(os.path.join(d, "summary.jsonl"))]
    assert len(summary) == len(set(summary)) == len(mh.load_archive(d))
    # calling it again on a finished archive evaluates nothing
    again = []
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(again), ok_validate, counting, archive_dir=d, k=3,
                    should_stop=stop_after(5), log=quiet)
    assert again == [] and len(proposer_calls) == 2


def test_resume_refuses_a_different_incumbent(tmp_path):
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=d,
                    should_stop=stop_after(1), log=quiet)
    with pytest.raises(ValueError):
        mh.search_phase(H0.replace("0.2", "0.4"), DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None,
                        archive_dir=d, should_stop=stop_after(1), log=quiet)
