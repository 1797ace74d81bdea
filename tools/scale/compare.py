"""Side-by-side of the projection and the paper, with the tolerances the tests hold it to.

Shape, not absolute numbers: what must match is how the variants compare with each other.
- Checkpoint throughput: for every model, (variant / torch.save) predicted vs the paper's ratio
  within a factor of ``RATIO_TOLERANCE``, and the order torch.save < copy-then-flush < DataStates.
- End to end (50 iterations, a checkpoint every iteration): torch.save / DataStates time within
  ``END_TO_END_TOLERANCE`` (relative) of the paper's 2.24x (7B) and 2.16x (13B).
The 3B column and the 70B DataStates point are calibration inputs (``paper.calibrate``), so only
the other points test the model.
"""
from __future__ import annotations

from dataclasses import dataclass

from tools.scale.architecture import paper_model
from tools.scale.paper import (PAPER_COLUMNS, PAPER_DP16_30B, PAPER_END_TO_END, PAPER_END_TO_END_ITERATIONS,
                               PAPER_THROUGHPUT, paper_case, throughput_case)
from tools.scale.projection import Platform, Variant, predict

RATIO_TOLERANCE = 1.7
"""Predicted and published variant ratios agree within this factor (either direction)."""
END_TO_END_TOLERANCE = 0.30
"""Relative error allowed on the end-to-end speed-up of DataStates over torch.save."""


@dataclass(frozen=True)
class RatioCheck:
    """One ratio compared with the paper."""

    what: str
    predicted: float
    paper: float
    tolerance: str
    calibrated: bool
    """True where the paper's number was a calibration input (agreement is by construction)."""
    ok: bool


def throughput_checks(platform: Platform, phases: dict) -> list[RatioCheck]:
    checks = []
    for name, row in PAPER_THROUGHPUT.items():
        case = throughput_case(name, phases)
        got = {v: predict(case, platform, v).checkpoint_throughput_gbps for v in Variant}
        base_pred, base_paper = got[Variant.TORCH_SAVE], row[0]
        for column, variant in enumerate(PAPER_COLUMNS):
            if variant is None or variant is Variant.TORCH_SAVE:
                continue
            pred, paper = got[variant] / base_pred, row[column] / base_paper
            checks.append(RatioCheck(
                f"{name} {variant.value}/torch throughput", pred, paper, f"x{RATIO_TOLERANCE}",
                calibrated=name == "3B", ok=1 / RATIO_TOLERANCE <= pred / paper <= RATIO_TOLERANCE))
        ordered = got[Variant.TORCH_SAVE] < got[Variant.TORCH_DIST_ASYNC] < got[Variant.DATASTATES_LAZY]
        checks.append(RatioCheck(f"{name} order torch < async < datastates", float(ordered), 1.0, "exact",
                                 calibrated=False, ok=ordered))
    return checks


def end_to_end_checks(platform: Platform, phases: dict) -> list[RatioCheck]:
    checks = []
    for name, (torch_s, datastates_s) in PAPER_END_TO_END.items():
        case = paper_case(paper_model(name), phases[name], PAPER_END_TO_END_ITERATIONS, 1)
        slow = predict(case, platform, Variant.TORCH_SAVE).end_to_end_s
        fast = predict(case, platform, Variant.DATASTATES_LAZY).end_to_end_s
        pred, paper = slow / fast, torch_s / datastates_s
        checks.append(RatioCheck(
            f"{name} end-to-end torch/datastates", pred, paper, f"+-{END_TO_END_TOLERANCE:.0%}",
            calibrated=False, ok=abs(pred / paper - 1) <= END_TO_END_TOLERANCE))
    return checks


def dp_scaling_rows(platform: Platform, phases: dict) -> list[RatioCheck]:
    """30B at DP=16, reported and not held to a tolerance (docs/SCALE.md: the model misses it):
    each variant's throughput against the paper's, then their ratio (the paper's "48x")."""
    case = throughput_case("30B", phases, dp=16)
    slow = predict(case, platform, Variant.TORCH_SAVE).checkpoint_throughput_gbps
    fast = predict(case, platform, Variant.DATASTATES_LAZY).checkpoint_throughput_gbps
    paper_slow, paper_fast = PAPER_DP16_30B
    return [RatioCheck(what, pred, paper, "not checked", calibrated=False, ok=True) for what, pred, paper in (
        ("30B DP16 torch throughput GB/s", slow, paper_slow),
        ("30B DP16 datastates throughput GB/s", fast, paper_fast),
        ("30B DP16 datastates/torch throughput", fast / slow, paper_fast / paper_slow))]


def format_checks(checks: list[RatioCheck]) -> str:
    lines = [f"{'comparison':<44} {'predicted':>10} {'paper':>8}  tolerance   status"]
    for c in checks:
        if c.tolerance == "not checked":
            status = "reported only"
        else:
            status = "calibration" if c.calibrated else ("ok" if c.ok else "OUT OF TOLERANCE")
        lines.append(f"{c.what:<44} {c.predicted:>10.2f} {c.paper:>8.2f}  {c.tolerance:<10}  {status}")
    return "\n".join(lines)
