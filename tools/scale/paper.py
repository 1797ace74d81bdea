"""The paper's published results (PAPER.md) and the inputs we derive from them.

Only numbers quoted in PAPER.md are used. Its Fig. 4 phase times are not in our digest, so
iteration times are derived from the end-to-end runs (see ``derive_paper_phases``).
"""
from __future__ import annotations

import dataclasses
import math

from tools.scale.architecture import (PAPER_MODELS, GPTArch, WeightsWriter, checkpoint_bytes_per_rank, paper_model,
                                      unique_parameters)
from tools.scale.projection import Phases, Platform, ScaleCase, Variant, predict

TP = 4
"""Tensor parallel size of every paper run (one node of 4 GPUs per pipeline stage)."""

# Checkpoint throughput, GB/s, one checkpoint per iteration: DeepSpeed torch.save, async
# copy-then-flush, TorchSnapshot, DataStates-LLM.
PAPER_THROUGHPUT = {
    "3B": (4, 7, 9, 135),
    "7B": (8, 11, 20, 223),
    "13B": (7, 23, 41, 234),
    "30B": (15, 44, 47, 395),
    "70B": (54, 78, 117, 638),
}
# Which of our variants each column stands for (TorchSnapshot has no counterpart here).
PAPER_COLUMNS = (Variant.TORCH_SAVE, Variant.TORCH_DIST_ASYNC, None, Variant.DATASTATES_LAZY)

# 50 iterations, a checkpoint every iteration: seconds for torch.save and DataStates-LLM.
PAPER_END_TO_END = {"7B": (631, 282), "13B": (759, 351)}
PAPER_END_TO_END_ITERATIONS = 50

# 30B at DP=16: 1201 GB/s (DataStates) vs 25 GB/s (torch.save), the "48x".
PAPER_DP16_30B = (25, 1201)

UPDATE_FRACTION = 0.04
"""Share of an iteration spent in the optimizer step (assumed; Adam on ~1 GB of fp32 state per GPU
takes tens of milliseconds at HBM speed, plus gradient clipping and scheduler)."""


def paper_stall_s(name: str, column: int) -> float:
    """Blocking time per checkpoint the paper's table implies: size / throughput."""
    return paper_model(name).paper_checkpoint_gb / PAPER_THROUGHPUT[name][column]


def derive_paper_phases() -> dict[str, Phases]:
    """Iteration phase times for the five paper models.

    7B and 13B: the DataStates end-to-end run minus its checkpoint stalls (table throughput),
    divided by 50. Others: one micro-batch per iteration (global batch = micro-batch 16, DP=1), so
    an iteration runs every layer once on one TP group and its time scales with the parameter
    count; scaled from 13B. Forward : backward = 1 : 2 (backward does twice the FLOPs).
    """
    iteration = {}
    for name, (_, datastates_s) in PAPER_END_TO_END.items():
        stalls = PAPER_END_TO_END_ITERATIONS * paper_stall_s(name, 3)
        iteration[name] = (datastates_s - stalls) / PAPER_END_TO_END_ITERATIONS
    per_param = iteration["13B"] / unique_parameters(paper_model("13B"), TP, 4)
    phases = {}
    for arch in PAPER_MODELS:
        total = iteration.get(arch.name, per_param * unique_parameters(arch, TP, arch.nodes))
        compute = total * (1 - UPDATE_FRACTION)
        phases[arch.name] = Phases(forward=compute / 3, backward=2 * compute / 3, update=total * UPDATE_FRACTION)
    return phases


def paper_case(arch: GPTArch, phases: Phases, iterations: int, interval: int, dp: int = 1,
               paper_sized: bool = True, writer: WeightsWriter = WeightsWriter.FIRST_REPLICA) -> ScaleCase:
    """A paper run: TP=4, PP=nodes; by default the paper's DeepSpeed layout (DP rank 0 writes the
    weights; ``SPREAD_OVER_DP`` is Megatron's fully parallel torch_dist save).

    ``paper_sized``: scale the formula's per-rank bytes so the total is the paper's reported
    checkpoint size, so throughputs compare directly with its table (the formula's own totals
    differ by -22% to +16%; docs/SCALE.md explains why).
    """
    per_rank = checkpoint_bytes_per_rank(arch, TP, arch.nodes, dp, writer=writer)
    if paper_sized:
        factor = arch.paper_checkpoint_gb * 1e9 / sum(per_rank)
        per_rank = [int(round(b * factor)) for b in per_rank]
    return ScaleCase(
        name=f"{arch.name} dp{dp}", bytes_per_rank=tuple(per_rank), mp_ranks=TP * arch.nodes,
        phases=phases, iterations=iterations, checkpoint_interval=interval)


def throughput_case(name: str, phases: dict, dp: int = 1) -> ScaleCase:
    """The throughput experiment: a checkpoint every iteration over 5 iterations."""
    return paper_case(paper_model(name), phases[name], iterations=5, interval=1, dp=dp)


def _bisect(f, lo: float, hi: float, steps: int = 60) -> float:
    """Root of an increasing-or-decreasing f on [lo, hi], in log space (all unknowns are > 0)."""
    flo = f(lo)
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        if (f(mid) > 0) == (flo > 0):
            lo, flo = mid, f(mid)
        else:
            hi = mid
    return math.sqrt(lo * hi)


def calibrate(platform: Platform, phases: dict) -> Platform:
    """Fit the four figures the paper does not publish so the model reproduces:
    the single-node 3B column (torch.save, copy-then-flush, DataStates stalls) and the 70B
    DataStates stall (the only multi-node point used). Everything else is predicted."""
    small, large = throughput_case("3B", phases), throughput_case("70B", phases)
    targets = {v: paper_stall_s("3B", i) for i, v in enumerate(PAPER_COLUMNS) if v is not None}

    def stall(p, case, variant):
        return predict(case, p, variant).stall_per_checkpoint_s

    def solve(p, field, case, variant, target, lo, hi):
        def error(x):
            return stall(dataclasses.replace(p, **{field: x}), case, variant) - target
        return dataclasses.replace(p, **{field: _bisect(error, lo, hi)})

    p = platform
    for _ in range(12):  # coordinate descent; each unknown mostly moves one target
        p = solve(p, "coordination_s", small, Variant.DATASTATES_LAZY, targets[Variant.DATASTATES_LAZY], 1e-4, 100)
        p = solve(p, "coordination_s_per_mp_rank", large, Variant.DATASTATES_LAZY, paper_stall_s("70B", 3),
                  1e-6, 10)
        p = solve(p, "write_stream_gbps", small, Variant.TORCH_SAVE, targets[Variant.TORCH_SAVE], 0.01, 1000)
        p = solve(p, "staging_gbps", small, Variant.TORCH_DIST_ASYNC, targets[Variant.TORCH_DIST_ASYNC], 0.01, 1000)
    misses = {v.value: (stall(p, small, v), t) for v, t in targets.items() if abs(stall(p, small, v) / t - 1) > 1e-3}
    if misses:
        raise ValueError(f"calibration did not converge (stall, target) per variant: {misses}; "
                         "start from figures closer to the platform's")
    return p
