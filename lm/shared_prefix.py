"""
Decode attention over a prompt cache that the samples of one prompt share.

WHALE samples G rollouts (8) of every task, so a batch holds each prompt G times. A plain
batched KV cache stores that prompt's keys and values once per sample and reads every copy at
every decode step: for a long-context harness (prompts of 1,000-2,000 tokens) those copies are
most of the sampler's memory (a chunk's cache is capped at 2^17 positions, 6 GB for the 135M
model) and, as the context grows, most of a decode step's time (reading the cache is memory
bound; the weights' matmuls are not). Here each distinct prompt's cache is kept ONCE (the
prefix: [prompts, kv_heads, prompt_len, head_dim], left-padded as the engine prefilled it) and
each row keeps only the tokens it generated itself (the suffix: [rows, kv_heads, new, head_dim],
all rows of a chunk start decoding together, so the suffix has no padding). A decode step's
attention is computed in two parts and merged exactly (the log-sum-exp merge of two softmax
blocks, as flash attention does between its tiles):
  - prefix: the queries of all of a prompt's rows (and of the query heads that share a kv head,
    grouped-query attention) go through ONE matmul with that prompt's keys: one read of the
    prompt's cache per step, not G;
  - suffix: each row against its own generated tokens;
  - out = (exp(m1 - m) o1 + exp(m2 - m) o2) / (exp(m1 - m) l1 + exp(m2 - m) l2), with m_i the
    block maxima, l_i the softmax denominators and o_i the unnormalised outputs.
The result equals full attention over the concatenated cache up to float round-off (summation
order), so a sampled token can differ only where two logits tie to ~1e-6.

Used by engine.HFEngine's fast sampler for decode only: prefill runs the model's own attention
(sdpa), then the prompt cache is handed over here (`SharedPrefix`), and the model's attention
implementation is switched to this one for the decode loop only (`decoding`), so that training
and any other forward never see it. Supported: models whose attention layers are plain causal
grouped-query (or multi-head) attention with one query per row in decode: llama (SmolLM2) and
qwen2, the two architectures tested here (`supported`); anything else (sliding windows,
soft-capping, alibi, other cache layouts) keeps the engine's full per-row cache.

Left out: prefill through the shared prefix (a multi-turn harness's later prompts are distinct,
so each is its own prefix; their common head is shared at prefill by the engine already), paged
or block-sparse layouts, more than one query position per row (speculative decoding), and GPU
kernels (on a GPU, vLLM's prefix caching does this and more).
"""
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

NAME = "whale_shared_prefix"
ARCHITECTURES = ("llama", "qwen2")  # tested here: SmolLM2 (llama) and a built Qwen2


def supported(model) -> bool:
    """True when every attention layer is one this module computes exactly (see the docstring)."""
    if getattr(model.config, "model_type", None) not in ARCHITECTURES:
        return False
    layers = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "layer_idx")]
    return bool(layers) and all(getattr(m, "sliding_window", None) is None for m in layers) \
        and model.config._attn_implementation in ("sdpa", "eager")


class SharedPrefix:
    """The decode state beside the suffix cache: each layer's prompt keys/values (views of the
    prefill cache, [P, kv_heads, Lp, d]), which prompt positions are padding, and which prompt
    each row of the batch samples from (`row_prompt`)."""

    def __init__(self, prefill_cache, prompt_mask, row_prompt):
        self.keys = [layer.keys for layer in prefill_cache.layers]
        self.values = [layer.values for layer in prefill_cache.layers]
        self.pad = (prompt_mask == 0)[:, None, None, :]  # [P, 1, 1, Lp], True where left padding
        self.set_rows(row_prompt)

    def set_rows(self, row_prompt):
        """row -> prompt index. The rows of a prompt become the G slots of a [P, G] grid (G: the
        most rows any prompt has), so that one matmul per prompt serves all of its rows."""
        self.row_prompt = row_prompt
        counts = torch.bincount(row_prompt, minlength=self.pad.shape[0])
        self.G = max(int(counts.max()), 1)
        order = torch.argsort(row_prompt, stable=True)
        start = torch.cumsum(counts, 0) - counts  # first position of each prompt in `order`
        within = torch.empty_like(row_prompt)
        within[order] = torch.arange(len(row_prompt), device=row_prompt.device) - start[row_prompt[order]]
        self.slot = row_prompt * self.G + within

    def keep_rows(self, rows):
        """After rows finished: keep `rows` (ascending), and drop the prompts none of them samples
        from any more (a copy of the surviving prompts' cache, smaller than what it frees). Layer by
        layer, each old one freed before the next is copied: copying all layers first held both
        caches at once (a long harness's 64 prompts: 2.5 GB more at the first compaction)."""
        row_prompt = self.row_prompt[rows]
        live = torch.unique(row_prompt)
        if len(live) < self.pad.shape[0]:
            for i in range(len(self.keys)):
                self.keys[i], self.values[i] = self.keys[i][live], self.values[i][live]
            self.pad = self.pad[live]
            row_prompt = torch.searchsorted(live, row_prompt)
        self.set_rows(row_prompt)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, shared_prefix=None, **kwargs):
    """One decode step: query [R, H, 1, d]; key/value: this layer's suffix cache [R, KVH, S, d]
    (the rows' own tokens, the current one included). Returns ([R, 1, H, d], None) as
    transformers' attention functions do. `attention_mask` is ignored: the prefix padding is in
    shared_prefix.pad and the suffix has none."""
    sp = shared_prefix
    R, H, q_len, d = query.shape
    assert sp is not None and q_len == 1, "shared-prefix attention is for decode steps (engine.HFEngine)"
    kvh = key.shape[1]
    rep, P, G = H // kvh, sp.pad.shape[0], sp.G
    q = query[:, :, 0] * (scaling if scaling is not None else d ** -0.5)  # [R, H, d]

    def merge_stats(s, v):  # softmax block statistics: max, denominator, unnormalised output
        s = s.float()  # (in fp32 also under bf16, as flash attention keeps them; a no-op on the CPU)
        m = s.amax(-1, keepdim=True)
        e = torch.exp(s - m)
        return m, e.sum(-1, keepdim=True), (e.to(v.dtype) @ v).float()

    # 1) the prompts: each prompt's G rows x rep query heads per kv head in one matmul
    grid = q.new_zeros((P * G, H, d))
    grid[sp.slot] = q
    grid = grid.view(P, G, kvh, rep, d).permute(0, 2, 1, 3, 4).reshape(P, kvh, G * rep, d)
    s1 = (grid @ sp.keys[module.layer_idx].transpose(-1, -2)).masked_fill(sp.pad, float("-inf"))
    back = lambda t: t.view(P, kvh, G, rep, -1).permute(0, 2, 1, 3, 4).reshape(P * G, H, -1)[sp.slot]
    m1, l1, o1 = (back(t) for t in merge_stats(s1, sp.values[module.layer_idx]))
    # 2) each row's own tokens
    s2 = q.view(R, kvh, rep, d) @ key.transpose(-1, -2)  # [R, kvh, rep, S]
    m2, l2, o2 = (t.reshape(R, H, -1) for t in merge_stats(s2, value))
    # 3) the two blocks as one softmax
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    out = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)
    return out.unsqueeze(1).to(query.dtype), None


AttentionInterface.register(NAME, attention)


@contextmanager
def decoding(model):
    """The model's attention is this module's inside the block (decode forwards, which must pass
    shared_prefix=...), its own (sdpa) again after, also on an exception."""
    saved = model.config._attn_implementation
    model.config._attn_implementation = NAME
    try:
        yield
    finally:
        model.config._attn_implementation = saved
