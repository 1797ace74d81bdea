"""`--save-interval auto`: the checkpoint interval chosen from measured costs and the job's MTBF.

Young (1974) and Daly (2006): with a checkpoint costing the training loop C seconds and failures
arriving every M seconds on average, the compute time between checkpoints that minimizes the
expected time lost (checkpoint costs plus work redone after a failure) is

    T = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C    for C < 2M, else T = M

(Daly's higher-order form; its first term is Young's). The interval in iterations is T divided by
the time of an iteration that no checkpoint disturbs.

What C is: the time a checkpoint costs the training loop, not its background flush time. Rank 0
times every iteration (from one `after_iteration` to the next: forward/backward, optimizer step,
the save call, the snapshot wait, the commit poll). An iteration is *disturbed* by a checkpoint from
the iteration that calls save until the one during which its record arrives (it is durable on every
rank); C is the sum over those iterations of their time above the median undisturbed iteration,
and never less than the stall the format measured. A lazy save's background copy and writes slow
the iterations they overlap: that is counted; the seconds the flush takes beyond it are not.

Never more often than a checkpoint can become durable: the interval is at least the newest
checkpoint's time to durability in undisturbed iterations, plus one, so saves never queue behind
each other and undisturbed iterations keep being measured.

Policy before costs are known: no checkpoint during the first WARMUP_ITERATIONS iterations of the
run (the first is slow: allocation, first-touch), then checkpoints at the durability bound (or
PROBE_INTERVAL before one is durable) until PROBE_CHECKPOINTS costs are measured; from then on the
formula over the median of the last PROBE_CHECKPOINTS costs, re-evaluated at every save.

Agreement: rank 0 decides the next save iteration when a save has been made and all ranks take it
from one control-plane all-reduce per save (no per-iteration collective). Every change is logged
with its inputs and, where TensorBoard/wandb are on, written as `checkpoint/interval-iterations`
and `checkpoint/cost-s`.

The levels one lazy save drains to (host cache, --lazy-save-local-dir, --save) are written by the
same save in the background, so one interval governs them: the loop's cost of a checkpoint does
not depend on how many levels it drains to. A non-persistent level that saves its own versions
(Megatron-LM's global, local and in_memory types) has its own interval, from its own measured
cost, by a second `AutoInterval` (`level` names it in the log line): with the in-memory level a
version costs the loop a copy into memory, far less than a persistent save's disturbance, so its
interval comes out much shorter. Both use the job's MTBF (every failure a restart recovers from;
the persistent level is then sized as if each failure needed it, which errs on the safe side
when nodes are lost more rarely than processes). The durability bound uses the time until the
checkpoint is committed on its level; an in-memory version commits right before the next one
is saved (`queues=False`), so once its costs are known its bound is one iteration.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

__all__ = ["AutoInterval", "Decision", "optimal_compute_seconds"]

WARMUP_ITERATIONS = 3
PROBE_INTERVAL = 2
PROBE_CHECKPOINTS = 3
MAX_PENDING = 2


def optimal_compute_seconds(cost_s: float, mtbf_s: float) -> float:
    """Daly's optimum compute time between checkpoints (seconds) for cost C and MTBF M."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    r = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - cost_s


@dataclass(frozen=True)
class Decision:
    """One choice of the interval and what it was computed from (logged when it changes)."""

    interval: int
    reason: str
    """`warm-up`, `probe`, `young-daly` or `durability` (the bound was larger than the optimum)."""
    cost_s: Optional[float] = None
    iteration_s: Optional[float] = None
    durable_s: Optional[float] = None

    def log_line(self, mtbf_hours: float, iteration: int, level: Optional[str] = None) -> str:
        def num(x: Optional[float]) -> str:
            return "n/a" if x is None else f"{x:.6E}"
        tag = f" level: {level} |" if level else ""
        return (f" checkpoint interval |{tag} iteration: {iteration:8d} | checkpoint cost (s): "
                f"{num(self.cost_s)} | MTBF (h): {mtbf_hours:g} | interval (iterations): "
                f"{self.interval} | iteration time (s): {num(self.iteration_s)} | durable (s): "
                f"{num(self.durable_s)} | set by: {self.reason} |")


@dataclass
class _Pending:
    """A save not yet accounted for: the times of the iterations it disturbed so far, and its
    record once it arrived (the iteration the record arrives in still counts)."""

    iteration: int
    times: List[float] = field(default_factory=list)
    stall_s: Optional[float] = None


class AutoInterval:
    """Rank 0 measures and decides; every rank asks `should_save` and calls `saved`.

    Call order: 1) every rank, each iteration: `should_save(iteration)`; 2) every rank, when it
    saves `iteration`, right before the save call: `saved(iteration)` (one all-reduce through
    `agree`); 3) rank 0, whenever a checkpoint becomes durable: `record(iteration, stall_s,
    durable_s)`; 4) rank 0, at the end of each iteration: `iteration_done(seconds)`.
    """

    def __init__(self, mtbf_hours: float, start_iteration: int, is_rank0: bool,
                 agree: Callable[[int], int], log: Callable[[str], None],
                 report: Optional[Callable[[int, Decision], None]] = None,
                 level: Optional[str] = None, queues: bool = True):
        self.mtbf_hours = mtbf_hours
        self.is_rank0 = is_rank0
        self.level = level  # named in the log line (None: --save's)
        self.queues = queues
        self._agree, self._log, self._report = agree, log, report
        self.next_save = start_iteration + WARMUP_ITERATIONS
        self.decision = Decision(WARMUP_ITERATIONS, "warm-up")
        self._clean: List[float] = []          # undisturbed iteration times (rank 0)
        self._pending: Dict[int, _Pending] = {}
        self._costs: List[float] = []
        self._durable_s: Optional[float] = None

    # 1) every rank
    def should_save(self, iteration: int) -> bool:
        return iteration >= self.next_save

    # 2) every rank, right before the save call of `iteration`
    def saved(self, iteration: int) -> None:
        if self.is_rank0:
            self._pending[iteration] = _Pending(iteration)
            for old in sorted(self._pending)[:-MAX_PENDING]:
                del self._pending[old]  # its record never came (a failed save): stop waiting
        proposed = self._decide() if self.is_rank0 else None
        interval = self._agree(proposed.interval if proposed else 0)
        if interval < 1:
            raise RuntimeError(f"--save-interval auto: rank 0 proposed interval {interval}")
        self.next_save = iteration + interval
        if proposed is None:
            return
        if (proposed.interval, proposed.reason) != (self.decision.interval, self.decision.reason):
            self._log(proposed.log_line(self.mtbf_hours, iteration, self.level))
            if self._report is not None:
                self._report(iteration, proposed)
        self.decision = proposed

    # 3) rank 0
    def record(self, iteration: int, stall_s: float, durable_s: float) -> None:
        self._durable_s = durable_s
        if iteration in self._pending:
            self._pending[iteration].stall_s = stall_s

    # 4) rank 0
    def iteration_done(self, seconds: float) -> None:
        if not self._pending:
            self._clean.append(seconds)
            del self._clean[:-16]  # the recent past: iteration time drifts
            return
        base = statistics.median(self._clean) if self._clean else None
        for p in list(self._pending.values()):
            p.times.append(seconds)
            if p.stall_s is not None:
                del self._pending[p.iteration]
                if base is not None:
                    slowdown = sum(max(0.0, t - base) for t in p.times)
                    self._costs.append(max(p.stall_s, slowdown))

    # -- rank 0 ------------------------------------------------------------------------------------
    def _decide(self) -> Decision:
        base = statistics.median(self._clean) if self._clean else None
        floor = PROBE_INTERVAL
        probing = len(self._costs) < PROBE_CHECKPOINTS or not base
        if not self.queues:  # each save commits the one before it first: saves never queue
            floor = PROBE_INTERVAL if probing else 1
        elif self._durable_s is not None and base:
            floor = max(1, math.ceil(self._durable_s / base)) + 1
        if probing:
            return Decision(floor, "probe", self._costs[-1] if self._costs else None, base,
                            self._durable_s)
        cost = statistics.median(self._costs[-PROBE_CHECKPOINTS:])
        optimum = max(1, round(optimal_compute_seconds(cost, self.mtbf_hours * 3600.0) / base))
        if optimum >= floor:
            return Decision(optimum, "young-daly", cost, base, self._durable_s)
        return Decision(floor, "durability", cost, base, self._durable_s)
