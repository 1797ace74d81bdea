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
     and the tracker's spare, every rank checks that it can write there (one agreement: a
     read-only or full file system stops every rank with one error before training starts), and
     rank 0 tells every rank which iterations already have a version directory;
  1) `before_optimizer_step()` each step, after forward/backward, before ``optimizer.step()``;
  2) `maybe_save(state, force=False)` right after the optimizer step of the iteration;
  3) `after_iteration(iteration)` at the end of each iteration (non-blocking; with
     --save-interval auto, rank 0 also times the iteration here);
  4) `finalize()` once at the end (or exit interval / SIGTERM): drain in-flight saves.
A committed checkpoint is never rewritten: those newer than the iteration a run starts from (a
rollback, another run's) are moved whole into ``ROOT/superseded-*`` before its first iteration
(`set_aside_newer`), a save that still falls on a complete one (the checkpoint --finetune loaded)
is skipped with one line, and leftovers of an unfinished save of that iteration are set aside
before a new one starts (`paths.set_aside`). A step that can fail on some ranks only is agreed on
(`control_plane.agree`) before the next collective, so every rank raises the same error.
Every save call is followed by Megatron's `(min, max) time across ranks (ms):` report of
`save-checkpoint` (one all-reduce on the checkpoint control plane); each complete checkpoint is
reported to `metrics` on rank 0 as a `CheckpointRecord`.
A format is one subclass implementing `_save` (and the hooks it needs), registered in
`formats.MANAGERS`; the public methods here keep the shared policy (interval, start-up,
tracker, retention) in one place so no format can skip it.
"""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from datastates import control_plane
from datastates.megatron_adapter import expand_local_dir, paths, prepare_and_probe_root
from datastates import CheckpointError
from datastates.faults import fail_point
from datastates.storage_errors import explain

from megatron.training.checkpointing.contents import TrainState
from megatron.training.config import RunConfig
from megatron.training.log import print_rank_0
from megatron.training.metrics import CheckpointRecord, Metrics
from megatron.training.model import params_gathered
from megatron.training.checkpointing.progress import ProgressLog
from megatron.training.checkpointing.retention import apply_retention, remove_now
from megatron.training.checkpointing.save_interval import AutoInterval, Decision
from megatron.training.timers import report_times, report_times_across_ranks


def non_persistent_root_of_this_rank(config: RunConfig, base: Optional[str] = None,
                                     saving: bool = True) -> Optional[str]:
    """Where this rank saves (`saving`) or, beside the root `base` (--load), looks for
    non-persistent checkpoints; None: it does not. The global root, or for the local type its
    node-local root with the placeholders filled in."""
    ckpt = config.checkpoint
    root = ckpt.non_persistent_save_root() if saving else ckpt.non_persistent_root(base)
    if root is not None and ckpt.non_persistent_node_local:
        root = expand_local_dir(root, dist.get_rank(), flag="--non-persistent-local-ckpt-dir")
    return root


#: How log lines name a non-persistent level.
LEVEL_NAMES = {"global": "non-persistent", "local": "node-local", "in_memory": "in-memory"}


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
        #: --non-persistent-save-interval auto: the non-persistent level's own.
        self.auto_non_persistent: Optional[AutoInterval] = None
        self._iteration_t0: Optional[float] = None
        #: Saves started by `maybe_save` (the summary's count; skipped and in-flight saves apart).
        self.saves_started = 0
        #: Rank 0: saves that became complete (their tracker moved), counted in `_after_commit`.
        self.saves_committed = 0
        #: Per root, as rank 0 found it at `start()`: iterations with a complete version
        #: (never saved again) and with an unfinished save's leftovers (set aside first).
        self.complete_at_start: Dict[str, List[int]] = {}
        self.leftovers_at_start: Dict[str, List[int]] = {}
        self._saved: Dict[str, set] = {}  # per root: iterations this run has saved
        #: Persistent saves that fell due while the previous one was still in flight
        #: (`_persistent_busy`) and were not started at their iteration (latest wins).
        self.saves_deferred = 0
        #: Versions the replica check (--ckpt-verify-replicas) refused: never committed.
        self.saves_refused = 0
        #: The oldest such iteration not yet followed by a persistent save (None: none).
        self.deferred_since: Optional[int] = None
        #: --log-progress: <save>/progress.txt, written by rank 0 (a no-op elsewhere).
        self.progress = ProgressLog(self.ckpt.save, config.parallel.world_size,
                                    config.logging.log_progress and dist.get_rank() == 0)

    def begin_training(self, start_iteration: int, loaded: Optional[str] = None) -> None:
        """Every rank, once the resumed iteration is known (before the first iteration);
        `loaded`: the checkpoint directory it was loaded from (None: none)."""
        self.set_aside_newer(start_iteration, loaded)
        self.start_auto_interval(start_iteration)

    def set_aside_newer(self, start_iteration: int, loaded: Optional[str] = None) -> None:
        """Every rank (collective where there is something to do), before the first iteration:
        complete checkpoints under a shared root (--save, the global non-persistent root) that
        are newer than the iteration this run starts from are another run's states of those
        iterations: a rollback (--ckpt-step, an edited tracker), --ckpt-fallback-to-previous
        past a damaged one, another job's --save, a restart after a kill between a commit
        marker and its tracker. This run saves those iterations anew, so they must neither
        hold back its saves nor ever be taken for its own (a restart would resume the other
        run). Rank 0 first moves the tracker back to the newest remaining complete checkpoint
        (or removes it where none is left), then moves them, whole and untouched, into
        ``ROOT/superseded-<time>-by-iter_N/`` (nothing saved is lost: delete it when no longer
        needed); agreed on. The checkpoint the run loaded stays where it is (--finetune starts
        at iteration 0 from a newer one). Node-local roots are each node's
        (`LazyCheckpointManager.begin_training`)."""
        node_local = self.ckpt.non_persistent_node_local
        for root in self.roots():
            if node_local and root == self.non_persistent_root:
                continue
            complete = self.complete_at_start.get(root, [])
            newer = newer_than(root, complete, start_iteration, loaded)
            if not newer:
                continue
            self.agreed(lambda: self.supersede(root, complete, newer, start_iteration)
                        if dist.get_rank() == 0 else None,
                        f"setting aside the checkpoints newer than iteration {start_iteration}",
                        root, None)
            self.complete_at_start[root] = [it for it in complete if it not in newer]

    def supersede(self, root: str, complete: List[int], newer: List[int], start_iteration: int,
                  then: str = "this run saves those iterations anew") -> None:
        """Rank 0, `set_aside_newer`: `newer` (of the complete iterations `complete` under
        `root`) moved into ``root/superseded-*``, the tracker first (`paths.supersede`); then
        the line that says where."""
        older = [it for it in complete if it <= start_iteration]  # none of them is newer
        aside = paths.superseded_dir(root, start_iteration)
        paths.supersede(root, newer, aside, older[-1] if older else None)
        listed = (", ".join(map(str, newer)) if len(newer) <= 8 else
                  f"{newer[0]}, {newer[1]}, ..., {newer[-1]} ({len(newer)} checkpoints)")
        print_rank_0(f"set aside iteration(s) {listed} of {root}: newer than iteration "
                     f"{start_iteration}, which this run starts from (another run's states of "
                     f"those iterations); moved whole to {aside} (delete it when no longer "
                     f"needed); {then}")

    def start_auto_interval(self, start_iteration: int) -> None:
        """Every rank, once the resumed iteration is known (before the first iteration)."""
        if not self.ckpt.save_interval_auto:
            return

        def agree(proposal: int) -> int:
            return int(control_plane.all_reduce([proposal], op=dist.ReduceOp.MAX)[0])

        def report(level: str):
            def write(iteration: int, decision: Decision) -> None:
                self.metrics.checkpoint_interval(iteration, decision.interval, decision.cost_s,
                                                 level)
            return write

        rank0 = dist.get_rank() == 0
        self.auto = AutoInterval(self.ckpt.mtbf_hours, start_iteration, rank0, agree,
                                 print_rank_0, report("persistent"))
        if self.ckpt.non_persistent_save_interval_auto and self.non_persistent_root:
            kind = self.ckpt.non_persistent_ckpt_type
            self.auto_non_persistent = AutoInterval(
                self.ckpt.mtbf_hours, start_iteration, rank0, agree, print_rank_0,
                report(kind), level=LEVEL_NAMES.get(kind, kind), queues=kind != "in_memory")
        self._iteration_t0 = time.perf_counter()

    # 0) every rank, once
    def start(self) -> None:
        rank0 = dist.get_rank() == 0
        for root in self.roots():
            prepare_and_probe_root(root, self._flag_of(root), prepares=rank0)
        self.scan_existing()

    def _flag_of(self, root: str) -> str:
        if root == self.ckpt.save:
            return "--save"
        kind = self.ckpt.non_persistent_ckpt_type
        if kind == "in_memory":
            return "--non-persistent-ckpt-type in_memory"
        return f"--non-persistent-{kind}-ckpt-dir"

    def scan_existing(self) -> None:
        """Every rank (collective): which iterations each root already holds, as rank 0 sees
        them (one broadcast), so that every rank decides the same way at each save. Keyed by
        each rank's own name of the root: a node-local root's path differs between nodes."""
        found = [None]
        if dist.get_rank() == 0:
            found = [[paths.existing_iterations(root) for root in self.roots()]]
        dist.broadcast_object_list(found, src=0, group=control_plane.control_group())
        for root, (complete, incomplete) in zip(self.roots(), found[0]):
            self.complete_at_start[root] = complete
            self.leftovers_at_start[root] = incomplete

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

    def _non_persistent_interval_due(self, iteration: int) -> bool:
        if not self.non_persistent_root:
            return False
        if self.auto_non_persistent is not None:
            return self.auto_non_persistent.should_save(iteration)
        interval = self.ckpt.non_persistent_save_interval
        return bool(interval and iteration % interval == 0)

    def _times_reported_at_commit(self, root: str) -> bool:
        """Whether a save into `root` has its Megatron timer report (fastest and slowest rank's
        save call) printed when it commits, from figures its commit gathers anyway, instead of
        right after the call with a collective of its own (`_report_save_times`)."""
        return False

    def _report_save_times(self, iteration: int, root: str, low_s: float, high_s: float) -> None:
        """Every rank: Megatron's timer report of a save call into `root` (`maybe_save`'s)."""
        timer = self._timer_name(root)
        report_times(timer, low_s, high_s)
        self.metrics.timer(timer, high_s, iteration)

    def _timer_name(self, root: str) -> str:
        """Megatron-LM's timer of a save into `root`."""
        return "save-checkpoint" if root == self.ckpt.save else "save-checkpoint-non-persistent"

    def _persistent_busy(self) -> bool:
        """Whether a persistent save that falls due now is deferred (latest wins) because the
        previous one is still in flight; the same answer on every rank. Off by default: each
        format that keeps levels at their own pace says when."""
        return False

    # 2) every rank, after optimizer.step()
    def maybe_save(self, state: TrainState, force: bool = False) -> bool:
        iteration = state.iteration
        if not self.ckpt.save:
            return False
        persistent = force or self.should_save(iteration) or self.deferred_since is not None
        # --save-retain-interval's iterations are saved as such: never deferred (the save then
        # waits for the level, as every persistent save does with --lazy-save-wait-persistent).
        retained = bool(self.ckpt.save_retain_interval and self.should_save(iteration)
                        and iteration % self.ckpt.save_retain_interval == 0)
        if persistent and not force and not retained and self._persistent_busy():
            if self.deferred_since is None or self.should_save(iteration):
                self._defer(iteration)
            persistent = False
        if persistent:
            root = self.ckpt.save
            self.deferred_since = None
        elif self._non_persistent_interval_due(iteration):
            # Also where a persistent save fell due but was deferred: the faster level keeps
            # its pace.
            root = self.non_persistent_root
        else:
            return False
        persistent = root == self.ckpt.save
        decided = self._decided(iteration, root)
        if decided is not None:
            self.last_save_persistent = persistent and decided
            return decided
        self.last_save_persistent = persistent
        if iteration in self._saved.get(root, ()):
            return True  # this run saved it already (e.g. the end-of-training save after it)
        if iteration in self.complete_at_start.get(root, ()):
            self._skip_complete(iteration, root)
            return True
        self.saves_started += 1
        self._saved.setdefault(root, set()).add(iteration)
        # --save-interval auto: the next interval is agreed on (a collective) before the call,
        # not after it: a lazy save's work may then be running on the checkpointer's save
        # worker, which a collective on this thread would have to wait for.
        if self.auto is not None and persistent:
            self.auto.saved(iteration)
        elif self.auto_non_persistent is not None and not persistent:
            self.auto_non_persistent.saved(iteration)
        start = time.time()
        track = self.log_save_calls and dist.get_rank() == 0
        if track:
            self._save_started[root, iteration] = start
        with params_gathered(state.model, self.config.parallel):  # --overlap-param-gather
            self._save(state, root)
        seconds = time.time() - start
        if persistent:
            self.progress.saved(iteration, state.floating_point_operations_so_far,
                                state.consumed_train_samples * self.config.model.seq_length,
                                asynchronous=self._asynchronous)
        if self.log_save_calls:
            print_rank_0(f"saved {'' if persistent else 'non-persistent '}checkpoint at iteration "
                         f"{iteration:7d} to {root} in {seconds * 1000:.1f} ms (format "
                         f"{self.ckpt.ckpt_format.value}{', async' if self.ckpt.async_save else ''})")
        if track:
            self._save_call_s[root, iteration] = seconds
            self._report_complete(iteration, root)
        if not self._times_reported_at_commit(root):  # else the same line, once committed
            timer = self._timer_name(root)
            slowest = report_times_across_ranks(timer, seconds)
            self.metrics.timer(timer, slowest, iteration)
        return True

    def _defer(self, iteration: int) -> None:
        """Every rank: the persistent save due at `iteration` waits for the level to free up,
        which then takes the newest iteration (latest wins); one line, counted in the summary
        and in TensorBoard."""
        self.saves_deferred += 1
        if self.deferred_since is None:
            self.deferred_since = iteration
        print_rank_0(f"deferred the persistent save of iteration {iteration}: the previous one is "
                     f"still being written to {self.ckpt.save}; the first iteration after it is "
                     "complete is saved instead (latest wins; --lazy-save-wait-persistent waits "
                     "for every persistent save)")
        if dist.get_rank() == 0:
            self.metrics.checkpoint_deferred(iteration, self.saves_deferred)

    def replica_counts(self) -> Optional[Tuple[int, int]]:
        """(versions sent, versions skipped) by the in-memory level's peer replicas in this run,
        or None without them."""
        return None

    def _skip_complete(self, iteration: int, root: str) -> None:
        """Every rank: `iteration` is already a complete checkpoint under `root` that
        `set_aside_newer` kept (the one this run loaded, e.g. with --finetune): it stays as it
        is. Rank 0 moves the tracker to it if the tracker names an older one."""
        directory = paths.checkpoint_dir(root, iteration)
        print_rank_0(f"skipping the save of iteration {iteration}: {directory} already holds a "
                     "complete checkpoint (a committed checkpoint is never rewritten)")
        if dist.get_rank() != 0:
            return
        tracked = paths.tracked_iteration(root)
        if tracked is None or tracked < iteration:
            try:
                paths.write_tracker(root, iteration, self.config.to_json())
            except OSError as err:
                print_rank_0(f"WARNING: could not move {paths.TRACKER_FILENAME} under {root} to "
                             f"iteration {iteration}: {explain(err, self._flag_of(root), root)}")

    def prepare_version_dir(self, root: str, iteration: int) -> str:
        """Every rank (collective), at a save call of a stock format: rank 0 sets aside an
        earlier unfinished save's leftovers of `iteration` and creates its directory; agreed."""
        directory = paths.checkpoint_dir(root, iteration)

        def prepare() -> None:
            if dist.get_rank() == 0:
                fail_point("prepare", iteration, 0, directory)
                self.set_aside_leftovers(root, iteration)
                os.makedirs(directory, exist_ok=True)

        self.agreed(prepare, f"saving iteration {iteration}", root, iteration)
        return directory

    def set_aside_leftovers(self, root: str, iteration: int) -> None:
        """Rank 0, before a save of `iteration` into `root`: an unfinished earlier save's
        directory is renamed out of the way (`paths.set_aside`) and removed."""
        aside = paths.set_aside(paths.checkpoint_dir(root, iteration))
        if aside is not None:
            print_rank_0(f"moved the leftovers of an earlier, unfinished save of iteration "
                         f"{iteration} aside ({aside}); removing them")
            self._remove(aside)

    def agreed(self, fn, what: str, root: Optional[str], iteration: Optional[int]):
        """Every rank: `control_plane.agree(fn, what)`, the error worded for `root`'s storage and
        completed with what is on disk (the newest complete checkpoint, this one's state)."""
        flag = self._flag_of(root) if root else "--save"
        try:
            return control_plane.agree(fn, what, describe=lambda err: _describe(err, flag, root))
        except CheckpointError as err:
            if getattr(err, "says_what_is_on_disk", False):
                raise  # an agreement inside `fn` already said it
            full = type(err)(err.reason + _on_disk(root, iteration), rank=err.rank,
                             file=err.file, ranks=err.ranks)
            full.says_what_is_on_disk = True
            raise full from err.__cause__

    # 3) every rank, end of each iteration
    def after_iteration(self, iteration: int) -> None:
        self._poll(iteration)
        if self.auto is not None and self.auto.is_rank0:
            now = time.perf_counter()
            for auto in (self.auto, self.auto_non_persistent):
                if auto is not None:
                    auto.iteration_done(now - self._iteration_t0)
            self._iteration_t0 = now

    def validation_done(self, iteration: int, t_start: float, t_end: float) -> None:
        """Every rank, after a validation run at `iteration` (wall-clock `t_start`..`t_end`): the
        lazy format adds it to the timeline's telemetry; the stock formats keep none."""

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
        # Each level's records set its own interval.
        auto = self.auto if record.level == "persistent" else self.auto_non_persistent
        if auto is not None:
            auto.record(record.iteration, record.stall_ms / 1e3, record.durable_s)

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
            fail_point("tracker", iteration, 0, os.path.join(root, paths.TRACKER_FILENAME))
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
            durable_s=durable_s, level="persistent" if root == self.ckpt.save
            else self.ckpt.non_persistent_ckpt_type))

    def _after_commit(self, iteration: int, root: str) -> None:
        """Rank 0, right after `root`'s tracker moved to `iteration` (with `--async-lazy-save`
        on the checkpointer's commit thread, off the training loop): retention (the
        non-persistent root keeps its newest `keep_last_n_non_persistent`, by default one, as
        Megatron-LM). Saves still in flight are newer than `iteration`, so retention never
        reaches them; checkpoints that `_in_use` names or another process reads are kept for
        now."""
        self.saves_committed += 1
        persistent = root == self.ckpt.save
        fail_point("retention", iteration, dist.get_rank(), root)
        keep = (self.ckpt.keep_last_n_checkpoints if persistent
                else self.ckpt.keep_last_n_non_persistent)
        # The in-memory level's old version goes at once (its shard files are mostly links to
        # reused slots: cheap to remove), so every rank's slot is free for the next save.
        at_once = not persistent and self.ckpt.non_persistent_ckpt_type == "in_memory"
        done = apply_retention(root, keep, iteration,
                               in_flight=self._in_use() if persistent else [],
                               remove=remove_now if at_once else self._remove,
                               retain_every=self.ckpt.save_retain_interval if persistent else None)
        if persistent:
            if self._asynchronous:
                self.progress.committed(iteration)
            for removed in done.removed:
                self.progress.deleted(removed)
        if done.kept_in_use and not at_once:  # in memory: held while a peer replica is sent
            print_rank_0(f"retention: keeping iteration(s) {done.kept_in_use} under "
                         f"{root} for now: a merge or a converter is reading them")

    @property
    def _asynchronous(self) -> bool:
        """Whether a save call returns before its checkpoint is complete."""
        return self.ckpt.async_save or self.ckpt.async_lazy_save

    def _in_use(self) -> List[int]:
        """Rank 0: iterations under --save that retention must keep for now although they are
        old enough to go (e.g. the source of a merge that waits or is starting)."""
        return []

    def _remove(self, trash: str) -> None:
        """Rank 0: delete a checkpoint retention has renamed out of the `iter_*` namespace."""
        remove_now(trash)


def newer_than(root: str, complete: List[int], start_iteration: int,
                loaded: Optional[str]) -> List[int]:
    """Of the complete iterations `complete` under `root`, those newer than `start_iteration`,
    except the checkpoint this run loaded (`loaded`)."""
    kept = os.path.normpath(loaded) if loaded else None
    return [it for it in complete if it > start_iteration
            and os.path.normpath(paths.checkpoint_dir(root, it)) != kept]


def _describe(err: BaseException, flag: str, root: Optional[str]):
    """One rank's error for an agreed message. PyTorch DCP's CheckpointException (megatron's
    torch_dist writers) is raised on every rank, with the failing ranks' errors on the
    coordinator only: there it names them (text, ranks), elsewhere it is an echo (None)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        if not failures:
            return None
        return ("; ".join(  # each value: the exception, or (exception, its stack)
            f"the writes of rank {r} failed: "
            f"{explain(e[0] if isinstance(e, tuple) else e, flag, root)}"
            for r, e in sorted(failures.items())), sorted(failures))
    return explain(err, flag, root)


def _on_disk(root: Optional[str], iteration: Optional[int]) -> str:
    """What a failed save left, for the agreed error: the newest complete checkpoint and whether
    this one is complete."""
    if not root:
        return ""
    latest = paths.tracked_iteration(root)
    text = ("; no complete checkpoint under " + root if latest is None else
            f"; the newest complete checkpoint is iteration {latest} "
            f"({paths.TRACKER_FILENAME} names it) and is intact")
    if iteration is not None and latest != iteration:
        if paths.is_complete(paths.checkpoint_dir(root, iteration)):
            text += (f"; iteration {iteration} is complete but {paths.TRACKER_FILENAME} could not "
                     f"be moved to it: --load uses the iteration the tracker names")
        else:
            text += (f"; iteration {iteration} is not complete: its directory is never loaded, "
                     "and the next save of that iteration sets it aside")
    return text + ". Nothing that was saved before was changed"


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
