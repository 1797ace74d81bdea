"""Megatron-LM's --log-progress: ``<save>/progress.txt``, one line per event of the jobs that
train into the same --save, so the progress of a run across its restarts is read in one place.

Each line is ``<time>\\tJob ID: <SLURM_JOB_ID>\\t# GPUs: <world size>\\t<event>`` with the events
Megatron-LM writes: ``Starting job``; ``Saved checkpoint`` (a synchronous save) or ``Saving
async checkpoint`` (--async-save, --async-lazy-save: at the save call), each with the iteration,
this job's and the cumulative throughput (TFLOP/s per GPU), the floating-point operations and
tokens so far; ``Saved async checkpoint`` once such a save is complete (committed on every rank);
``Deleted checkpoint`` when retention removes one. Persistent (--save) checkpoints only. Rank 0
appends; the cumulative throughput counts from the first ``Starting job`` of the newest stretch
of jobs at this world size, as Megatron-LM reads the file back.
"""
from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Optional, Tuple

FILENAME = "progress.txt"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


class ProgressLog:
    """The progress file of one --save directory (`enabled` False, or no --save: nothing is
    written). Rank 0 calls it; every method is one append."""

    def __init__(self, save: Optional[str], world_size: int, enabled: bool):
        self.path = os.path.join(save, FILENAME) if (save and enabled) else None
        self.world_size = world_size
        self._job_start: Optional[Tuple[float, float]] = None  # (time, FLOPs) at Starting job

    def start_job(self, flops_so_far: float) -> None:
        self._job_start = (time.time(), flops_so_far)
        self._append("Starting job")

    def saved(self, iteration: int, flops_so_far: float, tokens_so_far: int,
              asynchronous: bool) -> None:
        """A persistent save call returned (complete, unless `asynchronous`)."""
        if self.path is None:
            return
        started, flops_at_start = self._job_start or (time.time(), flops_so_far)
        per_gpu = 1e12 * self.world_size
        job = (flops_so_far - flops_at_start) / (max(time.time() - started, 1e-9) * per_gpu)
        first_start, first_flops = self._stretch_start()
        cumulative = (flops_so_far - first_flops) / (
            max((datetime.now() - first_start).total_seconds(), 1e-9) * per_gpu)
        self._append(f"{'Saving async checkpoint' if asynchronous else 'Saved checkpoint'}\t"
                     f"Iteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
                     f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                     f"Floating-point operations: {flops_so_far:.2e}\t"
                     f"Tokens (in billions): {tokens_so_far / 1e9:.2f}")

    def committed(self, iteration: int) -> None:
        """An asynchronous persistent save became complete."""
        self._append(f"Saved async checkpoint\tIteration: {iteration}")

    def deleted(self, iteration: int) -> None:
        self._append(f"Deleted checkpoint\tIteration: {iteration}")

    def _append(self, event: str) -> None:
        if self.path is None:
            return
        job = os.environ.get("SLURM_JOB_ID", "")
        with open(self.path, "a") as f:
            f.write(f"{datetime.now().strftime(_TIME_FORMAT)}\tJob ID: {job}\t"
                    f"# GPUs: {self.world_size}\t{event}\n")

    def _stretch_start(self) -> Tuple[datetime, float]:
        """(the time of the first ``Starting job`` of the newest stretch of lines at this world
        size, the FLOPs of the last ``Saved checkpoint`` before it), as Megatron-LM reads them;
        lines it cannot read are passed over."""
        start, start_flops, latest_flops = None, 0.0, 0.0
        with open(self.path) as f:
            for line in f:
                fields = line.rstrip("\n").split("\t")
                try:
                    world = int(fields[2].split(": ")[1])
                    if fields[3] == "Saved checkpoint":
                        latest_flops = float(fields[7].split(": ")[1])
                except (IndexError, ValueError):
                    continue
                if world != self.world_size:
                    start = None
                elif fields[3] == "Starting job" and start is None:
                    try:
                        start = datetime.strptime(fields[0], _TIME_FORMAT)
                    except ValueError:
                        continue
                    start_flops = latest_flops
        return (start or datetime.now()), start_flops
