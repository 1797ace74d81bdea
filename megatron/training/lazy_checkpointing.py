"""`--async-lazy-save`: DataStates lazy asynchronous checkpoints in Megatron's layout.

Per save, every rank (see `CheckpointManager` for the hook order):
  1) `maybe_save` right after optimizer step i: megatron-core's `dist_checkpointing.save` with our
     strategy; it returns without copying a tensor (small objects are serialized at once).
  2) forward/backward of iteration i+1 run while the engine copies the snapshot to its host cache
     and its writers drain the cache to storage.
  3) `before_optimizer_step` of iteration i+1 waits for the snapshot only if it is not done yet.
  4) `after_iteration`: a non-blocking local poll plus one all-reduce (MIN of "durable here") per
     iteration while a save is pending; once every rank is durable, all ranks run megatron's
     finalize (metadata.json), rank 0 writes the commit marker, then the tracker file.
  5) `finalize`: drain and commit everything before the process exits.
A version is reported and loadable only after step 4; a crash before leaves the previous one as
"latest".
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.training.checkpoint_state import (
    OPTIMIZER_METADATA,
    TrainState,
    build_sharded_state_dict,
)
from megatron.training.checkpointing import (
    TRACKER_FILENAME,
    CheckpointManager,
    checkpoint_dir,
    write_tracker,
)
from megatron.core.dist_checkpointing.core import CONFIG_FNAME as METADATA_FILE  # metadata.json
from megatron.training.config import CkptFailurePolicy, RunConfig
from datastates import CheckpointError as DataStatesError
from datastates import is_committed
from datastates.layout import COMMIT_FILE, make_spare, read_iteration, release_spare
from megatron.training.log import print_rank_0
from megatron.training.universal import make_background_merger

TELEMETRY_FILENAME = "datastates_checkpoints.jsonl"
#: Space set aside per version, at its save call, for each of metadata.json and COMMIT.json.
COMMIT_RESERVE_BYTES = 64 * 1024


@dataclass
class _Pending:
    iteration: int
    directory: str
    request: object  # megatron AsyncRequest: its finalize functions write metadata.json
    handle: object  # datastates SaveHandle
    stall_s: float  # time the training loop was blocked by this save
    t_start: float  # wall clock at the save call (for the timeline)
    t_returned: float  # wall clock when the save call returned


class LazyCheckpointManager(CheckpointManager):
    """Keeps a deque of saves in flight, oldest first; commits them in order."""

    def __init__(self, config: RunConfig):
        super().__init__(config)
        from datastates import Checksum, CheckpointEngine, CommitPolicy, EngineConfig

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        ckpt = config.checkpoint
        self.engine = CheckpointEngine(EngineConfig(
            rank=self.rank, world_size=self.world,
            host_cache_bytes=ckpt.lazy_save_cache_mb << 20,
            commit_policy=CommitPolicy.MANUAL,  # committed below, after every rank agrees
            checksum=Checksum(ckpt.lazy_save_checksum),
            background_nice=5))
        self.pending: Deque[_Pending] = deque()
        self.durable: Dict[int, object] = {}  # save id -> this rank's SaveRecord
        self._wrapper = None
        self._dp_group = None
        # Errors this rank hit since the last agreement, in order (a full disk can fail both
        # common.pt of the next save and the flush of the previous one: all are reported).
        self._local_errors: List[BaseException] = []
        self._telemetry_off = False
        self._failed: Optional[BaseException] = None  # an agreed failure already raised (STOP)
        self.disabled = False  # CkptFailurePolicy.CONTINUE after a failure: no more saves
        # Rank 0 runs the background universal merges (None when not asked for).
        self.universal = make_background_merger(config) if self.rank == 0 else None

    # -- 1) after optimizer step i ------------------------------------------------------------
    def _save(self, state: TrainState) -> None:
        from megatron.core import dist_checkpointing, parallel_state

        from datastates.megatron_adapter import durable_common_save, save_strategy

        t0, wall0 = time.perf_counter(), time.time()
        directory = checkpoint_dir(self.ckpt.save, state.iteration)
        if self._dp_group is None:
            self._dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        sd, extra = self._state_dict(state)
        strategy, base = save_strategy(self.engine, state.iteration, self._dp_group, self._wrapper,
                                       extra_shards=extra)
        if strategy is not base:
            self._wrapper = strategy
        request = None
        try:
            if self.rank == 0:
                os.makedirs(directory, exist_ok=True)  # megatron's save lists it on rank 0
                # Room for COMMIT.json (written into it) and metadata.json (megatron writes it:
                # released right before), taken before any shard byte of this save or a later
                # one, so a disk that the next save fills up rarely keeps this save, once
                # durable, from committing.
                make_spare(os.path.join(directory, COMMIT_FILE), COMMIT_RESERVE_BYTES)
                make_spare(os.path.join(directory, METADATA_FILE), COMMIT_RESERVE_BYTES)
            # After megatron's collectives, rank 0 writes common.pt and every rank opens its
            # shard: a full disk fails here on some ranks only, so the failure is recorded and
            # agreed on in after_iteration instead of raised (the others would wait for us).
            with durable_common_save():  # common.pt fsync'd; a full disk is an ENOSPC OSError
                request = dist_checkpointing.save(sd, directory, sharded_strategy=strategy,
                                                  async_sharded_save=True,
                                                  content_metadata=dict(OPTIMIZER_METADATA))
        except (OSError, RuntimeError, DataStatesError) as err:
            self._local_errors.append(err)
        self.pending.append(_Pending(state.iteration, directory, request, base.handle,
                                     time.perf_counter() - t0, wall0, time.time()))

    def maybe_save(self, state: TrainState, force: bool = False) -> bool:
        # The base class logs a synchronous save's duration; ours logs when durable (step 4).
        if self.disabled or not self.ckpt.save or not (force or self.should_save(state.iteration)):
            return False
        if self.pending and self.pending[-1].iteration == state.iteration:
            return True  # e.g. the end-of-training save right after an interval save
        self._save(state)
        return True

    def _state_dict(self, state: TrainState):
        """What torch_dist would save; with the distributed optimizer, its parameter state as
        this DP rank's own live slices (no gather at save time, see distopt_lazy_state)."""
        from datastates import TensorShard

        from megatron.training import distopt_lazy_state as dls

        lazy_optim = (self.ckpt.save_optim and self.config.parallel.use_distributed_optimizer
                      and dls.supported(state.optimizer))
        sd = build_sharded_state_dict(state, self.config, is_loading=False,
                                      include_optim=self.ckpt.save_optim and not lazy_optim,
                                      include_rng=self.ckpt.save_rng)
        if not lazy_optim:
            return sd, ()
        # Rebuilt every save (cheap): views must follow the optimizer's current tensors.
        boxes = [TensorShard(view, key, gshape, goff)
                 for key, view, gshape, goff in dls.param_state_boxes(state.optimizer, sd)]
        sd["optimizer"] = dls.optimizer_common_state(state.optimizer)
        sd["opt_param_scheduler"] = state.scheduler.state_dict()
        return sd, boxes

    # -- 3) before optimizer step i+1 --------------------------------------------------------
    def before_optimizer_step(self) -> None:
        if not self.pending:
            return
        t0 = time.perf_counter()
        self._guard(lambda: self.engine.wait_for_snapshot(timeout=self.ckpt.ckpt_drain_timeout))
        self.pending[-1].stall_s += time.perf_counter() - t0

    # -- 4) every iteration ------------------------------------------------------------------
    def after_iteration(self, iteration: int) -> None:
        if self.rank == 0 and self.ckpt.save:
            self._event({"event": "iteration", "iteration": iteration, "time": time.time()})
        if self.pending:
            self._apply_policy(lambda: self._commit_ready(blocking=False))
        if self.universal is not None:
            self.universal.poll()

    # -- 5) at exit --------------------------------------------------------------------------
    def finalize(self) -> None:
        try:
            if self._failed is None:
                self._apply_policy(lambda: self._commit_ready(blocking=True))
        finally:
            try:
                self._close_engine()
            finally:
                if self.universal is not None:
                    self.universal.wait()  # no merge process outlives the run

    # -- internals -----------------------------------------------------------------------------
    def _apply_policy(self, fn) -> None:
        """Run `fn`; an agreed save failure either propagates (STOP) or switches checkpointing
        off for the rest of the run (CONTINUE). Every rank decides the same way because the
        failure was agreed on collectively."""
        try:
            fn()
        except DataStatesError as err:
            if self.ckpt.ckpt_failure_policy is not CkptFailurePolicy.CONTINUE:
                self._failed = err
                raise
            self.disabled = True
            self._local_errors.clear()
            self.pending.clear()  # never committed: they stay partial and unloadable
            print_rank_0(f"WARNING: {err}. Continuing WITHOUT checkpointing for the rest of this "
                         "run (--ckpt-failure-policy continue): no further saves, no retry.")

    def _close_engine(self) -> None:
        try:
            self.engine.close(timeout=self.ckpt.ckpt_drain_timeout)
        except DataStatesError as err:
            if self._failed is None and not self.disabled:
                raise
            # A failure was already reported (or tolerated by policy); the saves still in flight
            # at that point fail the same way. Say so, do not hide the first error behind them.
            print_rank_0(f"WARNING: while closing the checkpoint engine after an earlier failure: "
                         f"{err}")

    def _guard(self, fn):
        """Run an engine call; a failure on any rank becomes a CheckpointError on every rank at
        the next agreement, so no rank hangs in a collective the others skipped."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - recorded and re-raised below
            self._local_errors.append(err)
            return None

    def _agree(self, p: _Pending, local_done: bool) -> bool:
        """All ranks: True when every rank has `p` durable (or committed); raises the same
        CheckpointError on every rank if any rank recorded an error."""
        err = self._local_errors[0] if self._local_errors else None
        code = -1 if err is not None else int(local_done)
        flags = torch.tensor([code], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if int(flags.item()) < 0:
            failed = torch.tensor([1 if err is not None else 0], dtype=torch.int64)
            gathered = [torch.zeros_like(failed) for _ in range(self.world)]
            dist.all_gather(gathered, failed)
            ranks = [r for r, f in enumerate(gathered) if int(f.item())]
            latest = _tracked_iteration(self.ckpt.save)
            committed = is_committed(p.directory)
            if committed and latest == p.iteration:  # failed after the tracker moved
                state = f"this one is complete and {TRACKER_FILENAME} names it"
            elif committed:  # the marker was written, then the tracker failed
                state = (f"this one is complete ({p.directory} has its commit marker) but "
                         f"{TRACKER_FILENAME} could not be moved to it: it still names "
                         f"{'no iteration' if latest is None else f'iteration {latest}'}, "
                         f"which --load will use")
            else:
                intact = ("no earlier checkpoint was completed" if latest is None else
                          f"earlier checkpoints are intact (newest complete: iteration {latest})")
                state = f"{intact}, and this one is not marked complete"
            msg = (f"DataStates save of iteration {p.iteration} failed on rank(s) {ranks}"
                   + (": " + "; then: ".join(dict.fromkeys(str(e) for e in self._local_errors))
                      if err is not None else "") + _free_space(self.ckpt.save)
                   + f"; {state}. Free space or fix --save storage; "
                   "--ckpt-failure-policy continue keeps training without checkpoints")
            raise DataStatesError(msg, rank=self.rank, file=p.directory) from err
        return bool(flags.item())

    def _commit_ready(self, blocking: bool) -> None:
        for record in self._guard(self.engine.poll) or []:
            self.durable[record.step] = record
        while self.pending:
            head = self.pending[0]
            if (blocking and head.iteration not in self.durable and head.handle is not None
                    and not self._local_errors):
                wait = lambda: self.engine.wait_for_durable(  # noqa: E731
                    head.handle, timeout=self.ckpt.ckpt_drain_timeout)
                for record in self._guard(wait) or []:
                    self.durable[record.step] = record
            if not self._agree(head, head.iteration in self.durable):
                return
            self.pending.popleft()
            self._commit(head, self.durable.pop(head.iteration))

    def _commit(self, p: _Pending, record) -> None:
        if self.rank == 0:
            release_spare(os.path.join(p.directory, METADATA_FILE))
        try:
            for fn in p.request.finalize_fns:  # rank 0 writes metadata.json; barrier
                fn()
        except OSError as err:  # rank 0 failed before megatron's barrier: meet the others there
            if err.filename is None:  # megatron's json.dump into metadata.json names no file
                err = OSError(err.errno, err.strerror, os.path.join(p.directory, METADATA_FILE))
            self._local_errors.append(err)
            dist.barrier()
        stats = self._gather_stats(p, record)
        if self.rank == 0 and not self._local_errors:
            try:
                self._publish(p, stats)
            except (OSError, DataStatesError) as err:
                self._local_errors.append(err)
        self._agree(p, True)  # a failed commit raises on every rank, like a failed flush

    def _publish(self, p: _Pending, stats: Dict[str, float]) -> None:
        """Rank 0: commit marker, then tracker (then retention), then the report."""
        from datastates import try_commit
        from datastates.faults import fault_point

        fault_point("commit", p.iteration, self.rank)
        _fsync_files(p.directory, (METADATA_FILE,))
        if not try_commit(p.directory, self.world):
            raise DataStatesError("every rank reported its shards durable but the rank markers "
                                  "are not all valid", rank=0, file=p.directory)
        fault_point("tracker", p.iteration, self.rank)
        write_tracker(self.ckpt.save, p.iteration, self.config)
        self._log(p, stats)
        if self.universal is not None:  # a failure to start the merge is agreed on like others
            self.universal.on_commit(p.iteration, p.directory)

    def _gather_stats(self, p: _Pending, record) -> Dict[str, float]:
        sums = torch.tensor([float(record.bytes)], dtype=torch.float64)
        maxes = torch.tensor([p.stall_s, record.copy_s, record.durable_s], dtype=torch.float64)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        total, (stall, copy, durable) = sums.item(), maxes.tolist()
        return {"event": "checkpoint", "iteration": p.iteration, "bytes": int(total),
                "stall_ms": stall * 1e3, "copy_ms": copy * 1e3, "durable_s": durable,
                "gbps": total / durable / 1e9 if durable > 0 else 0.0, "ranks": self.world,
                "t_start": p.t_start, "t_returned": p.t_returned, "time": time.time()}

    def _log(self, p: _Pending, s: Dict[str, float]) -> None:
        print_rank_0(f" checkpoint iteration {s['iteration']:8d} | bytes: {s['bytes']} | "
                     f"stall (ms): {s['stall_ms']:.1f} | copy (ms): {s['copy_ms']:.1f} | "
                     f"durable (s): {s['durable_s']:.3f} | throughput (GB/s): {s['gbps']:.3f} | "
                     f"committed: {p.directory}")
        self._event(s)

    def _event(self, record: Dict[str, float]) -> None:
        """Rank 0: one JSON line per iteration end and per committed checkpoint (the timeline
        tool draws both)."""
        if self._telemetry_off:
            return
        path = os.path.join(self.ckpt.save, TELEMETRY_FILENAME)
        try:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:  # e.g. the disk that just filled up: telemetry never stops training
            self._telemetry_off = True
            print_rank_0(f"WARNING: cannot append to {path} ({err}); checkpoint telemetry is off "
                         "for the rest of this run")


def _fsync_files(directory: str, names: List[str]) -> None:
    """megatron's finalize writes metadata.json without fsync (common.pt is written durably by
    `durable_common_save`); the commit marker must not reach the disk before it."""
    for name in names:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _tracked_iteration(root: Optional[str]) -> Optional[int]:
    """The iteration the tracker names, or None (used in error messages only)."""
    try:
        return read_iteration(os.path.join(root, TRACKER_FILENAME))
    except (DataStatesError, TypeError):
        return None


def _free_space(root: Optional[str]) -> str:
    """' (free space under --save: N MiB)' for error messages; '' if unknown."""
    try:
        return f" (free space under --save: {shutil.disk_usage(root).free / 2**20:.1f} MiB)"
    except (OSError, TypeError):
        return ""
