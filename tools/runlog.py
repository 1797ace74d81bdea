"""Read the figures of one training run out of its Megatron-format log.

Recognized lines (everything else is ignored):
- ``iteration N/ M | ... elapsed time per iteration (ms): X | ...`` (Megatron's training log);
- ``successfully saved checkpoint from iteration N ...`` (Megatron-LM) and
  ``saved checkpoint at iteration N to DIR in X ms ...`` (our trainer);
- ``save-checkpoint ...: X`` or ``(min, max)`` timer lines (Megatron's timers, milliseconds; our
  trainer prints one right after its own save line, and it then stands for that save);
- ``... checkpoint ... blocking time (ms): X`` (our checkpoint log lines);
- `` checkpoint iteration N | bytes: B | stall (ms): X | ... | committed: DIR`` (``--async-lazy-save``:
  one line per committed checkpoint, printed when it commits; its stall is the slowest rank's
  time blocked by that save, save call and wait before the next optimizer step together);
- `` training summary | ... | checkpoints: N (complete: M[; persistent deferred: K]) | blocked by checkpointing (s): X | ...`` (our trainer);
- ``[run] tag=T rc=R wall_seconds=S`` (written by examples/slurm/common.sh around the launch).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|.*?elapsed time per iteration \(ms\):\s*([0-9.eE+-]+)")
_SAVED = re.compile(r"saved checkpoint\b.*?\biteration\s+(\d+)(?:.*?\bin\s+([0-9.]+)\s*ms\b)?", re.IGNORECASE)
_SAVE_TIMER = re.compile(r"\bsave-checkpoint\b[ .]*:\s*\(?\s*([0-9.]+)(?:\s*,\s*([0-9.]+))?")
_BLOCKING = re.compile(r"checkpoint\b[^|\n]*?\bblocking time \(ms\):\s*([0-9.]+)", re.IGNORECASE)
_COMMITTED = re.compile(r"\bcheckpoint iteration\s+(\d+)\s*\|(.*)\|\s*committed:\s*(\S+)")
_SUMMARY = re.compile(r"\btraining summary \|.*?\bblocked by checkpointing \(s\):\s*([0-9.]+)"
                      r"(?:.*?\bnewest complete checkpoint:\s*(\S+))?")
_RUN = re.compile(r"^\[run\] tag=(\S+) rc=(-?\d+) wall_seconds=([0-9.]+)")


@dataclass(frozen=True)
class Commit:
    """One ``checkpoint iteration N | ... | committed: DIR`` line (--async-lazy-save)."""

    iteration: int
    directory: str
    fields: dict
    """By name: ``bytes``, ``stall (ms)``, ``copy (ms)``, ``durable (s)``, ``throughput (GB/s)``,
    ..."""


@dataclass
class RunFigures:
    """What one log says about its run."""

    iteration_ms: dict = field(default_factory=dict)
    """Elapsed time per iteration (ms) by iteration number (the last report wins)."""
    train_iters: Optional[int] = None
    saved_iterations: list = field(default_factory=list)
    save_ms: list = field(default_factory=list)
    """Per-checkpoint save time (timer max across ranks, or our blocking time), ms."""
    commits: list = field(default_factory=list)
    """--async-lazy-save: every level's ``checkpoint iteration N`` lines (`Commit`), in log order;
    with the in-memory or node-local level, two levels may commit the same iteration, and their
    lines are told apart by their directories."""
    blocked_s: Optional[float] = None
    """Training-loop time blocked by checkpointing, whole run (the trainer's summary line)."""
    newest_checkpoint: Optional[str] = None
    """The newest complete checkpoint's directory (summary line; None for "none")."""
    rc: Optional[int] = None
    wall_seconds: Optional[float] = None

    def stall_ms(self) -> list:
        """Time training was blocked per checkpoint, ms: a lazy save's committed line when there
        are any (the save-checkpoint timer then covers only the save call), else ``save_ms``."""
        if self.commits:
            return [c.fields["stall (ms)"] for c in self.commits if "stall (ms)" in c.fields]
        return list(self.save_ms)

    def persistent(self) -> list:
        """The fields of the committed lines of --save's versions: those under the directory of
        the summary's newest complete checkpoint (every line when the log has no summary, or
        names no checkpoint)."""
        if self.newest_checkpoint is None:
            return [c.fields for c in self.commits]
        root = os.path.dirname(os.path.normpath(self.newest_checkpoint))
        return [c.fields for c in self.commits
                if os.path.dirname(os.path.normpath(c.directory)) == root]

    def mean_iteration_ms(self, skip_first: bool = False) -> Optional[float]:
        items = sorted(self.iteration_ms.items())
        if skip_first:
            items = items[1:]  # the first iteration carries warm-up (allocation, compilation)
        return sum(v for _, v in items) / len(items) if items else None


def parse_log(lines) -> RunFigures:
    figures = RunFigures()
    own_line = False  # the last save time came from our "saved checkpoint ... in X ms" line
    for line in lines:
        m = _ITERATION.search(line)
        if m:
            figures.iteration_ms[int(m.group(1))] = float(m.group(3))
            figures.train_iters = int(m.group(2))
            own_line = False
            continue
        m = _SAVED.search(line)
        if m:
            figures.saved_iterations.append(int(m.group(1)))
            own_line = m.group(2) is not None
            if own_line:  # our trainer: "saved checkpoint at iteration N to DIR in X ms"
                figures.save_ms.append(float(m.group(2)))
            continue
        m = _SAVE_TIMER.search(line) or _BLOCKING.search(line)
        if m:
            values = [float(g) for g in m.groups() if g is not None]
            if own_line and m.re is _SAVE_TIMER:  # our trainer times the same save across ranks
                figures.save_ms[-1] = max(values)
            else:
                figures.save_ms.append(max(values))
            own_line = False
            continue
        m = _RUN.search(line)
        if m:
            figures.rc, figures.wall_seconds = int(m.group(2)), float(m.group(3))
            continue
        m = _COMMITTED.search(line)
        if m:
            fields = (f.split(":", 1) for f in m.group(2).split("|") if ":" in f)
            figures.commits.append(Commit(int(m.group(1)), m.group(3),
                                          {k.strip(): float(v) for k, v in fields}))
            figures.saved_iterations.append(int(m.group(1)))
            continue
        m = _SUMMARY.search(line)
        if m:
            figures.blocked_s = float(m.group(1))
            figures.newest_checkpoint = m.group(2) if m.group(2) not in (None, "none") else None
    return figures


CSV_COLUMNS = (
    "experiment", "model", "dp", "nodes", "variant", "iterations", "save_interval", "rc", "wall_seconds",
    "iterations_logged", "mean_iteration_ms", "mean_iteration_ms_after_first", "checkpoints_saved",
    "mean_save_ms", "max_save_ms", "checkpoint_bytes", "throughput_gbps", "mean_durable_s",
    "blocked_by_checkpointing_s", "persistent_checkpoints", "persistent_mean_save_ms",
    "persistent_mean_durable_s", "log",
)
"""``mean_save_ms``/``max_save_ms``: time training was blocked per checkpoint (``RunFigures.stall_ms``);
``checkpoint_bytes``: one checkpoint, all ranks (measured on disk by the caller, else the lazy
line's); ``throughput_gbps``: checkpoint_bytes / mean_save_ms, the paper's "checkpoint throughput";
``mean_durable_s``: save call to durable on every rank (lazy saves only); these count every
level's checkpoints. ``persistent_*``: --save's alone (lazy saves; with the in-memory or node-local
level, the other levels' lines are left out), ``persistent_mean_save_ms`` as ``mean_save_ms``."""


def csv_row(figures: RunFigures, **run) -> dict:
    """One results.csv row: the run's identity (keyword arguments) plus its parsed figures."""
    def fmt(x):
        return "" if x is None else f"{x:.3f}"

    row = {k: run.get(k, "") for k in CSV_COLUMNS}
    stalls = figures.stall_ms()
    mean_stall = _mean(stalls)
    lazy_bytes = [c.fields["bytes"] for c in figures.commits if "bytes" in c.fields]
    nbytes = run.get("checkpoint_bytes") or (max(lazy_bytes) if lazy_bytes else None)
    row.update(
        rc="" if figures.rc is None else figures.rc,
        wall_seconds=fmt(figures.wall_seconds),
        iterations_logged=len(figures.iteration_ms),
        mean_iteration_ms=fmt(figures.mean_iteration_ms()),
        mean_iteration_ms_after_first=fmt(figures.mean_iteration_ms(skip_first=True)),
        checkpoints_saved=len(set(figures.saved_iterations)),
        mean_save_ms=fmt(mean_stall),
        max_save_ms=fmt(max(stalls) if stalls else None),
        checkpoint_bytes="" if nbytes is None else int(nbytes),
        throughput_gbps=fmt(nbytes / mean_stall / 1e6 if nbytes and mean_stall else None),
        mean_durable_s=fmt(_mean(c.fields.get("durable (s)") for c in figures.commits)),
        blocked_by_checkpointing_s=fmt(figures.blocked_s),
    )
    persistent = figures.persistent()
    if persistent:
        row.update(persistent_checkpoints=len(persistent),
                   persistent_mean_save_ms=fmt(_mean(p.get("stall (ms)") for p in persistent)),
                   persistent_mean_durable_s=fmt(_mean(p.get("durable (s)") for p in persistent)))
    return row


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None
