"""The control plane: the small collectives checkpointing issues, on a gloo group of all ranks.

Checkpointing agrees on a few integers per save (is every rank durable? did a rank fail? byte
counts and times for the report; is this candidate intact on every rank?) and meets at barriers.
These are CPU values. On a GPU run the default process group is NCCL, which accepts only CUDA
tensors, so they go through a gloo group of every rank instead, created once per default group:
no host-device copy or stream sync for a flag, and nothing queued behind training's NCCL kernels.
CPU runs (default group gloo) get their own group too, so the path CI runs is the GPU one.

`control_group()` is collective the first time it is called for a default group (it may create a
group): every rank calls it at the same point, e.g. right after `init_process_group`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["all_gather_ints", "all_reduce", "barrier", "control_group", "exchange",
           "new_side_group"]

# (the default group it was made for, the gloo group); holding the first keeps its id unique.
_CACHE: Optional[Tuple[object, object]] = None


def control_group():
    """The gloo group of all ranks for checkpoint collectives (see module doc)."""
    global _CACHE
    if not dist.is_initialized():
        raise RuntimeError("the checkpoint control plane needs torch.distributed to be "
                           "initialized (init_process_group) first")
    world = dist.group.WORLD
    if _CACHE is None or _CACHE[0] is not world:
        _CACHE = (world, dist.new_group(backend="gloo"))
    return _CACHE[1]


def all_reduce(values: Sequence[float], op=dist.ReduceOp.SUM,
               dtype: torch.dtype = torch.int64, group=None) -> List:
    """`values` reduced element-wise over every rank (CPU tensor on the control group, or on
    `group`, e.g. a `new_side_group`)."""
    t = torch.tensor(list(values), dtype=dtype)
    dist.all_reduce(t, op=op, group=group or control_group())
    return t.tolist()


def all_gather_ints(value, group=None) -> List:
    """Every rank's `value` (an int, or a sequence of ints of the same length on every rank),
    indexed by rank."""
    t = torch.tensor([int(value)] if isinstance(value, int) else [int(v) for v in value],
                     dtype=torch.int64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t, group=group or control_group())
    return [int(x.item()) if isinstance(value, int) else x.tolist() for x in out]


def new_side_group():
    """A second gloo group of all ranks, for one background thread of every rank (its collectives
    then never interleave with the control group's). Collective: every rank, same point."""
    control_group()
    return dist.new_group(backend="gloo")


def exchange(sends: Dict[Tuple[int, int], torch.Tensor],
             recvs: Dict[Tuple[int, int], torch.Tensor], group=None) -> None:
    """Point to point, all at once: each tensor of `sends`, keyed (destination rank, tag), goes
    to its rank and each buffer of `recvs`, keyed (source rank, tag), is filled from its rank
    (CPU tensors; ranks of the default group, which every group made here spans). Posting every
    operation before waiting on any never deadlocks on order."""
    group = group or control_group()
    works = [dist.isend(t, dst, group=group, tag=tag) for (dst, tag), t in sends.items()]
    works += [dist.irecv(t, src, group=group, tag=tag) for (src, tag), t in recvs.items()]
    for w in works:
        w.wait()


def barrier() -> None:
    dist.barrier(group=control_group())
