"""NVIDIA Megatron-LM's own checkpoints (its `megatron/training/checkpointing/stock.py`, checked against
tag core_v0.16.1, commit 55ac7082517c3878ae653c07c09c534b8aed49f6): what its common state says
and how that maps onto ours.

Megatron-LM keeps the run's arguments as an `argparse.Namespace` under ``args`` (no
``run_config``), the RNG state as one object per (PP, TP) rank (a list whose item 0 is restored;
saved by data-parallel rank 0), consumed samples inside ``args``, and the distributed optimizer's
sharding type in the checkpoint's content metadata (``dp_reshardable`` by default,
``fully_reshardable`` with ``--dist-ckpt-optim-fully-reshardable``). `saved_config_from_args`
turns its ``args`` into the subset of our run-config JSON the loader checks;
`optimizer_sharding` reads the sharding type; `normalize_loaded` gives a loaded state dict our
keys. Fields we do not understand are refused by name, never guessed.
"""
from __future__ import annotations

import argparse
import json
from typing import Optional

from megatron.training.checkpointing.errors import CheckpointError

#: Megatron-LM's RNG key: a ShardedObject over the (PP, TP) grid, replicated over DP.
UPSTREAM_RNG_KEY = "rng_state"
UPSTREAM_CHECKPOINT_VERSION = 3.0

#: The sharding types of the distributed optimizer we load; the first reshards only over DP.
DP_RESHARDABLE = "dp_reshardable"
FULLY_RESHARDABLE = "fully_reshardable"
_SHARDING_KEY = "distrib_optim_sharding_type"
#: Content-metadata keys Megatron-LM 0.16.1 writes whose values we accept (others: refused).
_KNOWN_METADATA = {_SHARDING_KEY: (DP_RESHARDABLE, FULLY_RESHARDABLE),
                   "distrib_optim_fully_reshardable_mem_efficient": (False, True),
                   "singleton_local_shards": (False,), "chained_optim_avoid_prefix": (False, True)}

#: Top-level entries of Megatron-LM 0.16.1's common state; anything else is a field we do not
#: understand (a newer Megatron-LM, or a model family this trainer does not build).
_KNOWN_COMMON = {"args", "checkpoint_version", "iteration", "optimizer", "opt_param_scheduler",
                 "num_floating_point_operations_so_far", "content_metadata",
                 "rerun_state_machine", "rng_state"}

#: args fields the loader reads: their absence means a Megatron-LM whose args we do not know.
_REQUIRED_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                  "padded_vocab_size", "max_position_embeddings", "tensor_model_parallel_size",
                  "pipeline_model_parallel_size", "world_size", "use_distributed_optimizer")

#: args of model families and layouts this trainer does not build, with the value that means
#: "not used"; another value is refused naming the field.
_UNSUPPORTED_ARGS = {
    "num_experts": (None,), "multi_latent_attention": (False,), "mtp_num_layers": (None, 0),
    "context_parallel_size": (1,), "expert_model_parallel_size": (1,),
    "data_parallel_random_init": (False,), "fp8": (None,), "qk_layernorm": (False,), "apply_residual_connection_post_layernorm": (False,),
}


def megatron_lm_args(state, config) -> argparse.Namespace:
    """The ``args`` Megatron-LM's loader reads from a checkpoint (its `check_checkpoint_args`,
    the TP/PP/world-size and RNG/optimizer checks of `load_checkpoint`, the consumed and skipped
    samples it resumes, and the model fields `--use-checkpoint-args` takes), from our run config
    and counters. Plain values only, so every format (and the universal one) stores it without
    a pickle of any class but Namespace."""
    m, p, c = config.model, config.parallel, config.checkpoint
    rope = m.position_embedding_type.value == "rope"
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, kv_channels=m.hidden_size // m.num_attention_heads,
        group_query_attention=m.num_query_groups is not None,
        num_query_groups=m.num_query_groups or m.num_attention_heads,
        seq_length=m.seq_length, max_position_embeddings=m.max_position_embeddings,
        position_embedding_type=m.position_embedding_type.value, add_position_embedding=not rope,
        use_rotary_position_embeddings=rope, rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent, rotary_interleaved=False,
        normalization=m.normalization.value, norm_epsilon=m.norm_epsilon, swiglu=m.swiglu,
        add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_bias_linear,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        apply_layernorm_1p=m.apply_layernorm_1p, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, init_method_std=m.init_method_std,
        bf16=m.bf16, fp16=m.fp16, transformer_impl="local",
        tokenizer_type=config.data.tokenizer_type, vocab_size=m.vocab_size,
        vocab_file=config.data.vocab_file, merge_file=config.data.merge_file,
        tokenizer_model=config.data.tokenizer_model, padded_vocab_size=m.padded_vocab_size,
        make_vocab_size_divisible_by=config.data.make_vocab_size_divisible_by,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        sequence_parallel=p.sequence_parallel, world_size=p.world_size,
        data_parallel_size=p.data_parallel_size, context_parallel_size=1,
        expert_model_parallel_size=1, data_parallel_random_init=False,
        use_distributed_optimizer=p.use_distributed_optimizer,
        micro_batch_size=config.training.micro_batch_size,
        global_batch_size=config.training.global_batch_size,
        train_iters=config.training.train_iters, train_samples=config.training.train_samples,
        seed=config.training.seed,
        ckpt_format="torch" if c.ckpt_format.value == "torch" else "torch_dist",
        use_dist_ckpt=c.ckpt_format.value != "torch",
        ckpt_fully_parallel_save=c.ckpt_fully_parallel_save,
        dist_ckpt_optim_fully_reshardable=True,  # contents.OPTIMIZER_METADATA
        no_save_optim=not c.save_optim, no_save_rng=not c.save_rng,
        iteration=state.iteration, consumed_train_samples=state.consumed_train_samples,
        skipped_train_samples=state.skipped_train_samples,
        decrease_batch_size_if_needed=config.training.decrease_batch_size_if_needed,
        consumed_valid_samples=state.consumed_valid_samples,
    )


def is_upstream(common: dict) -> bool:
    """A Megatron-LM checkpoint's common state: ``args`` and no ``run_config`` of ours."""
    return isinstance(common, dict) and "run_config" not in common and "args" in common


def _arg(args: argparse.Namespace, name: str, path: str, default=None, required=True):
    if hasattr(args, name):
        return getattr(args, name)
    if required:
        raise CheckpointError(f"the checkpoint's Megatron-LM args have no field {name!r}; this "
                              "trainer reads Megatron-LM checkpoints as written at tag "
                              "core_v0.16.1 (an older or newer version?)", path=path)
    return default


def check_understood(common: dict, path: str) -> None:
    """Refuse, naming the field, a Megatron-LM checkpoint holding something we do not read."""
    args = common["args"]
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"the checkpoint's 'args' is a {type(args).__name__}, expected "
                              "Megatron-LM's argparse.Namespace", path=path)
    version = common.get("checkpoint_version")
    if version != UPSTREAM_CHECKPOINT_VERSION:
        raise CheckpointError(f"the checkpoint's field 'checkpoint_version' is {version!r}; this "
                              f"trainer reads Megatron-LM checkpoint version "
                              f"{UPSTREAM_CHECKPOINT_VERSION}", path=path)
    for key in common:
        if key not in _KNOWN_COMMON and not key.startswith("model"):
            raise CheckpointError(f"the checkpoint holds a field {key!r} that Megatron-LM "
                                  "core_v0.16.1 does not write and this trainer does not read",
                                  path=path)
    for name, fine in _UNSUPPORTED_ARGS.items():
        value = getattr(args, name, fine[0])
        if value not in fine:
            raise CheckpointError(f"the checkpoint's Megatron-LM args set {name}={value!r}; this "
                                  f"trainer builds only models and layouts with {name}="
                                  f"{fine[0]!r}", path=path)
    bias, qkv_bias = getattr(args, "add_bias_linear", True), getattr(args, "add_qkv_bias", None)
    if qkv_bias not in (None, bias):  # Megatron-LM sets add_qkv_bias = add_bias_linear
        raise CheckpointError(f"the checkpoint's Megatron-LM args set add_qkv_bias={qkv_bias!r} "
                              f"with add_bias_linear={bias!r}; this trainer builds QKV biases "
                              "exactly when the other linear layers have them", path=path)
    impl = getattr(args, "transformer_impl", "local")
    if impl not in ("local", "transformer_engine"):
        raise CheckpointError(f"the checkpoint's Megatron-LM args set transformer_impl={impl!r}; "
                              "expected 'local' or 'transformer_engine'", path=path)
    optimizer_sharding(common, path)


def optimizer_sharding(common: dict, path: str) -> Optional[str]:
    """The distributed optimizer's sharding type from the content metadata (None: no
    distributed optimizer, or no metadata)."""
    metadata = common.get("content_metadata") or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"the checkpoint's content metadata is a "
                              f"{type(metadata).__name__}, expected a dict", path=path)
    for key, value in metadata.items():
        if key not in _KNOWN_METADATA:
            raise CheckpointError(f"the checkpoint's content metadata holds a field {key!r} this "
                                  "trainer does not read", path=path)
        if value not in _KNOWN_METADATA[key]:
            raise CheckpointError(f"the checkpoint's content metadata sets {key}={value!r}; this "
                                  f"trainer reads {', '.join(map(repr, _KNOWN_METADATA[key]))}",
                                  path=path)
    return metadata.get(_SHARDING_KEY)


def optimizer_metadata(common: dict) -> dict:
    """The metadata to build the optimizer's sharded state dict with when loading ``common``'s
    checkpoint (Megatron-LM passes the checkpoint's content metadata the same way)."""
    return {k: v for k, v in (common.get("content_metadata") or {}).items() if k in _KNOWN_METADATA}


def saved_config_from_args(common: dict, path: str) -> str:
    """The part of our run-config JSON the loader checks (model shape, layout, what was saved),
    from Megatron-LM's ``args``."""
    check_understood(common, path)
    args = common["args"]
    rope = _arg(args, "position_embedding_type", path, "learned_absolute", required=False)
    gqa = bool(_arg(args, "group_query_attention", path, False, required=False))
    model = {name: _arg(args, name, path) for name in _REQUIRED_ARGS[:6]}
    model.update({
        "untie_embeddings_and_output_weights": bool(
            _arg(args, "untie_embeddings_and_output_weights", path, False, required=False)),
        "position_embedding_type": rope,
        "rotary_base": _arg(args, "rotary_base", path, 10000, required=False),
        "rotary_percent": _arg(args, "rotary_percent", path, 1.0, required=False),
        "normalization": _arg(args, "normalization", path, "LayerNorm", required=False),
        "swiglu": bool(_arg(args, "swiglu", path, False, required=False)),
        "num_query_groups": _arg(args, "num_query_groups", path) if gqa else None,
        "add_bias_linear": bool(_arg(args, "add_bias_linear", path, True, required=False)),
        "apply_layernorm_1p": bool(_arg(args, "apply_layernorm_1p", path, False,
                                        required=False)),
    })
    parallel = {name: _arg(args, name, path) for name in _REQUIRED_ARGS[6:]}
    parallel["virtual_pipeline_model_parallel_size"] = _arg(
        args, "virtual_pipeline_model_parallel_size", path, None, required=False)
    checkpoint = {"save_optim": not _arg(args, "no_save_optim", path, False, required=False),
                  "save_rng": not _arg(args, "no_save_rng", path, False, required=False)}
    data = {name: _arg(args, name, path, None, required=False) for name in _TOKENIZER_ARGS}
    return json.dumps({"model": model, "parallel": parallel, "checkpoint": checkpoint,
                       "data": data})


#: The tokenizer's arguments (`checkpoint_args` takes them with --use-checkpoint-args).
_TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model", "vocab_size", "vocab_file", "merge_file")


def normalize_loaded(loaded: dict, path: str) -> dict:
    """A state dict loaded from a Megatron-LM checkpoint, with our keys: progress counters from
    ``args``, the RNG state of this rank (item 0 of Megatron-LM's list: the state data-parallel
    rank 0 saved, which Megatron-LM restores on every DP rank), and its --decoupled-lr
    parameter group marked (`_mark_decoupled_groups`)."""
    args = loaded["args"]
    for name in ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples"):
        loaded.setdefault(name, int(getattr(args, name, 0) or 0))
    _mark_decoupled_groups(loaded.get("optimizer"), args)
    rng = loaded.get(UPSTREAM_RNG_KEY)
    if isinstance(rng, list):
        if not rng or not isinstance(rng[0], dict):
            raise CheckpointError("the checkpoint's rng_state is an empty list or holds no state "
                                  "dict (Megatron-LM saves [state] per (PP, TP) rank)", path=path)
        loaded[UPSTREAM_RNG_KEY] = rng[0]
    return loaded


def _mark_decoupled_groups(optimizer_state, args) -> None:
    """megatron-core 0.16.1's own overrides leave the --decoupled-lr parameter group unmarked
    (`mcore_fixes.optimizer_config_overrides`), so in a checkpoint Megatron-LM saved that group
    has the default group's identity (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) and
    a load takes one group's hyperparameters for both (Megatron-LM's own resume then steps the
    default group with the decoupled rates). The group is the one whose (max_lr, min_lr) are the
    run's decoupled ones, from the checkpoint's ``args``: marked as this trainer marks it. Where
    those equal the default rates the groups are alike and stay as they are."""
    decoupled = getattr(args, "decoupled_lr", None)
    if decoupled is None or not isinstance(optimizer_state, (dict, list)):
        return
    decoupled_min = getattr(args, "decoupled_min_lr", None)
    rates = (decoupled, getattr(args, "min_lr", None) if decoupled_min is None else decoupled_min)
    if rates == (getattr(args, "lr", None), getattr(args, "min_lr", None)):
        return
    pending = [optimizer_state]
    while pending:  # the optimizer's state dict, or a chained optimizer's list of them
        item = pending.pop()
        values = item.values() if isinstance(item, dict) else item
        pending.extend(v for v in values if isinstance(v, (dict, list)) and not (
            isinstance(item, dict) and v is item.get("param_groups")))
        if isinstance(item, dict) and isinstance(item.get("param_groups"), list):
            for group in item["param_groups"]:
                if isinstance(group, dict) and (group.get("max_lr"), group.get("min_lr")) == rates:
                    group["is_decoupled_lr"] = True
