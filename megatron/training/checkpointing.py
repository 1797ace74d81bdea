"""How the stock Megatron formats are written: ``torch_dist`` (megatron-core dist_checkpointing,
sync or ``--async-save``) and the legacy ``torch`` format. When is the base class's business
(`checkpoint_manager.CheckpointManager`); the registry of formats is `checkpoint_formats`.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from datastates import control_plane
from datastates.megatron_adapter import paths

from megatron.training.checkpoint_contents import (
    OPTIMIZER_METADATA,
    TrainState,
    build_sharded_state_dict,
    common_state,
    rng_state,
    torch_rank_dir,
)
from megatron.training.checkpoint_manager import CheckpointManager
from megatron.training.config import RunConfig
from megatron.training.model import unwrap


class TorchDistCheckpointManager(CheckpointManager):
    """megatron-core ``dist_checkpointing`` with the ``torch_dist`` strategy, sync or async."""

    def __init__(self, config: RunConfig):
        super().__init__(config)
        self._queue = None
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
        from megatron.core import dist_checkpointing

        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True)  # one save in flight at most
        iteration = state.iteration
        directory = paths.checkpoint_dir(root, iteration)
        if dist.get_rank() == 0:
            os.makedirs(directory, exist_ok=True)
        control_plane.barrier()
        sd = build_sharded_state_dict(state, self.config, is_loading=False,
                                      include_optim=self.ckpt.save_optim,
                                      include_rng=self.ckpt.save_rng)
        validate = self._strategy is None  # with --ckpt-assume-constant-structure: first only
        request = dist_checkpointing.save(
            sd, directory, sharded_strategy=self.save_strategy(),
            async_sharded_save=self._queue is not None, validate_access_integrity=validate,
            content_metadata=dict(OPTIMIZER_METADATA))
        finish = lambda: self._complete(iteration, root)  # noqa: E731
        if self._queue is None:
            control_plane.barrier()
            finish()
        else:
            request.add_finalize_fn(finish)
            self._queue.schedule_async_request(request)

    def _poll(self, iteration: int) -> None:
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

    def _save(self, state: TrainState, root: str) -> None:
        from megatron.core import parallel_state as ps

        directory = paths.checkpoint_dir(root, state.iteration)
        rank_dir = torch_rank_dir(directory)
        os.makedirs(rank_dir, exist_ok=True)
        payload = torch_payload(state, self.config, self.ckpt.save_optim, self.ckpt.save_rng)
        if self.ckpt.save_optim and self.config.parallel.use_distributed_optimizer:
            # Collective over DP: gathers the sharded Adam state on DP rank 0.
            state.optimizer.save_parameter_state(
                os.path.join(rank_dir, paths.DISTRIB_OPTIM_FILENAME))
        if ps.get_data_parallel_rank() == 0:
            torch.save(payload, os.path.join(rank_dir, paths.TORCH_FILENAME))
        control_plane.barrier()
        self._complete(state.iteration, root)


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
