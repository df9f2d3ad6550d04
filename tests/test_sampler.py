"""
The sampler (lm/: engine.py, chat_format.py, models.py, shared_prefix.py, int8.py; rollout.py's
llm_batch): greedy == HF generate, a shared prefill, fast == landed sampler, chunk caps, seeded
batch-independent sampling, the int8 sampler, stop strings, exact rollout records; any causal LM:
other architectures, chat formats, end-of-turn tokens, GGUF files, bad models.
"""
import collections
import copy
import json
import os
import shutil
import signal
import time
import types
from pathlib import Path

import pytest
import torch

import rollout
import rs_sft
import switch
import whale
from domains import math as M
from domains import searchqa
from harness_search import proposers
from lm import chat_format
from lm import engine
from lm import int8
from lm import models
from rundir import run_setup
from tests.helpers import (
    GEMMA_TEMPLATE, TINY, TINY_CONVERSATIONS, chat, check_run, run_whale, sft_cfg, tiny_tokenizer,
    two_call_harness)


# ==============================================================================================
# THE SAMPLER (engine.py, chat_format.py, models.py; rollout.py's llm_batch)
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


def test_shared_heads_are_the_cheapest_cut_of_the_sorted_prompts():
    """shared_head_groups: a group costs its head once plus each member's tail. Two questions' second
    turns (a 300-token instruction head, each question's own 200 tokens, each sample's own reply) are
    one group per question on its first prompt, not one group on the instructions; and on random
    prompt trees the cut is the cheapest of every way to cut the sorted prompts into runs."""
    import itertools
    import random
    cost = lambda groups, ps: sum(h + sum(len(ps[j]) - h for j in js) for h, js in groups)
    rng = random.Random(0)
    toks = lambda n: [rng.randrange(1000) for _ in range(n)]
    head, questions = toks(300), [toks(200), toks(200)]
    prompts = [head + q + toks(20) for q in questions for _ in range(3)]
    groups = engine.shared_head_groups(prompts, 64)
    assert sorted((h, len(js)) for h, js in groups) == [(500, 3), (500, 3)]
    assert cost(groups, prompts) < cost([(300, list(range(6)))], prompts)  # the old single group
    for trial in range(30):  # random trees of prompts: a root, branches, leaves; some of them repeated
        root = toks(rng.choice([10, 80]))
        branches = [root + toks(rng.randrange(0, 90)) for _ in range(rng.randrange(1, 4))]
        ps = [rng.choice(branches) + toks(rng.randrange(1, 40)) for _ in range(rng.randrange(1, 7))]
        ps = [list(p) for p in dict.fromkeys(map(tuple, ps))]  # distinct, as sample() hands them
        groups = engine.shared_head_groups(ps, 16)
        assert sorted(j for _, js in groups for j in js) == list(range(len(ps)))  # each prompt once
        for h, js in groups:  # a head is shared by its members and leaves each a tail
            assert all(ps[j][:h] == ps[js[0]][:h] and len(ps[j]) > h for j in js) and (len(js) == 1 or h >= 16)
        order = sorted(range(len(ps)), key=lambda j: ps[j])
        best = float("inf")
        for cuts in itertools.product((False, True), repeat=len(ps) - 1):  # every cut into runs
            runs, run = [], [order[0]]
            for j, cut in zip(order[1:], cuts):
                runs, run = (runs + [run], [j]) if cut else (runs, run + [j])
            runs.append(run)
            heads = [min(len(ps[j]) - 1 for j in r) if len(r) == 1 else
                     min([len(ps[j]) - 1 for j in r] + [engine.common_prefix_len(ps[a], ps[b]) for a, b in zip(r, r[1:])])
                     for r in runs]
            if all(len(r) == 1 or h >= 16 for h, r in zip(heads, runs)):
                best = min(best, cost(list(zip(heads, runs)), ps))
        assert cost(groups, ps) == best


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


@pytest.mark.slow
def test_a_prefill_in_row_slices_gives_the_tokens_of_one_forward(hf, monkeypatch):
    """max_prefill_tokens (the prefill's activations bound): distinct prompts (one prefill of their
    heads) and prompts sharing a head (their tails in buckets) prefilled a few rows per forward into
    the same cache give the tokens and endings of one forward each, greedy and sampled."""
    head = [{"role": "system", "content": "You answer in one short sentence. " * 12}]
    shared = [hf.chat_ids(head + [{"role": "user", "content": f"Name {k} animals, {'big and ' * k}small."}])
              for k in range(2, 8)]
    distinct = [hf.chat_ids([{"role": "system", "content": f"{i} is your number."},
                             {"role": "user", "content": f"Say the number {i} in words, then a colour."}])
                for i in range(7)]
    for prompts in (distinct, shared):
        groups = engine.shared_head_groups(prompts, hf.min_shared_head)
        widest = max(len(p) - (h if len(js) > 1 else 0) for h, js in groups for p in (prompts[j] for j in js))
        reqs = [{"prompt_ids": p, "max_tokens": 12, "temperature": t, "top_k": 20, "top_p": 1.0, "seed": 7 * i + j}
                for i, p in enumerate(prompts) for j in range(2) for t in (0.0, 1.0)]
        before = hf.work["prefill_forwards"]
        whole = hf.sample(reqs)
        one, before = hf.work["prefill_forwards"] - before, hf.work["prefill_forwards"]
        monkeypatch.setattr(hf, "max_prefill_tokens", 2 * widest)  # at most two rows a forward
        sliced = hf.sample(reqs)
        assert hf.work["prefill_forwards"] - before >= one + 2, (len(groups), one)
        assert [o["completion_ids"] for o in sliced] == [o["completion_ids"] for o in whole]
        assert [o["finish"] for o in sliced] == [o["finish"] for o in whole]
        monkeypatch.undo()


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


def test_max_memory_caps_the_cache_a_chunk_really_holds_and_keeps_the_tokens(hf, monkeypatch):
    """fit_to_memory (--max-memory): the bytes of a cache position are read off the model (2 x layers
    x KV heads x head size x 4 for the embedded model), more memory gives larger caps; under
    max_cache_positions each chunk's cache, a prompt's positions once plus each row's new tokens
    (shared_prefix), stays under the cap, and the tokens are those of one chunk."""
    c = hf.model.config
    small = engine.fit_to_memory(types.SimpleNamespace(sampling_model=hf.model, pad_id=hf.pad_id, device=hf.device),
                                 2.0, 2**30)
    large = engine.fit_to_memory(types.SimpleNamespace(sampling_model=hf.model, pad_id=hf.pad_id, device=hf.device),
                                 4.0, 2**30)
    assert small["kv_bytes_per_position"] == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    assert large["max_cache_positions"] > 2 * small["max_cache_positions"] and not large["too_small"]
    prompts = [chat(hf, f"Say the number {i} in words.") for i in range(6)]
    reqs = [{"prompt_ids": p, "max_tokens": 8, "temperature": 0.7, "top_k": 20, "seed": j} for p in prompts
            for j in range(4)]
    whole = hf.sample(reqs)
    width = max(map(len, prompts))
    cap = 2 * width + 8 * 8  # two prompts and their 8 rows' new tokens
    held, real = [], hf._sample_chunk
    monkeypatch.setattr(hf, "max_cache_positions", cap)
    monkeypatch.setattr(hf, "_sample_chunk", lambda r, chunk, res: (
        held.append(len(chunk) * max(len(p) for p, _ in chunk) + 8 * sum(len(m) for _, m in chunk)),
        real(r, chunk, res)))
    cut = hf.sample(reqs)
    assert len(held) == 3 and max(held) <= cap
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


@pytest.mark.slow
def test_a_rollout_bar_counts_every_sampled_token_and_moves_the_runs_bar(hf):
    """rollout.bar: rollouts finish a wave at a time, so while they run the engine reports each decode
    step's tokens (an evaluation is never silent); those add up to the records' completion tokens,
    the run's bar moves by the rollouts, and the engine's hook is gone after."""
    moved = []
    with rollout.bar(hf, 4, "two calls", also=types.SimpleNamespace(update=moved.append)) as bar:
        counted, shown = [], hf.on_tokens
        hf.on_tokens = lambda k: (counted.append(k), shown(k))
        recs = rollout.run(hf, searchqa, two_call_harness(), searchqa.load_split("test")[:2], 2, seed=0,
                           sampling={"temperature": 1.0, "top_k": 20, "top_p": 1.0}, max_tokens=24, progress=bar)
    assert sum(counted) == sum(r["completion_tokens"] for r in recs) > 0 and len(counted) > 2
    assert sum(moved) == 4 and hf.on_tokens is None


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
def test_harnesses_in_shared_batches_sample_what_each_samples_alone(hf):
    """rollout.in_shared_batches (phase B scores an iteration's candidates this way): three different
    harnesses rolled out at once, their llm() batches meeting in one engine call, give every rollout
    the tokens, answer and score it gets when its harness runs alone, in fewer engine calls."""
    one_call = '''
def run(task, llm, tools):
    return llm([{"role": "user", "content": "PROMPT" + task["question"]}], max_tokens=16)
'''
    harnesses = [two_call_harness(), one_call.replace("PROMPT", "Answer briefly: "),
                 one_call.replace("PROMPT", "Question: ")]
    ex = searchqa.load_split("val")[:3]
    sampling = {"temperature": 1.0, "top_k": 20, "top_p": 1.0}
    job = lambda src: lambda: rollout.run(hf, searchqa, src, ex, 2, seed=5, sampling=sampling, max_tokens=24)
    calls = hf.work["calls"]
    alone = [job(src)() for src in harnesses]
    calls_alone, calls = hf.work["calls"] - calls, hf.work["calls"]
    shared = rollout.in_shared_batches(hf, [job(src) for src in harnesses])
    assert hf.work["calls"] - calls < calls_alone
    tokens = lambda recs: [(r["status"], r["answer"], r["score"], [c["completion_ids"] for c in r["calls"]]) for r in recs]
    for a, b in zip(alone, shared):
        assert tokens(b) == tokens(a) and all(r["status"] == "ok" for r in a)
    assert "sample" not in vars(hf)  # the engine's own method is back


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


TINY_MODELS = ("qwen2-chatml", "qwen2-base", "gemma3-turns", "gemma3-base", "qwen2-gguf")


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


def test_a_run_keeps_freed_blocks_in_the_heap_unless_the_user_tunes_malloc():
    """lm.process_tuning.keep_freed_memory (whale.py runs it at import): a 100 MB block freed and taken again 40 times has its
    pages faulted in a few times, not 40 (glibc's own settings give it back to the kernel at every
    free); a GLIBC_TUNABLES of the user's, even empty, leaves glibc's settings alone."""
    import subprocess
    import sys
    probe = ("import resource, whale, torch\n"
             "r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
             "for _ in range(40):\n"
             "    x = torch.empty(25_000_000); x.fill_(1.0); del x\n"
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}

    def faults(**more):
        out = subprocess.run([sys.executable, "-c", probe], env={**env, **more}, cwd=Path(whale.__file__).parent,
                             capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])
    pages = 25_000_000 * 4 // 4096
    kept, glibc = faults(), faults(GLIBC_TUNABLES="")
    assert glibc >= 30 * pages, glibc  # a fresh mapping, faulted in, every time
    assert kept < glibc / 3, (kept, glibc)


def test_under_max_memory_an_update_gives_its_freed_memory_back():
    """lm.process_tuning.give_freed_memory_back (rs_sft.sft_update calls it under --max-memory): the
    heap whale.py keeps (above) holds the blocks an update freed, so RSS stays at the update's peak;
    after it, 400 MB of freed 8 MB blocks (activations' size) leave RSS, and without it they stay."""
    import subprocess
    import sys
    probe = ("import whale, torch\n"
             "from lm.process_tuning import give_freed_memory_back\n"
             "rss = lambda: int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) // 1024\n"
             "blocks = [torch.ones(2_000_000) for _ in range(50)]\n"
             "held = rss(); del blocks\n"
             "kept = rss(); give_freed_memory_back()\n"
             "print(held, kept, rss())\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=Path(whale.__file__).parent,
                         capture_output=True, text=True, check=True)
    held, kept, given = map(int, out.stdout.split()[-3:])
    assert kept > held - 100, (held, kept)  # kept in the heap while the run keeps freed memory
    assert given < held - 300, (held, kept, given)  # handed back to the kernel


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
    a = whale.Args(model=broken_model(tiny_models, tmp_path, case), chat_format=chat_format, train_layers=4)
    with pytest.raises(run_setup.UserError) as e:
        run_setup.check_args(a, whale.METHODS, switch.check)
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
