"""Megatron's checkpoint timers: `(min, max) time across ranks (ms):` after each save call and
after the load, and the bytes a resume read.

Megatron-LM times `save-checkpoint` and `load-checkpoint` on every rank and prints the fastest and
slowest rank from the last rank. The min and max are one all-reduce on the checkpoint control plane
(`datastates.control_plane`, gloo): the default group is NCCL on GPU runs and refuses CPU values.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from datastates import control_plane

from megatron.training.log import min_max_time_lines, print_rank_last

__all__ = ["process_bytes_read", "report_times_across_ranks"]


def report_times_across_ranks(name: str, seconds: float) -> float:
    """Every rank (collective): print Megatron's timers report of `name` from the last rank;
    returns the slowest rank's seconds."""
    high, neg_low = control_plane.all_reduce([seconds, -seconds], op=dist.ReduceOp.MAX,
                                             dtype=torch.float64)
    print_rank_last(min_max_time_lines({name: (-neg_low * 1e3, high * 1e3)}))
    return high


def process_bytes_read() -> Optional[int]:
    """Bytes this process (all its threads) has read through read-type system calls so far
    (Linux `/proc/self/io` rchar, page-cache hits included); None where unavailable."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None
