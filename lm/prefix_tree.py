"""
The fast path of phase A's forward: a micro-batch's shared prompt tokens run once.

rs_sft.py's reference path runs every kept sequence whole: `model(ids).logits`. But kept
sequences repeat their prompts: the kept samples of one task carry the same prompt, and every
prompt of a harness opens with the same instructions and worked examples. Run whole, a step's
forward and backward spend almost all of their tokens on prompts (phase-A study R7: ~330 tokens
a sequence, ~10 of them trained). Here a micro-batch runs as a prefix tree of three levels, each
one forward that attends to the keys and values of the levels above it:
  head   the tokens all sequences start with (one row);
  mids   each distinct prompt's tokens after the head (one row per prompt);
  tails  each sequence's own tokens from its last prompt token on (one row per sequence).
Sharing stops one token before a sequence's first trained token, so the logits that predict
trained tokens all come from the tails. The KV cache between the levels keeps its autograd graph,
so the gradient of every sequence flows back into the shared keys and values.

What it promises rs_sft.py: `logits_and_targets(model, seqs)` returns what rs_sft's reference
path returns for the positions that are trained: the same loss and gradients up to float
round-off (test_whale.py pins the two together). What it leaves out: sharing across micro-batches,
sequences with nothing in common (they run whole, in one forward, as the reference does).

`recomputed_blocks(model)`: a forward inside it keeps only each block's input for the backward,
which runs the block again (activation checkpointing), for a sequence longer than --max-memory's
cap of positions (rs_sft.sft_update: a sequence is never cut, so it runs alone, and its saved
activations set the run's peak). The same values and gradients, to the bit.
"""
import contextlib
import functools
import inspect

import torch
import torch.utils.checkpoint

IGNORE = -100  # label value that cross_entropy skips (rs_sft.IGNORE)


def plan(seqs, share: bool = True):
    """Where the tree cuts: (head, mids, row_mid, free), free[r] = the tokens of sequence r that
    are shared (all but the one that predicts its first label); head None: run each sequence whole."""
    ids, labels = [list(s[0]) for s in seqs], [list(s[1]) for s in seqs]
    free = [max(next((i for i, y in enumerate(lab) if y != IGNORE), len(lab)) - 1, 0) for lab in labels]
    if share and min(free) >= 2:  # (shorter: nothing worth sharing, and no row may be all padding)
        H = 0
        while H < min(free) - 1 and all(x[H] == ids[0][H] for x in ids):  # (keep >= 1 token per mid)
            H += 1
        prompts = sorted({tuple(x[H:f]) for x, f in zip(ids, free)})
        if H or len(prompts) < len(ids):
            index = {p: k for k, p in enumerate(prompts)}
            return ids[0][:H], [list(p) for p in prompts], [index[tuple(x[H:f])] for x, f in zip(ids, free)], free
    return None, [], list(range(len(ids))), [0] * len(ids)


def tokens_run(seqs, share: bool = True) -> int:
    """The positions the forward runs (the sequences' tokens, fewer where prompts are shared)."""
    head, mids, _, free = plan(seqs, share)
    return len(head or []) + sum(map(len, mids)) + sum(len(s[0]) - f for s, f in zip(seqs, free))


def pack(seqs, pad_id: int = 0, share: bool = True) -> dict:
    """One micro-batch of (ids, labels, ...) sequences as the tensors `logits` runs: head [1, H],
    mid_ids/mid_mask [P, M] (right-padded; P = 0 without mids), row_mid [S] (each sequence's mid,
    None: no tree), tail_ids/tail_mask/tail_pos [S, T], columns [K] (the tail positions some row
    trains), targets [S, K] (the token each of those positions predicts, IGNORE where that row
    trains none) and tokens (real positions run)."""
    ids, labels = [list(s[0]) for s in seqs], [list(s[1]) for s in seqs]
    head, mids, row_mid, free = plan(seqs, share)
    tree = head is not None
    tails = [x[f:] for x, f in zip(ids, free)]
    T, M = max(map(len, tails)), max(map(len, mids), default=0)

    def right_padded(lists, width, fill):
        return torch.tensor([x + [fill] * (width - len(x)) for x in lists], dtype=torch.long).view(len(lists), width)
    head = head or []
    targets = right_padded([lab[f + 1:] for lab, f in zip(labels, free)], T, IGNORE)
    # the tail positions some row trains: only they get logits (a tail also runs tool output, padding)
    columns = (targets != IGNORE).any(0).nonzero().view(-1)
    columns = columns if len(columns) else torch.tensor([T - 1])  # (nothing trained: one column, no label)
    return {"head": torch.tensor([head], dtype=torch.long).view(1, len(head)),
            "mid_ids": right_padded(mids, M, pad_id), "mid_mask": right_padded([[1] * len(m) for m in mids], M, 0),
            "row_mid": torch.tensor(row_mid, dtype=torch.long) if tree else None,
            "tail_ids": right_padded(tails, T, pad_id), "tail_mask": right_padded([[1] * len(t) for t in tails], T, 0),
            "tail_pos": torch.tensor(free).unsqueeze(1) + torch.arange(T),
            "targets": targets[:, columns], "columns": columns,
            "tokens": len(head) + sum(map(len, mids)) + sum(map(len, tails))}


def forward(model, batch: dict):
    """The logits [S, K, vocab] of a `pack`ed micro-batch's tails at its trained columns: logits[r, k]
    predicts batch["targets"][r, k]. Positions nothing trains get no logits (logits_to_keep): a tail
    also runs the tool output between a sequence's replies, and a position's logits, their
    log-softmax and their gradient are 3 x 49,152 floats for the 135M model, more than its blocks keep.
    `model` may be the DDP wrapper: the head and mids run through the
    module inside it and only the tails through the wrapper, because DDP expects one forward per
    backward (the gradient from all three still reaches every parameter in that backward)."""
    from transformers import DynamicCache

    from lm.engine import cache_arg
    core = getattr(model, "module", model)
    dev = next(core.parameters()).device
    b = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()}
    # (a model whose forward takes no logits_to_keep, e.g. a test's stand-in: all its logits, then the columns)
    keep = {"logits_to_keep": b["columns"]} if "logits_to_keep" in inspect.signature(core.forward).parameters else {}
    pick = (lambda x: x) if keep else (lambda x: x[:, b["columns"]])
    if b["row_mid"] is None:  # nothing shared: the plain forward
        return pick(model(input_ids=b["tail_ids"], attention_mask=b["tail_mask"], **keep).logits)
    cache, kw = DynamicCache(config=core.config), cache_arg(core)  # the levels hand their keys and values down
    (P, M), H = b["mid_ids"].shape, b["head"].shape[1]
    # the head and mids only fill the cache: logits_to_keep=1 spares their logits (positions x vocabulary
    # floats each, e.g. 4 x 400 x 49,152: 315 MB for a micro-batch's mids, thrown away at once)
    one = {"logits_to_keep": 1} if keep else {}
    if H:
        core(input_ids=b["head"], use_cache=True, **one, **{kw: cache})
        cache.batch_select_indices(torch.zeros(P, dtype=torch.long, device=dev))  # the head, once per mid
    mask = torch.cat([b["mid_mask"].new_ones((P, H)), b["mid_mask"]], 1)
    core(input_ids=b["mid_ids"], attention_mask=mask, position_ids=H + torch.arange(M, device=dev).expand(P, M),
         use_cache=True, **one, **{kw: cache})
    cache.batch_select_indices(b["row_mid"])  # each mid's keys and values to its sequences
    # (a mid's right padding is a masked gap between it and its tails; positions continue from its end)
    return pick(model(input_ids=b["tail_ids"], attention_mask=torch.cat([mask[b["row_mid"]], b["tail_mask"]], 1),
                      position_ids=b["tail_pos"], **keep, **{kw: cache}).logits)


def logits_and_targets(model, seqs, pad_id: int = 0):
    """rs_sft.logits_and_targets through the prefix tree: (logits [S, K, vocab], targets [S, K]),
    row r being seqs[r]; the same trained positions, fewer positions run and fewer logits."""
    batch = pack(seqs, pad_id, share=True)
    return forward(model, batch), batch["targets"]


@contextlib.contextmanager
def recomputed_blocks(model):
    """Inside: every decoder block of `model` (model.model.layers) saves only its input for the
    backward, which runs the block again from it, so a training forward holds each block's input
    (2.3 KB a position for the 135M model) instead of all it computed (~1.7 MB a position over its 30
    blocks at full fine-tuning: `python tools/bench.py --only update`). The recompute is the same
    arithmetic on the same inputs: the same values and gradients to the bit (tested), for one more
    forward of the blocks in the backward. Not transformers' own
    (gradient_checkpointing_enable): that one turns the KV cache off, and the tree's levels hand
    their keys and values down through it. Here the cache stays: a block run again in the backward
    is handed the keys and values its first run got from the cache, and appends nothing to it
    (_replayed_cache). A model without model.model.layers runs as it is."""
    core = getattr(model, "module", model)  # (the DDP wrapper's model)
    blocks = list(getattr(getattr(core, "model", None), "layers", None) or [])
    for block in blocks:
        block.forward = functools.partial(_recomputed_block, block)  # (an instance attribute: nn.Module calls it)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


def _recomputed_block(block, hidden_states, *args, **kwargs):
    """One block's forward under torch's activation checkpointing (non-reentrant: its inputs may be
    keyword arguments and non-tensors, such as the cache)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    first = {}  # what this call's first run took from the cache, for its run again in the backward

    def run(h, *a, **kw):
        with _replayed_cache(cache, first):
            return type(block).forward(block, h, *a, **kw)
    return torch.utils.checkpoint.checkpoint(run, hidden_states, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def _replayed_cache(cache, first):
    """The cache's update inside one block run: the first run appends as always and notes the keys
    and values that were there before; the run again in the backward gets the same concatenation
    (the same torch.cat of the same tensors) and leaves the cache as the forward left it."""
    if cache is None:
        yield
        return
    if not hasattr(cache, "layers"):  # (an older transformers' cache: no per-layer keys to note)
        raise RuntimeError("prefix_tree.recomputed_blocks needs a transformers Cache with .layers")
    plain = cache.update

    def update(keys, values, layer_idx, *args, **kwargs):
        if "keys" in first:  # the backward's recompute
            k, v = first["keys"], first["values"]
            return (keys, values) if k is None else (torch.cat([k, keys], dim=-2), torch.cat([v, values], dim=-2))
        layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
        held = layer is not None and getattr(layer, "is_initialized", False)
        first["keys"], first["values"] = (layer.keys, layer.values) if held else (None, None)
        return plain(keys, values, layer_idx, *args, **kwargs)
    cache.update = update
    try:
        yield
    finally:
        del cache.update
