"""Megatron's checkpoint timers: `(min, max) time across ranks (ms):` after each save call and
after the load, and the bytes a resume read.

Megatron-LM times `save-checkpoint` and `load-checkpoint` on every rank and prints the fastest and
slowest rank from the last rank. The min and max are one all-reduce on the checkpoint control plane
(`datastates.control_plane`, gloo): the default group is NCCL on GPU runs and refuses CPU values.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from datastates import control_plane

from megatron.training.log import min_max_time_lines, print_rank_last

__all__ = ["count_loaded", "loaded_bytes", "report_times_across_ranks"]


def report_times_across_ranks(name: str, seconds: float) -> float:
    """Every rank (collective): print Megatron's timers report of `name` from the last rank;
    returns the slowest rank's seconds."""
    high, neg_low = control_plane.all_reduce([seconds, -seconds], op=dist.ReduceOp.MAX,
                                             dtype=torch.float64)
    report_times(name, -neg_low, high)
    return high


def report_times(name: str, low_s: float, high_s: float) -> None:
    """Megatron's timers report of `name` from the last rank, for the fastest and slowest ranks'
    seconds known already (e.g. gathered with other figures)."""
    print_rank_last(min_max_time_lines({name: (low_s * 1e3, high_s * 1e3)}))


def count_loaded(obj: Any) -> Any:
    """Add the bytes of every tensor in `obj` (a loaded state dict, a box) to what this process
    has read into its state; returns `obj`. The resume line reports the sum over ranks: what
    they read out of the checkpoint, whatever the format or the read path (memory-mapped
    universal boxes, DCP byte ranges, torch.load), and nothing else the process read meanwhile
    (modules imported, metadata)."""
    global _loaded_bytes
    _loaded_bytes += _tensor_bytes(obj)
    return obj


def loaded_bytes() -> int:
    """Tensor bytes `count_loaded` has counted in this process so far."""
    return _loaded_bytes


_loaded_bytes = 0


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0
