"""Merging committed checkpoints into universal ones in a separate, low-priority process.

Policy (`MergeQueue.LATEST`): at most one merge process runs; a commit that arrives meanwhile
waits as the single pending job, and a newer one replaces it (the replaced iteration is reported
as skipped). So merges never pile up, and the newest checkpoint is always merged eventually.

Call order (one process, e.g. rank 0 of the trainer):
  1) `on_commit(iteration, directory)` after each checkpoint is committed (every N-th is merged);
  2) `poll()` now and then (e.g. every iteration): reaps a finished merge, starts the pending one;
  3) `wait()` before exiting: lets the running and the pending merge finish.
Retention asks `iterations_in_use()` (any time) which sources it must keep.
The merge runs as ``nice -n <nice> [ionice -c 3] python -m datastates.megatron_adapter.merge``: a process,
not a thread, so its reads, copies and writes never hold the trainer's GIL, and the scheduler
gives it only the CPU and disk time training leaves idle.
"""
from __future__ import annotations

import enum
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from .merge import TELEMETRY_FILE
from .paths import checkpoint_dir


def _die_with_parent() -> None:
    """In the merge child, before exec: SIGKILL it when the trainer process dies (Linux
    PR_SET_PDEATHSIG), so a crashed or killed rank 0 never leaves a merge running. A merge
    killed this way leaves only a .tmp- directory (see writer.py); the next merge removes it."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the merge then finishes on its own


class MergeQueue(str, enum.Enum):
    """What happens to a commit that arrives while a merge runs."""

    LATEST = "latest"  # keep only the newest waiting commit (queue of one)


@dataclass(frozen=True)
class MergerConfig:
    root: str
    """Universal root: ``<root>/iter_XXXXXXX`` checkpoints, its own tracker and telemetry."""
    every_n: int = 1
    """Merge every N-th committed checkpoint."""
    nice: int = 19
    """Niceness of the merge process (19 = lowest CPU priority)."""
    idle_io: bool = True
    """Run the merge in the idle I/O class (``ionice -c 3``) when ionice is installed."""
    max_file_bytes: int = 2 << 30
    """Split the universal safetensors files at this size."""
    max_bytes_per_s: Optional[float] = None
    """Throttle the merge's throughput (None: as fast as the low priority allows)."""
    queue: MergeQueue = MergeQueue.LATEST
    """Policy for commits that arrive while a merge runs."""


@dataclass
class _Job:
    iteration: int
    source: str
    output: str
    proc: Optional[subprocess.Popen] = None
    log_path: str = ""
    started: float = field(default_factory=time.time)


class BackgroundMerger:
    def __init__(self, config: MergerConfig, log: Callable[[str], None] = print):
        self.config = config
        self.log = log
        self.commits = 0
        self.running: Optional[_Job] = None
        self.pending: Optional[_Job] = None
        self.results: List[dict] = []
        os.makedirs(config.root, exist_ok=True)

    def output_dir(self, iteration: int) -> str:
        return checkpoint_dir(self.config.root, iteration)

    # 1) ---------------------------------------------------------------------------------------
    def on_commit(self, iteration: int, directory: str) -> None:
        self.commits += 1
        if self.commits % self.config.every_n:
            return
        job = _Job(iteration, directory, self.output_dir(iteration))
        if self.running is None:
            self._start(job)
            return
        if self.pending is not None:
            self.log(f" universal merge iteration {self.pending.iteration:8d} | skipped: "
                     f"iteration {iteration} committed while a merge was running")
            self._record({"iteration": self.pending.iteration, "skipped_for": iteration})
        self.pending = job

    # 2) ---------------------------------------------------------------------------------------
    def poll(self) -> None:
        if self.running is not None and self.running.proc.poll() is not None:
            self._reap(self.running)
            self.running = None
        if self.running is None and self.pending is not None:
            job, self.pending = self.pending, None
            self._start(job)

    def iterations_in_use(self) -> List[int]:
        """The sources of the running and the waiting merge, which retention must keep: the
        merge process holds its source (`fileio.hold_for_reading`) only once it has started."""
        return [job.iteration for job in (self.running, self.pending) if job is not None]

    # 3) ---------------------------------------------------------------------------------------
    def wait(self) -> None:
        while self.running is not None:
            self.running.proc.wait()
            self.poll()

    def _command(self, job: _Job) -> List[str]:
        c = self.config
        cmd = [sys.executable, "-m", "datastates.megatron_adapter.merge", "--source", job.source,
               "--output", job.output, "--root", c.root, "--max-file-bytes", str(c.max_file_bytes)]
        if c.max_bytes_per_s:
            cmd += ["--max-bytes-per-s", str(c.max_bytes_per_s)]
        prefix = ["nice", "-n", str(c.nice)] if shutil.which("nice") else []
        if c.idle_io and shutil.which("ionice"):
            prefix += ["ionice", "-c", "3"]
        return prefix + cmd

    def _start(self, job: _Job) -> None:
        logs = os.path.join(self.config.root, "merge_logs")
        os.makedirs(logs, exist_ok=True)
        job.log_path = os.path.join(logs, os.path.basename(checkpoint_dir(logs, job.iteration))
                                    + ".log")
        # One thread of each math library: the merge copies bytes, it must not compete with
        # training for both cores.
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        with open(job.log_path, "w") as out:
            job.proc = subprocess.Popen(self._command(job), stdout=out, stderr=subprocess.STDOUT,
                                        env=env, stdin=subprocess.DEVNULL,
                                        preexec_fn=_die_with_parent)
        job.started = time.time()
        self.running = job

    def _reap(self, job: _Job) -> None:
        with open(job.log_path) as f:
            lines = f.read().splitlines()
        wall = time.time() - job.started
        if job.proc.returncode == 0:
            result = dict(json.loads(lines[-1]), process_s=round(wall, 3))
            # The merge's own line times reading and writing; process (s) adds interpreter
            # start-up and the wait for CPU at low priority.
            line = next((x for x in lines if x.startswith(" universal merge")), lines[-1])
            self.log(f"{line} | process (s): {wall:.1f}")
            self.results.append(result)
        else:
            tail = " | ".join(lines[-3:])
            self.log(f" universal merge iteration {job.iteration:8d} | FAILED (exit "
                     f"{job.proc.returncode}), see {job.log_path}: {tail}")
            self._record({"iteration": job.iteration, "error": job.proc.returncode,
                          "log": job.log_path})

    def _record(self, doc: dict) -> None:
        with open(os.path.join(self.config.root, TELEMETRY_FILE), "a") as f:
            f.write(json.dumps(dict(doc, time=time.time())) + "\n")
