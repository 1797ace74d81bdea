"""When checkpoints are written, for every format: the one base class the training loop drives.

Layout on disk (`datastates.megatron_adapter.paths`): ``SAVE/iter_0000010/`` holds one checkpoint;
``SAVE/latest_checkpointed_iteration.txt`` names the newest complete one and is written (rank 0,
into space set aside at start-up) only after every rank's part is durable, so a loader never trusts
a partial directory. Megatron-LM's `global` non-persistent checkpoints
(--non-persistent-save-interval) are saved the same way, by the same format, into a second root
(`CheckpointConfig.non_persistent_root`) that keeps only its newest checkpoint; a save is
non-persistent where its interval is due and the persistent one is not.

Call order, every rank:
  0) `start()` once before training (`make_checkpoint_manager` calls it): rank 0 creates --save
     and the tracker's spare, for every format;
  1) `before_optimizer_step()` each step, after forward/backward, before ``optimizer.step()``;
  2) `maybe_save(state, force=False)` right after the optimizer step of the iteration;
  3) `after_iteration(iteration)` at the end of each iteration (non-blocking; with
     --save-interval auto, rank 0 also times the iteration here);
  4) `finalize()` once at the end (or exit interval / SIGTERM): drain in-flight saves.
Every save call is followed by Megatron's `(min, max) time across ranks (ms):` report of
`save-checkpoint` (one all-reduce on the checkpoint control plane); each complete checkpoint is
reported to `metrics` on rank 0 as a `CheckpointRecord`.
A format is one subclass implementing `_save` (and the hooks it needs), registered in
`checkpoint_formats.MANAGERS`; the public methods here keep the shared policy (interval, start-up,
tracker, retention) in one place so no format can skip it.
"""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from datastates import control_plane
from datastates.megatron_adapter import expand_local_dir, paths

from megatron.training.checkpoint_contents import TrainState
from megatron.training.config import RunConfig
from megatron.training.log import print_rank_0
from megatron.training.metrics import CheckpointRecord, Metrics
from megatron.training.retention import apply_retention, remove_now
from megatron.training.save_interval import AutoInterval, Decision
from megatron.training.timers import report_times_across_ranks


def non_persistent_root_of_this_rank(config: RunConfig, base: Optional[str] = None,
                                     saving: bool = True) -> Optional[str]:
    """Where this rank saves (`saving`) or, beside the root `base` (--load), looks for
    non-persistent checkpoints; None: it does not. The global root, or for the local type its
    node-local root with the placeholders filled in."""
    ckpt = config.checkpoint
    root = ckpt.non_persistent_save_root() if saving else ckpt.non_persistent_root(base)
    if root is not None and ckpt.non_persistent_ckpt_type == "local":
        root = expand_local_dir(root, dist.get_rank(), flag="--non-persistent-local-ckpt-dir")
    return root


class CheckpointManager:
    """Saving policy for one format; subclasses implement `_save`."""

    #: A synchronous save logs its duration when the call returns; a lazy one logs at commit.
    log_save_calls = True

    def __init__(self, config: RunConfig):
        self.config = config
        self.ckpt = config.checkpoint
        #: Where complete checkpoints and save times are reported (`make_checkpoint_manager`).
        self.metrics = Metrics.off(config)
        #: Root of the non-persistent checkpoints (None: off).
        self.non_persistent_root = non_persistent_root_of_this_rank(config)
        #: Whether the newest save `maybe_save` made (or reported made) went to --save.
        self.last_save_persistent = False
        # Stock formats, rank 0 only: save-call start, its duration and the time until complete,
        # per (root, iteration), until its record is reported.
        self._save_started: Dict[Tuple[str, int], float] = {}
        self._save_call_s: Dict[Tuple[str, int], float] = {}
        self._durable_s: Dict[Tuple[str, int], float] = {}
        #: --save-interval auto (`start_auto_interval`); None: the fixed --save-interval.
        self.auto: Optional[AutoInterval] = None
        self._iteration_t0: Optional[float] = None

    def start_auto_interval(self, start_iteration: int) -> None:
        """Every rank, once the resumed iteration is known (before the first iteration)."""
        if not self.ckpt.save_interval_auto:
            return

        def agree(proposal: int) -> int:
            return int(control_plane.all_reduce([proposal], op=dist.ReduceOp.MAX)[0])

        def report(iteration: int, decision: Decision) -> None:
            self.metrics.checkpoint_interval(iteration, decision.interval, decision.cost_s)

        self.auto = AutoInterval(self.ckpt.mtbf_hours, start_iteration, dist.get_rank() == 0,
                                 agree, print_rank_0, report)
        self._iteration_t0 = time.perf_counter()

    # 0) every rank, once
    def start(self) -> None:
        if dist.get_rank() == 0:
            for root in self.roots():
                paths.prepare_root(root)

    def roots(self) -> List[str]:
        """Where this run saves: --save, then the non-persistent root if any."""
        if not self.ckpt.save:
            return []
        return [self.ckpt.save] + ([self.non_persistent_root] if self.non_persistent_root else [])

    # 1) hook point for lazy snapshots; stock formats copy nothing and need not wait.
    def before_optimizer_step(self) -> None:
        pass

    def should_save(self, iteration: int) -> bool:
        if self.auto is not None:
            return bool(self.ckpt.save) and self.auto.should_save(iteration)
        interval = self.ckpt.save_interval
        return bool(self.ckpt.save and interval and iteration % interval == 0)

    def non_persistent_due(self, iteration: int) -> bool:
        """Megatron-LM's rule: a non-persistent save where its interval is due and the
        persistent one (`should_save`) is not."""
        interval = self.ckpt.non_persistent_save_interval
        return bool(self.non_persistent_root and iteration % interval == 0
                    and not self.should_save(iteration))

    # 2) every rank, after optimizer.step()
    def maybe_save(self, state: TrainState, force: bool = False) -> bool:
        iteration = state.iteration
        if not self.ckpt.save:
            return False
        if force or self.should_save(iteration):
            root = self.ckpt.save
        elif self.non_persistent_due(iteration):
            root = self.non_persistent_root
        else:
            return False
        persistent = root == self.ckpt.save
        decided = self._decided(iteration, root)
        if decided is not None:
            self.last_save_persistent = persistent and decided
            return decided
        self.last_save_persistent = persistent
        start = time.time()
        track = self.log_save_calls and dist.get_rank() == 0
        if track:
            self._save_started[root, iteration] = start
        self._save(state, root)
        seconds = time.time() - start
        if self.log_save_calls:
            print_rank_0(f"saved {'' if persistent else 'non-persistent '}checkpoint at iteration "
                         f"{iteration:7d} to {root} in {seconds * 1000:.1f} ms (format "
                         f"{self.ckpt.ckpt_format.value}{', async' if self.ckpt.async_save else ''})")
        if track:
            self._save_call_s[root, iteration] = seconds
            self._report_complete(iteration, root)
        timer = "save-checkpoint" if persistent else "save-checkpoint-non-persistent"
        slowest = report_times_across_ranks(timer, seconds)  # Megatron-LM's timer names
        self.metrics.timer(timer, slowest, iteration)
        if self.auto is not None and persistent:
            self.auto.saved(iteration)
        return True

    # 3) every rank, end of each iteration
    def after_iteration(self, iteration: int) -> None:
        self._poll(iteration)
        if self.auto is not None and self.auto.is_rank0:
            now = time.perf_counter()
            self.auto.iteration_done(now - self._iteration_t0)
            self._iteration_t0 = now

    # 4) every rank, once
    def finalize(self) -> None:
        pass

    # -- for subclasses ------------------------------------------------------------------------
    def _save(self, state: TrainState, root: str) -> None:
        """Save `state` as ROOT/iter_NNNNNNN (`root`: --save or the non-persistent root)."""
        raise NotImplementedError

    def _poll(self, iteration: int) -> None:
        """End of each iteration: progress of saves in flight (non-blocking)."""

    def _record(self, record: CheckpointRecord) -> None:
        """Rank 0: a checkpoint is complete; report it (metrics, the auto interval)."""
        self.metrics.checkpoint(record)
        if self.auto is not None:
            self.auto.record(record.iteration, record.stall_ms / 1e3, record.durable_s)

    def _decided(self, iteration: int, root: str) -> Optional[bool]:
        """None to save `iteration` into `root` now; True/False to report it saved/not saved
        without a new save (e.g. saving switched off by a failure policy, or this iteration
        already in flight)."""
        return None

    def _complete(self, iteration: int, root: str) -> None:
        """Rank 0 only, once `iteration` is durable on every rank: move `root`'s tracker, then
        apply retention. Stock formats call it; the lazy format's adapter moves the tracker
        itself and calls `_after_commit`."""
        if dist.get_rank() == 0:
            paths.write_tracker(root, iteration, self.config.to_json())
            self._after_commit(iteration, root)
            if (root, iteration) in self._save_started:
                self._durable_s[root, iteration] = (
                    time.time() - self._save_started.pop((root, iteration)))
                self._report_complete(iteration, root)

    def _report_complete(self, iteration: int, root: str) -> None:
        """Rank 0: the record of a stock-format checkpoint once both its save call returned and it
        is complete (a synchronous save completes inside the call, an --async-save one later).
        Its bytes are the files of its directory."""
        key = (root, iteration)
        if key not in self._durable_s or key not in self._save_call_s:
            return
        call_s, durable_s = self._save_call_s.pop(key), self._durable_s.pop(key)
        directory = paths.checkpoint_dir(root, iteration)
        self._record(CheckpointRecord(
            iteration=iteration, bytes=_directory_bytes(directory), stall_ms=call_s * 1e3,
            durable_s=durable_s))

    def _after_commit(self, iteration: int, root: str) -> None:
        """Rank 0, right after `root`'s tracker moved to `iteration`: retention (the
        non-persistent root keeps its newest checkpoint only, as Megatron-LM). Saves still in
        flight are newer than `iteration`, so retention never reaches them; checkpoints that
        `_in_use` names or another process reads are kept for now."""
        persistent = root == self.ckpt.save
        keep = self.ckpt.keep_last_n_checkpoints if persistent else 1
        done = apply_retention(root, keep, iteration,
                               in_flight=self._in_use() if persistent else [],
                               remove=self._remove)
        if done.kept_in_use:
            print_rank_0(f"retention: keeping iteration(s) {done.kept_in_use} under "
                         f"{root} for now: a merge or a converter is reading them")

    def _in_use(self) -> List[int]:
        """Rank 0: iterations under --save that retention must keep for now although they are
        old enough to go (e.g. the source of a merge that waits or is starting)."""
        return []

    def _remove(self, trash: str) -> None:
        """Rank 0: delete a checkpoint retention has renamed out of the `iter_*` namespace."""
        remove_now(trash)


def _directory_bytes(directory: str) -> int:
    """Bytes of the files under `directory` (0 for what vanished meanwhile, e.g. retention)."""
    total = 0
    for top, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(top, name))
            except OSError:
                pass
    return total
