"""
Benchmark: where WHALE's time goes, measured side by side in one run.

Prints one `name: value` line per measurement:
  - matmul peak: torch fp32 GFLOP/s of a 2048^3 matmul on this machine;
  - rollout workload: 32 SQuAD prompts of ~250 tokens x 8 samples x 32 new tokens,
    the engine's sampler vs model.generate(num_return_sequences=8) (tokens/s, ratio);
  - pure decode: 64 short prompts x 64 new tokens, sampler vs generate, sampled and
    greedy, with a token-identity check under greedy;
  - sandbox overhead: a one-call harness run through the sandbox vs the same prompts
    sampled in-process as one batch;
  - isolation (only with --only isolation): what a process per rollout costs, with the model
    out of the picture (every llm() answered at once): the searchqa and chess h0 harnesses on
    questions x 8 through the sandbox vs called in this process with a fresh import per
    rollout (no isolation at all): ms per rollout, their ratio, and the peak memory (PSS) of
    the sandbox's process tree;
  - multi-turn: the chess h0 harness (a retry after every unparsed move: later calls
    repeat the first prompt plus each sample's own reply) on 16 puzzles x 8 through the
    sandbox, with shared-head prefill vs without (seconds, tokens prefilled, ratio);
  - SFT: tokens/s of rs_sft.sft_update and its fraction of the matmul peak
    (6N FLOPs per token for full fine-tuning; the reduced count with --train-layers);
  - eval (only with --only eval): the real workload, `rollout.evaluate` of two real harnesses
    through the sandbox, the landed sampler, the fast one and the fast one sampling from int8
    weights (`--rollout-precision int8`, CPU) side by side, then one phase-A step (rollouts +
    SFT update) the same way; see `eval_workload` for what is printed and what the limit is;
  - vote (only with --only vote): the menu's voting searchqa harness (5 replies to its first
    turn) with those replies asked as one llm(..., n=5) call vs as 5 llm() calls, the same seeds;
  - memory (only with --only memory): peak RSS of one long-context evaluation (16 questions x 8)
    per sampler, each in its own process: landed, fast with a cache copy per row, fast; then one
    long-harness candidate (64 questions x 2) with its prefill in one forward vs in row slices;
    then phase A's update (8 searchqa-shaped sequences) uncapped vs under --max-memory 4's cap, and
    one sequence longer than the cap (it runs alone; --only update runs this part alone);
  - omp (only with --only omp): how OpenMP's threads wait between parallel regions, searchqa h0
    evaluated in fresh processes with OMP_WAIT_POLICY=PASSIVE (sleep at once) and with
    GOMP_SPINCOUNT=20000 (whale.py's: spin briefly, then sleep): rollouts/s, context switches, ratio;
  - malloc (only with --only malloc): the long-context harness evaluated in fresh processes with
    glibc's malloc settings and with whale.py's (freed blocks under 1 GB kept in the heap, not
    returned to the kernel): rollouts/s, system time, page faults, peak RSS, ratio;
  - race (only with --only race): what cutting one candidate's evaluation into racing's blocks
    costs on this machine: searchqa h0 on 64 harness-split questions x 2 (one search-set
    evaluation) scored as one batch, as racing's blocks (meta_harness.RACE: after 16, 32 and 48
    questions) and as blocks of 8 questions (the first registered setting), the same rollouts each
    way: seconds and the ratio to one batch (a thin block runs the model further below its peak);
    then three candidates in racing's blocks one after another vs at once, their batches shared
    (rollout.in_shared_batches, phase B's way): seconds, the same tokens, the speedup;
  - prefix (only with --only prefix): prompts' shared heads cut as before (greedy) vs the cheapest
    cut, on searchqa h0, the long-context harness and chess h0 (positions prefilled, seconds, ratio),
    and what a prefix cache kept across sample() calls could save at most (`prefix_reuse`);
  - deadline (only with --only deadline): what rollouts are charged against their
    deadline (own time + tools + their share of each model batch) in a real evaluation,
    64 searchqa questions x 8 = one 512-rollout wave and 16 chess puzzles x 8 (multi-turn,
    retries), and how far past a 30 s deadline an llm() flood gets.

    python tools/bench.py                         # everything (~12 min on a 2-core CPU)
    python tools/bench.py --quick                 # smaller shapes, for a smoke run
    python tools/bench.py --only decode,multiturn # some sections (rollout, decode, sandbox, multiturn, sft, deadline, eval, memory, vote, omp, malloc, race, isolation, prefix)
    python tools/bench.py --only eval             # the real workload, landed vs fast vs int8 (~35 min on 2 cores)
    python tools/bench.py --only eval --questions 8 --harnesses long  # a smaller part of it
    python tools/bench.py --only eval --harnesses '' --phase-a study  # one phase-A step of the study's regime
    python tools/bench.py --only memory           # peak memory per sampler (~10 min on 2 cores)
    python tools/bench.py --only update           # its last part: phase A's update, capped or not (~2 min)
    python tools/bench.py --only isolation        # a process per rollout vs none (~1 min)
    python tools/bench.py --only race             # racing's blocks vs one batch; three candidates shared (~10 min)
    python tools/bench.py --only prefix           # shared heads: greedy vs cheapest cut; a cache across calls (~4 min)
    python tools/bench.py --only vote --questions 16  # llm(n=5) vs 5 calls in the voting harness
    python tools/bench.py --only omp              # OpenMP threads sleeping at once vs spinning briefly (~2 min)
    python tools/bench.py --only malloc           # freed memory back to the kernel vs kept (~8 min)

The limit (eval section): on a CPU a rollout's time is matmul time, so no sampler can beat
(matmul peak) / (the FLOPs the rollouts need): 2N per prompt position, a prefix shared by
several prompts counted once, plus 2N per completion token (N: the weights a token goes
through; `least_flops`). Padding, finished rows still in the batch, copies of the cache,
thin decode batches and the sandbox's round trips are what stands between a sampler and it;
eval_fraction_of_peak says how much of it is left. The peak is measured in the same run,
on the same (possibly shared) cores, right before each side-by-side pair.

Ratios are what to trust on a shared machine; absolute numbers move with load.
"""
import argparse
import collections
import os
import sys
import time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python tools/x.py` imports the repository's modules

import whale  # (first: its process settings, OpenMP's wait and malloc's threshold, as a run has them)
import torch

from lm import engine as eng
from lm import models
import rollout
import rs_sft


def matmul_gflops(n=2048, reps=5, device="cpu", dtype=torch.float32):
    """GFLOP/s of an n^3 matmul in the model's dtype on its device: the compute limit."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    a @ b
    sync()
    t = time.time()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n ** 3 * reps / (time.time() - t) / 1e9


def squad_prompts(e, n, target_tokens=250):
    """n chat prompts of ~target_tokens: a real SQuAD passage + its question."""
    from domains import searchqa
    passages = {p["id"]: p for p in searchqa.passages()}
    out = []
    for ex in searchqa.load_split("test"):
        p = passages[ex["answer"]["passage_id"]]["text"]
        words = p.split()
        text = " ".join(words[:int(target_tokens * 0.62)])
        ids = e.chat_ids([{"role": "user", "content": f"{text}\n\nQuestion: {ex['task']['question']}\nAnswer briefly."}])
        out.append(ids)
        if len(out) == n:
            return out
    return out


def left_pad(prompts, pad_id):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    return ids, mask


def hf_generate(model, prompts, pad_id, new_tokens, n=1, greedy=False):
    """model.generate on the same prompts; returns (seconds, generated tokens, rows of new ids).
    Sampled runs are forced to new_tokens (min_new_tokens) so both sides make the same count;
    greedy runs stop at EOS, as the sampler does, for the identity check."""
    ids, mask = left_pad(prompts, pad_id)
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=20,
                                                   min_new_tokens=new_tokens)
    t = time.time()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             num_return_sequences=n, pad_token_id=pad_id, **kw)
    return time.time() - t, (out.shape[1] - ids.shape[1]) * out.shape[0], out[:, ids.shape[1]:]


def engine_sample(e, prompts, new_tokens, n=1, greedy=False, ignore_eos=True):
    reqs = [{"prompt_ids": p, "max_tokens": new_tokens, "temperature": 0.0 if greedy else 1.0, "top_k": 20,
             "top_p": 1.0, "stop": [], "seed": rollout.stable_seed("bench", i, j)}
            for i, p in enumerate(prompts) for j in range(n)]
    saved = e.eos_ids
    if ignore_eos:  # same token count as generate(min_new_tokens=...)
        e.eos_ids = set()
    t = time.time()
    outs = e.sample(reqs)
    e.eos_ids = saved
    return time.time() - t, sum(len(o["completion_ids"]) for o in outs), outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller shapes (smoke run)")
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--only", default="rollout,decode,sandbox,multiturn,sft", help="comma-separated sections")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the eval section; the others assume cpu)")
    ap.add_argument("--harnesses", default="h0,long", help="eval: which of h0, long ('' = only the phase-A step)")
    ap.add_argument("--phase-a", default="default", choices=sorted(PHASE_A),
                    help="eval: the phase-A step's settings: whale.py's defaults, or the phase-A study's learning regime")
    ap.add_argument("--max-tokens", type=int, default=48,
                    help="eval: the new-token cap of each rollout (whale.py's --max-tokens; the CPU dry run of gpu_check.sh: 16)")
    ap.add_argument("--questions", type=int, default=0,
                    help="eval: test questions x 8 (default 64, 8 with --quick; phase A: a quarter of it); "
                         "memory, vote, omp, malloc and prefix: 16, 4 with --quick")
    ap.add_argument("--eval-child", default="", help=argparse.SUPPRESS)  # fresh_evaluation(): one in its own process
    ap.add_argument("--update-child", type=int, default=-1, help=argparse.SUPPRESS)  # update_memory(): the same
    ap.add_argument("--update-long", action="store_true", help=argparse.SUPPRESS)  # (its one-long-sequence case)
    args = ap.parse_args()
    if args.eval_child:
        return eval_child(args.eval_child, args.model, args.questions)
    if args.update_child >= 0:
        return update_child(args.update_child, args.model, args.update_long)
    only = set(args.only.split(","))
    sections = {"rollout", "decode", "sandbox", "multiturn", "sft", "deadline", "eval", "memory", "update", "vote", "omp",
                "malloc", "isolation", "race", "prefix"}
    if only - sections:
        print(f"bench.py: unknown section(s) {', '.join(sorted(only - sections))}; "
              f"choose from {', '.join(sorted(sections))}", file=sys.stderr)
        raise SystemExit(2)
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        print(f"bench.py: --device {args.device}: use cpu, or cuda where torch sees a CUDA device", file=sys.stderr)
        raise SystemExit(2)
    if set(filter(None, args.harnesses.split(","))) - {"h0", "long"}:
        print(f"bench.py: --harnesses takes h0 and/or long, not {args.harnesses!r}", file=sys.stderr)
        raise SystemExit(2)
    if args.max_tokens < 1:
        print(f"bench.py: --max-tokens must be >= 1, not {args.max_tokens}", file=sys.stderr)
        raise SystemExit(2)
    if args.questions < 0:
        print(f"bench.py: --questions must be >= 0 (0 = the default), not {args.questions}", file=sys.stderr)
        raise SystemExit(2)
    sys.stdout.reconfigure(line_buffering=True)  # each line as it is measured, also into a file
    q = args.quick
    torch.manual_seed(0)
    peak = matmul_gflops(device=args.device)
    print(f"matmul_fp32_gflops: {peak:.1f}")
    model, tok = models.load_model(args.model, device=args.device)
    e = eng.HFEngine(model, tok)
    n_params = sum(p.numel() for n_, p in model.named_parameters() if "embed_tokens" not in n_)
    n_params += model.lm_head.weight.numel() if model.config.tie_word_embeddings else 0

    P, G, NEW = (8, 8, 16) if q else (32, 8, 32)
    prompts = squad_prompts(e, P) if only - {"eval", "deadline", "memory", "update", "vote", "isolation", "race",
                                             "prefix"} else []
    if "rollout" in only:
        rollout_workload(e, model, prompts, G, NEW, n_params, peak)
    if "decode" in only:
        decode(e, model, q)
    if "sandbox" in only:
        sandbox_overhead(e, P, G, NEW)
    if "isolation" in only:
        isolation(args.questions or (8 if q else 64))
    if "race" in only:
        race_blocks(e, args.questions or (16 if q else 64), args.max_tokens)
    if "multiturn" in only:
        multiturn(e, 4 if q else 16)
    if "prefix" in only:
        prefix_reuse(e, args.questions or (4 if q else 16), args.max_tokens)
    if "deadline" in only:
        deadline(e, 8 if q else 64, 4 if q else 16)
    if "memory" in only:
        memory(args.model, args.questions or (4 if q else 16))
    if "update" in only and "memory" not in only:  # (memory ends with it)
        update_memory(args.model)
    if "vote" in only:
        vote(e, args.questions or (4 if q else 16), args.max_tokens)
    if "omp" in only:
        omp(args.model, args.questions or (4 if q else 16))
    if "malloc" in only:
        malloc(args.model, args.questions or (4 if q else 16))
    if "eval" in only:  # restores the weights it trains
        n_q = args.questions or (8 if q else 64)
        eval_workload(model, tok, n_q, max(1, n_q // 4), args.harnesses.split(","), PHASE_A[args.phase_a],
                      args.max_tokens)
    if "sft" in only:  # last: it changes the weights
        sft(model, prompts, q, peak)
    print(f"matmul_fp32_gflops_after: {matmul_gflops():.1f}")


def rollout_workload(e, model, prompts, G, NEW, n_params, peak):
    """Shared prefill + one batch for all rollouts, vs generate(num_return_sequences)."""
    print(f"rollout_prompt_tokens_mean: {sum(map(len, prompts)) / len(prompts):.0f}")
    ts, ns, _ = engine_sample(e, prompts, NEW, n=G)
    tg, ng, _ = hf_generate(model, prompts, e.pad_id, NEW, n=G)
    print(f"rollout_sampler_tokens_per_s: {ns / ts:.1f}")
    print(f"rollout_generate_tokens_per_s: {ng / tg:.1f}")
    print(f"rollout_sampler_seconds: {ts:.1f}")
    print(f"rollout_generate_seconds: {tg:.1f}")
    print(f"rollout_speedup: {tg / ts:.2f}")
    # compute limit: each generated token costs ~2N FLOPs (+ the shared prefill, counted too)
    flops = 2 * n_params * (ns + sum(map(len, prompts)))
    print(f"rollout_sampler_fraction_of_peak: {flops / ts / 1e9 / peak:.2f}")



def decode(e, model, q):
    """Pure decode at batch 64: sampled and greedy, with a token-identity check."""
    B, NEW = (16, 32) if q else (64, 64)
    short = [e.chat_ids([{"role": "user", "content": f"Write one sentence about the number {i}."}]) for i in range(B)]
    ts, ns, _ = engine_sample(e, short, NEW)
    tg, ng, _ = hf_generate(model, short, e.pad_id, NEW)
    print(f"decode_sampler_tokens_per_s: {ns / ts:.1f}")
    print(f"decode_generate_tokens_per_s: {ng / tg:.1f}")
    print(f"decode_speedup: {tg / ts * ns / ng:.2f}")
    ts, ns, outs = engine_sample(e, short, NEW, greedy=True, ignore_eos=False)
    tg, ng, gen = hf_generate_greedy_until_eos(model, short, e, NEW)
    same = sum(o["completion_ids"] == g for o, g in zip(outs, gen))
    print(f"decode_greedy_sampler_tokens_per_s: {ns / ts:.1f}")
    print(f"decode_greedy_generate_tokens_per_s: {ng / tg:.1f}")
    print(f"decode_greedy_speedup: {tg / ts:.2f}")
    print(f"decode_greedy_identical_rows: {same}/{len(outs)}")



def sandbox_overhead(e, P, G, NEW):
    """The same prompts through a one-call harness vs in-process."""
    from domains import searchqa
    examples = searchqa.load_split("test")[:P]
    harness = ("def run(task, llm, tools):\n"
               "    return llm([{'role': 'user', 'content': 'Question: ' + task['question'] + '\\nAnswer briefly.'}],"
               " max_tokens=%d)\n" % NEW)
    msgs = [[{"role": "user", "content": "Question: " + ex["task"]["question"] + "\nAnswer briefly."}] for ex in examples]
    sampling = {"temperature": 1.0, "top_k": 20, "top_p": 1.0}
    t = time.time()
    reqs = [{"prompt_ids": e.chat_ids(m), "max_tokens": NEW, "stop": [], "seed": rollout.stable_seed(0, ex["id"], j),
             **sampling} for m, ex in zip(msgs, examples) for j in range(G)]
    e.sample(reqs)
    t_in = time.time() - t
    t = time.time()
    rollout.run(e, searchqa, harness, examples, G, seed=0, sampling=sampling, max_tokens=NEW)
    t_sb = time.time() - t
    print(f"sandbox_seconds: {t_sb:.1f}")
    print(f"inprocess_seconds: {t_in:.1f}")
    print(f"sandbox_overhead_ratio: {t_sb / t_in:.3f}")



def tree_pss_mb(root):
    """PSS (shared pages split among their users) of process `root` and all its descendants, in MB."""
    kids, total, todo = {}, 0, [root]
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            total += next(int(line.split()[1]) for line in open(f"/proc/{pid}/smaps_rollup") if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def isolation(n_questions, G=8):
    """A process per rollout, priced with the model out of the picture: each h0 harness on
    n_questions x G through the sandbox (rollout.run, every llm() answered at once) vs called
    in this process, a fresh import of the harness per rollout and the same tools."""
    import threading
    import types
    from domains import chess, searchqa

    class Instant:  # an engine that answers every prompt at once with a fixed reply
        max_model_len = 8192

        def chat_ids(self, messages):
            return [1] * 8

        def sample(self, reqs):
            return [{"text": "<answer>Paris</answer> e2e4", "completion_ids": [2, 3], "finish": "stop"} for _ in reqs]
    for domain in (searchqa, chess):
        examples, source = domain.load_split("test")[:n_questions], open(domain.H0).read()
        sampling = {"temperature": 1.0, "top_k": 20, "top_p": 1.0}
        peak, done = [0.0], threading.Event()

        def watch():
            while not done.wait(0.1):
                peak[0] = max(peak[0], tree_pss_mb(os.getpid()) - base)
        base = tree_pss_mb(os.getpid())
        watcher = threading.Thread(target=watch)
        watcher.start()
        t = time.perf_counter()
        recs = rollout.run(Instant(), domain, source, examples, G, seed=0, sampling=sampling, max_tokens=32)
        t_sandbox = time.perf_counter() - t
        done.set()
        watcher.join()
        code = compile(source, "harness.py", "exec")
        t = time.perf_counter()
        for ex in examples:
            for _ in range(G):
                module = types.ModuleType("harness")
                exec(code, module.__dict__)
                tools, _ = domain.make_tools(ex)
                try:
                    module.run(ex["task"], lambda *a, **k: "<answer>Paris</answer> e2e4",
                               types.SimpleNamespace(**{k: v for k, v in tools.items() if not k.startswith("_")}))
                except Exception:
                    pass
        t_inproc = time.perf_counter() - t
        n = len(examples) * G
        name = domain.__name__.split(".")[-1]
        print(f"isolation_{name}_rollouts: {n} ({sum(r['status'] == 'ok' for r in recs)} ok)")
        print(f"isolation_{name}_sandbox_ms_per_rollout: {1000 * t_sandbox / n:.2f}")
        print(f"isolation_{name}_inprocess_ms_per_rollout: {1000 * t_inproc / n:.2f}")
        print(f"isolation_{name}_sandbox_over_inprocess: {t_sandbox / t_inproc:.1f}")
        print(f"isolation_{name}_sandbox_tree_peak_pss_mb: {peak[0]:.0f}")


def race_blocks(e, n_questions, max_tokens, n=2):
    """One candidate's search-set evaluation (searchqa h0, n_questions x n, whale.py's sampling),
    whole and cut into racing's blocks: the same rollouts (a rollout's seed is its example's and
    sample's, so the cuts sample the same tokens), in batches of different sizes."""
    import meta_harness
    from domains import searchqa
    from harness_search import harness_source
    examples, source = searchqa.load_split("harness")[:n_questions], open(searchqa.H0).read()
    sampling = {"temperature": 0.7, "top_k": 20, "top_p": 1.0}
    cuts = {"one_batch": (), "racing": tuple(meta_harness.race_looks(n_questions, **meta_harness.RACE)),
            "blocks_of_8": tuple(range(8, n_questions, 8))}
    seconds = {}
    for name, cut in cuts.items():
        ends = [k for k in cut if k < n_questions] + [n_questions]
        t = time.perf_counter()
        for lo, hi in zip([0] + ends, ends):
            rollout.run(e, searchqa, source, examples[lo:hi], n, seed=0, sampling=sampling, max_tokens=max_tokens)
        seconds[name] = time.perf_counter() - t
        print(f"race_{name}_batches: {len(ends)} (after {', '.join(map(str, ends))} questions)")
        print(f"race_{name}_seconds: {seconds[name]:.1f}")
        print(f"race_{name}_over_one_batch: {seconds[name] / seconds['one_batch']:.2f}")
    # An iteration's three candidates (h0 and two of its primitive edits: the long context, voting),
    # each in racing's blocks, one candidate after another vs all three at once with their batches
    # shared (rollout.in_shared_batches, as phase B runs them): the same rollouts, the same tokens
    three = [source, long_context_harness(), harness_source.splice(source, "run", searchqa.PRIMITIVES["run"][2])]
    ends = list(cuts["racing"]) + [n_questions]
    blocks = lambda src: [rollout.run(e, searchqa, src, examples[lo:hi], n, seed=0, sampling=sampling,
                                      max_tokens=max_tokens) for lo, hi in zip([0] + ends, ends)]
    t = time.perf_counter()
    apart = [blocks(src) for src in three]
    seconds["apart"] = time.perf_counter() - t
    t = time.perf_counter()
    shared = rollout.in_shared_batches(e, [lambda src=src: blocks(src) for src in three])
    seconds["shared"] = time.perf_counter() - t
    ids = lambda runs: [[c["completion_ids"] for b in run for r in b for c in r["calls"]] for run in runs]
    print(f"race_three_candidates_apart_seconds: {seconds['apart']:.1f}")
    print(f"race_three_candidates_shared_seconds: {seconds['shared']:.1f} (same tokens: {ids(apart) == ids(shared)})")
    print(f"race_three_candidates_speedup: {seconds['apart'] / seconds['shared']:.2f} (apart / shared batches)")


def multiturn(e, n_puzzles):
    """The chess h0 harness through the sandbox, shared-head prefill on vs off (same seeds)."""
    from domains import chess
    examples, h0 = chess.load_split("test")[:n_puzzles], open(chess.H0).read()
    sampling = {"temperature": 0.3, "top_k": 20, "top_p": 1.0}
    out = {}
    for name, min_shared in (("shared", e.min_shared_head), ("unshared", 10**9)):
        saved, e.min_shared_head, before = e.min_shared_head, min_shared, e.prefill_tokens
        t = time.time()
        recs = rollout.run(e, chess, h0, examples, 8, seed=0, sampling=sampling, max_tokens=48)
        out[name] = time.time() - t
        e.min_shared_head = saved
        calls = [c for r in recs for c in r["calls"]]
        print(f"multiturn_{name}_seconds: {out[name]:.1f}")
        print(f"multiturn_{name}_prefill_tokens: {e.prefill_tokens - before}")
        print(f"multiturn_{name}_calls: {len(calls)} (prompt tokens {sum(len(c['prompt_ids']) for c in calls)})")
    print(f"multiturn_speedup: {out['unshared'] / out['shared']:.2f}")


def long_context_harness():
    """searchqa h0 with the domain's own primitives spliced in: three worked examples
    (EXAMPLES[0]) and three passages of up to 500 characters (RETRIEVAL[1]); ~3x h0's prompt."""
    from harness_search import harness_source
    from domains import searchqa
    src = open(searchqa.H0).read()
    for name, i in (("EXAMPLES", 0), ("RETRIEVAL", 1)):
        src = harness_source.splice(src, name, searchqa.PRIMITIVES[name][i])
    return src


def forward_fraction(model, rows, length, n_body, n_head, reps=3):
    """The fraction of the matmul peak (measured right before) that one bare forward of `rows`
    x `length` tokens reaches, without a cache, the LM head at the last position only: the
    ceiling of a sampler whose forwards have these shapes (a decode step is `length` 1)."""
    dev = next(model.parameters()).device
    peak = matmul_gflops(device=dev, dtype=next(model.parameters()).dtype)
    ids = torch.randint(100, 20000, (rows, length), device=dev)
    with torch.no_grad():
        model(input_ids=ids, logits_to_keep=1)  # (warm-up)
        t = time.time()
        for _ in range(reps):
            model(input_ids=ids, logits_to_keep=1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.time() - t) / reps
    return (2 * n_body * rows * length + 2 * n_head * rows) / seconds / 1e9 / peak


def tree_positions(prompts) -> int:
    """The distinct positions of these prompts' prefix tree: the prompt positions a sampler that
    never computed one prefix twice would run (sorted, each prompt adds what it does not share
    with the one before it)."""
    positions, prev = 0, ()
    for p in sorted(set(map(tuple, prompts))):
        positions, prev = positions + len(p) - eng.common_prefix_len(p, prev), p
    return positions


def least_flops(records, n_body, n_head):
    """The FLOPs any sampler must do for these rollouts: every prompt position once (a prefix
    that several calls share, counted once: the distinct positions of the prompts' prefix
    tree; the body only, the LM head runs at each prompt's last position, below) and every
    completion token through body and LM head. Attention over the cache is left out (~5%)."""
    prompts = {tuple(c["prompt_ids"]) for r in records for c in r["calls"]}
    completion = sum(len(c["completion_ids"]) for r in records for c in r["calls"])
    return 2 * n_body * tree_positions(prompts) + 2 * (n_body + n_head) * (completion + len(prompts))


def greedy_head_groups(prompts, min_shared):
    """engine.shared_head_groups as it was before its cheapest cut (kept here to compare): a sorted
    prompt joins the group before it whenever they share min_shared tokens, shrinking its head."""
    groups = []
    for j in sorted(range(len(prompts)), key=lambda j: prompts[j]):
        p = prompts[j]
        if groups:
            h, js = groups[-1]
            n = min(eng.common_prefix_len(prompts[js[0]], p), h, len(p) - 1)
            if n >= min_shared:
                groups[-1] = (n, js + [j])
                continue
        groups.append((len(p) - 1, [j]))
    return groups


def prefix_reuse(e, n_questions, max_tokens):
    """Prefill on the real workloads through the sandbox with the fast sampler (issue 68 item 3):
    searchqa h0, the long-context harness and the multi-turn chess h0 (a retry repeats the first
    prompt plus the sample's own reply), each evaluated with the prompts' shared heads cut as
    before (`greedy_head_groups`) and as now (engine.shared_head_groups, the cheapest cut), the same
    seeds, in turn. Per workload and cut: the prompt positions the sampler prefilled, the prefill
    and total seconds and mean@8 (the same up to float round-off); then the positions a prefix tree
    needs within each sample() call (what one level of shared heads aims at) and across all calls
    (what a cache kept between calls could reach), and the prefill seconds such a cache could save
    at most, in proportion."""
    from domains import chess, searchqa
    sampling = {"temperature": 0.3, "top_k": 20, "top_p": 1.0}
    work = (("searchqa_h0", searchqa, open(searchqa.H0).read(), searchqa.load_split("test")[:n_questions]),
            ("searchqa_long", searchqa, long_context_harness(), searchqa.load_split("test")[:n_questions]),
            ("chess_h0", chess, open(chess.H0).read(), chess.load_split("test")[:n_questions]))
    real_sample, real_groups = e.sample, eng.shared_head_groups
    for k, (name, domain, source, examples) in enumerate(work):
        seconds, ran, calls = {}, {}, {}
        for cut in (("greedy", "cheapest") if k % 2 == 0 else ("cheapest", "greedy")):  # in turn: drift hits both
            calls[cut] = []
            e.sample = lambda reqs: calls[cut].append([r["prompt_ids"] for r in reqs]) or real_sample(reqs)
            eng.shared_head_groups = greedy_head_groups if cut == "greedy" else real_groups
            before, tokens_before, t = collections.Counter(e.work), e.prefill_tokens, time.time()
            try:
                res = rollout.evaluate(e, domain, source, examples, 8, seed=0, sampling=sampling, max_tokens=max_tokens)
            finally:
                e.sample, eng.shared_head_groups = real_sample, real_groups
            seconds[cut], ran[cut], w = time.time() - t, e.prefill_tokens - tokens_before, e.work - before
            print(f"prefix_{name}_{cut}: {ran[cut]} prompt positions prefilled in {w['prefill_seconds']:.1f} s "
                  f"of {seconds[cut]:.1f}; mean@8 {res['mean']:.3f}")
        print(f"prefix_{name}_cheapest_speedup: {seconds['greedy'] / seconds['cheapest']:.2f} (greedy / cheapest seconds)")
        within = sum(tree_positions(c) for c in calls["cheapest"])
        across = tree_positions([p for c in calls["cheapest"] for p in c])
        print(f"prefix_{name}_tree: {len(calls['cheapest'])} sample() calls; a prefix tree needs {within} positions "
              f"within each call, {across} across all calls: a cache across calls saves at most "
              f"{(within - across) / max(ran['cheapest'], 1):.1%} of the cheapest cut's prefill")


# the phase-A step's settings: whale.py's defaults (h0, T 0.3, the top 4 blocks, 2 kept per prompt), or
# the regime results/phase-a found to learn (R6-R8: the cpu-long search's harness H_s, T 0.7, full
# fine-tuning at lr 1e-5, 4 kept per prompt)
PHASE_A = {"default": dict(harness="h0", temperature=0.3, train_layers=4, lr=3e-4, kept=2),
           "study": dict(harness="results/runs/cpu-long/searchqa-harness-only-s0/harnesses/cycle00.py",
                         temperature=0.7, train_layers=0, lr=1e-5, kept=4)}


def eval_workload(model, tok, n_questions, n_phase_a, harnesses=("h0", "long"), phase_a=PHASE_A["default"],
                  max_tokens=48):
    """The real workload, the samplers side by side (same weights, same seeds, interleaved), each
    rollout capped at max_tokens new tokens (48: whale.py's default; `--max-tokens`):
    landed and fast (engine.SAMPLERS) in fp32, fast with a cache copy per row ("full", as before
    shared_prefix.py), and on a CPU the fast one in int8 (int8.Int8Linear).

    The limit (module docstring): (matmul peak) / (least FLOPs per rollout, `least_flops`);
    the peak is a 2048^3 matmul in the model's dtype, measured right before each pair.
    eval_fraction_of_peak is how close a sampler gets; eval_speedup = fast / landed rollouts/s.
    Prints per harness (h0, long: `long_context_harness`) and sampler:
    eval_<h>_<sampler>_rollouts_per_s, _prompt_tokens, _completion_tokens, _fraction_of_peak,
    _mean (mean@8, the same within float round-off for landed, full and fast; int8 samples other
    tokens), _time_split (prefill and decode seconds and forwards, from HFEngine.work), for fast
    _model_ceiling (`forward_fraction` at the workload's prefill and mean decode shapes), then eval_<h>_speedup (fast / landed), eval_<h>_shared_prefix_speedup (fast / full)
    and eval_<h>_int8_speedup (int8 / fast, and
    vs landed); int8's fraction is of the fp32 peak (its int8 matmuls can pass it). For one
    phase-A step (16 weight-split prompts x 8, rollouts + SFT update of the top `train_layers`
    blocks, 0 = all, as `phase_a` says; int8 re-quantizes after the update, counted) phase_a_<sampler>_seconds,
    _fraction_of_peak, phase_a_speedup (landed / fast) and phase_a_int8_speedup (fast / int8).
    "landed" is the whole path as it landed: its sampler and the update on whole sequences
    (--sft-prompts whole); the others share the kept sequences' prompts (lm/prefix_tree.py).
    That change alone: the update on the fast step's kept sequences, whole vs shared, from the same
    weights (phase_a_update_tokens, _seconds, phase_a_update_shared_speedup)."""
    import rs_sft
    from domains import searchqa
    n_head = model.lm_head.weight.numel()
    n_body = sum(p.numel() for n_, p in model.named_parameters() if "embed_tokens" not in n_ and "lm_head" not in n_)
    sampling = {"temperature": 0.3, "top_k": 20, "top_p": 1.0}  # whale.py's defaults
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    examples = searchqa.load_split("test")[:n_questions]
    engines = {s: eng.HFEngine(model, tok, sampler=s) for s in eng.SAMPLERS}
    engines["full"] = eng.HFEngine(model, tok, shared_prefix=False)  # fast, with a cache copy per row
    if dev.type == "cpu":  # Int8Linear is a CPU path (whale.py refuses int8 with --device cuda)
        engines["int8"] = eng.HFEngine(model, tok, precision="int8")
    for h_name, source in (("h0", open(searchqa.H0).read()), ("long", long_context_harness())):
        if h_name not in harnesses:
            continue
        peak = matmul_gflops(device=dev, dtype=dtype)
        print(f"eval_{h_name}_matmul_gflops: {peak:.1f} ({dtype} on {dev})")
        rate = {}
        order = ("landed", "full", "fast", "int8") if h_name == "h0" else ("int8", "fast", "full", "landed")  # none always first
        for s in (s for s in order if s in engines):
            before = collections.Counter(engines[s].work)
            res = rollout.evaluate(engines[s], searchqa, source, examples, 8, seed=0, sampling=sampling,
                                  max_tokens=max_tokens)
            w = engines[s].work - before
            rate[s] = res["rollouts"] / res["seconds"]
            frac = least_flops(res["records"], n_body, n_head) / res["seconds"] / 1e9 / peak
            print(f"eval_{h_name}_{s}_rollouts_per_s: {rate[s]:.2f} ({res['rollouts']} rollouts in {res['seconds']:.1f} s)")
            print(f"eval_{h_name}_{s}_prompt_tokens: {res['prompt_tokens']}")
            print(f"eval_{h_name}_{s}_completion_tokens: {res['completion_tokens']}")
            print(f"eval_{h_name}_{s}_fraction_of_peak: {frac:.2f}")
            print(f"eval_{h_name}_{s}_mean: {res['mean']:.3f} +- {res['se']:.3f}")
            # where the time went: prefill (to each row's first token) and decode, per sample() call
            rows = w["decode_rows"] / max(w["decode_forwards"], 1)
            # the decode loop's matmul work (body and LM head per row) over its seconds, against the peak:
            # what model_ceiling's bare decode forward at the same rows reaches is its ceiling
            decode_frac = 2 * (n_body + n_head) * w["decode_rows"] / max(w["decode_seconds"], 1e-9) / 1e9 / peak
            print(f"eval_{h_name}_{s}_time_split: prefill {w['prefill_seconds']:.1f} s ({w['prefill_forwards']} forwards), "
                  f"decode {w['decode_seconds']:.1f} s ({w['decode_forwards']} forwards, {rows:.1f} rows on average, "
                  f"{decode_frac:.2f} of the peak), "
                  f"the rest {res['seconds'] - w['prefill_seconds'] - w['decode_seconds']:.1f} s; {w['calls']} sample() calls")
            if s == "fast":  # the model's own forward at this workload's shapes, no sampler around it
                ceiling = {"prefill 8x256": forward_fraction(model, 8, 256, n_body, n_head),
                           f"decode {round(rows)} rows": forward_fraction(model, max(round(rows), 1), 1, n_body, n_head)}
                print(f"eval_{h_name}_model_ceiling: " + ", ".join(f"{k} {v:.2f}" for k, v in ceiling.items())
                      + " of the matmul peak (a bare forward: what no sampler can beat at these shapes)")
        print(f"eval_{h_name}_speedup: {rate['fast'] / rate['landed']:.2f}")
        print(f"eval_{h_name}_shared_prefix_speedup: {rate['fast'] / rate['full']:.2f} (fast / the same with a cache copy per row)")
        if "int8" in rate:
            print(f"eval_{h_name}_int8_speedup: {rate['int8'] / rate['fast']:.2f} (int8 / fast fp32; "
                  f"{rate['int8'] / rate['landed']:.2f} vs landed)")
    # one phase-A step per sampler from the same weights: the update is undone between them
    pool = searchqa.load_split("weight")
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    peak, seconds, sft_seconds, real_run = matmul_gflops(device=dev, dtype=dtype), {}, {}, rollout.run
    step_harness = open(searchqa.H0 if phase_a["harness"] == "h0" else ROOT / phase_a["harness"]).read()
    train_layers, kept = phase_a["train_layers"], {}
    print(f"phase_a_matmul_gflops: {peak:.1f} ({dtype} on {dev})")
    for s in (s for s in ("int8", "fast", "landed") if s in engines):  # (the eval pair above ran int8 last)
        model.load_state_dict(saved)
        engines[s].sync_weights()  # int8: its copy from the restored weights (before the clock starts)
        opt = rs_sft.make_optimizer(rs_sft.set_trainable(model, train_layers), phase_a["lr"])
        records = []  # the step's rollouts, kept as rs_sft.rollout_step makes them (it returns only metrics)
        rollout.run = lambda *a, **k: records.extend(real_run(*a, **k)) or records
        t = time.time()
        cfg = sft_config(group=8, minibatch=16, micro_batch=8, max_tokens=max_tokens, max_kept_per_prompt=phase_a["kept"],
                         sft_prompts="whole" if s == "landed" else "shared", **{**sampling, "temperature": phase_a["temperature"]})
        prompts = rs_sft.draw_prompts(pool, rs_sft.new_loader(len(pool), 0), n_phase_a)
        m = rs_sft.rollout_step(engines[s], opt, cfg, searchqa, step_harness, prompts, seed=(0, "A", 0), replay=[])
        seconds[s], sft_seconds[s] = time.time() - t, m["sft_seconds"] + m["health_seconds"]
        rollout.run = real_run
        kept[s] = [q for r, w in rs_sft.keep(records, cfg.max_kept_per_prompt) for q in rs_sft.sequences(r, w)]
        # the least FLOPs: each kept sequence's shared prompt trained once, as `least_flops` counts prefill
        flops = least_flops(records, n_body, n_head) + rs_sft.flops_per_token(model, train_layers) * m["sft_forward_tokens"]
        print(f"phase_a_{s}_seconds: {seconds[s]:.1f} (rollouts {m['rollout_seconds']:.1f} s, update "
              f"{m['sft_seconds']:.1f} s + health {m['health_seconds']:.1f} s, {m['rollouts']} rollouts, "
              f"{m['sequences']} sequences trained: {m['sft_tokens']} tokens, {m['sft_forward_tokens']} run)")
        print(f"phase_a_{s}_rollouts_per_s: {m['rollouts'] / m['rollout_seconds']:.2f}")
        print(f"phase_a_{s}_fraction_of_peak: {flops / seconds[s] / 1e9 / peak:.2f}")
    # the update alone on the fast step's kept sequences from the same weights, whole then shared
    # prompts, twice in turn (a change of load hits both); the same seed cuts the same minibatches
    upd = {False: [], True: []}
    for share in (False, True) * 2:
        model.load_state_dict(saved)
        opt = rs_sft.make_optimizer(rs_sft.set_trainable(model, train_layers), phase_a["lr"])
        cfg = sft_config(minibatch=16, micro_batch=8, sft_prompts="shared" if share else "whole")
        st = rs_sft.sft_update(model, opt, kept["fast"], cfg, pad_id=engines["fast"].pad_id, seed=1)
        upd[share].append(st)
    if kept["fast"]:
        whole, shared = (min(x["seconds"] for x in upd[k]) for k in (False, True))
        print(f"phase_a_update_tokens: {upd[False][0]['tokens']} whole, {upd[True][0]['forward_tokens']} shared "
              f"({len(kept['fast'])} kept sequences, loss {upd[False][0]['loss']:.4f} vs {upd[True][0]['loss']:.4f})")
        print(f"phase_a_update_seconds: {whole:.1f} whole, {shared:.1f} shared (the better of two each)")
        print(f"phase_a_update_shared_speedup: {whole / shared:.2f}")
    model.load_state_dict(saved)
    rs_sft.set_trainable(model, 0)
    print(f"phase_a_speedup: {seconds['landed'] / seconds['fast']:.2f}")
    if sft_seconds["fast"]:  # (nothing kept: no update to time)
        print(f"phase_a_sft_speedup: {sft_seconds['landed'] / sft_seconds['fast']:.2f} (update + health, whole / shared)")
    if "int8" in seconds:
        print(f"phase_a_int8_speedup: {seconds['fast'] / seconds['int8']:.2f} (fast fp32 / int8 seconds)")


def vote(e, n_questions, max_tokens):
    """Self-consistency's cost: searchqa's voting `run` (PRIMITIVES["run"][2], spliced into h0)
    on n_questions test questions x 8 at whale.py's sampling, its 5 first-turn replies asked as
    one llm(..., n=5) call (one batch: the prompt prefilled once, one cache for its rows) and as
    5 llm() calls one after another (5 batches), apart first. Prints vote_<way>_seconds (and the
    llm calls in the traces: the same both ways), vote_same_tokens (the seeds are the calls', so
    both ways sample the same tokens), vote_mean and vote_speedup (apart / together)."""
    from harness_search import harness_source
    from domains import searchqa
    together = harness_source.splice(open(searchqa.H0).read(), "run", searchqa.PRIMITIVES["run"][2])
    one_call = "llm(messages, max_tokens=MAX_TOKENS, n=votes if turn == 0 else 1)"
    assert one_call in together, "the voting run changed: update bench.py's vote()"
    apart = together.replace(one_call, "[llm(messages, max_tokens=MAX_TOKENS) for _ in range(votes if turn == 0 else 1)]")
    examples = searchqa.load_split("test")[:n_questions]
    res = {}
    for way, source in (("apart", apart), ("together", together)):
        res[way] = rollout.evaluate(e, searchqa, source, examples, 8, seed=0, max_tokens=max_tokens,
                                    sampling={"temperature": 0.3, "top_k": 20, "top_p": 1.0})
        calls = sum(len(r["calls"]) for r in res[way]["records"])
        print(f"vote_{way}_seconds: {res[way]['seconds']:.1f} ({res[way]['rollouts']} rollouts, {calls} llm calls)")
    tokens = [[[c["completion_ids"] for c in r["calls"]] for r in res[w]["records"]] for w in ("apart", "together")]
    print(f"vote_same_tokens: {tokens[0] == tokens[1]}")
    print(f"vote_mean: {res['together']['mean']:.3f} +- {res['together']['se']:.3f} (apart {res['apart']['mean']:.3f})")
    print(f"vote_speedup: {res['apart']['seconds'] / res['together']['seconds']:.2f} (5 calls / one call with n=5)")


def fresh_evaluation(what, model_name, n_questions, sampler, harness, temperature, env=None, n=8,
                     max_prefill_tokens=None):
    """One searchqa evaluation (harness "h0" or "long", n_questions test questions x n; the engine's
    max_prefill_tokens, or its default) in a fresh
    process, so that it has its own peak RSS and reads process-wide settings (OpenMP's) anew:
    {"peak_gb", "model_gb" (after loading the model), "seconds", "rollouts_per_s",
    "context_switches" (voluntary), "system_s", "minor_faults" (these three during the evaluation), "mean"}."""
    import json
    import subprocess
    spec = json.dumps({"sampler": sampler, "harness": harness, "temperature": temperature, "n": n,
                       "max_prefill_tokens": max_prefill_tokens})
    out = subprocess.run([sys.executable, __file__, "--eval-child", spec, "--model", model_name,
                          "--questions", str(n_questions)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"bench.py: the {what} evaluation failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def eval_child(spec, model_name, n_questions):
    """`fresh_evaluation`'s side in the new process: prints one json line."""
    import hashlib
    import json
    import resource
    from domains import searchqa
    spec = json.loads(spec)
    model, tok = models.load_model(model_name)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux -> GB
    sampler = spec["sampler"]
    e = eng.HFEngine(model, tok, sampler="landed" if sampler == "landed" else "fast", shared_prefix=sampler == "fast")
    if spec.get("max_prefill_tokens"):
        e.max_prefill_tokens = spec["max_prefill_tokens"]
    harness = long_context_harness() if spec["harness"] == "long" else open(searchqa.H0).read()
    before = resource.getrusage(resource.RUSAGE_SELF)
    res = rollout.evaluate(e, searchqa, harness, searchqa.load_split("test")[:n_questions], spec.get("n", 8), seed=0,
                           sampling={"temperature": spec["temperature"], "top_k": 20, "top_p": 1.0}, max_tokens=48)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"peak_gb": usage.ru_maxrss / 1e6, "model_gb": base, "seconds": res["seconds"],
                      "rollouts_per_s": res["rollouts"] / res["seconds"],
                      "context_switches": usage.ru_nvcsw - before.ru_nvcsw, "system_s": usage.ru_stime - before.ru_stime,
                      "minor_faults": usage.ru_minflt - before.ru_minflt, "mean": res["mean"],
                      "tokens": hashlib.sha256(json.dumps([[c["completion_ids"] for c in r["calls"]]
                                                           for r in res["records"]]).encode()).hexdigest()[:16]}))


def memory(model_name, n_questions):
    """Peak memory of one evaluation of the long-context harness (`long_context_harness`, ~970
    prompt tokens; 16 questions x 8 make one chunk at the sampler's 2^17-position cache cap), each
    sampler in a fresh process so that each has its own peak RSS: landed, full (the fast sampler
    with a cache copy per row, as before shared_prefix.py) and fast (each prompt's cache once).
    Prints memory_<sampler>_peak_gb, _model_gb (the process after loading the model: what no
    sampler changes), _seconds and _mean, then memory_shared_prefix_ratio: full's peak above the
    model over fast's (how many times less memory the sampler itself takes). Then one candidate of
    the long harness on a search set (4 x n_questions questions x 2, whale.py's 64 x 2 by default)
    with its prefill in one forward and in row slices (engine.max_prefill_tokens): memory_candidate_
    <one_forward|sliced>_peak_gb, ..., _same_tokens, and the ratio of their peaks above the model."""
    res = {}
    for s in ("landed", "full", "fast"):
        res[s] = fresh_evaluation(f"{s} memory", model_name, n_questions, s, "long", 0.3)
        for k in ("peak_gb", "model_gb", "seconds", "mean"):
            print(f"memory_{s}_{k}: {res[s][k]:.3f}")
    above = {s: res[s]["peak_gb"] - res[s]["model_gb"] for s in res}
    print(f"memory_shared_prefix_ratio: {above['full'] / above['fast']:.2f} (full / fast, peak above the model)")
    print(f"memory_landed_ratio: {above['landed'] / above['fast']:.2f} (landed / fast, peak above the model)")
    # one candidate of the long harness on a search set (whale.py's: 64 questions x 2): 64 distinct ~1,000-token
    # prompts in one chunk, their prefill in one forward (as before max_prefill_tokens) or in row slices
    cand = {}
    for name, cap in (("one_forward", 2**30), ("sliced", None)):
        cand[name] = fresh_evaluation(f"candidate {name}", model_name, 4 * n_questions, "fast", "long", 0.7, n=2,
                                      max_prefill_tokens=cap)
        for k in ("peak_gb", "model_gb", "seconds", "mean"):
            print(f"memory_candidate_{name}_{k}: {cand[name][k]:.3f}")
    print(f"memory_candidate_same_tokens: {cand['one_forward']['tokens'] == cand['sliced']['tokens']}")
    above = {k: r["peak_gb"] - r["model_gb"] for k, r in cand.items()}
    slower = cand["sliced"]["seconds"] / cand["one_forward"]["seconds"]
    print(f"memory_candidate_prefill_ratio: {above['one_forward'] / above['sliced']:.2f} (one forward / row slices, "
          f"peak above the model; time {slower:.2f}x)")
    update_memory(model_name)


def update_memory(model_name):
    """Phase A's update, where the default run peaks (results/first-run runs 14-16): one minibatch of 8
    sequences as searchqa's kept rollouts look (4 real prompts, 138-237 tokens with the embedded
    model's tokenizer, x 2: a reply, 200 tokens of tool output, a reply; 420-520 positions each) at
    full fine-tuning with AdamW's state in place, in a fresh process each: uncapped (--max-memory 0) and with a training forward capped at 256 positions,
    which --max-memory 4 gives (one sequence a forward, the freed memory given back after it); then
    one_long: a single sequence of ~650 positions (two of those prompts, a reply, tool output, a
    reply) under the same cap, which it cannot honour (a sequence is never cut, so it runs alone):
    where the default run peaks (its first update after phase B, whose harness made the sequences
    longer; results/first-run/README.md after run 22). Prints memory_update_<case>_<rest|peak|after>_gb
    (RSS before, at the peak of, and after the update), _loss, memory_update_ratio (the peak above
    rest, uncapped over capped) and memory_update_one_long_mb_per_position (its peak above rest per
    position: what a sequence over the cap costs)."""
    import json
    import subprocess
    res = {}
    for name, cap in (("uncapped", 0), ("capped", 256), ("one_long", 256)):
        out = subprocess.run([sys.executable, __file__, "--update-child", str(cap), "--model", model_name,
                              *(["--update-long"] if name == "one_long" else [])], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"bench.py: the {name} update failed:\n{out.stderr[-2000:]}")
        res[name] = json.loads(out.stdout.strip().splitlines()[-1])
        for k in ("rest_gb", "peak_gb", "after_gb", "loss"):
            print(f"memory_update_{name}_{k.replace('_gb', '')}{'_gb' if k.endswith('_gb') else ''}: {res[name][k]:.4f}")
    above = {k: r["peak_gb"] - r["rest_gb"] for k, r in res.items()}
    print(f"memory_update_ratio: {above['uncapped'] / above['capped']:.2f} (uncapped / capped, peak above rest)")
    print(f"memory_update_one_long_mb_per_position: {above['one_long'] * 1024 / res['one_long']['positions']:.2f} "
          f"({res['one_long']['positions']} positions, alone over the cap of 256: gradients included)")


def update_child(cap, model_name, one_long=False):
    """`update_memory`'s side in the new process: prints one json line. RSS is sampled every 2 ms by a
    thread (ru_maxrss would hold the loading's peak too)."""
    import json
    import threading
    rss = lambda: int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 2**20  # noqa: E731 (GB)
    peak = [0.0]

    def watch():
        while True:
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)
    model, tok = models.load_model(model_name)
    e = eng.HFEngine(model, tok)
    prompts = squad_prompts(e, 4, target_tokens=450)
    seqs = []
    for i, p in enumerate(prompts):
        for j in range(2):
            reply, tool = prompts[(i + j + 1) % 4][-40:], prompts[(i + j + 2) % 4][-200:]  # real tokens as stand-ins
            seqs.append(rs_sft.Sequence(p + reply + tool + reply, [rs_sft.IGNORE] * len(p) + reply
                                        + [rs_sft.IGNORE] * len(tool) + reply, 1.0))
    opt = rs_sft.make_optimizer(rs_sft.set_trainable(model, 0), 1e-5)
    cfg = sft_config(minibatch=8, micro_batch=8, max_forward_tokens=cap)
    rs_sft.sft_update(model, opt, seqs[:1], cfg)  # AdamW's state in place, as from a run's second update on
    if one_long:  # two prompts before the first reply: a long harness's two-turn rollout, kept
        reply, tool = prompts[1][-40:], prompts[2][-200:]
        seqs = [rs_sft.Sequence(prompts[0] + prompts[3] + reply + tool + reply, [rs_sft.IGNORE] * (len(prompts[0])
                                + len(prompts[3])) + reply + [rs_sft.IGNORE] * len(tool) + reply, 1.0)]
    threading.Thread(target=watch, daemon=True).start()
    time.sleep(0.1)
    rest = rss()
    peak[0] = rest
    r = rs_sft.sft_update(model, opt, seqs, cfg)
    time.sleep(0.1)
    print(json.dumps({"rest_gb": rest, "peak_gb": peak[0], "after_gb": rss(), "loss": r["loss"],
                      "positions": sum(len(q.ids) for q in seqs)}))


def fresh_pair(section, model_name, n_questions, harness, temperature, settings):
    """The same evaluation under two process-wide settings {name: environment}, each in fresh
    processes (these settings are read once, at start), in the order a, b, b, a (a drift of the
    load hits both); returns {name: the better run of its two} and prints each run's rate."""
    res = {k: [] for k in settings}
    a, b = settings
    for k in (a, b, b, a):
        res[k].append(fresh_evaluation(k, model_name, n_questions, "fast", harness, temperature, env=settings[k]))
    for k in settings:
        runs = ", ".join(f"{r['rollouts_per_s']:.2f}" for r in res[k])
        res[k] = max(res[k], key=lambda r: r["rollouts_per_s"])
        print(f"{section}_{k}_rollouts_per_s: {res[k]['rollouts_per_s']:.2f} (the two runs: {runs})")
    return res


def omp(model_name, n_questions):
    """How OpenMP's threads wait between parallel regions: searchqa h0 on n_questions test questions
    x 8 at whale.py's sampling, passive vs spin (`fresh_pair`). A decode step runs hundreds of small
    parallel regions; a thread that sleeps at once must be woken by a futex for each. Prints
    omp_<passive|spin>_rollouts_per_s, _context_switches (voluntary, of that process), _mean (the
    same tokens: the same mean), then omp_speedup (spin / passive)."""
    env = {key: v for key, v in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    res = fresh_pair("omp", model_name, n_questions, "h0", 0.7, {
        "passive": {**env, "OMP_WAIT_POLICY": "PASSIVE"}, "spin": {**env, "GOMP_SPINCOUNT": "20000"}})
    for k, r in res.items():
        print(f"omp_{k}_context_switches: {r['context_switches']}")
        print(f"omp_{k}_mean: {r['mean']:.4f}")
    print(f"omp_speedup: {res['spin']['rollouts_per_s'] / res['passive']['rollouts_per_s']:.2f} (spin / passive rollouts/s)")


def malloc(model_name, n_questions):
    """Where freed memory goes: the long-context harness (`long_context_harness`) on n_questions
    test questions x 8, with glibc's own malloc settings (an empty GLIBC_TUNABLES, which
    lm.process_tuning leaves alone) vs whale.py's (freed blocks under 1 GB stay in the heap),
    `fresh_pair`. Prints malloc_<glibc|keep>_rollouts_per_s, _system_s and _minor_faults (kernel
    time and page faults during the evaluation), _peak_gb, _mean, then malloc_speedup."""
    env = {key: v for key, v in os.environ.items() if key != "GLIBC_TUNABLES" and not key.startswith("MALLOC_")}
    res = fresh_pair("malloc", model_name, n_questions, "long", 0.7, {
        "glibc": {**env, "GLIBC_TUNABLES": ""}, "keep": env})
    for k, r in res.items():
        print(f"malloc_{k}_system_s: {r['system_s']:.1f}")
        print(f"malloc_{k}_minor_faults: {r['minor_faults']}")
        print(f"malloc_{k}_peak_gb: {r['peak_gb']:.2f}")
        print(f"malloc_{k}_mean: {r['mean']:.4f}")
    print(f"malloc_speedup: {res['keep']['rollouts_per_s'] / res['glibc']['rollouts_per_s']:.2f} (keep / glibc rollouts/s)")


def deadline(e, n_questions, n_puzzles, flood_deadline=30.0):
    """Charged seconds per rollout against rollout.run's deadline in real evaluations, and an
    llm() flood (one rollout, ~600-token prompts, as fast as it can) against a 30 s deadline."""
    from domains import chess, searchqa
    sampling = {"temperature": 0.3, "top_k": 20, "top_p": 1.0}
    timeout = rollout.run.__kwdefaults__["rollout_timeout"]
    for name, domain, examples in (("searchqa", searchqa, searchqa.load_split("val")[:n_questions]),
                                   ("chess", chess, chess.load_split("test")[:n_puzzles])):
        t = time.time()
        recs = rollout.run(e, domain, open(domain.H0).read(), examples, 8, seed=0, sampling=sampling, max_tokens=48)
        charged = sorted(r["charged_s"] for r in recs)
        print(f"deadline_{name}_rollouts: {len(recs)} in {time.time() - t:.1f} s, "
              f"{sum(len(r['calls']) for r in recs)} llm calls, timeouts {sum(r['status'] == 'timeout' for r in recs)}")
        print(f"deadline_{name}_charged_s: median {charged[len(charged) // 2]:.2f}, max {charged[-1]:.2f} "
              f"(deadline {timeout:.0f} s)")
    flood = ("def run(task, llm, tools):\n"
             "    while True:\n"
             "        llm('Summarise: ' + 'the cat sat on the mat. ' * 80, max_tokens=48)\n")
    t = time.time()
    rec = rollout.run(e, searchqa, flood, searchqa.load_split("val")[:1], 1, seed=0, sampling=sampling,
                      max_tokens=48, rollout_timeout=flood_deadline)[0]
    print(f"deadline_flood: {rec['status']} after {time.time() - t:.1f} s wall, {len(rec['calls'])} llm calls "
          f"of {len(rec['calls'][0]['prompt_ids']) if rec['calls'] else 0} prompt tokens, charged "
          f"{rec['charged_s']:.1f} s (deadline {flood_deadline:.0f} s)")


def sft_config(**overrides):
    """Phase A's settings as whale.py builds them from its default command line, these changed."""
    return whale.phase_a_config(whale.Args(), **overrides)


def sft(model, prompts, q, peak):
    """SFT throughput and fraction of peak."""
    for layers in (0, 4):
        trainable = rs_sft.set_trainable(model, layers)
        opt = rs_sft.make_optimizer(trainable, 1e-6)
        seqs = [(p + [5] * 16, [-100] * len(p) + [5] * 16) for p in prompts[:16 if not q else 8]]
        rs_sft.sft_update(model, opt, seqs[:4], sft_config(minibatch=4, micro_batch=4))  # warm-up
        st = rs_sft.sft_update(model, opt, seqs, sft_config(minibatch=8, micro_batch=8))
        frac = rs_sft.mfu(model, st["tokens_per_s"], peak * 1e9, layers)
        tag = "full" if layers == 0 else f"top{layers}"
        print(f"sft_{tag}_tokens_per_s: {st['tokens_per_s']:.1f}")
        print(f"sft_{tag}_fraction_of_peak: {frac:.2f}")


def hf_generate_greedy_until_eos(model, prompts, e, new_tokens):
    """generate greedy; rows cut after their first EOS (what the sampler returns)."""
    t, _, rows = hf_generate(model, prompts, e.pad_id, new_tokens, greedy=True)
    out = []
    for r in rows.tolist():
        cut = []
        for x in r:
            cut.append(x)
            if x in e.eos_ids:
                break
        out.append(cut)
    return t, sum(map(len, out)), out


if __name__ == "__main__":
    main()
