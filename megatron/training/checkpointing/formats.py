"""The registry of checkpoint formats: the one way a format is plugged into the trainer.

Every format, DataStates' lazy one included, is a `CheckpointManager` subclass registered here
under its name and built and driven the same way (`make_checkpoint_manager`, then the call order in
`manager`). ``--async-lazy-save`` selects "datastates"; otherwise ``--ckpt-format``
names the format.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from megatron.training.checkpointing.manager import CheckpointManager
from megatron.training.checkpointing.stock import TorchCheckpointManager, TorchDistCheckpointManager
from megatron.training.config import RunConfig
from megatron.training.checkpointing.lazy import LazyCheckpointManager
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
