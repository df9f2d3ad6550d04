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
  - multi-turn: the chess h0 harness (a retry after every unparsed move: later calls
    repeat the first prompt plus each sample's own reply) on 16 puzzles x 8 through the
    sandbox, with shared-head prefill vs without (seconds, tokens prefilled, ratio);
  - SFT: tokens/s of rs_sft.sft_update and its fraction of the matmul peak
    (6N FLOPs per token for full fine-tuning; the reduced count with --train-layers);
  - deadline (only with --only deadline): what rollouts are charged against their
    deadline (own time + tools + their share of each model batch) in a real evaluation,
    64 searchqa questions x 8 = one 512-rollout wave and 16 chess puzzles x 8 (multi-turn,
    retries), and how far past a 30 s deadline an llm() flood gets.

    python tools/bench.py                         # everything (~12 min on a 2-core CPU)
    python tools/bench.py --quick                 # smaller shapes, for a smoke run
    python tools/bench.py --only decode,multiturn # some sections (rollout, decode, sandbox, multiturn, sft, deadline)

Ratios are what to trust on a shared machine; absolute numbers move with load.
"""
import argparse
import os
import sys
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python tools/x.py` imports the repository's modules

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch

import engine as eng
import rollout
import rs_sft


def matmul_gflops(n=2048, reps=5):
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.time()
    for _ in range(reps):
        a @ b
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
    args = ap.parse_args()
    only = set(args.only.split(","))
    if only - {"rollout", "decode", "sandbox", "multiturn", "sft", "deadline"}:
        raise SystemExit(f"bench.py: unknown section(s) {', '.join(sorted(only))}; "
                         "choose from rollout, decode, sandbox, multiturn, sft, deadline")
    sys.stdout.reconfigure(line_buffering=True)  # each line as it is measured, also into a file
    q = args.quick
    torch.manual_seed(0)
    peak = matmul_gflops()
    print(f"matmul_fp32_gflops: {peak:.1f}")
    model, tok = eng.load_model(args.model)
    e = eng.HFEngine(model, tok)
    n_params = sum(p.numel() for n_, p in model.named_parameters() if "embed_tokens" not in n_)
    n_params += model.lm_head.weight.numel() if model.config.tie_word_embeddings else 0

    P, G, NEW = (8, 8, 16) if q else (32, 8, 32)
    prompts = squad_prompts(e, P)
    if "rollout" in only:
        rollout_workload(e, model, prompts, G, NEW, n_params, peak)
    if "decode" in only:
        decode(e, model, q)
    if "sandbox" in only:
        sandbox_overhead(e, P, G, NEW)
    if "multiturn" in only:
        multiturn(e, 4 if q else 16)
    if "deadline" in only:
        deadline(e, 8 if q else 64, 4 if q else 16)
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


def sft(model, prompts, q, peak):
    """SFT throughput and fraction of peak."""
    for layers in (0, 4):
        trainable = rs_sft.set_trainable(model, layers)
        opt = rs_sft.make_optimizer(trainable, 1e-6)
        seqs = [(p + [5] * 16, [-100] * len(p) + [5] * 16) for p in prompts[:16 if not q else 8]]
        rs_sft.sft_update(model, opt, seqs[:4], rs_sft.Config(minibatch=4, micro_batch=4))  # warm-up
        st = rs_sft.sft_update(model, opt, seqs, rs_sft.Config(minibatch=8, micro_batch=8))
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
