"""Projected time of a universal merge at the paper's scales, against its checkpoint interval.

A universal checkpoint holds every unique parameter once: the bf16 weight plus the fp32 main weight
and Adam's two moments (2 + 4 + 4 + 4 bytes). The merge reads the lazy shards and writes those
bytes; its measured rate (`benchmarks/universal_merge_bench.py`: universal bytes per second of one
worker, reading and writing on the same storage) is taken per worker, and a merge with W workers
per node over N nodes runs at min(W * N * rate, node_write_gbps * N, fs_aggregate_gbps / 2) (each
byte is read once and written once on the shared file system). The checkpoint interval is the
paper's end-to-end one (a checkpoint every 10 iterations) times an iteration's time (`Phases`). A
merge "fits" when it finishes before the next checkpoint commits; otherwise merging every N-th
checkpoint (N = the merge time over the interval, rounded up) keeps up.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List

from .architecture import GPTArch, unique_parameters
from .projection import Phases, Platform

UNIVERSAL_BYTES_PER_PARAM = 2 + 4 + 4 + 4
PAPER_INTERVAL_ITERATIONS = 10


@dataclass(frozen=True)
class MergeProjection:
    model: str
    nodes: int
    workers: int
    universal_gb: float
    merge_gbps: float
    merge_s: float
    interval_s: float
    fits: bool
    every_nth: int
    """Merge every N-th checkpoint to keep up (1: every one)."""


def universal_bytes(arch: GPTArch) -> int:
    return unique_parameters(arch, arch.tp, arch.nodes) * UNIVERSAL_BYTES_PER_PARAM


def project_merge(arch: GPTArch, phases: Phases, platform: Platform, gbps_per_worker: float,
                  workers_per_node: int = 1,
                  interval_iterations: int = PAPER_INTERVAL_ITERATIONS) -> MergeProjection:
    if gbps_per_worker <= 0 or workers_per_node < 1 or interval_iterations < 1:
        raise ValueError(f"expected a positive rate, >= 1 worker per node and interval, found "
                         f"{gbps_per_worker}, {workers_per_node}, {interval_iterations}")
    workers = workers_per_node * arch.nodes
    rate = min(workers * gbps_per_worker, platform.node_write_gbps * arch.nodes,
               platform.fs_aggregate_gbps / 2)
    size = universal_bytes(arch) / 1e9
    merge_s = size / rate
    interval_s = interval_iterations * phases.total
    return MergeProjection(arch.name, arch.nodes, workers, size, rate, merge_s, interval_s,
                           merge_s <= interval_s, max(1, math.ceil(merge_s / interval_s)))


def merge_table(archs: List[GPTArch], phases: Dict[str, Phases], platform: Platform,
                gbps_per_worker: float, workers_per_node: int = 1) -> List[MergeProjection]:
    return [project_merge(a, phases[a.name], platform, gbps_per_worker, workers_per_node)
            for a in archs]


def format_merge_table(rows: List[MergeProjection], gbps_per_worker: float) -> str:
    lines = [f"universal merge at {gbps_per_worker:.3f} GB/s per worker, checkpoint every "
             f"{PAPER_INTERVAL_ITERATIONS} iterations:",
             f"{'model':<6} {'nodes':>5} {'workers':>7} {'GB':>7} {'GB/s':>7} {'merge s':>9} "
             f"{'interval s':>10} {'fits':>5} {'merge every':>11}"]
    for r in rows:
        lines.append(f"{r.model:<6} {r.nodes:>5} {r.workers:>7} {r.universal_gb:>7.1f} "
                     f"{r.merge_gbps:>7.2f} {r.merge_s:>9.1f} {r.interval_s:>10.1f} "
                     f"{'yes' if r.fits else 'no':>5} {r.every_nth:>11}")
    return "\n".join(lines)
