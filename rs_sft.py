"""
Phase A: online rejection-sampling fine-tuning (RSFT), in plain PyTorch.

One rollout step, as in the paper:
  1. take the next B prompts of the weight pool (a persistent loader: no prompt
     is seen twice within an epoch);
  2. roll each out G times under the CURRENT harness (rollout.py, the sandbox);
  3. keep a rollout iff the verifier says it succeeded;
  4. one epoch of supervised fine-tuning on the kept rollouts: token NLL on the
     tokens the model itself wrote. Every llm() call of a multi-call trajectory
     contributes its completion; the prompt, tool output and padding are masked;
  5. the sampler sees the new weights (HF engine: same module; vLLM: sync).

Two knobs reuse the kept set, as ReST's improve step: `replay_steps=R` trains on a
buffer of the last R steps' kept sequences (R=1: this step's only) and
`sft_epochs=E` makes E passes over it. Each step also reports a cheap health figure
of its update (see health_warnings): the share of replies cut by the token cap and
the NLL of (a sample of) the kept sequences before and after the update.

What is left out compared with PPO/GRPO, and why: there is no KL penalty, no
importance ratio or clipping and no value head. RSFT only imitates its own
verified successes, so it never pushes probability away from anything and
needs no trust region: each update is plain maximum likelihood on on-policy
samples that were already likely under the current model. The price is that
failures teach nothing (an all-rejected step does no update) — which is exactly
why a better harness, which turns more rollouts into successes, helps it.

CPU affordance: `train_layers=K` trains only the top K transformer blocks and
the final norm; the blocks below run without autograd, so a step costs about
one forward plus K/L of a backward. And whatever K, the prompt tokens that a
micro-batch's kept sequences have in common run once (`pack`: the kept samples
of one task share their whole prompt, all of a harness's prompts share their
instructions), for the same loss and gradient up to float round-off.

Data parallel (`torchrun --nproc_per_node N whale.py ...`): each rank rolls out
its slice of the prompt batch, the records are gathered so that every rank holds
the same global kept set in the same order, and each minibatch is split across
ranks with gradients all-reduced by DistributedDataParallel. The loss
trajectory is that of one process with the same global batch (up to float
round-off): same minibatches, same normaliser, same clipped gradient.
"""
import contextlib
import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import rollout
from rundir.run_dir import crash_point

IGNORE = -100  # label value that cross_entropy skips


# -----------------------------------------------------------------------------
# the persistent prompt loader (its state is a small dict, saved with the run)

def new_loader(pool_size: int, seed: int) -> dict:
    return {"pool_size": pool_size, "seed": seed, "epoch": 0, "pos": 0}


def next_batch(loader: dict, batch: int) -> list[int]:
    """The next `batch` pool indices. Each epoch walks a fresh permutation, so no
    prompt repeats within an epoch; a batch that crosses the end of an epoch
    takes the rest from the next one."""
    out = []
    while len(out) < batch:
        perm = list(range(loader["pool_size"]))
        random.Random(loader["seed"] * 1_000_003 + loader["epoch"]).shuffle(perm)
        take = perm[loader["pos"]:loader["pos"] + batch - len(out)]
        out += take
        loader["pos"] += len(take)
        if loader["pos"] >= loader["pool_size"]:
            loader["epoch"], loader["pos"] = loader["epoch"] + 1, 0
    return out


# -----------------------------------------------------------------------------
# from kept rollouts to training sequences

def keep(records, max_per_prompt: int = 0):
    """Successful rollouts; at most max_per_prompt per example (0 = all), so that
    easy prompts solved 8/8 do not dominate the update with near-duplicates."""
    kept, per = [], {}
    for r in records:
        if r["score"] > 0.5 and r["calls"]:
            n = per.get(r["example_id"], 0)
            if max_per_prompt <= 0 or n < max_per_prompt:
                kept.append(r)
                per[r["example_id"]] = n + 1
    return kept


def sequences(record) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) for one trajectory. Labels are the ids of model-written
    tokens and IGNORE elsewhere. When a call's prompt extends the previous
    call's prompt + completion token for token (a multi-turn chat), the two
    become one sequence: the completion of turn 1 is trained in place and the
    tool output between the turns is masked, which is the paper's formulation
    and costs one forward instead of two. Otherwise each call is its own sequence."""
    out, ids, labels = [], [], []
    for c in record["calls"]:
        p, comp = list(c["prompt_ids"]), list(c["completion_ids"])
        if ids and p[:len(ids)] == ids:
            extra = p[len(ids):]
        else:
            if ids:
                out.append((ids, labels))
            ids, labels, extra = [], [], p
        ids = ids + extra + comp
        labels = labels + [IGNORE] * len(extra) + comp
    if ids:
        out.append((ids, labels))
    return out


# -----------------------------------------------------------------------------
# data parallel: the DDP wrapper and the gather (the process group and the state broadcast are run_dir.py's)

def ddp_wrap(model, find_unused: bool = False):
    """The DDP wrapper phase A trains through (None in a single process). Call it
    after set_trainable: DDP all-reduces exactly the parameters that require grad
    at construction (frozen lower blocks are neither synced nor all-reduced).
    Every trainable parameter here (top blocks + final norm, or all of them) is
    used by every forward, so the graph walk of find_unused_parameters is not
    needed; pass find_unused=True for a model whose forward skips some."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev = next(model.parameters()).device
    return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, find_unused_parameters=find_unused)


# -----------------------------------------------------------------------------
# the update

def set_trainable(model, train_layers: int = 0) -> list[torch.nn.Parameter]:
    """All parameters (train_layers=0) or only the top K blocks + final norm.
    Frozen parameters get requires_grad=False, so autograd builds no graph below
    the first trainable block."""
    if train_layers <= 0:
        for p in model.parameters():
            p.requires_grad_(True)
        return list(model.parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    blocks = model.model.layers
    trainable = list(blocks[len(blocks) - train_layers:].parameters()) + list(model.model.norm.parameters())
    for p in trainable:
        p.requires_grad_(True)
    return trainable


def make_optimizer(params, lr: float, weight_decay: float = 0.0):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)


@dataclass(frozen=True)
class Config:
    """Phase A's settings, one object (whale.py builds it from the command line once)."""
    batch: int = 16               # B: prompts per rollout step
    group: int = 8                # G: rollouts per prompt
    max_tokens: int = 256         # cap on new tokens per llm() call
    max_kept_per_prompt: int = 2  # kept rollouts per prompt (0 = all), see keep()
    minibatch: int = 16           # sequences per optimizer step
    micro_batch: int = 4          # sequences per forward/backward (gradient accumulation)
    clip: float = 1.0             # gradient-norm clip
    max_len: int = 1024           # tokens of a sequence that are trained (the rest is cut)
    replay_steps: int = 1         # R: train on the kept sequences of the last R steps (1 = this step's only)
    sft_epochs: int = 1           # E: passes over those sequences per step
    health_seqs: int = 4          # kept sequences the health figure scores (an even sample), see kept_nll
    share_prompts: bool = True    # run a micro-batch's shared prompt tokens once (pack); False: each sequence whole


def pack(seqs, pad_id: int = 0, share: bool = True) -> dict:
    """One micro-batch of (ids, labels) pairs as the tensors `forward` runs.

    Kept sequences repeat their prompts: the kept samples of one task carry the same prompt, and
    every prompt of a harness opens with the same instructions and worked examples. Run whole, a
    step's forward and backward spend almost all of their tokens on prompts (phase-A study R7:
    ~330 tokens a sequence, ~10 of them trained). With share=True a micro-batch runs as a prefix
    tree of three levels, each one forward that attends to the keys and values of the levels
    above it:
      head   the tokens all sequences start with (one row);
      mids   each distinct prompt's tokens after the head (one row per prompt);
      tails  each sequence's own tokens from its last prompt token on (one row per sequence).
    Sharing stops one token before a sequence's first trained token, so the logits that predict
    trained tokens all come from the tails. The KV cache between the levels keeps its autograd
    graph, so the gradient of every sequence flows back into the shared keys and values: the
    same loss and gradient as the whole sequences, up to float round-off (tested). share=False
    (or a micro-batch with nothing to share) runs each sequence whole in one forward.

    Returns head [1, H], mid_ids/mid_mask [P, M] (right-padded; P = 0 without mids), row_mid [S]
    (each sequence's mid), tail_ids/tail_mask/tail_pos [S, T], targets [S, T] (the token each
    tail position predicts, IGNORE where nothing is trained) and tokens (real positions run)."""
    ids = [list(x) for x, _ in seqs]
    labels = [list(y) for _, y in seqs]
    # a sequence may share its first `free` tokens: all but the one that predicts its first label
    free = [max(next((i for i, y in enumerate(lab) if y != IGNORE), len(lab)) - 1, 0) for lab in labels]
    head = mids = None
    if share and min(free) >= 2:  # (shorter: nothing worth sharing, and no row may be all padding)
        H = 0
        while H < min(free) - 1 and all(x[H] == ids[0][H] for x in ids):  # (keep >= 1 token per mid)
            H += 1
        prompts = sorted({tuple(x[H:f]) for x, f in zip(ids, free)})
        if H or len(prompts) < len(ids):
            head, mids = ids[0][:H], [list(p) for p in prompts]
            index = {p: k for k, p in enumerate(prompts)}
            row_mid = [index[tuple(x[H:f])] for x, f in zip(ids, free)]
    if head is None:  # whole sequences: one forward, no prefix
        head, mids, row_mid, free = [], [], list(range(len(ids))), [0] * len(ids)
    tails = [x[f:] for x, f in zip(ids, free)]
    T, M = max(map(len, tails)), max(map(len, mids), default=0)

    def right_padded(lists, width, fill):
        return torch.tensor([x + [fill] * (width - len(x)) for x in lists], dtype=torch.long).view(len(lists), width)
    return {"head": torch.tensor([head], dtype=torch.long).view(1, len(head)),
            "mid_ids": right_padded(mids, M, pad_id), "mid_mask": right_padded([[1] * len(m) for m in mids], M, 0),
            "row_mid": torch.tensor(row_mid, dtype=torch.long) if mids else None,
            "tail_ids": right_padded(tails, T, pad_id), "tail_mask": right_padded([[1] * len(t) for t in tails], T, 0),
            "tail_pos": torch.tensor(free).unsqueeze(1) + torch.arange(T),
            "targets": right_padded([lab[f + 1:] for lab, f in zip(labels, free)], T, IGNORE),
            "tokens": len(head) + sum(map(len, mids)) + sum(map(len, tails))}


def forward(model, batch: dict):
    """The logits [S, T, vocab] of a `pack`ed micro-batch's tails: logits[r, t] predicts
    batch["targets"][r, t]. `model` may be the DDP wrapper: the head and mids run through the
    module inside it and only the tails through the wrapper, because DDP expects one forward per
    backward (the gradient from all three still reaches every parameter in that backward)."""
    from transformers import DynamicCache

    from lm.engine import cache_arg
    core = getattr(model, "module", model)
    dev = next(core.parameters()).device
    b = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()}
    if b["row_mid"] is None:  # nothing shared: the plain forward
        return model(input_ids=b["tail_ids"], attention_mask=b["tail_mask"]).logits
    cache, kw = DynamicCache(config=core.config), cache_arg(core)  # the levels hand their keys and values down
    (P, M), H = b["mid_ids"].shape, b["head"].shape[1]
    if H:
        core(input_ids=b["head"], use_cache=True, **{kw: cache})
        cache.batch_select_indices(torch.zeros(P, dtype=torch.long, device=dev))  # the head, once per mid
    mask = torch.cat([b["mid_mask"].new_ones((P, H)), b["mid_mask"]], 1)
    core(input_ids=b["mid_ids"], attention_mask=mask, position_ids=H + torch.arange(M, device=dev).expand(P, M),
         use_cache=True, **{kw: cache})
    cache.batch_select_indices(b["row_mid"])  # each mid's keys and values to its sequences
    # (a mid's right padding is a masked gap between it and its tails; positions continue from its end)
    return model(input_ids=b["tail_ids"], attention_mask=torch.cat([mask[b["row_mid"]], b["tail_mask"]], 1),
                 position_ids=b["tail_pos"], **{kw: cache}).logits


def token_nll(model, batch: dict):
    """THE LOSS of phase A, on one micro-batch (`pack`): the summed negative log-likelihood of the
    labelled tokens (those the model itself wrote); the prompt, tool output and padding are
    IGNORE. `model` is whatever runs the forward (the DDP wrapper under torchrun). A sum, not a
    mean: sft_update divides by the label count of the whole minibatch, so that micro-batches
    and ranks add up to one mean. To try another objective (a token weighting, an extra term),
    change this function or pass sft_update another loss_fn with the same signature; nothing
    else in the update needs to know."""
    logits = forward(model, batch)
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten().to(logits.device),
                           ignore_index=IGNORE, reduction="sum")


def sft_update(model, optimizer, seqs, cfg: Config = Config(), *, pad_id: int = 0, seed: int = 0, ddp_model=None,
               loss_fn=token_nll) -> dict:
    """cfg.sft_epochs epochs over `seqs`, each in freshly shuffled minibatches of
    cfg.minibatch sequences; each minibatch is one optimizer step, accumulated over
    micro-batches of cfg.micro_batch sequences. The loss is loss_fn (token_nll: the
    mean NLL per labelled token of the minibatch). Returns loss (over all epochs), mean
    pre-clip gradient norm, steps, tokens (the sequences' tokens; forward_tokens: the positions
    the forwards ran, fewer when prompts are shared), trained_tokens (labels trained, epochs x
    seqs) and speed (tokens_per_s: the sequences' tokens a second).

    Data parallel (ddp_model = ddp_wrap(model)): every rank passes the same GLOBAL
    `seqs` and `seed`, so all ranks cut the same minibatches; each rank then
    trains on its slice mb[rank::world] of every minibatch. Returned numbers are global."""
    if not seqs:
        return {"loss": None, "opt_steps": 0, "tokens": 0, "forward_tokens": 0, "trained_tokens": 0, "seconds": 0.0,
                "skipped": True}
    rank, world = 0, 1
    if ddp_model is not None:
        import torch.distributed as dist
        rank, world = dist.get_rank(), dist.get_world_size()
    fwd = ddp_model or model
    dev = next(model.parameters()).device
    model.train()
    rng = random.Random(seed)  # one generator for all epochs: epoch 0 is shuffled as a single epoch always was
    batches = []
    for _ in range(cfg.sft_epochs):
        order = list(range(len(seqs)))
        rng.shuffle(order)
        batches += [order[m:m + cfg.minibatch] for m in range(0, len(order), cfg.minibatch)]
    t0, total_nll, total_lab, tokens, run_tokens, steps, norms = time.time(), 0.0, 0, 0, 0, 0, []
    for batch in batches:
        mb = [seqs[i] for i in batch]
        # the normaliser is the label count of the WHOLE minibatch (every rank knows it)
        n_lab = sum(sum(l != IGNORE for l in lab[1:cfg.max_len]) for _, lab in mb)
        mine = [(x[:cfg.max_len], y[:cfg.max_len]) for x, y in mb[rank::world]]
        if cfg.share_prompts:  # the same prompts next to each other, so that they share a micro-batch
            mine.sort(key=lambda s: s[0])  # (the order within a minibatch changes nothing but round-off)
        chunks = [mine[s:s + cfg.micro_batch] for s in range(0, len(mine), cfg.micro_batch)]
        # DDP all-reduces in the backward of a forward made outside no_sync(), and every
        # rank must join that all-reduce: a rank whose slice is empty (a minibatch smaller
        # than the world) runs one sequence without labels, which adds a zero gradient
        chunks = chunks or [[([pad_id, pad_id], [IGNORE, IGNORE])]]
        optimizer.zero_grad(set_to_none=True)
        for c, chunk in enumerate(chunks):
            packed = pack(chunk, pad_id, cfg.share_prompts)
            # micro-batches accumulate locally; only the last one of a rank syncs gradients
            last = ddp_model is None or c == len(chunks) - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                loss = loss_fn(fwd, packed)
                # DDP AVERAGES gradients over ranks; scaling by world turns that average into
                # the sum over the whole minibatch, so the step's gradient is exactly one
                # process's sum(loss) / n_lab on the same minibatch (and so is the clip below)
                (loss * (world / max(n_lab, 1))).backward()
            total_nll += loss.item()
            if mine:
                tokens += sum(len(x) for x, _ in chunk)
                run_tokens += packed["tokens"]
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                          cfg.clip)))
        optimizer.step()
        crash_point("sft")
        total_lab += n_lab
        steps += 1
    if world > 1:  # each rank summed the loss and tokens of its own slices
        import torch.distributed as dist
        tot = torch.tensor([total_nll, float(tokens), float(run_tokens)], dtype=torch.float64, device=dev)
        dist.all_reduce(tot)
        total_nll, tokens, run_tokens = float(tot[0]), int(tot[1]), int(tot[2])
    model.eval()
    secs = time.time() - t0
    return {"loss": total_nll / max(total_lab, 1), "opt_steps": steps, "tokens": tokens, "forward_tokens": run_tokens,
            "trained_tokens": total_lab, "seconds": secs, "tokens_per_s": tokens / max(secs, 1e-9),
            "grad_norm": sum(norms) / len(norms), "skipped": False}


# -----------------------------------------------------------------------------
# the health figure of an update: is the step too large?

def kept_nll(model, seqs, cfg: Config, *, pad_id: int = 0, shard=(0, 1)):
    """Mean NLL per labelled token of `seqs` under the model as it is (None without labels):
    the kept set's likelihood, measured before and after the update. Cost: one no-grad forward
    over `seqs`, micro-batched as training is. rollout_step scores an even sample of at most
    cfg.health_seqs (4) of the step's kept sequences, so a step pays two forwards of <= 4
    sequences: about what prefilling 8 of its prompts costs, whatever the number kept (measured on
    2 kept sequences: health_seconds about 1.4x sft_seconds at --train-layers 1, a tiny run).
    Under torchrun each rank scores its slice, then the sums add up."""
    rank, world = shard
    total, count, dev = 0.0, 0, next(model.parameters()).device
    mine = seqs[rank::world]
    with torch.no_grad():
        for s in range(0, len(mine), cfg.micro_batch):
            packed = pack([(x[:cfg.max_len], y[:cfg.max_len]) for x, y in mine[s:s + cfg.micro_batch]], pad_id,
                          cfg.share_prompts)
            total += float(token_nll(model, packed))
            count += int((packed["targets"] != IGNORE).sum())
    if world > 1:
        import torch.distributed as dist
        tot = torch.tensor([total, float(count)], dtype=torch.float64, device=dev)
        dist.all_reduce(tot)
        total, count = float(tot[0]), int(tot[1])
    return total / count if count else None


CAPPED_JUMP = 0.25  # a step whose capped share is this far above the run's mean so far is a warning


def health_warnings(m: dict, earlier_capped: list[float]) -> list[str]:
    """What looks like a collapse in one step's metrics, as sentences (empty: healthy).
    (a) Many more replies hit the token cap than in the run's earlier steps: the model has
    started to ramble or repeat. (b) The update made its own training data LESS likely
    (kept_nll_after > kept_nll_before): plain maximum likelihood should do the opposite, so the
    step overshot. Both point at a learning rate that is too large for this model."""
    out = []
    if earlier_capped and m["capped_frac"] > sum(earlier_capped) / len(earlier_capped) + CAPPED_JUMP:
        out.append(f"{m['capped_frac']:.0%} of replies hit the token cap, against "
                   f"{sum(earlier_capped) / len(earlier_capped):.0%} in the earlier steps")
    before, after = m.get("kept_nll_before"), m.get("kept_nll_after")
    if before is not None and after is not None and after > before:
        out.append(f"the update raised the kept set's NLL from {before:.3f} to {after:.3f} per token")
    return out


def step_line(m: dict, step: int, cycle: int) -> str:
    """The console line of one RSFT step: what it had to learn from up front, then how the
    update went (metrics.jsonl keeps every field)."""
    before, after = m["kept_nll_before"], m["kept_nll_after"]
    nll = "-" if before is None or after is None else f"{before:.2f}->{after:.2f}"  # (nothing kept: -)
    loss = "-" if m["loss"] is None else f"{m['loss']:.3f}"
    return (f"step {step} (cycle {cycle}): reward {m['train_reward']:.3f} kept {m['kept']}/{m['rollouts']} "
            f"trained_tokens {m['trained_tokens']} loss {loss} capped {m['capped_frac']:.0%} nll {nll} "
            f"{m['rollout_seconds'] + m['sft_seconds'] + m['health_seconds']:.0f} s")


# -----------------------------------------------------------------------------
# one rollout step = rollouts + filter + update + sync

def rollout_step(engine, domain, harness: str, pool: list[dict], loader: dict, optimizer, cfg: Config, *, seed,
                 sampling: dict, ddp_model=None, shard=(0, 1), progress=None, replay: list | None = None) -> dict:
    """Phase A's unit of work: cfg.batch prompts x cfg.group rollouts, then the update. Returns
    the step's metrics (and nothing else: the model and optimizer are updated in place, the
    loader advances).
    replay: the kept sequences of the earlier steps that cfg.replay_steps still trains on, one
    list per step, oldest first; this step's are appended and the oldest dropped, in place
    (the caller saves it with the run, so a resumed run trains on the same buffer).
    shard=(rank, world): under torchrun each rank rolls out its slice of the batch
    and passes ddp_model; the metrics returned are global, the same on every rank."""
    idx = next_batch(loader, cfg.batch)
    rank, world = shard
    examples = [pool[i] for i in idx][rank::world]
    t0 = time.time()
    records = rollout.run(engine, domain, harness, examples, cfg.group, seed=seed, sampling=sampling,
                          max_tokens=cfg.max_tokens, progress=progress)
    if world > 1:
        records = gather_records(records, rank, world, cfg.group)
        if progress is not None:  # the bar has counted this rank's rollouts; add the others'
            progress.update(len(records) - len(examples) * cfg.group)
    t_roll = time.time() - t0
    kept = keep(records, cfg.max_kept_per_prompt)
    seqs = [s for r in kept for s in sequences(r)]
    replay = [] if replay is None else replay
    train = [s for earlier in replay for s in earlier] + seqs  # the buffer: R-1 earlier steps' and this one's
    probe = seqs[::max(1, math.ceil(len(seqs) / cfg.health_seqs))]  # the health figure's sample: <= health_seqs
    t_health = time.time()
    nll_before = kept_nll(engine.model, probe, cfg, pad_id=engine.pad_id, shard=shard)
    t_health = time.time() - t_health
    upd = sft_update(engine.model, optimizer, train, cfg, pad_id=engine.pad_id, seed=rollout.stable_seed(seed, "sft"),
                     ddp_model=ddp_model)
    if not upd["skipped"]:
        engine.sync_weights()
    t0 = time.time()
    nll_after = nll_before if upd["skipped"] else kept_nll(engine.model, probe, cfg, pad_id=engine.pad_id, shard=shard)
    t_health += time.time() - t0
    replay.append(seqs)
    del replay[:max(len(replay) - (cfg.replay_steps - 1), 0)]  # keep what the next step still trains on
    calls = [c for r in records for c in r["calls"]]
    reward = sum(r["score"] for r in records) / max(len(records), 1)
    return {"prompts": len(idx), "rollouts": len(records), "train_reward": reward,
            "kept": len(kept), "kept_frac": len(kept) / max(len(records), 1), "sequences": len(seqs),
            "replay_sequences": len(train),
            "capped_frac": sum(c.get("finish") == "length" for c in calls) / max(len(calls), 1),
            "kept_nll_before": nll_before, "kept_nll_after": nll_after, "health_seconds": t_health,
            "loss": upd["loss"], "grad_norm": upd.get("grad_norm"), "opt_steps": upd["opt_steps"],
            "skipped_update": upd["skipped"],
            "sft_tokens": upd["tokens"], "sft_forward_tokens": upd.get("forward_tokens", 0),
            "trained_tokens": upd["trained_tokens"],
            "sft_tokens_per_s": upd.get("tokens_per_s"),
            "sft_seconds": upd["seconds"], "rollout_seconds": t_roll, "epoch": loader["epoch"],
            **{k: v for k, v in rollout.totals(records).items() if k != "rollouts"}}


def gather_records(records, rank: int, world: int, group: int) -> list[dict]:
    """Every rank's rollout records, on every rank, in the order ONE process would
    have produced them. Rank r rolled out batch positions r, r+world, ...; record
    rid = i*group + j is sample j of its i-th example. Rollout seeds depend only on
    (step seed, example id, j), so the global records equal one process's, and so do
    keep(), the kept sequences, their shuffle into minibatches and the metrics."""
    import torch.distributed as dist
    mine = [((rank + (r["rid"] // group) * world, r["rid"] % group), r) for r in records]
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return [r for _, r in sorted((x for part in parts for x in part), key=lambda x: x[0])]


def sequence_logprob(model, seq) -> float:
    """Sum of log-probabilities of the labelled tokens of one (ids, labels) pair."""
    with torch.no_grad():
        return -float(token_nll(model, pack([seq], share=False)))


def flops_per_token(model, train_layers: int = 0) -> float:
    """Training FLOPs per token: 6N for full fine-tuning (N = non-embedding params
    + the LM head, which runs every token). With only the top K blocks trainable,
    the frozen part costs a forward (2N_frozen) and the trained part 6N_train;
    the head still needs its backward to reach the blocks (4 for grad-input + 2 fwd)."""
    head = model.lm_head.weight.numel()
    blocks = model.model.layers
    per_block = sum(p.numel() for p in blocks[0].parameters())
    L = len(blocks)
    if train_layers <= 0:
        return 6.0 * (per_block * L + head)
    K = min(train_layers, L)
    return 2.0 * per_block * (L - K) + 6.0 * per_block * K + 4.0 * head


def mfu(model, tokens_per_s: float, peak_flops: float, train_layers: int = 0) -> float:
    return tokens_per_s * flops_per_token(model, train_layers) / peak_flops if peak_flops else math.nan
