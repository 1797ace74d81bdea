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
from megatron.training.checkpointing import CheckpointManager, checkpoint_dir, write_tracker
from megatron.training.config import RunConfig
from megatron.training.log import print_rank_0
from megatron.training.universal import make_background_merger

TELEMETRY_FILENAME = "datastates_checkpoints.jsonl"


@dataclass
class _Pending:
    iteration: int
    directory: str
    request: object  # megatron AsyncRequest: its finalize functions write metadata.json
    handle: object  # datastates SaveHandle
    stall_s: float  # time the training loop was blocked by this save


class LazyCheckpointManager(CheckpointManager):
    """Keeps a deque of saves in flight, oldest first; commits them in order."""

    def __init__(self, config: RunConfig):
        super().__init__(config)
        from datastates import CheckpointEngine, CommitPolicy, EngineConfig

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        ckpt = config.checkpoint
        self.engine = CheckpointEngine(EngineConfig(
            rank=self.rank, world_size=self.world,
            host_cache_bytes=ckpt.lazy_save_cache_mb << 20,
            commit_policy=CommitPolicy.MANUAL,  # committed below, after every rank agrees
            background_nice=5))
        self.pending: Deque[_Pending] = deque()
        self.durable: Dict[int, object] = {}  # save id -> this rank's SaveRecord
        self._wrapper = None
        self._dp_group = None
        self._local_error: Optional[BaseException] = None
        # Rank 0 runs the background universal merges (None when not asked for).
        self.universal = make_background_merger(config) if self.rank == 0 else None

    # -- 1) after optimizer step i ------------------------------------------------------------
    def _save(self, state: TrainState) -> None:
        from megatron.core import dist_checkpointing, parallel_state

        from datastates.megatron_adapter import save_strategy

        t0 = time.perf_counter()
        directory = checkpoint_dir(self.ckpt.save, state.iteration)
        if self.rank == 0:
            os.makedirs(directory, exist_ok=True)  # megatron's save lists it on rank 0
        if self._dp_group is None:
            self._dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        sd = build_sharded_state_dict(state, self.config, is_loading=False,
                                      include_optim=self.ckpt.save_optim,
                                      include_rng=self.ckpt.save_rng)
        strategy, base = save_strategy(self.engine, state.iteration, self._dp_group, self._wrapper)
        if strategy is not base:
            self._wrapper = strategy
        request = dist_checkpointing.save(sd, directory, sharded_strategy=strategy,
                                          async_sharded_save=True,
                                          content_metadata=dict(OPTIMIZER_METADATA))
        self.pending.append(_Pending(state.iteration, directory, request, base.handle,
                                     time.perf_counter() - t0))

    def maybe_save(self, state: TrainState, force: bool = False) -> bool:
        # The base class logs a synchronous save's duration; ours logs when durable (step 4).
        if not self.ckpt.save or not (force or self.should_save(state.iteration)):
            return False
        if self.pending and self.pending[-1].iteration == state.iteration:
            return True  # e.g. the end-of-training save right after an interval save
        self._save(state)
        return True

    # -- 3) before optimizer step i+1 --------------------------------------------------------
    def before_optimizer_step(self) -> None:
        if not self.pending:
            return
        t0 = time.perf_counter()
        self._guard(self.engine.wait_for_snapshot)
        self.pending[-1].stall_s += time.perf_counter() - t0

    # -- 4) every iteration ------------------------------------------------------------------
    def after_iteration(self, iteration: int) -> None:
        if self.pending:
            self._commit_ready(blocking=False)
        if self.universal is not None:
            self.universal.poll()

    # -- 5) at exit --------------------------------------------------------------------------
    def finalize(self) -> None:
        try:
            self._commit_ready(blocking=True)
        finally:
            self.engine.close()
            if self.universal is not None:
                self.universal.wait()  # no merge process outlives the run

    # -- internals -----------------------------------------------------------------------------
    def _guard(self, fn):
        """Run an engine call; a failure on any rank becomes a CheckpointError on every rank at
        the next agreement, so no rank hangs in a collective the others skipped."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - recorded and re-raised below
            self._local_error = err
            return None

    def _agree(self, local_done: bool) -> bool:
        """All ranks: True when every rank's oldest pending save is durable; raises on every rank
        if any rank's engine failed."""
        err = self._local_error
        code = -1 if err is not None else int(local_done)
        flags = torch.tensor([code], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if int(flags.item()) < 0:
            failed = torch.tensor([1 if err is not None else 0], dtype=torch.int64)
            gathered = [torch.zeros_like(failed) for _ in range(self.world)]
            dist.all_gather(gathered, failed)
            ranks = [r for r, f in enumerate(gathered) if int(f.item())]
            from datastates import CheckpointError

            msg = (f"DataStates save of iteration {self.pending[0].iteration} failed on rank(s) "
                   f"{ranks}" + (f": {err}" if err is not None else "") +
                   "; earlier checkpoints are intact")
            raise CheckpointError(msg, rank=self.rank, file=self.pending[0].directory) from err
        return bool(flags.item())

    def _commit_ready(self, blocking: bool) -> None:
        for record in self._guard(self.engine.poll) or []:
            self.durable[record.step] = record
        while self.pending:
            head = self.pending[0]
            if blocking and head.iteration not in self.durable:
                for record in self._guard(lambda: self.engine.wait_for_durable(head.handle)) or []:
                    self.durable[record.step] = record
            if not self._agree(head.iteration in self.durable):
                return
            self.pending.popleft()
            self._commit(head, self.durable.pop(head.iteration))

    def _commit(self, p: _Pending, record) -> None:
        from datastates import CheckpointError, try_commit

        for fn in p.request.finalize_fns:  # rank 0 writes metadata.json; barrier
            fn()
        stats = self._gather_stats(p, record)
        if self.rank == 0:
            _fsync_files(p.directory, ("common.pt", "metadata.json"))
            if not try_commit(p.directory, self.world):
                raise CheckpointError("every rank reported its shards durable but the rank "
                                      "markers are not all valid", rank=0, file=p.directory)
            write_tracker(self.ckpt.save, p.iteration, self.config)
            self._log(p, stats)
            if self.universal is not None:
                self.universal.on_commit(p.iteration, p.directory)

    def _gather_stats(self, p: _Pending, record) -> Dict[str, float]:
        sums = torch.tensor([float(record.bytes)], dtype=torch.float64)
        maxes = torch.tensor([p.stall_s, record.copy_s, record.durable_s], dtype=torch.float64)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        total, (stall, copy, durable) = sums.item(), maxes.tolist()
        return {"iteration": p.iteration, "bytes": int(total), "stall_ms": stall * 1e3,
                "copy_ms": copy * 1e3, "durable_s": durable,
                "gbps": total / durable / 1e9 if durable > 0 else 0.0,
                "ranks": self.world, "time": time.time()}

    def _log(self, p: _Pending, s: Dict[str, float]) -> None:
        print_rank_0(f" checkpoint iteration {s['iteration']:8d} | bytes: {s['bytes']} | "
                     f"stall (ms): {s['stall_ms']:.1f} | copy (ms): {s['copy_ms']:.1f} | "
                     f"durable (s): {s['durable_s']:.3f} | throughput (GB/s): {s['gbps']:.3f} | "
                     f"committed: {p.directory}")
        with open(os.path.join(self.ckpt.save, TELEMETRY_FILENAME), "a") as f:
            f.write(json.dumps(s) + "\n")


def _fsync_files(directory: str, names: List[str]) -> None:
    """megatron's common strategy writes common.pt (and metadata.json) without fsync; the commit
    marker must not reach the disk before them."""
    for name in names:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
