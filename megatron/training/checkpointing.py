"""When and how checkpoints are written and read, in Megatron's directory layout.

Layout: ``SAVE/iter_0000010/`` holds one checkpoint; ``SAVE/latest_checkpointed_iteration.txt``
names the newest complete one and is written (atomically, by rank 0) only after every rank's
part is durable, so a loader never trusts a partial directory.

The training loop talks to one ``CheckpointManager``; call order, every rank:
  1) ``before_optimizer_step()`` each step, after forward/backward, before ``optimizer.step()``;
  2) ``maybe_save(state, force=False)`` right after the optimizer step of the iteration;
  3) ``after_iteration(iteration)`` at the end of each iteration (non-blocking poll);
  4) ``finalize()`` once at the end (or exit interval / SIGTERM): drain in-flight saves.
A new backend is one subclass registered in ``MANAGERS`` under its ``--ckpt-format``.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from datastates import CheckpointError as DataStatesError
from datastates.layout import (atomic_write, make_spare, read_iteration, replace_from_spare,
                               safe_join)
from megatron.training.checkpoint_state import (
    CheckpointError,
    OPTIMIZER_METADATA,
    TrainState,
    apply_loaded_state_dict,
    build_sharded_state_dict,
    check_model_shape,
    layout,
)
from megatron.training.config import CkptFormat, RunConfig
from megatron.training.log import print_rank_0
from megatron.training.model import unwrap
from megatron.training.retention import apply_retention

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
RUN_CONFIG_FILENAME = "run_config.json"
TORCH_FILENAME = "model_optim_rng.pt"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def write_tracker(root: str, iteration: int, config: RunConfig) -> None:
    """Rank 0 only: mark ``iteration`` complete. Called after the save is finalized.

    On a disk that filled up after the commit marker was written, the tracker still moves: it
    is rewritten in blocks allocated beforehand (see ``replace_from_spare``), and
    run_config.json is rewritten only when the run's configuration differs from it."""
    if dist.get_rank() == 0:
        run_config = config.to_json().encode()
        path = os.path.join(root, RUN_CONFIG_FILENAME)
        try:
            with open(path, "rb") as f:
                same = f.read() == run_config
        except OSError:
            same = False
        if not same:
            atomic_write(path, run_config)
        replace_from_spare(os.path.join(root, TRACKER_FILENAME), str(iteration).encode())
        # Saves still in flight are newer than `iteration`, so retention never reaches them.
        apply_retention(root, config.checkpoint.keep_last_n_checkpoints, iteration)


def read_tracker(root: str) -> int:
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isdir(root):
        raise CheckpointError("--load directory does not exist", path=root)
    if not os.path.isfile(path):
        raise CheckpointError(f"no {TRACKER_FILENAME} in the --load directory (no complete "
                              f"checkpoint was ever written there)", path=root)
    # Untrusted: a plain non-negative number, naming a directory that is no link out of root.
    try:
        iteration = read_iteration(path, what=TRACKER_FILENAME)
        safe_join(root, os.path.basename(checkpoint_dir(root, iteration)), what=TRACKER_FILENAME)
    except DataStatesError as err:
        raise CheckpointError(err.reason, path=err.file) from err
    return iteration


class CheckpointManager:
    """Saving policy and mechanism for one format. Subclasses implement ``_save``."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.ckpt = config.checkpoint
        self._root_prepared = False

    # 1) hook point for lazy snapshots; stock formats copy nothing and need not wait.
    def before_optimizer_step(self) -> None:
        pass

    def should_save(self, iteration: int) -> bool:
        interval = self.ckpt.save_interval
        return bool(self.ckpt.save and interval and iteration % interval == 0)

    # 2) every rank, after optimizer.step()
    def maybe_save(self, state: TrainState, force: bool = False) -> bool:
        if not self.ckpt.save or not (force or self.should_save(state.iteration)):
            return False
        if not self._root_prepared:
            self._root_prepared = True
            if dist.get_rank() == 0:  # the tracker's spare, allocated before any shard is
                os.makedirs(self.ckpt.save, exist_ok=True)
                make_spare(os.path.join(self.ckpt.save, TRACKER_FILENAME))
        start = time.time()
        self._save(state)
        print_rank_0(f"saved checkpoint at iteration {state.iteration:7d} to {self.ckpt.save} "
                     f"in {(time.time() - start) * 1000:.1f} ms (format {self.ckpt.ckpt_format.value}"
                     f"{', async' if self.ckpt.async_save else ''})")
        return True

    # 3) every rank, end of each iteration
    def after_iteration(self, iteration: int) -> None:
        pass

    # 4) every rank, once
    def finalize(self) -> None:
        pass

    def _save(self, state: TrainState) -> None:
        raise NotImplementedError


class TorchDistCheckpointManager(CheckpointManager):
    """megatron-core ``dist_checkpointing`` with the ``torch_dist`` strategy, sync or async."""

    def __init__(self, config: RunConfig):
        super().__init__(config)
        self._queue = None
        if self.ckpt.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            # Fork-based caller: the child holds a copy-on-write image of the state as of the
            # save call, and it needs no CUDA (the persistent worker calls torch.cuda.set_device).
            self._queue = AsyncCallsQueue(persistent=False)

    def save_strategy(self):
        """The dist_checkpointing save strategy; a backend with its own format overrides this
        (and registers the matching load strategy, see docs/TRAINER.md)."""
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        return TorchDistSaveShardedStrategy("torch_dist", 1)

    def _save(self, state: TrainState) -> None:
        from megatron.core import dist_checkpointing

        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True)  # one save in flight at most
        iteration = state.iteration
        directory = checkpoint_dir(self.ckpt.save, iteration)
        if dist.get_rank() == 0:
            os.makedirs(directory, exist_ok=True)
        dist.barrier()
        sd = build_sharded_state_dict(state, self.config, is_loading=False,
                                      include_optim=self.ckpt.save_optim,
                                      include_rng=self.ckpt.save_rng)
        request = dist_checkpointing.save(
            sd, directory, sharded_strategy=self.save_strategy(),
            async_sharded_save=self._queue is not None, content_metadata=dict(OPTIMIZER_METADATA))
        finish = lambda: write_tracker(self.ckpt.save, iteration, self.config)  # noqa: E731
        if self._queue is None:
            dist.barrier()
            finish()
        else:
            request.add_finalize_fn(finish)
            self._queue.schedule_async_request(request)

    def after_iteration(self, iteration: int) -> None:
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=False)

    def finalize(self) -> None:
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True)
            self._queue.close()
            self._queue = None


class TorchCheckpointManager(CheckpointManager):
    """Megatron's legacy ``torch`` format: one ``torch.save`` file per (TP, PP) rank written by
    DP rank 0, plus ``distrib_optim.pt`` for the distributed optimizer. Not reshardable."""

    def _save(self, state: TrainState) -> None:
        from megatron.core import parallel_state as ps

        directory = checkpoint_dir(self.ckpt.save, state.iteration)
        rank_dir = torch_rank_dir(directory)
        os.makedirs(rank_dir, exist_ok=True)
        payload = torch_payload(state, self.config, self.ckpt.save_optim, self.ckpt.save_rng)
        if self.ckpt.save_optim and self.config.parallel.use_distributed_optimizer:
            # Collective over DP: gathers the sharded Adam state on DP rank 0.
            state.optimizer.save_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
        if ps.get_data_parallel_rank() == 0:
            torch.save(payload, os.path.join(rank_dir, TORCH_FILENAME))
        dist.barrier()
        write_tracker(self.ckpt.save, state.iteration, self.config)


def torch_rank_dir(directory: str) -> str:
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    return os.path.join(directory, name)


def torch_payload(state: TrainState, config: RunConfig, with_optim: bool, with_rng: bool) -> dict:
    from megatron.training.checkpoint_state import CHECKPOINT_VERSION, rng_state

    payload = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": state.iteration,
               "consumed_train_samples": state.consumed_train_samples,
               "consumed_valid_samples": state.consumed_valid_samples,
               "run_config": config.to_json()}
    n = len(state.model)
    for i, chunk in enumerate(state.model):
        payload["model" if n == 1 else f"model{i}"] = unwrap(chunk).state_dict()
    if with_optim:
        # With the distributed optimizer this holds param groups and step only; its sharded
        # Adam state goes to distrib_optim.pt.
        payload["optimizer"] = state.optimizer.state_dict()
        payload["opt_param_scheduler"] = state.scheduler.state_dict()
    if with_rng:
        payload["rng_state"] = rng_state()
    return payload


MANAGERS: Dict[CkptFormat, Callable[[RunConfig], CheckpointManager]] = {
    CkptFormat.TORCH_DIST: TorchDistCheckpointManager,
    CkptFormat.TORCH: TorchCheckpointManager,
}


def make_checkpoint_manager(config: RunConfig) -> CheckpointManager:
    if config.checkpoint.async_lazy_save:
        from megatron.training.lazy_checkpointing import LazyCheckpointManager

        return LazyCheckpointManager(config)
    return MANAGERS[config.checkpoint.ckpt_format](config)
