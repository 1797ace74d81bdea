"""What a checkpoint holds: building the state dict to save, reading what a saved one says about
itself, and applying a loaded one.

Kept apart from *how* it is written (stock.py, lazy.py) so every format saves
exactly the dict torch_dist saves: ``build_sharded_state_dict`` gives the model's and optimizer's
``sharded_state_dict()`` plus the common state; ``saved_run_config`` reads the configuration a
checkpoint was saved with (without running code from it); ``apply_loaded_state_dict`` takes what a
loader returned.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib.util
import io
import json
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional

import numpy as np
import torch

from datastates.megatron_adapter import paths
from datastates.safe_load import UNSAFE_PICKLE_FLAG, UnsafePickleError, pickle_imports, torch_load

from megatron.training.checkpointing import upstream_compat
from megatron.training.checkpointing.errors import CheckpointError
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
                "add_bias_linear", "apply_layernorm_1p")
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
    #: Megatron-LM's skipped_train_samples: what --decrease-batch-size-if-needed left out of the
    #: global batches (not in consumed_train_samples) and the batches --iterations-to-skip read
    #: past (in consumed_train_samples too).
    skipped_train_samples: int = 0
    #: Megatron-LM's running FLOP count (saved as num_floating_point_operations_so_far).
    floating_point_operations_so_far: float = 0.0
    extra: dict = field(default_factory=dict)
    #: The checkpoint directory this run resumed from (None: none); never saved.
    loaded: Optional[str] = None


def parallel_layout(config: RunConfig) -> dict:
    p = config.parallel
    return {"tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size,
            "vpp": p.virtual_pipeline_model_parallel_size, "dp": p.data_parallel_size}


def model_shape(config: RunConfig) -> dict:
    return _model_fields(json.loads(config.to_json())["model"])


def model_shape_of(saved_run_config: dict) -> dict:
    """`model_shape` of a saved run_config.json (parsed)."""
    return _model_fields(saved_run_config["model"])


def _model_fields(saved: dict) -> dict:
    """The SHAPE_FIELDS of a model config as JSON (missing ones: their defaults), with key/value
    heads counted as megatron-core builds them (one per query head without GQA)."""
    out = {}
    for k in SHAPE_FIELDS:
        default = _MODEL_DEFAULTS.get(k)
        out[k] = saved.get(k, default.value if isinstance(default, enum.Enum) else default)
    out["num_query_groups"] = out["num_query_groups"] or out["num_attention_heads"]
    return out


#: Architecture fields that only add or remove whole tensors (the output layer, the biases):
#: what a lenient --dist-ckpt-strictness load may bridge.
TENSOR_SET_FIELDS = ("untie_embeddings_and_output_weights", "add_bias_linear")


def check_model_shape(saved_config_json: str, config: RunConfig, path: str,
                      tensor_set_may_differ: bool = False) -> List[str]:
    """Refuse a checkpoint of another model shape or architecture before megatron-core reports it
    as a tensor-level mismatch (or, for an architecture flag, loads it into a model that computes
    something else). `tensor_set_may_differ` (a lenient --dist-ckpt-strictness): differences in
    `TENSOR_SET_FIELDS` alone are returned (described) instead of refused."""
    saved = _model_fields(json.loads(saved_config_json)["model"])
    ours = model_shape(config)
    # A rope model has no position table; the rotary fields mean nothing without rope.
    rope = PositionEmbeddingType.ROPE.value
    ignored = set()
    if saved["position_embedding_type"] == ours["position_embedding_type"] == rope:
        ignored.add("max_position_embeddings")
    if rope not in (saved["position_embedding_type"], ours["position_embedding_type"]):
        ignored.update(_ROPE_ONLY)
    differ = [k for k, v in ours.items() if k not in ignored and saved[k] != v]
    diffs = [f"{k}: checkpoint {saved[k]!r}, this run {ours[k]!r}" for k in differ]
    bridgeable = set(differ) <= set(TENSOR_SET_FIELDS)
    if diffs and not (tensor_set_may_differ and bridgeable):
        raise CheckpointError("checkpoint was saved for another model shape (" + "; ".join(diffs)
                              + "); pass the same model flags or another --load"
                              + (" (or, to load the tensors both models have, "
                                 "--dist-ckpt-strictness log_all with --finetune)"
                                 if bridgeable else ""), path=path)
    return diffs


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
    state = rng_state()  # taken once: both layouts save the same states (a save per iteration)

    def theirs() -> dict:
        # Megatron-LM's loader requires cuda_rng_state (see `rng_state`).
        megatron_lm = state if "cuda_rng_state" in state else \
            {**state, "cuda_rng_state": state["torch_rng_state"].clone()}
        return {"rng_state": ShardedObject("rng_state", [megatron_lm], shape, offset,
                                           replica_id=ps.get_data_parallel_rank())}

    if layout is RngLayout.MEGATRON_LM:
        return theirs()
    key = "rng_state" if layout is RngLayout.PER_RANK else RNG_PER_RANK_KEY
    ours = {key: ShardedObject(key, state, shape + dp_shape, offset + dp_offset, replica_id=0)}
    # Loading reads ours only; Megatron-LM's copy is for Megatron-LM.
    return ours if is_loading or layout is RngLayout.PER_RANK else {**ours, **theirs()}


@dataclass(frozen=True)
class SaveValues:
    """What a save's dict holds that the training loop changes before the next optimizer step,
    taken in the save call: the RNG states (the next forward's dropout draws from them), the
    counters and the schedule. The rest (the model's and the optimizer's parts) may be built
    later, until that step (`LazyCheckpointer.save_built`)."""

    rng: dict  # the RNG states' ShardedObjects (none without --save-rng)
    common: dict  # `common_state`
    scheduler: dict  # the learning-rate scheduler's state


def save_values(state: TrainState, config: RunConfig, include_rng: bool,
                rng_layout: RngLayout = RngLayout.BOTH, is_loading: bool = False) -> SaveValues:
    """`SaveValues` now (`rng_layout`, `is_loading`: as `build_sharded_state_dict`'s)."""
    return SaveValues(_rng_sharded_objects(rng_layout, is_loading) if include_rng else {},
                      common_state(state, config),
                      {} if state.scheduler is None else state.scheduler.state_dict())


def build_sharded_state_dict(state: TrainState, config: RunConfig, *, is_loading: bool,
                             include_optim: bool, include_rng: bool,
                             optimizer_metadata: Optional[dict] = None,
                             rng_layout: RngLayout = RngLayout.BOTH,
                             cache: Any = None, values: Optional[SaveValues] = None) -> dict:
    """The dict torch_dist saves: model and optimizer sharded state plus common state, with
    what Megatron-LM's loader reads too (its ``args``, FLOP count and RNG layout).
    `optimizer_metadata` and `rng_layout` describe a checkpoint being loaded (default: ours).
    `cache`: a `state_cache.SaveStateCache` the model's and optimizer's parts come from when
    saving, if not built anew. `values`: the `save_values` taken in the save call, when the
    dict is built after it (`rng_layout` is then ours).

    Must be called on every rank (the distributed optimizer gathers over DP when saving)."""
    values = values or save_values(state, config, include_rng, rng_layout, is_loading)
    sd = model_sharded_state_dict(state.model) if cache is None else \
        cache.model_part(state.model)
    if include_optim and state.optimizer is not None:
        # The optimizer finds each param's sharded tensor by identity anywhere in this dict,
        # so one dict serves every VPP chunk.
        metadata = optimizer_metadata or OPTIMIZER_METADATA
        sd["optimizer"] = (
            state.optimizer.sharded_state_dict(dict(sd), is_loading=is_loading, metadata=metadata)
            if cache is None or is_loading else
            cache.optimizer_part(state.optimizer, dict(sd), metadata))
        sd["opt_param_scheduler"] = values.scheduler
    sd.update(values.rng)  # (empty without `include_rng`)
    sd.update(values.common)
    return sd


def common_state(state: TrainState, config: RunConfig) -> dict:
    """The small entries every format saves: ours and Megatron-LM's (``args``, the FLOP count)."""
    return {"checkpoint_version": CHECKPOINT_VERSION, "iteration": state.iteration,
            "consumed_train_samples": state.consumed_train_samples,
            "consumed_valid_samples": state.consumed_valid_samples,
            "skipped_train_samples": state.skipped_train_samples,
            "num_floating_point_operations_so_far": state.floating_point_operations_so_far,
            "run_config": config.to_json(),
            "args": upstream_compat.megatron_lm_args(state, config)}


#: (scheduler attribute, Megatron-LM's name for it in messages) compared on resume.
_SCHEDULE_FIELDS = (("max_lr", "--lr"), ("min_lr", "--min-lr"),
                    ("lr_warmup_steps", "warm-up samples (--lr-warmup-iters x global batch, "
                                        "--lr-warmup-samples, or --lr-warmup-fraction x decay "
                                        "samples)"),
                    ("lr_decay_steps", "decay samples (--lr-decay-iters, default --train-iters, "
                                       "x global batch; or --lr-decay-samples, default "
                                       "--train-samples)"),
                    ("lr_decay_style", "--lr-decay-style"), ("start_wd", "--weight-decay"),
                    ("end_wd", "--weight-decay"),
                    ("wd_incr_steps", "samples of the run (--train-iters x global batch, or "
                                      "--train-samples)"),
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


#: Transformer Engine 2.18+ refuses pickled extra state unless this is "1" (its own opt-in).
TE_UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


def _te_guards_extra_state() -> bool:
    """Whether the Transformer Engine loaded in this process refuses pickled extra state itself
    (2.18 and later: `transformer_engine.pytorch._extra_state`). Earlier 2.x releases unpickle
    whatever bytes a checkpoint holds in `set_extra_state`, with plain pickle."""
    if "transformer_engine.pytorch" not in sys.modules:
        return False
    try:
        return importlib.util.find_spec("transformer_engine.pytorch._extra_state") is not None
    except (ImportError, ValueError):
        return False


def _extra_state_bytes(value: Any) -> Optional[bytes]:
    """The bytes a module's `set_extra_state` would unpickle from `value` (TE: a uint8 tensor, or
    an io.BytesIO from TE 1.x), None when there is nothing to unpickle."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes() \
            if value.numel() else None
    if isinstance(value, io.BytesIO):
        return value.getvalue() or None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value) or None
    return None


def check_extra_states(model_state: dict, *, allow_unsafe_pickle: bool, path: str = "") -> None:
    """Refuse a checkpoint whose modules' ``_extra_state`` would be unpickled with code in it.

    Transformer Engine before 2.18 saves its FP8 metadata as a pickle in a uint8 tensor and
    `set_extra_state` runs `pickle.loads` on whatever the checkpoint holds there (`torch.load` for
    TE 1.x's BytesIO), so loading a crafted checkpoint would run its code. Here, unless
    --allow-unsafe-pickle: a non-empty BytesIO, or bytes whose pickle would import anything
    (`safe_load.pickle_imports`), is refused before any module sees it. A pickle that imports
    nothing cannot run code (an empty dict, say) and passes. Where the loaded TE guards itself
    (2.18+), its own check decides, with our flag as its opt-in (`_te_pickle_opt_in`)."""
    if allow_unsafe_pickle or _te_guards_extra_state():
        return
    refused = []
    for key, value in model_state.items():
        if not key.endswith("_extra_state"):
            continue
        data = _extra_state_bytes(value)
        if data is None:
            continue
        if isinstance(value, io.BytesIO):
            refused.append(f"{key} (a torch.save buffer)")
            continue
        try:
            imports = pickle_imports(data)
        except ValueError as err:
            refused.append(f"{key} ({err})")
            continue
        if imports:
            refused.append(f"{key} (imports {', '.join(imports[:3])})")
    if refused:
        raise UnsafePickleError(
            f"the checkpoint's module extra state would be unpickled by Transformer Engine's "
            f"set_extra_state, which can run code: {'; '.join(refused[:4])}"
            f"{f' and {len(refused) - 4} more' if len(refused) > 4 else ''}. Nothing of it was "
            f"run. If you trust this checkpoint, rerun with {UNSAFE_PICKLE_FLAG}; Transformer "
            "Engine 2.18 or later checks these pickles itself", file=path or None)


@contextlib.contextmanager
def _te_pickle_opt_in(allow_unsafe_pickle: bool) -> Iterator[None]:
    """--allow-unsafe-pickle is also Transformer Engine 2.18+'s opt-in while the model loads, so
    one flag reads a trusted FP8 checkpoint; the environment is restored afterwards."""
    if not allow_unsafe_pickle or os.environ.get(TE_UNSAFE_PICKLE_ENV) == "1":
        yield
        return
    before = os.environ.get(TE_UNSAFE_PICKLE_ENV)
    os.environ[TE_UNSAFE_PICKLE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TE_UNSAFE_PICKLE_ENV, None)
        else:
            os.environ[TE_UNSAFE_PICKLE_ENV] = before


def apply_loaded_state_dict(state: TrainState, loaded: dict, *, load_optim: bool,
                            load_rng: bool, finetune: bool,
                            schedule: SchedulerOnResume = SchedulerOnResume.MUST_MATCH,
                            path: str = "", allow_unsafe_pickle: bool = False,
                            partial: bool = False) -> Optional[str]:
    """Restore model (always), then optimizer+scheduler, RNG and progress counters unless told
    not to; a note to print, or None. ``finetune`` keeps iteration and sample counters at zero.
    Module extra state that would be unpickled with code in it is refused first
    (`check_extra_states`). ``partial``: the checkpoint lacked some of this rank's model tensors
    (a lenient --dist-ckpt-strictness load left exactly those out), which keep their values."""
    n = len(state.model)
    for i in range(n):
        check_extra_states(loaded[_model_key(i, n)], allow_unsafe_pickle=allow_unsafe_pickle,
                           path=path)
    with _te_pickle_opt_in(allow_unsafe_pickle):
        for i, chunk in enumerate(state.model):
            unwrap(chunk).load_state_dict(loaded[_model_key(i, n)], strict=not partial)
    note = None
    if load_optim and "opt_param_scheduler" in loaded:
        # Before anything is applied: a refused schedule leaves the state untouched.
        note = check_schedule(state.scheduler, loaded["opt_param_scheduler"], schedule, path)
    if load_optim and "optimizer" in loaded:
        with torch.no_grad():  # fp32 main params are leaf tensors that require grad
            state.optimizer.load_state_dict(loaded["optimizer"])
        state.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        # As Megatron-LM: with --fp16/--bf16 the optimizer steps fp32 main copies of the
        # parameters, made when it was built; without this, the first step would write them
        # (the initial weights plus the update) over the weights just loaded.
        with torch.no_grad():
            state.optimizer.reload_model_params()
    rng = loaded.get(RNG_PER_RANK_KEY, loaded.get("rng_state"))
    if load_rng and rng is not None:
        set_rng_state(rng[0] if isinstance(rng, list) else rng)  # a list: Megatron-LM's layout
    if not finetune:
        state.iteration = int(loaded["iteration"])
        state.consumed_train_samples = int(loaded["consumed_train_samples"])
        state.consumed_valid_samples = int(loaded["consumed_valid_samples"])
        state.skipped_train_samples = int(loaded.get("skipped_train_samples", 0))
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
