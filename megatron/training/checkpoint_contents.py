"""What a checkpoint holds: building the state dict to save, reading what a saved one says about
itself, and applying a loaded one.

Kept apart from *how* it is written (checkpointing.py, lazy_checkpointing.py) so every format saves
exactly the dict torch_dist saves: ``build_sharded_state_dict`` gives the model's and optimizer's
``sharded_state_dict()`` plus the common state; ``saved_run_config`` reads the configuration a
checkpoint was saved with (without running code from it); ``apply_loaded_state_dict`` takes what a
loader returned.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
import random
from dataclasses import dataclass, field
from typing import Any, List, Optional

import numpy as np
import torch

from datastates.megatron_adapter import paths
from datastates.safe_load import torch_load

from megatron.training import upstream_compat
from megatron.training.checkpoint_errors import CheckpointError
from megatron.training.config import ModelConfig, PositionEmbeddingType, RunConfig, \
    SchedulerOnResume
from megatron.training.model import unwrap

CHECKPOINT_VERSION = 3.0

# The distributed optimizer's only format that both saves without error in 0.16.1 and reshards
# across TP/PP/DP (see docs/TRAINER.md for the other formats' defects).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}

# Model fields a checkpoint must agree on before any tensor is read: the shapes, and the
# architecture flags that give tensors of the same shape another meaning (rotary vs learned
# positions, RMSNorm vs LayerNorm weights) or another layout (swiglu's two fc1 halves, GQA's
# fused qkv rows). A saved run config without one of them predates the field: it had
# ModelConfig's default, GPT-2 style (learned_absolute, LayerNorm, no swiglu, no GQA, biases).
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "padded_vocab_size", "max_position_embeddings",
                "untie_embeddings_and_output_weights", "position_embedding_type",
                "rotary_base", "rotary_percent", "normalization", "swiglu", "num_query_groups",
                "add_bias_linear")
_ROPE_ONLY = ("rotary_base", "rotary_percent")
_MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


@dataclass
class TrainState:
    """Everything the loop mutates; what checkpoints capture."""

    model: List[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    #: Megatron-LM's running FLOP count (saved as num_floating_point_operations_so_far).
    floating_point_operations_so_far: float = 0.0
    extra: dict = field(default_factory=dict)


def parallel_layout(config: RunConfig) -> dict:
    p = config.parallel
    return {"tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size,
            "vpp": p.virtual_pipeline_model_parallel_size, "dp": p.data_parallel_size}


def model_shape(config: RunConfig) -> dict:
    return _model_fields(json.loads(config.to_json())["model"])


def _model_fields(saved: dict) -> dict:
    """The SHAPE_FIELDS of a model config as JSON (missing ones: their defaults), with key/value
    heads counted as megatron-core builds them (one per query head without GQA)."""
    out = {}
    for k in SHAPE_FIELDS:
        default = _MODEL_DEFAULTS.get(k)
        out[k] = saved.get(k, default.value if isinstance(default, enum.Enum) else default)
    out["num_query_groups"] = out["num_query_groups"] or out["num_attention_heads"]
    return out


def check_model_shape(saved_config_json: str, config: RunConfig, path: str) -> None:
    """Refuse a checkpoint of another model shape or architecture before megatron-core reports it
    as a tensor-level mismatch (or, for an architecture flag, loads it into a model that computes
    something else)."""
    saved = _model_fields(json.loads(saved_config_json)["model"])
    ours = model_shape(config)
    # A rope model has no position table; the rotary fields mean nothing without rope.
    rope = PositionEmbeddingType.ROPE.value
    ignored = set()
    if saved["position_embedding_type"] == ours["position_embedding_type"] == rope:
        ignored.add("max_position_embeddings")
    if rope not in (saved["position_embedding_type"], ours["position_embedding_type"]):
        ignored.update(_ROPE_ONLY)
    diffs = [f"{k}: checkpoint {saved[k]!r}, this run {v!r}" for k, v in ours.items()
             if k not in ignored and saved[k] != v]
    if diffs:
        raise CheckpointError("checkpoint was saved for another model shape (" + "; ".join(diffs)
                              + "); pass the same model flags or another --load", path=path)


def rng_state(with_cuda: bool = False) -> dict:
    """This process's RNG states; `with_cuda` adds ``cuda_rng_state`` on a CPU machine too (the
    CPU generator's, which the CUDA calls return under cpu_compat), as Megatron-LM's loader
    requires it."""
    from megatron.core import tensor_parallel

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    elif with_cuda:
        state["cuda_rng_state"] = torch.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def model_sharded_state_dict(model) -> dict:
    merged = {}
    for i, chunk in enumerate(model):
        # The bare GPTModel: its keys are the same with or without DDP/Float16Module wrappers.
        merged[_model_key(i, len(model))] = unwrap(chunk).sharded_state_dict()
    return merged


#: Our per-rank RNG states' key beside Megatron-LM's ``rng_state`` (checkpoints with ``args``).
RNG_PER_RANK_KEY = "rng_state_per_rank"


class RngLayout(str, enum.Enum):
    """Where a checkpoint keeps the RNG state."""

    PER_RANK = "per_rank"
    """Ours until checkpoints carried Megatron-LM's ``args``: under ``rng_state``, one state
    dict per rank over the (pp, tp, dp) grid, never replicated, so resume at the same layout
    restores each rank's own streams exactly."""
    MEGATRON_LM = "megatron_lm"
    """NVIDIA Megatron-LM's: under ``rng_state``, ``[state]`` per (pp, tp) rank, written by
    data-parallel rank 0 (replica id = DP rank); item 0 is restored on every DP rank."""
    BOTH = "both"
    """What we save now: ours under ``rng_state_per_rank`` (read back by us) and Megatron-LM's
    under ``rng_state`` (read by Megatron-LM's loader)."""


def rng_layout_of(common: dict) -> RngLayout:
    """The RNG layout of one of our checkpoints, from its common state."""
    return RngLayout.BOTH if "args" in common else RngLayout.PER_RANK


def _rng_sharded_objects(layout: RngLayout, is_loading: bool) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape = (ps.get_pipeline_model_parallel_world_size(),
             ps.get_tensor_model_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    dp_shape, dp_offset = (ps.get_data_parallel_world_size(),), (ps.get_data_parallel_rank(),)
    if layout is RngLayout.MEGATRON_LM:
        return {"rng_state": ShardedObject("rng_state", [rng_state(with_cuda=True)], shape,
                                           offset, replica_id=ps.get_data_parallel_rank())}
    if layout is RngLayout.PER_RANK:
        return {"rng_state": ShardedObject("rng_state", rng_state(), shape + dp_shape,
                                           offset + dp_offset, replica_id=0)}
    ours = {RNG_PER_RANK_KEY: ShardedObject(RNG_PER_RANK_KEY, rng_state(), shape + dp_shape,
                                            offset + dp_offset, replica_id=0)}
    # Loading reads ours only; Megatron-LM's copy is for Megatron-LM.
    return ours if is_loading else {**ours, **_rng_sharded_objects(RngLayout.MEGATRON_LM, False)}


def build_sharded_state_dict(state: TrainState, config: RunConfig, *, is_loading: bool,
                             include_optim: bool, include_rng: bool,
                             optimizer_metadata: Optional[dict] = None,
                             rng_layout: RngLayout = RngLayout.BOTH) -> dict:
    """The dict torch_dist saves: model and optimizer sharded state plus common state, with
    what Megatron-LM's loader reads too (its ``args``, FLOP count and RNG layout).
    `optimizer_metadata` and `rng_layout` describe a checkpoint being loaded (default: ours).

    Must be called on every rank (the distributed optimizer gathers over DP when saving)."""
    sd = model_sharded_state_dict(state.model)
    if include_optim and state.optimizer is not None:
        # The optimizer finds each param's sharded tensor by identity anywhere in this dict,
        # so one dict serves every VPP chunk.
        sd["optimizer"] = state.optimizer.sharded_state_dict(
            dict(sd), is_loading=is_loading, metadata=optimizer_metadata or OPTIMIZER_METADATA)
        sd["opt_param_scheduler"] = state.scheduler.state_dict()
    if include_rng:
        sd.update(_rng_sharded_objects(rng_layout, is_loading))
    sd.update(common_state(state, config))
    return sd


def common_state(state: TrainState, config: RunConfig) -> dict:
    """The small entries every format saves: ours and Megatron-LM's (``args``, the FLOP count)."""
    return {"checkpoint_version": CHECKPOINT_VERSION, "iteration": state.iteration,
            "consumed_train_samples": state.consumed_train_samples,
            "consumed_valid_samples": state.consumed_valid_samples,
            "num_floating_point_operations_so_far": state.floating_point_operations_so_far,
            "run_config": config.to_json(),
            "args": upstream_compat.megatron_lm_args(state, config)}


#: (scheduler attribute, Megatron-LM's name for it in messages) compared on resume.
_SCHEDULE_FIELDS = (("max_lr", "--lr"), ("min_lr", "--min-lr"),
                    ("lr_warmup_steps", "warm-up samples (--lr-warmup-iters x global batch, "
                                        "or --lr-warmup-fraction x decay samples)"),
                    ("lr_decay_steps", "--lr-decay-iters (default --train-iters) x global batch"),
                    ("lr_decay_style", "--lr-decay-style"), ("start_wd", "--weight-decay"),
                    ("end_wd", "--weight-decay"),
                    ("wd_incr_steps", "--train-iters x global batch"),
                    ("wd_incr_style", "weight-decay schedule"))


def check_schedule(scheduler, saved: dict, policy: SchedulerOnResume, path: str = "") -> str:
    """Megatron-LM's rule for a resumed learning-rate/weight-decay schedule, with a message
    instead of its bare assert: a checkpoint whose schedule differs from this run's flags is
    refused unless --override-opt_param-scheduler (this run's flags win) or
    --use-checkpoint-opt_param-scheduler (the checkpoint's wins). Returns a line saying which
    schedule the run follows."""
    diffs = [f"{label}: checkpoint {saved[key]!r}, this run {getattr(scheduler, key)!r}"
             for key, label in _SCHEDULE_FIELDS
             if key in saved and saved[key] != getattr(scheduler, key, saved[key])]
    if not diffs:
        return "learning-rate schedule: the checkpoint's and this run's agree"
    if policy is SchedulerOnResume.MUST_MATCH:
        raise CheckpointError("the checkpoint was saved with another learning-rate schedule ("
                              + "; ".join(diffs) + "); pass --override-opt_param-scheduler to "
                              "follow this run's flags, or --use-checkpoint-opt_param-scheduler to "
                              "keep the checkpoint's", path=path or None)
    which = ("this run's flags (--override-opt_param-scheduler)"
             if policy is SchedulerOnResume.OVERRIDE
             else "the checkpoint's (--use-checkpoint-opt_param-scheduler)")
    return f"learning-rate schedule: following {which}; they differ in " + "; ".join(diffs)


def apply_loaded_state_dict(state: TrainState, loaded: dict, *, load_optim: bool,
                            load_rng: bool, finetune: bool,
                            schedule: SchedulerOnResume = SchedulerOnResume.MUST_MATCH,
                            path: str = "") -> Optional[str]:
    """Restore model (always), then optimizer+scheduler, RNG and progress counters unless told
    not to. ``finetune`` keeps iteration and sample counters at zero."""
    n = len(state.model)
    for i, chunk in enumerate(state.model):
        unwrap(chunk).load_state_dict(loaded[_model_key(i, n)], strict=True)
    note = None
    if load_optim and "opt_param_scheduler" in loaded:
        # Before anything is applied: a refused schedule leaves the state untouched.
        note = check_schedule(state.scheduler, loaded["opt_param_scheduler"], schedule, path)
    if load_optim and "optimizer" in loaded:
        with torch.no_grad():  # fp32 main params are leaf tensors that require grad
            state.optimizer.load_state_dict(loaded["optimizer"])
        state.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    rng = loaded.get(RNG_PER_RANK_KEY, loaded.get("rng_state"))
    if load_rng and rng is not None:
        set_rng_state(rng[0] if isinstance(rng, list) else rng)  # a list: Megatron-LM's layout
    if not finetune:
        state.iteration = int(loaded["iteration"])
        state.consumed_train_samples = int(loaded["consumed_train_samples"])
        state.consumed_valid_samples = int(loaded["consumed_valid_samples"])
        state.floating_point_operations_so_far = float(
            loaded.get("num_floating_point_operations_so_far", 0.0))
    return note


def torch_rank_dir(directory: str) -> str:
    """This rank's directory of a legacy torch-format checkpoint (by its TP/PP position)."""
    from megatron.core import parallel_state as ps

    return paths.torch_rank_dir(directory, ps.get_tensor_model_parallel_rank(),
                                ps.get_pipeline_model_parallel_rank(),
                                ps.get_pipeline_model_parallel_world_size())


def safe_torch_load(path: str, allow_unsafe_pickle: bool = False):
    """A torch-format file read without running code from it (`datastates.safe_load.torch_load`:
    weights_only=True plus numpy RNG states); plain pickle only with --allow-unsafe-pickle."""
    return torch_load(path, file=path, allow_unsafe=allow_unsafe_pickle)


def saved_run_config(directory: str, kind: paths.Format,
                     allow_unsafe_pickle: bool = False) -> str:
    """The run configuration (JSON) the checkpoint in `directory` (of `paths.detect_format` kind)
    was saved with: from common.pt (torch_dist, DataStates) or this rank's torch file, read
    without running code."""
    if kind is not paths.Format.TORCH:
        common = paths.saved_common(directory, allow_unsafe_pickle)
        if upstream_compat.is_upstream(common):  # NVIDIA Megatron-LM's own checkpoint
            return upstream_compat.saved_config_from_args(common, directory)
        if not isinstance(common, dict) or "run_config" not in common:
            raise CheckpointError("common.pt holds neither run_config (this trainer's) nor args "
                                  "(Megatron-LM's): not a checkpoint this trainer reads",
                                  path=directory)
        return common["run_config"]
    path = os.path.join(torch_rank_dir(directory), paths.TORCH_FILENAME)
    if not os.path.isfile(path):
        raise CheckpointError("torch-format checkpoint has no file for this rank's TP/PP "
                              "position; it was saved with another layout (the torch format "
                              "cannot be resharded: save with --ckpt-format torch_dist)", path=path)
    return safe_torch_load(path, allow_unsafe_pickle)["run_config"]


def init_distributed_optimizer_state(optimizer) -> None:
    """A fresh DistributedOptimizer has no Adam state; fully_reshardable loading copies into
    existing state tensors (and asserts one `step` per group), so create them first."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()
