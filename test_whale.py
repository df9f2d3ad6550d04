"""
WHALE's tests of the method, read as what it guarantees: phase A (rs_sft.py), phase B's search
(meta_harness.py and its archive), the switch policy (switch.py), the budget, and the loop with
its resume (whale.py, evaluation.py): tiny runs of every method, SIGKILL-and-resume. The real
embedded model, real data, real processes: nothing a guarantee is about is mocked. The machinery's
tests are in tests/, one file per concept; shared fixtures in conftest.py.

    python -m pytest -q test_whale.py tests/                  # everything (CI runs it as two tiers)
    python -m pytest -q -m "not slow" test_whale.py tests/    # the fast tier: pure functions, in-process
    python -m pytest -q tests/test_sandbox.py                 # one concept

A test that loads the model, starts a process or runs whale.py is marked @pytest.mark.slow
(pytest.ini registers the marker and refuses unknown ones); everything else is the fast tier.
Speed and memory targets are not tested here (timed tests are flaky on a shared machine):
tools/bench.py measures them side by side.
"""
import ast
import copy
import dataclasses
import gzip
import http.server
import importlib.util
import json
import math
import os
import random
import re
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
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import evaluation
import meta_harness as mh
import rollout
import rs_sft
import switch
import whale
from domains import searchqa
from harness_search import eval_cache
from harness_search import harness_archive
from harness_search import harness_source as hsrc
from harness_search import primitives
from harness_search import proposers
from jail import agent_jail
from jail import isolation
from lm import engine
from lm import prefix_tree
from rundir import run_dir
from rundir import run_setup
from rundir import tracking
from switch import Fixed, Patience, epochs_to_steps, parse_schedule, smoothed
from rundir import report
from rundir import run_reader
from tools import results
from tests.helpers import (
    DOMAIN, EXAMPLES, H0, ROOT, TINY, U, chat, check_run, constant, copy_run, make_evaluate,
    ok_validate, openai_server, quiet, record, run_whale, sft_cfg, stop_after, two_call_harness)


# ==============================================================================================
# PHASE A: ONLINE REJECTION-SAMPLING FINE-TUNING (rs_sft.py)
# ==============================================================================================
# Guarantee: a rollout's training sequences label exactly the model's completion tokens (prompts
# and tool output are masked); an SFT update on kept completions raises their log-probability; a
# step whose rollouts are all rejected leaves the weights and the optimizer untouched; the loader
# gives every prompt once per epoch; --sft-epochs and --replay-steps train on what they say; the
# health figure (kept NLL before/after, capped share) warns at an absurd lr and not at a sane one.
# (Phase A on other architectures: tests/test_sampler.py; under torchrun: tests/test_scale_out.py.)

@pytest.mark.slow
def test_labels_mask_everything_but_completions(hf):
    rec = rollout.run(hf, searchqa, two_call_harness(), searchqa.load_split("test")[:1], 1, seed=1,
                      sampling={"temperature": 1.0, "top_k": 20, "top_p": 1.0})[0]
    w = rs_sft.weights([rec])[0]
    seqs = rs_sft.sequences(rec, w)
    c1, c2 = rec["calls"]
    # every label is either IGNORE or exactly the token in place, and the labelled tokens are the completions
    labelled = [t for ids, lab, _ in seqs for t, l in zip(ids, lab) if l != rs_sft.IGNORE]
    assert labelled == c1["completion_ids"] + c2["completion_ids"]
    for ids, lab, weight in seqs:
        assert len(ids) == len(lab) and weight == w == (1.0 if rec["score"] > 0.5 else 0.0)
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
    m = rs_sft.rollout_step(hf, opt, sft_cfg(group=2, temperature=1.0, top_k=20, top_p=1.0), searchqa, never,
                            rs_sft.draw_prompts(searchqa.load_split("weight")[:8], loader, 2), seed=0, replay=[])
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
    """lm/prefix_tree.py: the prefix tree (one head, a mid per distinct prompt, a tail per sequence) gives
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


def test_recomputed_blocks_give_the_same_loss_and_gradient_to_the_bit(monkeypatch):
    """prefix_tree.recomputed_blocks (activation checkpointing that keeps the tree's KV cache): the
    loss and every gradient equal the plain forward's to the bit, through the prefix tree (the
    cache handed down its levels and run again in the backward) and through whole sequences; and
    an update under --max-memory's cap, where a sequence over it runs this way, moves the weights
    exactly as the update without a cap."""
    import random
    rng = random.Random(1)
    head = [rng.randrange(5, 60) for _ in range(10)]
    seqs = shared_prompt_seqs([head + [rng.randrange(5, 60) for _ in range(rng.randrange(3, 12))] for _ in range(4)], rng)
    model = tiny_lm()
    rs_sft.set_trainable(model, 0)
    model.train()
    block_runs = []  # (each block run: once in the forward, once again in the backward)
    real = prefix_tree._replayed_cache
    monkeypatch.setattr(prefix_tree, "_replayed_cache", lambda cache, first: block_runs.append(1) or real(cache, first))
    for share in (True, False):
        for batch in (seqs, seqs[:1]):
            want = loss_and_grads(model, batch, share)
            block_runs.clear()
            with prefix_tree.recomputed_blocks(model):
                got = loss_and_grads(model, batch, share)
            assert got[0] == want[0] and all(torch.equal(a, b) for a, b in zip(got[1], want[1])), (share, len(batch))
            assert len(block_runs) >= 2 * len(model.model.layers) and len(block_runs) % 2 == 0  # it did recompute
    assert "forward" not in vars(model.model.layers[0])  # the blocks are plain again

    def moved(cap):
        m = tiny_lm()
        opt = torch.optim.AdamW(rs_sft.set_trainable(m, 0), lr=1e-3)
        st = rs_sft.sft_update(m, opt, seqs, sft_cfg(minibatch=8, micro_batch=1, max_forward_tokens=cap), seed=3)
        return [p.detach().clone() for p in m.parameters()], st
    (w0, st0) = moved(0)
    entered = []
    plain = prefix_tree.recomputed_blocks
    monkeypatch.setattr(prefix_tree, "recomputed_blocks", lambda m: entered.append(1) or plain(m))
    w1, st1 = moved(4)  # (a cap of 4 positions: every sequence is over it and runs recomputed)
    assert len(entered) == len(seqs) and st0["loss"] == st1["loss"] and all(torch.equal(a, b) for a, b in zip(w0, w1))


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
    (keep/drop is 1/0), the default rule is the verifier's (rs_sft.weights), and a replaced rule
    sees a step's records together (a group baseline) and reaches keep() and sequences(); an
    update on sequences of weight 0 leaves every weight as it was."""
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
    records = [{"example_id": e, "score": x, "calls": [call]} for e, x in (("a", 1.0), ("a", 0.0), ("a", 1.0),
                                                                            ("b", 0.0), ("b", 0.0))]
    assert [(r["example_id"], w) for r, w in rs_sft.keep(records)] == [("a", 1.0), ("a", 1.0)]
    assert rs_sft.sequences(records[0]) == [rs_sft.Sequence([1, 2, 3, 4, 5], [rs_sft.IGNORE] * 3 + [4, 5], 1.0)]

    def advantages(records):  # e.g. GRPO's: a score minus its example's mean (group "b" all equal: 0)
        mean = {e: np.mean([r["score"] for r in records if r["example_id"] == e]) for e in {"a", "b"}}
        return [r["score"] - mean[r["example_id"]] for r in records]
    monkeypatch.setattr(rs_sft, "weights", advantages)
    kept = rs_sft.keep(records)
    assert [(r["example_id"], round(w, 3)) for r, w in kept] == [("a", 0.333), ("a", -0.667), ("a", 0.333)]
    assert [round(s.weight, 3) for r, w in kept for s in rs_sft.sequences(r, w)] == [0.333, -0.667, 0.333]
    assert len(rs_sft.keep(records, max_per_prompt=2)) == 2  # --max-kept-per-prompt cuts a group after weighting


def test_phase_a_under_a_cap_on_a_forwards_positions_trains_the_same_update():
    """--max-memory caps the positions one training forward runs (Config.max_forward_tokens): a
    micro-batch is cut into runs of whole sequences within the cap (a longer one runs alone), and the
    update is the same up to the order of its sums (gradient accumulation, as over micro-batches)."""
    import random
    seqs = shared_prompt_seqs([[random.Random(k).randrange(5, 60) for _ in range(12 + 3 * k)] for k in range(4)],
                              random.Random(4))
    for shared in (True, False):
        sizes, after = [], {}
        for cap in (0, 30):
            seen = []

            def spy(model, chunk, **kw):  # what each forward ran: (positions, sequences)
                seen.append((rs_sft.prefix_tree.tokens_run(chunk, kw["shared"]), len(chunk)))
                return rs_sft.token_nll(model, chunk, **kw)
            model = tiny_lm(seed=2)
            cfg = sft_cfg(minibatch=len(seqs), micro_batch=8, max_forward_tokens=cap, loss_fn=spy,
                          sft_prompts="shared" if shared else "whole")
            m = rs_sft.sft_update(model, rs_sft.make_optimizer(rs_sft.set_trainable(model, 0), 1e-3), seqs, cfg)
            after[cap], _ = [p.detach().clone() for p in model.parameters()], sizes.append(seen)
            assert m["trained_tokens"] == sum(sum(x != rs_sft.IGNORE for x in s[1][1:]) for s in seqs)
        assert len(sizes[1]) > len(sizes[0]) and max(n for n, _ in sizes[0]) > 30  # the cap cut the micro-batches
        assert all(n <= 30 or k == 1 for n, k in sizes[1])  # within the cap, or one sequence alone
        assert sum(k for _, k in sizes[1]) == sum(k for _, k in sizes[0]) == len(seqs)  # every sequence, once
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(after[0], after[30]))


def test_phase_a_update_adds_its_gradients_in_a_fixed_order_on_the_cpu():
    """The update runs under torch's deterministic algorithms (rs_sft.fixed_order_sums: with two
    threads the prefix tree's repeated-index backward added in a varying order, and two processes
    trained weights differing at the 7th digit), and the process gets its own setting back after it."""
    import random
    seen = []

    def spy(model, chunk, **kw):  # inside the update: forward here, backward right after
        seen.append(torch.are_deterministic_algorithms_enabled())
        return rs_sft.token_nll(model, chunk, **kw)
    seqs = shared_prompt_seqs([[random.Random(k).randrange(5, 60) for _ in range(12 + 3 * k)] for k in range(3)],
                              random.Random(1))
    model = tiny_lm(seed=2)
    assert not torch.are_deterministic_algorithms_enabled()
    rs_sft.sft_update(model, rs_sft.make_optimizer(rs_sft.set_trainable(model, 0), 1e-3), seqs,
                      sft_cfg(minibatch=len(seqs), micro_batch=8, loss_fn=spy))
    assert seen and all(seen)
    assert not torch.are_deterministic_algorithms_enabled()  # the sampler runs as it did


def test_phase_a_a_loss_can_ask_for_the_starting_model(tmp_path):
    """Fork point: Config.loss_fn gets reference(), the frozen starting model that --model names
    (Config.base_model), loaded on the first call and once: a KL-to-start term reads it, and it
    still gives the starting weights after the trained model has moved."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tiny_lm(seed=5).save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                            unk_token="[UNK]").save_pretrained(tmp_path)
    model, start = tiny_lm(seed=5), [p.detach().clone() for p in tiny_lm(seed=5).parameters()]
    seen = []

    def kl_to_start(model, seqs, *, pad_id=0, shared=False, reference=None):
        ref = reference()
        seen.append(ref)
        logits, targets = rs_sft.logits_and_targets(model, seqs, pad_id)
        with torch.no_grad():
            ref_logits, _ = rs_sft.logits_and_targets(ref, seqs, pad_id)
        kl = (F.softmax(logits, -1) * (F.log_softmax(logits, -1) - F.log_softmax(ref_logits, -1))).sum(-1)
        return rs_sft.token_nll(model, seqs, pad_id=pad_id) + kl[targets != rs_sft.IGNORE].sum()
    g = torch.Generator().manual_seed(1)
    seqs = [(x, [rs_sft.IGNORE] * 4 + x[4:]) for x in torch.randint(0, 64, (4, 10), generator=g).tolist()]
    cfg = sft_cfg(minibatch=4, micro_batch=2, loss_fn=kl_to_start, base_model=str(tmp_path))
    opt = rs_sft.make_optimizer(rs_sft.set_trainable(model, 0), 1e-2)
    for _ in range(2):
        rs_sft.sft_update(model, opt, seqs, cfg)
    assert len(seen) == 4 and all(r is seen[0] for r in seen)  # loaded once
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), start))  # the model moved
    assert all(torch.equal(p, q) and not p.requires_grad for p, q in zip(seen[0].parameters(), start))


def test_a_switch_policy_of_your_own_reads_the_validation_means(monkeypatch):
    """Fork point: whale.py asks the policy with the run's validation means so far, so a policy that
    switches on a validation plateau needs only its own class (and a line in switch.BY_NAME to name
    it); it may ask for validations inside a weight phase."""
    seen = []

    class Plateau:
        def weight_done(self, rewards, steps_per_epoch, val_means=()):
            seen.append(list(val_means))
            return len(val_means) >= 2 and val_means[-1] <= val_means[-2]

        def harness_done(self, paper_successes, val_means=()):
            return True
    evals = [{"split": "test", "mean": 0.1}, {"split": "val", "mean": 0.2}, {"split": "val", "mean": 0.2}]
    run = types.SimpleNamespace(state={"rollouts": 0, "phase_rewards": [0.1], "evals": evals, "done": False})
    ctx = types.SimpleNamespace(method=whale.METHODS["whale"], policy=Plateau(), steps_per_epoch=4,
                                budget=whale.Budget(total=10_000, step_cost=8, candidate_cost=8, candidates=2))
    assert whale.weight_phase_over(run, ctx) is True and seen == [[0.2, 0.2]]
    evals[-1]["mean"] = 0.3
    assert whale.weight_phase_over(run, ctx) is False
    # it may ask for validations inside a weight phase (val_every), the shorter of its own and --val-every
    assert switch.val_every(Plateau(), 0) == 0
    Plateau.val_every = 2
    assert (switch.val_every(Plateau(), 0), switch.val_every(Plateau(), 1), switch.val_every(Plateau(), 5)) == (2, 1, 2)
    # and a name on the command line: one line in switch.BY_NAME, its options its dataclass fields
    monkeypatch.setitem(switch.BY_NAME, "plateau", dataclasses.make_dataclass(
        "P", [("patience", int, 2)], bases=(Plateau,), frozen=True))
    assert switch.parse_schedule("plateau:patience=3").patience == 3


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
    cfg = cfg or sft_cfg(group=2, max_kept_per_prompt=2, minibatch=4, micro_batch=2)
    cfg = dataclasses.replace(cfg, temperature=1.0, top_k=20, top_p=1.0)
    prompts = rs_sft.draw_prompts(template.load_split("weight")[:8], rs_sft.new_loader(8, 0), 2)
    m = rs_sft.rollout_step(eng, opt, cfg, template, SUM_HARNESS, prompts, seed=0, replay=[] if replay is None else replay)
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
    cfg = sft_cfg(group=2, max_kept_per_prompt=2, minibatch=4, micro_batch=2, replay_steps=3,
                        sft_epochs=2)
    earlier = [[(list(ids), list(lab)) for ids, lab in [([1, 2, 3, 4], [rs_sft.IGNORE, rs_sft.IGNORE, 3, 4])] * 4]]
    replay = copy.deepcopy(earlier)
    m, _ = phase_a_step(hf, 1e-4, cfg, replay)
    assert m["sequences"] == 4 and m["replay_sequences"] == 8 and m["opt_steps"] == 4  # 2 epochs x 2 minibatches
    assert len(replay) == 2 and replay[0] == earlier[0] and len(replay[1]) == 4
    assert m["trained_tokens"] == 2 * (4 * 2 + sum(sum(l != rs_sft.IGNORE for l in s.labels[1:]) for s in replay[1]))
    m1, _ = phase_a_step(hf, 1e-4, sft_cfg(group=2, max_kept_per_prompt=2, minibatch=4,
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
    assert "exhausted" in res["stop_reason"] and res["iterations"] == len(res["paper_successes"])
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
    last = prop(d, 3)
    assert last.candidates == [] and last.exhausted


def test_primitives_axis_follows_failure_signature(tmp_path):
    def run_iter0(d, answer, tool_result):
        def evaluate(source, examples, tag):
            return [record(ex, i < 5, answer=answer, tool_result=tool_result) for i, ex in enumerate(examples)]
        mh.search_phase(H0, DOMAIN, EXAMPLES, evaluate, ok_validate, None, archive_dir=d,
                        should_stop=stop_after(1), log=quiet)
        return proposers.make_proposer("primitives", DOMAIN)(d, 1).candidates[0]["axis"]
    # no answer extracted -> the answer-extraction axis
    assert run_iter0(str(tmp_path / "a"), None, "") == "extract_answer"
    # an answer the tool output does not contain -> a retrieval axis
    assert run_iter0(str(tmp_path / "b"), "made up", "unrelated passage") == "TOP_K"
    # a wrong answer after a tool output that was cut short -> a retrieval axis, even when the
    # answer is a word of the output (which alone would point at the prompts)
    assert run_iter0(str(tmp_path / "c"), "passage", "a passage cut ...\n[2] more") == "TOP_K"
    assert run_iter0(str(tmp_path / "c2"), "passage", "a whole passage.") != "TOP_K"
    # deterministic given rng_seed
    p1 = proposers.make_proposer("primitives", DOMAIN, rng_seed=3)(str(tmp_path / "a"), 3).candidates
    p2 = proposers.make_proposer("primitives", DOMAIN, rng_seed=3)(str(tmp_path / "a"), 3).candidates
    assert [c["source"] for c in p1] == [c["source"] for c in p2]
    assert len({c["axis"] for c in p1}) == 3    # k different axes first (extract_answer has one alternative)
    # an axis that explains over half the failures gets all its alternatives first, then the others
    p3 = proposers.make_proposer("primitives", DOMAIN)(str(tmp_path / "c"), 3).candidates
    assert [c["axis"] for c in p3][:2] == ["TOP_K", "TOP_K"] and p3[2]["axis"] != "TOP_K"
    wide = types.SimpleNamespace(**{**vars(DOMAIN), "PRIMITIVES": {**DOMAIN.PRIMITIVES,
                                                                   "TOP_K": [f"TOP_K = {n}" for n in (2, 3, 5, 8)]}})
    p4 = proposers.make_proposer("primitives", wide)(str(tmp_path / "c"), 5).candidates
    assert [c["axis"] for c in p4] == ["TOP_K"] * 4 + [p4[4]["axis"]] and p4[4]["axis"] != "TOP_K"


def test_primitives_sideways_parent_stacks_swaps_across_a_plateau(tmp_path):
    """--proposer-ties newer: on a tie for the top score the newest tied candidate is the parent, so
    a swap that did not hurt stays and the next swaps go on top of it (older: the paper's order, h0
    stays the parent of every swap while everything scores 0); a better score still wins."""
    d = str(tmp_path / "arch")
    think = hsrc.splice(H0, "SYSTEM_PROMPT", 'SYSTEM_PROMPT = "Think, then answer."')
    batches = [[think]]
    mh.search_phase(H0, DOMAIN, EXAMPLES, lambda src, exs, tag: [record(ex, False) for ex in exs], ok_validate,
                    lambda a, k: [dict(source=s, proposer="fake", note="n", parent="cand_000") for s in batches.pop(0)],
                    archive_dir=d, k=1, should_stop=stop_after(2), log=quiet)
    arch = harness_archive.load_archive(d)
    assert [c["scores"]["success"] for c in arch] == [0.0, 0.0]
    assert primitives.parent_of(arch, "older")["name"] == "cand_000" == harness_archive.paper_choice(arch)["name"]
    assert primitives.parent_of(arch, "newer")["name"] == "cand_001"
    older = proposers.make_proposer("primitives", DOMAIN)(d, 3).candidates
    newer = proposers.make_proposer("primitives", DOMAIN, ties="newer")(d, 3).candidates
    assert {c["parent"] for c in older} == {"cand_000"} and {c["parent"] for c in newer} == {"cand_001"}
    stacked = [c for c in newer if c["axis"] != "SYSTEM_PROMPT"]
    assert stacked and all("Think, then answer." in c["source"] for c in stacked)  # the first swap stays
    assert not any("Think, then answer." in c["source"] for c in older if c["axis"] != "SYSTEM_PROMPT")
    better = dict(arch[0], scores=dict(arch[0]["scores"], success=0.1))
    assert primitives.parent_of([better, arch[1]], "newer")["name"] == "cand_000"  # sideways only on a tie
    # racing: a candidate dropped after its first examples ties when it scored what the best scored on
    # them (on a plateau at 0 every candidate is dropped at its first look), and not when it scored less
    ids = arch[0]["scores"]["example_ids"]
    raced = lambda name, num, per: dict(arch[1], name=name, num=num, scores=dict(  # noqa: E731
        arch[1]["scores"], example_ids=ids[:2], per_example=per, success=sum(per) / 2, dropped_after=2))
    assert primitives.parent_of(arch + [raced("cand_002", 2, [0.0, 0.0])], "newer")["name"] == "cand_002"
    lead = dict(arch[0], scores=dict(arch[0]["scores"], per_example=[1.0] + [0.0] * (len(ids) - 1),
                                     success=1 / len(ids)))
    assert primitives.parent_of([lead, raced("cand_002", 2, [0.0, 0.0])], "newer")["name"] == "cand_000"
    assert primitives.parent_of([lead, raced("cand_002", 2, [1.0, 0.0])], "newer")["name"] == "cand_002"
    assert primitives.parent_of(arch + [raced("cand_002", 2, [0.0, 0.0])], "older")["name"] == "cand_000"
    with pytest.raises(ValueError, match="older or newer"):
        proposers.make_proposer("primitives", DOMAIN, ties="sideways")
    for bad in (["--proposer-ties", "sideways"], ["--proposer", "command", "--proposer-command", "x",
                                                  "--proposer-ties", "newer"]):
        with pytest.raises(run_setup.UserError, match="proposer-ties"):
            run_setup.check_args(run_setup.parse_args(whale.Args, bad), whale.METHODS, switch.check)


def test_a_run_from_before_a_setting_existed_resumes_as_it_ran(tmp_path):
    """run_setup.ADDED_LATER: a config.json from before --confirm-examples and --sft-prompts existed
    resumes without the second look and with whole sequences (the defaults would change what the
    run does, or its float round-off); a new run gets them."""
    run = tmp_path / "old"
    run.mkdir()
    saved = {k: v for k, v in vars(whale.Args()).items() if k not in ("confirm_examples", "sft_prompts")}
    (run / "config.json").write_text(json.dumps(saved))
    _, a = run_setup.open_run(whale.Args(resume=str(run)), whale.METHODS, switch.check)
    assert a.confirm_examples == 0 and whale.Args().confirm_examples == 64
    assert a.sft_prompts == "whole" and whale.Args().sft_prompts == "shared"
    assert set(run_setup.ADDED_LATER) <= set(vars(whale.Args()))


def test_a_domains_own_defaults_apply_to_it_alone_and_the_command_line_overrides_them(tmp_path, capsys,
                                                                                     monkeypatch):
    """domains/<name>.py DEFAULTS (e.g. chess's run size; values set here, so that a fork's own do not
    matter): `--domain chess` gets them, another domain gets whale.Args', a flag given beats both,
    --help shows both, and a chess run from before the domain had DEFAULTS resumes with `--domain
    chess` as it ran (the new defaults are not taken for flags)."""
    from domains import chess
    assert set(chess.DEFAULTS) <= set(vars(whale.Args()))  # the real ones name flags
    monkeypatch.setattr(chess, "DEFAULTS", {"budget": 640, "val_limit": 8, "schedule": "fixed-steps:2,2"})
    a = run_setup.parse_args(whale.Args, ["--domain", "chess"])
    assert {k: getattr(a, k) for k in chess.DEFAULTS} == chess.DEFAULTS
    run_setup.check_args(a, whale.METHODS, switch.check)  # the domain's own size is a valid run
    plain = run_setup.parse_args(whale.Args, ["--domain", "searchqa"])
    assert {k: getattr(plain, k) for k in chess.DEFAULTS} == {k: getattr(whale.Args(), k) for k in chess.DEFAULTS}
    k = next(iter(chess.DEFAULTS))
    flag, value = "--" + k.replace("_", "-"), str(getattr(whale.Args(), k))
    assert str(getattr(run_setup.parse_args(whale.Args, ["--domain", "chess", flag, value]), k)) == value
    with pytest.raises(SystemExit):
        run_setup.parse_args(whale.Args, ["--help"])
    assert f"chess: {chess.DEFAULTS[k]}" in capsys.readouterr().out
    run = tmp_path / "chess-run"
    run.mkdir()
    before = vars(whale.Args(domain="chess"))
    (run / "config.json").write_text(json.dumps(before))
    _, resumed = run_setup.open_run(run_setup.parse_args(whale.Args, ["--resume", str(run), "--domain", "chess"]),
                                    whale.METHODS, switch.check)
    assert vars(resumed) == {**before, "resume": str(run)}


def test_the_runs_two_by_two_adds_up_and_reuses_what_is_scored():
    """evaluation.two_by_two: the effects are paired per question and add up (together = weights alone +
    harness alone + interaction); cells a resumed run already scored are not scored again (no engine
    is touched here); a run that moved only one half scores nothing new (its cells are the others)."""
    q = [f"q{i}" for i in range(5)]
    b, f = dict(zip(q, [0, 0, .5, 0, 0])), dict(zip(q, [1, .5, 1, 0, 1]))
    fw, bh = dict(zip(q, [0, .5, .5, 0, 1])), dict(zip(q, [1, 0, .5, .5, 0]))
    cell = lambda d: {"mean": sum(d.values()) / len(d), "se": 0.0, "per_example": d}  # noqa: E731
    state = {"counters": {"optimizer_steps": 3}, "harness": "found", "two_by_two": {
        "final_weights_h0": cell(fw), "base_weights_final_harness": cell(bh)}}
    run, ctx = types.SimpleNamespace(state=state), types.SimpleNamespace(h0="h0", args=whale.Args(), engine=None)
    c = evaluation.two_by_two(run, ctx, cell(b), cell(f))
    assert (c["final_weights_h0"], c["base_weights_final_harness"], c["questions"]) == (0.4, 0.4, 5)
    assert c["together"] == pytest.approx(c["weights_alone"] + c["harness_alone"] + c["interaction"])
    assert c["interaction"] == pytest.approx(sum(f[k] - fw[k] - bh[k] + b[k] for k in q) / 5) and c["interaction_se"] > 0
    state.update(counters={"optimizer_steps": 0}, two_by_two={})  # harness-only: the weights never moved
    c = evaluation.two_by_two(run, ctx, cell(b), cell(f))
    assert c["final_weights_h0"] == c["base_h0"] and c["base_weights_final_harness"] == c["final"]
    assert c["weights_alone"] == 0 and c["interaction"] == 0 and not state["two_by_two"]


def test_a_preset_sets_its_flags_for_any_domain_and_a_flag_beside_it_wins():
    """--preset tiny (whale.PRESETS) is a valid run of every method in every domain, beats a domain's own
    DEFAULTS (chess's run size), loses to a flag given beside it, and an unknown preset is one line."""
    for domain in ("searchqa", "math", "chess"):
        for method in whale.METHODS:
            a = run_setup.parse_args(whale.Args, ["--preset", "tiny", "--domain", domain, "--method", method],
                                     presets=whale.PRESETS)
            assert {k: getattr(a, k) for k in whale.PRESETS["tiny"]} == whale.PRESETS["tiny"]
            run_setup.check_args(a, whale.METHODS, switch.check)
    a = run_setup.parse_args(whale.Args, ["--preset", "tiny", "--budget", "64"], presets=whale.PRESETS)
    assert a.budget == 64 and a.group == whale.PRESETS["tiny"]["group"]
    with pytest.raises(run_setup.UserError, match="unknown --preset 'huge'; choose tiny"):
        run_setup.parse_args(whale.Args, ["--preset", "huge"], presets=whale.PRESETS)


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
        return proposers.make_proposer("primitives", domain)(str(d), 1).candidates[0]["axis"]
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
    proposal = prop(d, 6)
    out = proposal.candidates
    assert len(out) == 6 and not proposal.exhausted and not proposal.errors
    norms = [hsrc.normalized(c["source"]) for c in out]
    assert len(set(norms)) == 6 and not set(norms) & seen  # distinct, never seen
    by_name = {c["name"]: c for c in arch}
    for c in out:
        assert hsrc.static_check(c["source"]) is None and c["kind"] in ("merge", "combine", "retry", "pair")
        assert c["parents"][0] == c["parent"] and all(p in by_name for p in c["parents"])
        # the candidate is its first parent with exactly the named axes changed
        assert set(primitives.changed_axes(by_name[c["parent"]]["source"], c["source"], DOMAIN.PRIMITIVES)) \
            == set(c["axes"]) and c["axis"] == "+".join(c["axes"])
    combined = [c for c in out if c["kind"] == "combine" and len(c["axes"]) == 2]
    assert combined and all(len(c["parents"]) == 3 and c["parents"][0] == best["name"] for c in combined)
    assert [c["source"] for c in proposers.make_proposer("primitives", DOMAIN, rng_seed=4)(d, 6).candidates] \
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
        assert meta["kind"] in ("swap", "merge", "combine", "retry", "pair") and meta["axes"] and meta["parents"]
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
    page = report.render_candidate(run_reader.read_candidate(combo["dir"]), {c["name"]: c for c in arch}, "cand_000", [])
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


@pytest.mark.slow
def test_whether_a_harness_runs_at_all_does_not_depend_on_the_models_speed(hf):
    """rollout.runs_at_all, phase B's validation: on a machine so loaded that every model batch takes
    longer than the whole deadline, chess h0 (two llm() calls) is still valid, while a harness whose own
    code loops past the deadline, or that raises, is not."""
    from domains import chess

    class Loaded:  # the real engine on a slow machine: each batch is late by more than the deadline
        def __getattr__(self, name):
            return getattr(hf, name)

        def sample(self, reqs):
            time.sleep(1.5)
            return hf.sample(reqs)

    example = chess.load_split("harness")[0]
    check = lambda src: rollout.runs_at_all(Loaded(), chess, src, example, seed=0, max_tokens=8, timeout=1.0,
                                            sampling={"temperature": 0.7, "top_k": 0, "top_p": 1.0})
    assert check(Path(chess.H0).read_text()) is None
    assert check("def run(task, llm, tools):\n    while True:\n        pass\n").startswith("timeout")
    assert check("def run(task, llm, tools):\n    raise ValueError('no')\n").startswith("error")


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
    assert res["incumbent_source"] == ref["incumbent_source"] and res["paper_successes"] == ref["paper_successes"]
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


def _paired(rng, n, discordant, theta):
    """Synthetic paired per-example scores: an example is discordant with chance `discordant`,
    then the candidate wins it with chance `theta`; the rest are ties (both 0 or both 1)."""
    cand, inc = [], []
    for _ in range(n):
        if rng.random() < discordant:
            won = rng.random() < theta
            cand.append(float(won))
            inc.append(float(not won))
        else:
            tie = float(rng.random() < 0.1)
            cand.append(tie)
            inc.append(tie)
    return cand, inc


def test_racing_drops_losers_early_and_rarely_a_candidate_the_full_test_would_accept():
    """Racing (meta_harness.race, its registered setting) on synthetic pairs where the truth is known,
    64 examples as a search set has, alpha 0.2 as whale.py's: a candidate no better than the incumbent
    is mostly dropped and stops spending (measured here: 60 % dropped, 67 % of the examples spent; a
    worse one 90 %, 46 %); of the truly better candidates (theta 0.8) that the full test accepts,
    racing drops at most 10 % (measured: 5 %), of clearly better ones (theta 0.9) 5 % (1 %)."""
    rng = random.Random(0)

    def trial(discordant, theta, runs=300):
        dropped = used = accepted = lost = 0
        for _ in range(runs):
            cand, inc = _paired(rng, 64, discordant, theta)
            full = mh.accept(cand, inc, 0.2)[0]
            d, u = mh.race(cand, inc, 0.2, **mh.RACE)
            dropped, used, accepted, lost = dropped + d, used + u, accepted + full, lost + (full and d)
        return dropped / runs, used / runs / 64, lost / max(accepted, 1)
    drop, spent, _ = trial(0.15, 0.5)
    assert drop >= 0.55 and spent <= 0.75  # no better: most dropped, early
    drop, spent, _ = trial(0.15, 0.3)
    assert drop >= 0.85 and spent <= 0.5  # worse: nearly all dropped, earlier
    assert trial(0.15, 0.8)[2] <= 0.1 and trial(0.2, 0.9)[2] <= 0.05
    cand, inc = [1.0] * 64, [0.0] * 64
    assert mh.race(cand, inc, 0.2, **mh.RACE) == (False, 64)  # a clear winner runs to the end: accept() decides
    assert mh.race(inc, cand, 0.2, **mh.RACE) == (True, mh.race_looks(64, **mh.RACE)[0])  # a clear loser: first look


def _evaluate_by_id(calls, fail_at=None):
    """make_evaluate's quality-driven evaluate, with an example's draw taken by its id (a block of
    examples scores each as the whole set does); counts (candidate, examples) in `calls`; raises on
    call number `fail_at` (a crash)."""
    def evaluate(source, examples, tag):
        if fail_at is not None and len(calls) + 1 == fail_at:
            raise RuntimeError("simulated crash")
        calls.append((tag, len(examples)))
        q = constant(source, "QUALITY")
        return [record(ex, U[int(ex["id"][2:])] < q) for ex in examples]
    return evaluate


def test_racing_stops_spending_on_a_loser_and_decides_as_scoring_every_example(tmp_path):
    """search_phase(race=RACE): a candidate that cannot win is dropped at a look and costs no more
    (its scores say after how many examples, and it is never the paper's choice); the winners run to
    the end, so every iteration keeps the incumbent that scoring every example keeps."""
    batches = [["QUALITY = 0.0", "QUALITY = 0.5"], ["QUALITY = 0.1", "QUALITY = 0.8"], ["QUALITY = 0.05"]]

    def search(race, d, fail_at=None):
        todo, calls = [list(b) for b in batches], []

        def propose(archive_dir, k):
            best = harness_archive.paper_choice(harness_archive.load_archive(archive_dir))
            return [dict(source=hsrc.splice(H0, "QUALITY", q), proposer="fake", parent=best["name"]) for q in todo.pop(0)]
        try:
            mh.search_phase(H0, DOMAIN, EXAMPLES, _evaluate_by_id(calls, fail_at), ok_validate, propose,
                            archive_dir=str(d), k=2, should_stop=stop_after(4), log=quiet, race=race)
        except RuntimeError:  # the crash: the same search again resumes it from its archive
            mh.search_phase(H0, DOMAIN, EXAMPLES, _evaluate_by_id(calls), ok_validate, propose,
                            archive_dir=str(d), k=2, should_stop=stop_after(4), log=quiet, race=race)
        return [line["incumbent"] for line in harness_archive.read_jsonl(d / "iterations.jsonl")], calls
    full, full_calls = search(None, tmp_path / "full")
    raced, raced_calls = search(mh.RACE, tmp_path / "raced")
    assert raced == full == ["cand_000", "cand_002", "cand_004", "cand_004"]  # the same decisions
    assert all(n == len(EXAMPLES) for _, n in full_calls)  # racing off: every candidate on every example at once
    archive = {c["name"]: c for c in harness_archive.load_archive(str(tmp_path / "raced"))}
    first_look = mh.race_looks(len(EXAMPLES), **mh.RACE)[0]
    for loser in ("cand_001", "cand_003", "cand_005"):  # quality 0.0, 0.1, 0.05 against 0.2, 0.5, 0.8
        s = archive[loser]["scores"]
        assert s["dropped_after"] <= 2 * first_look and s["rollouts"] == s["dropped_after"]
        assert sum(n for tag, n in raced_calls if tag == loser) == s["dropped_after"]  # stopped spending
        assert s["cost"]["rollouts"] == s["dropped_after"]
    for winner in ("cand_002", "cand_004"):
        assert "dropped_after" not in archive[winner]["scores"] and archive[winner]["scores"]["rollouts"] == len(EXAMPLES)
    assert sum(n for _, n in raced_calls) < sum(n for _, n in full_calls)
    lines = harness_archive.read_jsonl(tmp_path / "raced" / "iterations.jsonl")
    assert not {line["paper_choice"] for line in lines} & {"cand_001", "cand_003", "cand_005"}
    # a crash in the middle of a race (after a dropped candidate was archived) resumes to the same decisions
    assert search(mh.RACE, tmp_path / "crashed", fail_at=len(raced_calls) - 1)[0] == raced


def test_candidates_scored_out_of_order_write_the_archive_of_one_after_another(tmp_path):
    """search_phase(run_together=...): an iteration's candidates may be scored at once (whale.py shares
    their batches); whatever order they finish in, each candidate's files are written after the ones
    before it, so the archive, the ledger and the log read as when they are scored one by one."""
    def search(d, run_together):
        events = []
        mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate,
                        proposers.make_proposer("primitives", DOMAIN), archive_dir=str(d), k=3,
                        should_stop=stop_after(3), log=events.append, run_together=run_together)
        untimed = lambda rows: [{k: v for k, v in row.items() if k not in ("cost", "seconds")} for row in rows]
        return (untimed(harness_archive.read_jsonl(d / "summary.jsonl")), untimed(harness_archive.read_jsonl(d / "iterations.jsonl")),
                [(e["event"], e.get("cand")) for e in events])
    one_by_one = search(tmp_path / "a", lambda jobs: [job() for job in jobs])
    backwards = search(tmp_path / "b", lambda jobs: [job() for job in reversed(jobs)][::-1])
    assert backwards == one_by_one and len(one_by_one[0]) >= 7


def fake_engine(batches, threads=None):
    """An engine whose sample() answers each request with its own seed, and notes each batch's seeds
    (and the thread it ran in)."""
    def sample(requests):
        batches.append([r["seed"] for r in requests])
        (threads if threads is not None else []).append(threading.get_ident())
        return [{"seed": r["seed"]} for r in requests]
    return types.SimpleNamespace(sample=sample)


def test_jobs_in_shared_batches_sample_once_per_meeting_and_get_their_own_rows():
    """rollout.in_shared_batches: while every job is running, their engine.sample calls meet in one
    call (rows in job order) and each job gets back exactly its own rows; a job that is done no
    longer holds the others back; the model runs in the caller's thread only (one malloc arena);
    the engine's own sample() is back afterwards."""
    batches, threads = [], []
    engine = fake_engine(batches, threads)
    own = engine.sample

    def job(k, sizes):
        def run():
            got = []
            for n_call, n in enumerate(sizes):
                reqs = [{"seed": (k, n_call, j)} for j in range(n)]
                outs = engine.sample(reqs)
                assert [o["seed"] for o in outs] == [r["seed"] for r in reqs]
                got.append(len(outs))
                time.sleep(0.01 * k)  # (the jobs reach their next call at different times)
            return got
        return run
    assert rollout.in_shared_batches(engine, [job(0, [2, 1, 3]), job(1, [4]), job(2, [1, 1])]) == [[2, 1, 3], [4], [1, 1]]
    assert [len(b) for b in batches] == [7, 2, 3]  # all three, then jobs 0 and 2, then job 0 alone
    assert batches[0] == [(0, 0, 0), (0, 0, 1)] + [(1, 0, j) for j in range(4)] + [(2, 0, 0)]
    assert set(threads) == {threading.get_ident()} and engine.sample is own


def test_a_job_that_fails_ends_the_shared_batches_without_a_hang():
    """in_shared_batches: a job that raises is re-raised, and a job waiting for it in a meeting is
    released (its sample() raises) instead of waiting forever; so is an engine that raises."""
    batches = []
    engine = fake_engine(batches)
    waited = []

    def waits():
        try:
            engine.sample([{"seed": 1}])
        except RuntimeError:
            waited.append("released")
            raise

    def fails():
        time.sleep(0.2)
        raise ValueError("the harness machinery broke")
    t = time.monotonic()
    with pytest.raises(ValueError, match="machinery broke"):
        rollout.in_shared_batches(engine, [waits, fails])
    assert waited == ["released"] and batches == [] and time.monotonic() - t < 5

    def broken_sample(requests):
        raise OSError("out of memory")
    engine = types.SimpleNamespace(sample=broken_sample)
    with pytest.raises(OSError, match="out of memory"):
        rollout.in_shared_batches(engine, [lambda: engine.sample([{"seed": 1}]), lambda: engine.sample([{"seed": 2}])])


def test_the_evaluation_cache_never_pays_twice_and_its_key_changes_with_the_weights(tmp_path):
    """eval_cache.cached: a resumed candidate's finished examples are not run again (and are paid as
    the first time), another phase's request for the same source under the same weights gets the
    records free ("cached"), and new weights, another seed or another source run anew."""
    calls = []

    def run_fn(source, examples, name):
        calls.append(len(examples))
        return [dict(record(ex, U[int(ex["id"][2:])] < constant(source, "QUALITY")), sample=0) for ex in examples]
    sampling = {"temperature": 0.7, "top_k": 20, "top_p": 1.0, "max_tokens": 48}

    def cached(version, phase, seed=(0, "B", 0)):
        return eval_cache.cached(run_fn, tmp_path, version, seed, sampling, 1, phase)
    first = cached(0, "phase00")(H0, EXAMPLES[:8], "cand_001")
    resumed = cached(0, "phase00")(H0, EXAMPLES[:16], "cand_001")
    assert calls == [8, 8] and resumed[:8] == first and not any(r.get("cached") for r in resumed)
    again = cached(0, "phase01")(H0, EXAMPLES[:16], "cand_000")  # the next phase's incoming harness
    assert calls == [8, 8] and all(r["cached"] for r in again)
    assert [r["score"] for r in again] == [r["score"] for r in resumed]
    assert mh.paid(again) == 0 and mh.paid(resumed) == 16
    cached(1, "phase01")(H0, EXAMPLES[:16], "cand_000")  # one optimizer step later: new weights
    cached(0, "phase01", seed=(0, "B", 1))(H0, EXAMPLES[:16], "cand_000")
    cached(0, "phase01")(hsrc.splice(H0, "QUALITY", "QUALITY = 0.5"), EXAMPLES[:16], "cand_001")
    assert calls == [8, 8, 16, 16, 16]
    key = dict(source=H0, weights_version=0, seed=(0, "B", 0), sampling=sampling)
    assert eval_cache.cache_file(tmp_path, **key) != eval_cache.cache_file(tmp_path, **dict(key, weights_version=1))


def test_a_merge_carries_both_parents_changes_and_validates(tmp_path):
    """The primitives proposer's merge: two swaps of different axes that each held against h0 (here
    neither changes the score, a plateau) come back stacked in one candidate, labelled a merge with
    its parents, and the search scores it like any candidate. An LLM's merge is labelled from its
    docstring's first line."""
    d = tmp_path / "arch"
    swaps = [[hsrc.splice(H0, "TOP_K", "TOP_K = 3"), hsrc.splice(H0, "SYSTEM_PROMPT", 'SYSTEM_PROMPT = "Answer briefly."')]]
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate,
                    lambda a, k: [dict(source=s, proposer="fake", parent="cand_000") for s in swaps.pop(0)],
                    archive_dir=str(d), k=2, should_stop=stop_after(2), log=quiet)
    out = primitives.proposer(DOMAIN)(str(d), 3)
    merge = out.candidates[0]
    assert merge["kind"] == "merge" and merge["parents"] == ["cand_000", "cand_001", "cand_002"]
    assert sorted(merge["axes"]) == ["SYSTEM_PROMPT", "TOP_K"]
    assert primitives.definition(merge["source"], "TOP_K").strip() == "TOP_K = 3"
    assert primitives.definition(merge["source"], "SYSTEM_PROMPT").strip() == 'SYSTEM_PROMPT = "Answer briefly."'
    assert hsrc.static_check(merge["source"]) is None
    assert all(c["kind"] != "merge" for c in primitives.proposer(DOMAIN, merge=False)(str(d), 3).candidates)
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, primitives.proposer(DOMAIN), archive_dir=str(d),
                    k=3, should_stop=stop_after(3), log=quiet)
    merged = [c for c in harness_archive.load_archive(str(d)) if c["meta"].get("kind") == "merge"]
    assert merged and merged[0]["scores"] and not merged[0]["invalid"]
    assert merged[0]["meta"]["parents"] == ["cand_000", "cand_001", "cand_002"]
    llm = dict(source=hsrc.with_hypothesis(merge["source"], "merge of cand_001 and cand_002: both changes"),
               proposer="openai", parent="cand_000")
    harness_archive.write_candidate(str(d), 99, llm, 9, {})
    meta = json.loads((d / "cand_099" / "meta.json").read_text())
    assert meta["kind"] == "merge" and meta["parents"] == ["cand_000", "cand_001", "cand_002"]


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
    assert its[-1]["paper_success"] == max(true0, arch[1]["scores"]["success"]) < 1.0
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
    # (the iteration line keeps 300 characters of each error: another process writing in /tmp meanwhile makes one long)
    assert calls[-1]["files"] == ["cand_1.py"] and [e[:300] for e in calls[-1]["errors"]] == its[-1]["proposer_errors"]
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
        proposal = prop(str(d), 1)
        assert proposal.candidates == []
        took = time.time() - t0
        assert took < timeout + agent_jail.GRACE_S + 5 < 60, took  # not the daemon's 60 s
        assert leftover_processes(marker) == [], marker
        assert ("timed out" in " ".join(proposal.errors)) == (timeout == 2)
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
            proposal = prop(d, 2)
            assert proposal.candidates == []
            assert time.time() - t0 < 10  # the drip lasts 20 s
            assert len(proposal.errors) == 1 and "TimeoutError" in proposal.errors[0] and "in all" in proposal.errors[0]
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
    assert line["paper_success"] < 1.0 and line["paper_choice"] != "cand_009" and line["incumbent"] == "cand_000"
    assert sum(e["event"] == "archive_integrity" for e in events) == 3


def test_a_search_whose_ledger_was_removed_trusts_none_of_its_files(tmp_path):
    """The ledger is the search's own record: with it deleted and a scores.json forged into a win,
    a resumed search logs an integrity event and measures again instead of trusting the files."""
    d = tmp_path / "arch"
    batches = [[hsrc.splice(H0, "QUALITY", "QUALITY = 0.1")]]

    def propose(archive_dir, k):
        return [dict(source=s, proposer="fake", note="n", parent="cand_000") for s in batches.pop(0)] if batches else []
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, propose, archive_dir=str(d),
                    should_stop=stop_after(2), log=lambda e: None)
    honest = json.loads((d / "cand_001" / "scores.json").read_text())
    (d / "cand_001" / "scores.json").write_text(json.dumps(dict(honest, success=1.0, per_example=[1.0] * 40)))
    os.remove(harness_archive.ledger_path_for(str(d)))
    events = []
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, propose, archive_dir=str(d),
                          should_stop=stop_after(2), log=events.append)
    reasons = [e["reason"] for e in events if e["event"] == "archive_integrity"]
    assert any("ledger" in r and "missing" in r for r in reasons), reasons
    assert json.loads((d / "cand_001" / "scores.json").read_text())["success"] == honest["success"]  # measured again
    assert res["incumbent_scores"]["success"] < 1.0


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
        proposal = prop(str(d), 1)
        cands = proposal.candidates
    finally:
        listener.close()
    doc = cands[0]["note"]
    could = doc.split("could: ")[1].split(". env:")[0].split("; ")
    assert could == ["read the system", "read its copy", "read the guide", "write its copy", "write its home"], doc
    assert "env: WHALE_TEST_NAMED." in doc  # named: passed; WHALE_TEST_SECRET: scrubbed
    for f in ("GUIDE.md", "OUTCOMES.md", "outcomes.tsv", "failures", "PROPOSE.md"):
        assert f in doc.split("files: ")[1], f
    errors = " | ".join(proposal.errors)
    for what in ["read the repository's data", "read WHALE_DATA", "read the run directory", "read the real archive",
                 "read the home directory", "read tmp", "write tmp", "write the run directory", "write the repository",
                 "connect to a local service"]:  # (as root, what lives under /tmp is not even in its mounts)
        assert re.search(f"refused: {re.escape(what)}: (PermissionError|FileNotFoundError)", errors), what
    assert not (run / "planted.txt").exists() and not (repo / "planted.txt").exists()
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), "whale-prober-was-here"))


# ==============================================================================================
# THE SWITCH POLICY (switch.py)
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


def first_harness_done(policy, paper_successes):
    for n in range(1, len(paper_successes) + 1):
        if policy.harness_done(paper_successes[:n]):
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
# THE LOOP AND RESUME (whale.py, evaluation.py, run_dir.py; results.py)
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
    # --harness-length rollouts: a phase of I = 2 iterations may spend 4 + 1 x 8 rollouts, however they fall
    assert b.phase_allowance(2) == 12 and b.phase_allowance(1) == 4
    assert b.candidates_affordable(0, weights_follow=True, phase_left=12 - 4 - 1) == 1  # a raced candidate's 1 unspent
    assert b.candidates_affordable(0, weights_follow=True, phase_left=3) == 0
    assert b.candidates_affordable(20, weights_follow=True, phase_left=100) == 1         # the budget still binds


def test_budget_stagewise_weight_share_matches_one_fixed_cycle():
    # one cycle: 2 steps x 128 rollouts on weights; 32 incoming + 2 iterations x 96 on the harness
    b = whale.Budget(total=1664, step_cost=128, candidate_cost=32, candidates=3)
    assert b.weight_share(Fixed(E_steps=2, I=3), 100) == 256 / (256 + 32 + 192)
    assert b.weight_share(Patience(), 100) == 0.5


@pytest.mark.slow
def test_a_harness_phase_in_rollouts_spends_what_racing_saves_on_more_candidates(tmp_path, tiny_harness):
    """--harness-length rollouts: the first harness phase (I = 2: the incoming harness and one iteration of
    2 candidates at full evaluation, 16 + 2 x 16 = 48 rollouts on 16 examples x 1) goes on proposing while
    its allowance buys a whole candidate, so what racing saves on a loser is spent on further candidates;
    it never spends past the allowance, and ends saying so."""
    out = tmp_path / "run"
    r = run_whale("--domain", "searchqa", *TINY, "--harness-examples", "16", "--budget", "72", "--harness-length",
                  "rollouts", "--harness", tiny_harness, "--test-limit", "1", "--two-by-two", "off", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    its = [json.loads(x) for x in (out / "archive" / "phase00" / "iterations.jsonl").read_text().splitlines()]
    costs = [json.loads(x)["cost"]["rollouts"] for x in (out / "archive" / "phase00" / "summary.jsonl").read_text().splitlines()]
    spent = sum(costs) + sum((x.get("cost") or {}).get("rollouts", 0) for x in its)
    assert spent <= 48 < spent + 16, (spent, costs)  # it stopped when no whole candidate was left, not before
    assert "48" in its[-1]["stop_reason"] and not its[-1]["stop_reason"].startswith("budget")  # its allowance ended it
    assert len(costs) - 1 >= 2  # at least the candidates of I = 2 iterations at full cost


@pytest.mark.slow
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
    assert [(x["event"], x["rollouts"]) for x in rows if x["event"] not in tracking.PROCESS_EVENTS] == \
        [(x["event"], x["rollouts"]) for x in ref_rows if x["event"] not in tracking.PROCESS_EVENTS]


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
    # a finished run, resumed once more: it says so with its summary, and nothing on disk changes
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}
    r = run_whale("--resume", str(run), timeout=120)
    assert r.returncode == 0 and "is finished; nothing was changed" in r.stdout and "final" in r.stdout, r.stderr[-2000:]
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()} == files


# (--budget 24: three steps, the least with a mid-phase point after a step that replays an earlier one)
KNOBS = ["--method", "weight-only", *TINY, "--budget", "24", "--replay-steps", "2", "--sft-epochs", "2", "--val-every", "1"]


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
def test_tiny_run_of_each_rsft_knob_evaluates_every_step_and_trains_on_its_buffer(knobs_reference):
    """--val-every 1 puts a validation point after every RSFT step (tag A<cycle>.<step>, the last
    one the phase's own), which the curve, the report and the results tables take; --replay-steps 2
    --sft-epochs 2 trains twice over this step's and the previous step's kept sequences. This run is
    also the tiny weight-only run that test_tiny_run_of_each_method_... leaves out: check_run."""
    s = check_run(knobs_reference, "weight-only")
    rows = [json.loads(x) for x in (knobs_reference / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if x["event"] == "rollout_step"]
    assert len(steps) == s["steps"] == 3
    assert [x["tag"] for x in rows if x["event"] == "eval" and x["split"] == "val"] == ["initial", "A0.1", "A0.2", "A0"]
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
def test_resume_refuses_trained_blocks_on_another_base(tmp_path, tiny_reference):
    """A checkpoint holds only the trained blocks and the fingerprint of the base weights they were
    trained on; a resume whose --model loads other weights stops with one line and changes nothing."""
    run = copy_run(tiny_reference, tmp_path / "run")
    shutil.copytree(tiny_reference / "checkpoint", run / "checkpoint")
    (run / "summary.json").unlink()  # not finished: a finished run is not resumed at all
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
        run_setup.check_args(whale.Args(domain="searchqa", method=name), whale.METHODS, switch.check)
    with pytest.raises(run_setup.UserError) as e:
        run_setup.check_args(whale.Args(domain="searchqa", method="weights-only"), whale.METHODS, switch.check)
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


def test_a_checkpoint_after_no_update_links_the_weights_and_optimizer_state_and_resumes_the_same(tmp_path):
    """run_dir.save_checkpoint with model_changed=False (after an evaluation or a harness phase):
    the weights and the optimizer's state (1 GB at full fine-tuning) are hard links to the last
    checkpoint's, not new copies; after an update both are written anew; each loads back as saved."""
    model = tiny_lm()
    engine = types.SimpleNamespace(model=model, tokenizer=types.SimpleNamespace(save_pretrained=lambda d: None))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    files = lambda: [tmp_path / "checkpoint" / f for f in ("model.safetensors", "optimizer.pt")]
    run_dir.save_checkpoint(tmp_path, engine, opt, {"n": 1}, model_changed=True)
    first = [f.stat().st_ino for f in files()]
    run_dir.save_checkpoint(tmp_path, engine, opt, {"n": 2}, model_changed=False)
    assert [f.stat().st_ino for f in files()] == first
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text()) == {"n": 2}
    opt.step()  # an update: both written anew
    run_dir.save_checkpoint(tmp_path, engine, opt, {"n": 3}, model_changed=True)
    assert all(f.stat().st_ino != i for f, i in zip(files(), first))
    saved = torch.load(files()[1], weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(saved["state"][0].values(), opt.state_dict()["state"][0].values()))


def test_a_finished_run_halves_only_weights_that_bfloat16_holds_exactly(tmp_path):
    """run_dir.halve_weights (a finished run's last step): a model whose values are all bf16 values
    (an untrained one) is kept once in bfloat16, checkpoint/ and best_val/ of the same point sharing
    one file, and loads back as the same fp32 values; a trained model (fp32 values between bf16
    steps) keeps its fp32 file byte for byte: the weights a run scored are the weights it keeps."""
    from safetensors.torch import load_file
    model = tiny_lm()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # what bf16 holds exactly
    run = tmp_path / "run"
    model.save_pretrained(run / "checkpoint")
    run_dir.copy_checkpoint(run, "checkpoint", "best_val")  # the same point: hard links
    fp32 = (run / "checkpoint" / "model.safetensors").stat().st_size
    run_dir.halve_weights(run)
    ck, bv = run / "checkpoint" / "model.safetensors", run / "best_val" / "model.safetensors"
    assert ck.stat().st_ino == bv.stat().st_ino and ck.stat().st_size < 0.6 * fp32
    assert all(t.dtype == torch.bfloat16 for t in load_file(ck).values())
    assert json.loads((run / "best_val" / "config.json").read_text())["dtype"] == "bfloat16"
    back = type(model).from_pretrained(run / "checkpoint", dtype=torch.float32)
    for (name, p), q in zip(model.named_parameters(), back.parameters()):
        assert q.dtype == torch.float32 and torch.equal(p.detach(), q.detach()), name
    trained = tiny_lm(seed=1)  # best_val a trained point: fp32 between bf16 steps
    trained.save_pretrained(run / "best_val")
    before = bv.read_bytes()
    run_dir.halve_weights(run)
    assert bv.read_bytes() == before and ck.stat().st_ino != bv.stat().st_ino
    assert all(t.dtype == torch.float32 for t in load_file(bv).values())


@pytest.mark.slow
def test_a_run_under_max_memory_sizes_its_sampler_and_may_change_it_on_resume(tiny_harness, tmp_path):
    """--max-memory GB: the run logs the caps it gave the sampler (smaller for less memory), finishes,
    and a resume on another machine may give another limit (like --device): it is not a setting of
    the method, and the resumed run is fitted to it. Not given, a CPU run takes auto's 4 GB."""
    out = tmp_path / "run"  # (weight-only, two steps: the caps are the run's, not a phase's)
    r = run_whale("--domain", "searchqa", *TINY, "--method", "weight-only", "--budget", "16", "--harness", tiny_harness,
                  "--out", str(out), env={"WHALE_CRASH_AT": "checkpoint:2"})
    assert r.returncode != 0 and not (out / "summary.json").exists()
    r = run_whale("--resume", str(out), "--max-memory", "6")
    assert r.returncode == 0, r.stderr[-2000:]
    fits = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"memory_fit"' in x]
    assert [f["max_memory_gb"] for f in fits] == [run_dir.AUTO_MAX_MEMORY_GB, 6]
    assert fits[0]["max_cache_positions"] < fits[1]["max_cache_positions"]
    assert 256 <= fits[0]["max_forward_tokens"] < fits[1]["max_forward_tokens"]  # a training forward's cap too
    assert all(line.split()[:1] != ["Traceback"] for line in r.stderr.splitlines())
