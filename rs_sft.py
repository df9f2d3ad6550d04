"""
Phase A: online rejection-sampling fine-tuning (RSFT), in plain PyTorch.

One rollout step, as in the paper (rollout_step, at the bottom):
  1. take the next B prompts of the weight pool (draw_prompts, a persistent loader:
     no prompt is seen twice within an epoch);
  2. roll each out G times under the CURRENT harness (rollout.py, the sandbox);
  3. weigh each rollout (weight: 1 if the verifier says it succeeded, else 0) and
     keep those of weight > 0 (keep);
  4. one epoch of supervised fine-tuning on the kept rollouts (sft_update): token
     NLL of `model(ids).logits` on the tokens the model itself wrote (token_nll).
     Every llm() call of a multi-call trajectory contributes its completion; the
     prompt, tool output and padding are masked;
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

Where to fork it: the objective is Config.loss_fn (token_nll's signature; it may
ask for the frozen starting model, `reference()`, e.g. for a KL term); how much
each rollout teaches is weights(records) (a GRPO-style fork returns advantages over
each example's group, and the loss scales each sequence's tokens by them); the step
itself is rollout_step.

The reference path is what this file reads as: every sequence whole, one
`model(ids).logits`. Two things make it faster and are machinery, opt-in by
settings, each held to the reference by a test:
  --sft-prompts shared (the default): a micro-batch's shared prompt tokens run once
      (lm/prefix_tree.py), the same loss and gradients up to float round-off;
  torchrun: each rank takes its slice of every minibatch (rundir/ddp.py), the same
      loss trajectory as one process with the same global batch.
CPU affordance: `train_layers=K` trains only the top K transformer blocks and
the final norm; the blocks below run without autograd, so a step costs about
one forward plus K/L of a backward.
"""
import contextlib
import functools
import math
import random
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

import rollout
from lm import prefix_tree
from lm.process_tuning import give_freed_memory_back  # (--max-memory only)
from rundir import ddp
from rundir.run_dir import crash_point

IGNORE = -100     # label value that cross_entropy skips
MAX_LEN = 1024    # tokens of a sequence that are trained (the rest is cut)
HEALTH_SEQS = 4   # kept sequences the health figure scores (an even sample), see kept_nll


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
# from rollouts to training sequences

class Sequence(NamedTuple):
    """One training sequence: the token ids, the labels (the id where the model wrote the token,
    IGNORE elsewhere) and the weight its tokens' loss is scaled by (keep/drop: 1; see weights)."""
    ids: list[int]
    labels: list[int]
    weight: float = 1.0


def weights(records) -> list[float]:
    """How much each rollout of a step teaches, one number per record, given all of the step's
    records at once (a fork can use an example's whole group: a GRPO-style advantage is a record's
    score minus the mean of its example_id's scores, over their std). Rejection sampling: a
    verified success 1, anything else 0 (dropped). keep() keeps every rollout whose weight is not
    0, and token_nll scales its tokens by it. Flags that meet a fork here: --max-kept-per-prompt
    (default 4) cuts an example's kept rollouts after weighting (a group fork sets it to 0, so no
    group is cut); a step's "kept" count and its health figure (kept_nll_*) are then over the
    rollouts of weight != 0, negative ones too."""
    return [1.0 if r["score"] > 0.5 else 0.0 for r in records]


def keep(records, max_per_prompt: int = 0) -> list[tuple[dict, float]]:
    """The rollouts phase A trains on, each with its weight (weights()): weight != 0 and at least
    one llm() call; at most max_per_prompt per example (0 = all), so that easy prompts solved 8/8
    do not dominate the update with near-duplicates."""
    kept, per = [], {}
    for r, w in zip(records, weights(records)):
        if w != 0 and r["calls"]:
            n = per.get(r["example_id"], 0)
            if max_per_prompt <= 0 or n < max_per_prompt:
                kept.append((r, w))
                per[r["example_id"]] = n + 1
    return kept


def sequences(record, weight: float = 1.0) -> list[Sequence]:
    """The training sequences of one trajectory, each with the record's weight. When a call's
    prompt extends the previous call's prompt + completion token for token (a multi-turn chat),
    the two become one sequence: the completion of turn 1 is trained in place and the tool output
    between the turns is masked, which is the paper's formulation and costs one forward instead of
    two. Otherwise each call is its own sequence."""
    out, ids, labels, w = [], [], [], weight
    for c in record["calls"]:
        p, comp = list(c["prompt_ids"]), list(c["completion_ids"])
        if ids and p[:len(ids)] == ids:
            extra = p[len(ids):]
        else:
            if ids:
                out.append(Sequence(ids, labels, w))
            ids, labels, extra = [], [], p
        ids = ids + extra + comp
        labels = labels + [IGNORE] * len(extra) + comp
    if ids:
        out.append(Sequence(ids, labels, w))
    return out


# -----------------------------------------------------------------------------
# the loss

def logits_and_targets(model, seqs, pad_id: int = 0):
    """THE REFERENCE FORWARD: the sequences right-padded into one batch, one `model(ids).logits`.
    Returns (logits [S, T, vocab], targets [S, T]): logits[r, t] predicts targets[r, t], the label
    of token t + 1 (IGNORE where nothing is trained or past the sequence's end)."""
    dev = next(getattr(model, "module", model).parameters()).device
    T = max(len(s[0]) for s in seqs)
    ids = torch.tensor([list(s[0]) + [pad_id] * (T - len(s[0])) for s in seqs], dtype=torch.long).view(len(seqs), T)
    mask = torch.tensor([[1] * len(s[0]) + [0] * (T - len(s[0])) for s in seqs], dtype=torch.long).view(len(seqs), T)
    targets = torch.tensor([list(s[1][1:]) + [IGNORE] * (T - len(s[1]) + 1) for s in seqs],
                           dtype=torch.long).view(len(seqs), T)
    return model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits, targets


def token_nll(model, seqs, *, pad_id: int = 0, shared: bool = False, reference=None):
    """THE LOSS of phase A, on one micro-batch of Sequences: the summed negative log-likelihood of
    the labelled tokens (those the model itself wrote), each sequence's scaled by its weight; the
    prompt, tool output and padding are IGNORE. A sum, not a mean: sft_update divides by the
    label count of the whole minibatch, so that micro-batches and ranks add up to one mean.
    shared=True takes the logits from the prefix tree (lm/prefix_tree.py: the same numbers up to
    round-off, fewer positions run). `model` may be the DDP wrapper. To try another objective,
    write a function with this signature and set Config.loss_fn: `reference()` returns the frozen
    starting model (reference_model; loaded on the first call, never if no loss asks), e.g. for a
    KL term; this loss does not ask."""
    logits, targets = (prefix_tree.logits_and_targets if shared else logits_and_targets)(model, seqs, pad_id)
    flat, goal = logits.flatten(0, 1).float(), targets.flatten().to(logits.device)
    scale = [float(s[2]) if len(s) > 2 else 1.0 for s in seqs]  # each sequence's weight
    if all(w == 1.0 for w in scale):  # keep/drop: every kept token counts once
        return F.cross_entropy(flat, goal, ignore_index=IGNORE, reduction="sum")
    nll = F.cross_entropy(flat, goal, ignore_index=IGNORE, reduction="none").view(targets.shape)
    return (nll.sum(1) * torch.tensor(scale, dtype=nll.dtype, device=nll.device)).sum()


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
    """Phase A's settings, one object. whale.phase_a_config builds it from the command line: the
    defaults and their help live in whale.Args alone, and each field here has its Args name."""
    group: int              # G: rollouts per prompt
    max_tokens: int         # cap on new tokens per llm() call
    temperature: float      # the rollouts' sampling (the run's, as in every other rollout)
    top_k: int
    top_p: float
    max_kept_per_prompt: int  # kept rollouts per prompt (0 = all), see keep()
    minibatch: int          # sequences per optimizer step
    micro_batch: int        # sequences per forward/backward (gradient accumulation)
    clip: float             # gradient-norm clip
    replay_steps: int       # R: train on the kept sequences of the last R steps (1 = this step's only)
    sft_epochs: int         # E: passes over those sequences per step
    sft_prompts: str        # "shared": the prefix-tree forward (lm/prefix_tree.py); "whole": the reference
    loss_fn: Callable = token_nll  # the objective: (model, seqs, pad_id=, shared=, reference=) -> summed loss
    base_model: str = ""    # the starting model as --model names it (whale.py sets it): what reference() loads
    max_forward_tokens: int = 0  # positions one training forward may run (0: no cap; --max-memory sets one)


def training_bytes_per_position(model, train_layers: int = 0) -> int:
    """An estimate of what one position of a training forward holds until its backward (--max-memory
    sizes a forward with it): each trained block's saved activations (~12 x hidden + 4 x intermediate
    floats: attention's inputs and outputs, the MLP's three projections) and the logits three times
    (the logits, their log-softmax, their gradient), in fp32; frozen blocks keep nothing."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    blocks = train_layers or c.num_hidden_layers
    return 4 * (blocks * (12 * c.hidden_size + 4 * c.intermediate_size) + 3 * c.vocab_size)


def within_tokens(chunk, max_tokens: int, shared: bool) -> list[list]:
    """A micro-batch cut into runs of whole sequences, in order, each of whose forward runs at most
    max_tokens positions (prefix_tree.tokens_run; a longer sequence runs alone, its blocks recomputed
    in the backward: sft_update): the gradient is their sum, as it is over micro-batches, the same up
    to the order of the sums."""
    runs = [[]]
    for s in chunk:
        if runs[-1] and prefix_tree.tokens_run(runs[-1] + [s], shared) > max_tokens:
            runs.append([])
        runs[-1].append(s)
    return runs


@functools.lru_cache(maxsize=1)
def reference_model(path: str, device: str = "cpu"):
    """The starting weights, frozen, loaded once per process: what a loss that keeps the model near
    where it began (a KL term) compares with. From the run's --model (Config.base_model), never the
    sampler's model: that one has trained, and on --resume it starts from the trained weights."""
    from lm.models import load_model
    if not path:
        raise ValueError("reference_model: Config.base_model is empty (whale.phase_a_config sets it from --model)")
    model, _ = load_model(path, device=device)
    return model.requires_grad_(False).eval()


@contextlib.contextmanager
def fixed_order_sums(device):
    """The update's sums in one fixed order, so that two processes train the same weights to the bit.
    The prefix tree hands one prompt's keys and values to several sequences (an index with repeats,
    lm/prefix_tree.py), so backward adds their gradients into one tensor; on a CPU with two threads
    that add's order changed from process to process and the weights after one update differed at
    the 7th digit (one RSFT step run twice: 265 of 272 gradients differed; with this, none, and no
    slower; at one thread they never differed). torch's deterministic algorithms fix the order; the
    memory torch.empty hands out stays unfilled (filling it costs time, and nothing reads it unset).
    CPU only: on a GPU the same switch needs cuBLAS settings of its own, and GPU runs do not promise
    bits."""
    if device.type != "cpu":
        yield
        return
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def sft_update(model, optimizer, seqs, cfg: Config, *, pad_id: int = 0, seed: int = 0, ddp_model=None) -> dict:
    """cfg.sft_epochs epochs over `seqs`, each in freshly shuffled minibatches of
    cfg.minibatch sequences; each minibatch is one optimizer step, accumulated over
    micro-batches of cfg.micro_batch sequences. The loss is cfg.loss_fn (token_nll: the
    mean NLL per labelled token of the minibatch). Returns loss (over all epochs), mean
    pre-clip gradient norm, steps, tokens (the sequences' tokens; forward_tokens: the positions
    the forwards ran, fewer when prompts are shared), trained_tokens (labels trained, epochs x
    seqs) and speed (tokens_per_s: the sequences' tokens a second).

    Data parallel (ddp_model = ddp.ddp_wrap(model)): every rank passes the same GLOBAL
    `seqs` and `seed`, so all ranks cut the same minibatches; each rank then
    trains on its slice mb[rank::world] of every minibatch. Returned numbers are global."""
    if not seqs:
        return {"loss": None, "opt_steps": 0, "tokens": 0, "forward_tokens": 0, "trained_tokens": 0, "seconds": 0.0,
                "skipped": True}
    seqs = [Sequence(*s) for s in seqs]  # (a replay buffer read back from state.json holds lists)
    shared = cfg.sft_prompts == "shared"
    rank, world = ddp.rank_world(ddp_model)  # (0, 1) in one process
    fwd = ddp_model or model
    dev = next(model.parameters()).device
    model.train()
    with fixed_order_sums(dev):  # the same update in every process (fixed_order_sums says why)
        rng = random.Random(seed)  # one generator for all epochs: epoch 0 is shuffled as a single epoch always was
        batches = []
        for _ in range(cfg.sft_epochs):
            order = list(range(len(seqs)))
            rng.shuffle(order)
            batches += [order[m:m + cfg.minibatch] for m in range(0, len(order), cfg.minibatch)]
        t0, total_nll, total_lab, tokens, run_tokens, steps, norms = time.time(), 0.0, 0, 0, 0, 0, []
        for batch in batches:
            mb = [seqs[i] for i in batch]
            # the normaliser is the label count of the WHOLE minibatch (every rank knows it); a
            # sequence of weight 0 trains nothing and counts nothing
            n_lab = sum(sum(l != IGNORE for l in s.labels[1:MAX_LEN]) for s in mb if s.weight != 0)
            mine = [Sequence(s.ids[:MAX_LEN], s.labels[:MAX_LEN], s.weight) for s in mb[rank::world]]
            if shared:  # the same prompts next to each other, so that they share a micro-batch
                mine.sort(key=lambda s: s.ids)  # (the order within a minibatch changes nothing but round-off)
            chunks = [mine[s:s + cfg.micro_batch] for s in range(0, len(mine), cfg.micro_batch)]
            if cfg.max_forward_tokens:  # (--max-memory: a forward's activations and logits grow with its positions)
                chunks = [part for chunk in chunks for part in within_tokens(chunk, cfg.max_forward_tokens, shared)]
            # under DDP every rank must join the all-reduce: a rank whose slice is empty (a minibatch
            # smaller than the world) runs one sequence without labels, which adds a zero gradient
            chunks = chunks or [[Sequence([pad_id, pad_id], [IGNORE, IGNORE])]]
            optimizer.zero_grad(set_to_none=True)
            for c, chunk in enumerate(chunks):
                # a sequence longer than the cap runs alone (within_tokens never cuts one): its blocks keep
                # only their inputs and run again in the backward (prefix_tree.recomputed_blocks: the same
                # bits), or its activations would set the run's peak (results/first-run, after run 22)
                over = cfg.max_forward_tokens and prefix_tree.tokens_run(chunk, shared) > cfg.max_forward_tokens
                with ddp.accumulating(ddp_model, last=c == len(chunks) - 1), \
                        (prefix_tree.recomputed_blocks(model) if over else contextlib.nullcontext()):
                    loss = cfg.loss_fn(fwd, chunk, pad_id=pad_id, shared=shared,
                                       reference=functools.partial(reference_model, cfg.base_model, str(dev)))
                    # DDP AVERAGES gradients over ranks; scaling by world turns that average into
                    # the sum over the whole minibatch, so the step's gradient is exactly one
                    # process's sum(loss) / n_lab on the same minibatch (and so is the clip below)
                    (loss * (world / max(n_lab, 1))).backward()
                total_nll += loss.item()
                if mine:
                    tokens += sum(len(s.ids) for s in chunk)
                    run_tokens += prefix_tree.tokens_run(chunk, shared)
            norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                              cfg.clip)))
            optimizer.step()
            crash_point("sft")
            total_lab += n_lab
            steps += 1
    total_nll, tokens, run_tokens = ddp.sum_over_ranks([total_nll, tokens, run_tokens], world, dev)
    optimizer.zero_grad(set_to_none=True)  # the gradients (the trained weights' size) are not kept through the rollouts
    if cfg.max_forward_tokens:  # --max-memory: the freed activations and gradients go back to the kernel
        give_freed_memory_back()
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
    HEALTH_SEQS (4) of the step's kept sequences, so a step pays two forwards of <= 4
    sequences: about what prefilling 8 of its prompts costs, whatever the number kept (measured on
    2 kept sequences: health_seconds about 1.4x sft_seconds at --train-layers 1, a tiny run).
    Under torchrun each rank scores its slice, then the sums add up."""
    rank, world = shard
    total, count, dev = 0.0, 0, next(model.parameters()).device
    mine = [Sequence(s[0][:MAX_LEN], s[1][:MAX_LEN]) for s in seqs[rank::world]]
    with torch.no_grad():
        for s in range(0, len(mine), cfg.micro_batch):
            chunk = mine[s:s + cfg.micro_batch]
            total += float(token_nll(model, chunk, pad_id=pad_id, shared=cfg.sft_prompts == "shared"))
            count += sum(sum(l != IGNORE for l in q.labels[1:]) for q in chunk)
    total, count = ddp.sum_over_ranks([total, count], world, dev)
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

def draw_prompts(pool: list[dict], loader: dict, n: int) -> list[dict]:
    """The next n prompts of the weight pool (next_batch's order; the loader advances)."""
    return [pool[i] for i in next_batch(loader, n)]


def rollout_step(engine, optimizer, cfg: Config, domain, harness: str, prompts: list[dict], *, seed, replay: list,
                 progress=None, data_parallel=None) -> dict:
    """Phase A's unit of work: cfg.group rollouts of each of `prompts` (the step's, draw_prompts),
    then the update. Returns the step's metrics (and nothing else: the model and optimizer are
    updated in place).
    replay: the kept sequences of the earlier steps that cfg.replay_steps still trains on, one
    list per step, oldest first; this step's are appended and the oldest dropped, in place
    (the caller saves it with the run, so a resumed run trains on the same buffer).
    data_parallel=(rank, world, ddp_model) under torchrun (rundir/ddp.py): each rank rolls out its
    slice of the prompts and trains through ddp_model; the metrics returned are global, the same
    on every rank."""
    rank, world, ddp_model = data_parallel or (0, 1, None)
    shard = (rank, world)
    examples = prompts[rank::world]
    sampling = {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
    t0 = time.time()
    records = rollout.run(engine, domain, harness, examples, cfg.group, seed=seed, sampling=sampling,
                          max_tokens=cfg.max_tokens, progress=progress)
    if world > 1:
        records = ddp.gather_records(records, rank, world, cfg.group)
        if progress is not None:  # the bar has counted this rank's rollouts; add the others'
            progress.update(len(records) - len(examples) * cfg.group)
    t_roll = time.time() - t0
    kept = keep(records, cfg.max_kept_per_prompt)  # [(record, weight)]
    seqs = [s for r, w in kept for s in sequences(r, w)]
    train = [s for earlier in replay for s in earlier] + seqs  # the buffer: R-1 earlier steps' and this one's
    probe = seqs[::max(1, math.ceil(len(seqs) / HEALTH_SEQS))]  # the health figure's sample: <= HEALTH_SEQS
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
    return {"prompts": len(prompts), "rollouts": len(records), "train_reward": reward,
            "kept": len(kept), "kept_frac": len(kept) / max(len(records), 1), "sequences": len(seqs),
            "replay_sequences": len(train),
            "capped_frac": sum(c.get("finish") == "length" for c in calls) / max(len(calls), 1),
            "kept_nll_before": nll_before, "kept_nll_after": nll_after, "health_seconds": t_health,
            "loss": upd["loss"], "grad_norm": upd.get("grad_norm"), "opt_steps": upd["opt_steps"],
            "skipped_update": upd["skipped"],
            "sft_tokens": upd["tokens"], "sft_forward_tokens": upd.get("forward_tokens", 0),
            "trained_tokens": upd["trained_tokens"],
            "sft_tokens_per_s": upd.get("tokens_per_s"),
            "sft_seconds": upd["seconds"], "rollout_seconds": t_roll,
            **{k: v for k, v in rollout.totals(records).items() if k != "rollouts"}}


def sequence_logprob(model, seq) -> float:
    """Sum of log-probabilities of the labelled tokens of one Sequence (or (ids, labels) pair)."""
    with torch.no_grad():
        return -float(token_nll(model, [Sequence(seq[0], seq[1])]))


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
