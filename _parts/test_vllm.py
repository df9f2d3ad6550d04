"""Tests of the optional vLLM backend (vllm_engine.py) on the embedded model (fp32 HF dir).

Skipped unless vllm imports (see requirements-vllm.txt). One engine per module: vLLM start-up is ~50 s on CPU.
Run: /opt/vllm-venv/bin/python -m pytest -s _parts/test_vllm.py
"""
import os

import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - ImportError, or CUDA libraries missing under a CUDA build
    pytest.skip(f"vllm not importable ({type(e).__name__}: {e}); install requirements-vllm.txt",
                allow_module_level=True)

HF_DIR = os.environ.get("WHALE_HF_DIR", "/tmp/smol_hf")  # the embedded model converted to an HF fp32 dir
QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write one sentence about the sea.", "What is 12 plus 7?"]
N_NEW = 24


def greedy(q, max_tokens=N_NEW, stop=None, seed=0):
    return {"prompt_ids": q, "max_tokens": max_tokens, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
            "stop": stop, "seed": seed}


def hf_greedy(eng, ids, n=N_NEW):
    with torch.no_grad():
        out = eng.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False, pad_token_id=eng.tokenizer.eos_token_id)
    return out[0, len(ids):].tolist()


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def eng():
    if not os.path.exists(os.path.join(HF_DIR, "config.json")):
        pytest.skip(f"no HF model dir at {HF_DIR} (set WHALE_HF_DIR)")
    from vllm_engine import VLLMEngine
    e = VLLMEngine(HF_DIR, seed=0)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def prompts(eng):
    return [eng.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]


def test_chat_ids(eng, prompts):
    assert eng.chat_ids(QUESTIONS[0]) == prompts[0]  # a plain string is one user message
    text = eng.tokenizer.decode(prompts[0])
    assert text.endswith("<|im_start|>assistant\n") and QUESTIONS[0] in text


def test_greedy_matches_hf(eng, prompts):
    got = eng.sample([greedy(p) for p in prompts])
    same = total = 0
    for p, g in zip(prompts, got):
        ref = hf_greedy(eng, p)
        k = common_prefix(g["completion_ids"], ref)
        same, total = same + k, total + len(ref)
        print(f"vLLM vs HF greedy: {k}/{len(ref)} tokens identical  {g['text'][:50]!r}")
        # fp32 on both sides, but different kernels (vLLM's CPU GEMM/attention vs torch's) round differently:
        # a near-tie between the two best logits could flip and then the texts diverge. So we ask for a long
        # common prefix, not bit-identity (observed on this machine: all tokens identical).
        assert k >= min(8, len(ref)), (g["completion_ids"], ref)
        assert g["finish"] in ("eos", "length")
        assert g["text"] == eng.tokenizer.decode(g["completion_ids"], skip_special_tokens=True)
    print(f"vLLM vs HF greedy total: {same}/{total} tokens identical")
    assert same >= 0.9 * total


def test_seeded_sampling_reproducible(eng, prompts):
    def req(seed):
        return {"prompt_ids": prompts[2], "max_tokens": 16, "temperature": 1.0, "top_k": 50, "top_p": 0.95,
                "stop": None, "seed": seed}
    a = eng.sample([req(s) for s in range(6)])
    b = eng.sample([req(s) for s in reversed(range(6))])[::-1]  # other batch order, same seeds
    assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b]
    assert len({tuple(r["completion_ids"]) for r in a}) > 1  # different seeds -> different samples
    alone = eng.sample([req(3)])[0]  # a per-request seed does not depend on the rest of the batch
    assert alone["completion_ids"] == a[3]["completion_ids"]
    big = eng.sample([req(7 * 2**62)])[0]  # a 64-bit hash seed is accepted
    assert big["completion_ids"]


def test_stop_strings_and_finish(eng, prompts):
    full = eng.sample([greedy(prompts[0], max_tokens=40)])[0]
    assert "." in full["text"], full  # "The capital of France is Paris." on the embedded model
    cut = eng.sample([greedy(prompts[0], max_tokens=40, stop=["."])])[0]
    assert cut["finish"] == "stop"
    assert cut["text"] == full["text"][:full["text"].index(".")]  # cut before the stop string
    # the token ids are kept as generated, up to and including the token that completed the stop string
    assert full["completion_ids"][:len(cut["completion_ids"])] == cut["completion_ids"]
    assert "." in eng.tokenizer.decode(cut["completion_ids"])
    short = eng.sample([greedy(prompts[0], max_tokens=3)])[0]
    assert short["finish"] == "length" and len(short["completion_ids"]) == 3
    if full["finish"] == "eos":
        assert full["completion_ids"][-1] == eng.tokenizer.eos_token_id  # EOS kept: training learns to stop
    too_long = eng.sample([greedy([1] * eng.max_model_len), greedy(prompts[0], max_tokens=3)])
    assert too_long[0] == {"completion_ids": [], "text": "", "finish": "length"}
    assert too_long[1]["completion_ids"] == short["completion_ids"]  # one bad prompt does not sink the batch


def test_sync_weights(eng, prompts):
    before = [r["completion_ids"] for r in eng.sample([greedy(p) for p in prompts])]
    w = eng.model.model.norm.weight
    orig = w.detach().clone()
    try:
        with torch.no_grad():  # a visible change, as a phase-A update would make
            w.mul_(torch.linspace(0.5, 1.5, w.numel()))
        stale = [r["completion_ids"] for r in eng.sample([greedy(p) for p in prompts])]
        assert stale == before  # vLLM holds its own copy until synced
        print(f"sync_weights ({eng.sync_mode}): {eng.sync_weights():.2f} s")
        after = [r["completion_ids"] for r in eng.sample([greedy(p) for p in prompts])]
        assert after != before
        for p, a in zip(prompts, after):
            ref = hf_greedy(eng, p)
            assert common_prefix(a, ref) >= min(8, len(ref)), (a, ref)
    finally:
        with torch.no_grad():
            w.copy_(orig)
        eng.sync_mode, mode = "disk", eng.sync_mode  # also exercise the checkpoint path (used for tp > 1)
        try:
            print(f"sync_weights (disk): {eng.sync_weights():.2f} s")
        finally:
            eng.sync_mode = mode
    assert [r["completion_ids"] for r in eng.sample([greedy(p) for p in prompts])] == before


@pytest.mark.skipif(not os.environ.get("WHALE_TEST_VLLM_RESTART"), reason="slow (~50 s): set WHALE_TEST_VLLM_RESTART=1")
def test_sync_weights_restart_fallback(eng, prompts):
    before = eng.sample([greedy(prompts[0])])[0]["completion_ids"]
    w = eng.model.model.norm.weight
    orig = w.detach().clone()
    mode, eng.sync_mode = eng.sync_mode, "restart"
    try:
        with torch.no_grad():
            w.mul_(torch.linspace(0.5, 1.5, w.numel()))
        eng.sync_weights()
        after = eng.sample([greedy(prompts[0])])[0]["completion_ids"]
        assert after != before and common_prefix(after, hf_greedy(eng, prompts[0])) >= 8
    finally:
        with torch.no_grad():
            w.copy_(orig)
        eng.sync_weights()
        eng.sync_mode = mode
    assert eng.sample([greedy(prompts[0])])[0]["completion_ids"] == before
