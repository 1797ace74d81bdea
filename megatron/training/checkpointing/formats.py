"""The registry of checkpoint formats: the one way a format is plugged into the trainer.

Every format, DataStates' lazy one included, is a `CheckpointManager` subclass registered here
under its name and built and driven the same way (`make_checkpoint_manager`, then the call order in
`manager`). ``--async-lazy-save`` selects "datastates"; otherwise ``--ckpt-format``
names the format.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, Optional

from datastates.megatron_adapter import paths

from megatron.training.checkpointing.contents import CheckpointError, TrainState
from megatron.training.checkpointing.manager import CheckpointManager
from megatron.training.checkpointing.stock import TorchCheckpointManager, TorchDistCheckpointManager
from megatron.training.config import CheckpointConfig, RunConfig
from megatron.training.checkpointing.lazy import LazyCheckpointManager
from megatron.training.log import print_rank_0
from megatron.training.metrics import Metrics

LAZY_FORMAT = "datastates"

MANAGERS: Dict[str, Callable[[RunConfig], CheckpointManager]] = {
    "torch_dist": TorchDistCheckpointManager,
    "torch": TorchCheckpointManager,
    LAZY_FORMAT: LazyCheckpointManager,
}


def register_manager(name: str, factory: Callable[[RunConfig], CheckpointManager]) -> None:
    """Plug in a format (a `CheckpointManager` subclass) under `name`."""
    MANAGERS[name] = factory


def format_name(config: RunConfig) -> str:
    return LAZY_FORMAT if config.checkpoint.async_lazy_save else config.checkpoint.ckpt_format.value


def make_checkpoint_manager(config: RunConfig,
                            metrics: Optional[Metrics] = None) -> CheckpointManager:
    """Every rank, once, after the process group exists: the run's manager, started, reporting
    complete checkpoints and save times to `metrics` (none: not reported)."""
    manager = MANAGERS[format_name(config)](config)
    if metrics is not None:
        manager.metrics = metrics
    manager.start()
    return manager


def save_converted(state: TrainState, config: RunConfig,
                   metrics: Optional[Metrics] = None) -> str:
    """Every rank, Megatron-LM's --ckpt-convert-format: the checkpoint the run loaded (`state`)
    saved once more, synchronously, in that format as ``<--ckpt-convert-save>/<format>/`` (its
    iteration, tracker and run config as any save of this trainer); the line Megatron-LM prints.
    Returns that root."""
    ckpt = config.checkpoint
    if state.loaded is None:  # not reached: the loader refuses a conversion with nothing
        raise CheckpointError("--ckpt-convert-format: nothing was loaded to convert",
                              path=ckpt.load)
    target = os.path.join(ckpt.ckpt_convert_save, ckpt.ckpt_convert_format.value)
    fresh = CheckpointConfig()  # the other levels, intervals and retention: not for this save
    converted = dataclasses.replace(ckpt, **{
        f.name: getattr(fresh, f.name) for f in dataclasses.fields(CheckpointConfig)
        if f.name not in _KEPT_FOR_CONVERSION})
    converted = dataclasses.replace(converted, save=target, ckpt_format=ckpt.ckpt_convert_format)
    manager = make_checkpoint_manager(dataclasses.replace(config, checkpoint=converted), metrics)
    manager.begin_training(state.iteration, loaded=state.loaded)
    manager.maybe_save(state, force=True)
    manager.finalize()
    source = os.path.normpath(state.loaded)
    print_rank_0(f"> converted checkpoint: {paths.detect_format(state.loaded).value} -> "
                 f"{ckpt.ckpt_convert_format.value}. ({os.path.basename(source)} of "
                 f"{os.path.dirname(source)} saved under {target})")
    return target


#: What a converted save keeps of the run's checkpoint flags: what to include and how to write.
_KEPT_FOR_CONVERSION = frozenset((
    "load", "save_optim", "save_rng", "ckpt_fully_parallel_save", "ckpt_failure_policy",
    "ckpt_drain_timeout", "allow_unsafe_pickle", "lazy_save_checksum"))
