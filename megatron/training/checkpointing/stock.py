"""How the stock Megatron formats are written: ``torch_dist`` (megatron-core dist_checkpointing,
sync or ``--async-save``) and the legacy ``torch`` format. When is the base class's business
(`manager.CheckpointManager`); the registry of formats is `formats`.
"""
from __future__ import annotations

import os
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from datastates import CheckpointError
from datastates.faults import fail_point, fault_point
from datastates.fileio import atomic_write, fsync_dir
from datastates.megatron_adapter import paths
from datastates.megatron_adapter import durable_common_save

from megatron.training.checkpointing.contents import (
    OPTIMIZER_METADATA,
    TrainState,
    build_sharded_state_dict,
    common_state,
    rng_state,
    torch_rank_dir,
)
from megatron.training.checkpointing.manager import CheckpointManager
from megatron.training.config import RunConfig
from megatron.training.mcore_fixes import results_queue_dies_with_rank
from megatron.training.model import unwrap


class TorchDistCheckpointManager(CheckpointManager):
    """megatron-core ``dist_checkpointing`` with the ``torch_dist`` strategy, sync or async."""

    _backend = ("torch_dist", 1)  # what metadata.json names: megatron's torch_dist strategy

    def __init__(self, config: RunConfig):
        super().__init__(config)
        self._queue = None
        self._in_flight: Optional[Tuple[str, int]] = None  # --async-save: (root, iteration)
        self._strategy = None  # kept across saves with --ckpt-assume-constant-structure
        if self.ckpt.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            # Fork-based caller: the child holds a copy-on-write image of the state as of the
            # save call, and it needs no CUDA (the persistent worker calls torch.cuda.set_device).
            self._queue = AsyncCallsQueue(persistent=False)

    def save_strategy(self):
        """The dist_checkpointing save strategy; a backend with its own format overrides this
        (and registers the matching load strategy, see docs/TRAINER.md)."""
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.strategies.fully_parallel import \
            FullyParallelSaveStrategyWrapper
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        constant = self.ckpt.ckpt_assume_constant_structure
        if constant and self._strategy is not None:
            return self._strategy  # Megatron-LM: its cached plan and distribution are reused
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
        strategy.use_cached_ckpt_structure = constant
        group = ps.get_data_parallel_group(with_context_parallel=True)
        if self.ckpt.ckpt_fully_parallel_save and dist.get_world_size(group) > 1:
            # Megatron-LM's default: replicated shards are written once, spread over DP ranks.
            strategy = FullyParallelSaveStrategyWrapper(strategy, group, constant)
        if constant:
            self._strategy = strategy
        return strategy

    def _save(self, state: TrainState, root: str) -> None:
        """Every step that can fail on one rank is agreed on before the next collective: rank 0's
        directory, common.pt (its failure is held until megatron's collectives are done), the
        writes (megatron gathers every rank's result), metadata.json, tracker and retention (one
        agreement in place of megatron's barrier). With --async-save the last two run when the
        writer process is done, at a later `_poll`."""
        from megatron.core import dist_checkpointing

        results_queue_dies_with_rank()  # megatron-core's writer results: no orphan at exit
        if self._queue is not None:
            self._agreed_poll(blocking=True)  # one save in flight at most
        iteration = state.iteration
        directory = self.prepare_version_dir(root, iteration)
        sd = build_sharded_state_dict(state, self.config, is_loading=False,
                                      include_optim=self.ckpt.save_optim,
                                      include_rng=self.ckpt.save_rng)
        validate = self._strategy is None  # with --ckpt-assume-constant-structure: first only
        strategy = self.save_strategy()
        common_errors: List[BaseException] = []
        rank = dist.get_rank()

        def write_common(path: str, data: bytes) -> None:
            try:
                fail_point("common", iteration, rank, path)
                atomic_write(path, data)
            except Exception as err:  # noqa: BLE001 - agreed on once megatron's save returns
                common_errors.append(err)

        def save():
            with durable_common_save(write_common):
                request = dist_checkpointing.save(
                    sd, directory, sharded_strategy=strategy, async_sharded_save=True,
                    validate_access_integrity=validate, content_metadata=dict(OPTIMIZER_METADATA))
            if common_errors:
                raise common_errors[0]
            return request

        request = self.agreed(save, f"saving iteration {iteration}", root, iteration)
        request = _with_fault_points(request, iteration, root, strategy,
                                     lambda: self._commit(iteration, root))
        if self._queue is None:
            # megatron's execute_sync, with its writer bounded by --ckpt-drain-timeout and its
            # barrier (on the training group, where a rank whose writer never returns would hold
            # every other rank until the group's timeout) replaced by an agreement.
            self.agreed(lambda: _write_within(request, self.ckpt.ckpt_drain_timeout, iteration),
                        f"saving iteration {iteration}", root, iteration)
            self.agreed(lambda: [fn() for fn in request.finalize_fns],
                        f"saving iteration {iteration}", root, iteration)
        else:
            self._queue.schedule_async_request(request)
            self._in_flight = (root, iteration)

    def _commit(self, iteration: int, root: str) -> None:
        """Every rank, once every rank's files of `iteration` are written (megatron's finalize
        gathered the write results): rank 0 writes metadata.json (megatron's commit of a
        torch_dist checkpoint), moves the tracker and applies retention; one agreement."""
        directory = paths.checkpoint_dir(root, iteration)

        def commit() -> None:
            if dist.get_rank() == 0:
                fail_point("commit", iteration, 0, os.path.join(directory, paths.METADATA_FILENAME))
                write_metadata_json(directory, self._backend)
                self._complete(iteration, root)

        self.agreed(commit, f"committing iteration {iteration}", root, iteration)

    def _agreed_poll(self, blocking: bool) -> None:
        root, iteration = self._in_flight or (self.ckpt.save, None)
        if blocking and self._queue.get_num_unfinalized_calls():
            # megatron's blocking finalize joins each rank's writer process without a bound,
            # while the ranks whose writer is done wait in its all-reduce on the training group:
            # the writers are waited for here first, bounded, and agreed on. A timed-out save is
            # dropped on every rank (its writer processes killed, nothing of it finalized).
            try:
                self.agreed(lambda: _writers_exit_within(self._queue, self.ckpt.ckpt_drain_timeout,
                                                         iteration),
                            f"saving iteration {iteration}", root, iteration)
            except CheckpointError:
                queue, self._queue = self._queue, type(self._queue)(persistent=False)
                queue.close(abort=True)
                self._in_flight = None
                raise
        self.agreed(lambda: self._queue.maybe_finalize_async_calls(blocking=blocking),
                    "finishing an --async-save checkpoint", root, iteration)
        if not self._queue.get_num_unfinalized_calls():
            self._in_flight = None

    def _poll(self, iteration: int) -> None:
        if self._queue is not None:
            self._agreed_poll(blocking=False)

    def finalize(self) -> None:
        if self._queue is None:
            return
        try:
            self._agreed_poll(blocking=True)
        finally:
            queue, self._queue = self._queue, None
            queue.close(abort=True)  # nothing is left to finalize (or it failed)


def _write_within(request, timeout_s: float, iteration: int) -> None:
    """This rank's part of megatron's sync torch_dist save (`AsyncRequest.execute_sync` up to its
    barrier: the staging, then the writer, which forks a writer process per file), waited for at
    most `timeout_s`. Past it, the writer processes it started are killed and the save fails on
    this rank (agreed on by the caller); the thread left waiting for them is abandoned, as a hung
    engine writer is. A forked writer can also never finish on its own: it inherits the locks the
    trainer's other threads held at the fork."""
    import gc
    import threading

    import psutil

    args = list(request.async_fn_args)
    if request.preload_fn:  # as execute_sync: the staged copy replaces the write buckets
        args[1] = request.preload_fn()
    if request.async_fn is None:
        return
    me = psutil.Process()
    before = {child.pid for child in me.children(recursive=True)}
    collecting = gc.isenabled()  # megatron's writer turns collection off until it returns
    failed: List[BaseException] = []

    def write() -> None:
        try:
            request.async_fn(*args, **request.async_fn_kwargs)
        except BaseException as err:  # noqa: BLE001 - raised on the caller's thread below
            failed.append(err)

    writer = threading.Thread(target=write, name="torch-dist-writer", daemon=True)
    writer.start()
    writer.join(timeout_s)
    if writer.is_alive():
        started = _kill([child for child in me.children(recursive=True)
                         if child.pid not in before])
        if collecting:
            gc.enable()
        raise _timed_out(iteration, timeout_s, "torch_dist writer did not return",
                         f"its writer processes {started} were killed" if started
                         else "it had started no writer process")
    if failed:
        raise failed[0]


def _writers_exit_within(queue, timeout_s: float, iteration: Optional[int]) -> None:
    """This rank's --async-save writer processes (megatron's forked caller, one per save in
    flight), waited for at most `timeout_s` in all. Past it each one still running is killed with
    the processes it started (one per file) and the save fails on this rank (agreed on by the
    caller); no collective here."""
    import psutil

    deadline = time.monotonic() + timeout_s
    for call in list(queue.async_calls):
        process = getattr(call.async_caller, "process", None)
        if process is None:
            continue
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            try:
                top = psutil.Process(process.pid)
                tree = top.children(recursive=True) + [top]
            except psutil.Error:
                tree = []
            raise _timed_out(iteration, timeout_s, "--async-save writer process did not finish",
                             f"its processes {_kill(tree)} were killed")


def _timed_out(iteration: Optional[int], timeout_s: float, what: str,
               killed: str) -> TimeoutError:
    """The error of a wait on megatron's writer past --ckpt-drain-timeout: `what` of megatron's
    did not end; `killed` says what was killed."""
    return TimeoutError(f"writing iteration {iteration} timed out after {timeout_s:g} s "
                        f"(--ckpt-drain-timeout): megatron's {what} (storage not responding, or "
                        f"a writer process that cannot finish); {killed}")


def _kill(processes) -> List[int]:
    """SIGKILL each of `processes` (psutil) that is still there; the pids signalled, sorted."""
    import psutil

    killed = []
    for proc in processes:
        try:
            proc.kill()
            killed.append(proc.pid)
        except psutil.Error:
            pass
    return sorted(killed)


def _with_fault_points(request, iteration: int, root: str, strategy, commit):
    """megatron's request for a torch_dist save, with the `write` fault point in its writer
    (as a failed write: the rank's result is the error, gathered by megatron's finalize) and
    megatron's metadata finalize (rank 0 writes metadata.json, then a barrier a failure on rank 0
    would leave the others in) replaced by `commit`, which agrees instead."""
    write = request.async_fn
    if write is not None:
        def faulty_write(rank, buckets, results, *args, **kwargs):
            fault_point("flush", iteration, rank)  # a pause here models a hung writer
            try:
                fail_point("write", iteration, rank, paths.checkpoint_dir(root, iteration))
            except Exception as err:  # noqa: BLE001 - reported as this rank's write result
                results.put(err)
                return None
            return write(rank, buckets, results, *args, **kwargs)
        request = request._replace(async_fn=faulty_write)
    fns = [fn for fn in request.finalize_fns
           if getattr(fn, "__name__", None) != "metadata_finalize_fn"]
    if len(fns) != len(request.finalize_fns) - 1:
        raise RuntimeError("megatron-core's save request has no metadata_finalize_fn: this "
                           "megatron-core version is not supported")
    return request._replace(finalize_fns=fns + [commit])


class TorchCheckpointManager(CheckpointManager):
    """Megatron's legacy ``torch`` format: one ``torch.save`` file per (TP, PP) rank written by
    DP rank 0, plus ``distrib_optim.pt`` for the distributed optimizer. Not reshardable."""

    def _save(self, state: TrainState, root: str) -> None:
        from megatron.core import parallel_state as ps

        iteration = state.iteration
        directory = self.prepare_version_dir(root, iteration)
        rank_dir = torch_rank_dir(directory)
        rank = dist.get_rank()
        self.agreed(lambda: os.makedirs(rank_dir, exist_ok=True),
                    f"saving iteration {iteration}", root, iteration)
        payload = torch_payload(state, self.config, self.ckpt.save_optim, self.ckpt.save_rng)
        if self.ckpt.save_optim and self.config.parallel.use_distributed_optimizer:
            # Collective over DP: gathers the sharded Adam state on DP rank 0, which writes it
            # (torch.save into a path); its failure is agreed on with the model file's.
            self.agreed(lambda: state.optimizer.save_parameter_state(
                os.path.join(rank_dir, paths.DISTRIB_OPTIM_FILENAME)),
                f"saving iteration {iteration}", root, iteration)

        def write() -> None:
            if ps.get_data_parallel_rank() == 0:
                path = os.path.join(rank_dir, paths.TORCH_FILENAME)
                fail_point("write", iteration, rank, path)
                durable_torch_save(payload, path)

        self.agreed(write, f"saving iteration {iteration}", root, iteration)

        def commit() -> None:
            if rank == 0:
                self._complete(iteration, root)

        self.agreed(commit, f"committing iteration {iteration}", root, iteration)


def durable_torch_save(obj, path: str) -> None:
    """`torch.save(obj, path)`, made durable and atomic: written to a temp file through a Python
    file object (a full disk is then an OSError naming the errno), fsync'd, renamed over `path`,
    directory fsync'd."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path))


def write_metadata_json(directory: str, backend) -> None:
    """metadata.json as megatron's save finalize writes it (the sharded backend and version)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    save_config(CheckpointingConfig(*backend), directory)


def torch_payload(state: TrainState, config: RunConfig, with_optim: bool, with_rng: bool) -> dict:
    payload = common_state(state, config)
    n = len(state.model)
    for i, chunk in enumerate(state.model):
        payload["model" if n == 1 else f"model{i}"] = unwrap(chunk).state_dict()
    if with_optim:
        # With the distributed optimizer this holds param groups and step only; its sharded
        # Adam state goes to distrib_optim.pt.
        payload["optimizer"] = state.optimizer.state_dict()
        payload["opt_param_scheduler"] = state.scheduler.state_dict()
    if with_rng:
        # Megatron-LM's layout ([state]); only data-parallel rank 0 writes this file anyway.
        payload["rng_state"] = [rng_state(with_cuda=True)]
    return payload
