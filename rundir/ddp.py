"""
Data parallel plumbing for phase A under torchrun (a no-op in one process).

`torchrun --nproc_per_node N whale.py ...`: each rank rolls out its slice of the prompt batch,
the records are gathered so that every rank holds the same global kept set in the same order
(gather_records), and each minibatch is split across ranks with gradients all-reduced by
DistributedDataParallel. The loss trajectory is that of one process with the same global batch
(up to float round-off): same minibatches, same normaliser, same clipped gradient (tested under
torchrun in test_whale.py). Rank 0 alone evaluates, searches harnesses and writes files; the
others wait in `broadcast`.

What it leaves out: multi-node setup beyond what torchrun's environment gives, sharded
optimizers (FSDP/ZeRO), asynchronous rollouts.
"""
import contextlib
import datetime
import os

import torch


def ddp_setup(device: str = "cpu") -> tuple[int, int, str]:
    """(rank, world, device) of this process. Under torchrun (WORLD_SIZE > 1) this
    joins the process group: gloo on CPU, nccl on CUDA with one GPU per rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, device
    import torch.distributed as dist
    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # rank 0 alone evaluates and searches harnesses while the other ranks wait in a
        # broadcast; that can take hours on CPU, far past the default 10-30 min timeout
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=48))
    return dist.get_rank(), dist.get_world_size(), device


def broadcast(obj, world: int):
    """Rank 0's copy of a picklable object, on every rank (identity in one process)."""
    if world <= 1:
        return obj
    import torch.distributed as dist
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def data_parallel(model):
    """What rs_sft.rollout_step's data_parallel= takes: (rank, world, the DDP-wrapped model) under torchrun,
    None in one process."""
    wrapped = ddp_wrap(model)
    return None if wrapped is None else (*rank_world(wrapped), wrapped)


def rank_world(ddp_model) -> tuple[int, int]:
    """(rank, world) of an sft_update: (0, 1) without a DDP wrapper."""
    if ddp_model is None:
        return 0, 1
    import torch.distributed as dist
    return dist.get_rank(), dist.get_world_size()


def accumulating(ddp_model, last: bool):
    """Micro-batches accumulate locally; only a rank's last one syncs gradients (DDP all-reduces
    in the backward of a forward made outside no_sync(), and every rank must join it)."""
    return contextlib.nullcontext() if ddp_model is None or last else ddp_model.no_sync()


def sum_over_ranks(values: list, world: int, device) -> list:
    """Each number summed over the ranks (as given in one process), with its type kept."""
    if world <= 1:
        return values
    import torch.distributed as dist
    tot = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(tot)
    return [type(v)(t) for v, t in zip(values, tot.tolist())]


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
