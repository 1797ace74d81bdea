"""What a merge of a Megatron checkpoint writes: source keys mapped to universal names, and the
Megatron fields of the manifest (counters, scheduler, optimizer, model config, layout, common.pt).

megatron-core names optimizer state differently per optimizer: the distributed optimizer's
``fully_reshardable`` format saves ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` with the step
in every param group; the non-distributed optimizer saves ``optimizer.state.{exp_avg,exp_avg_sq}.
<key>`` (plus ``fp32_param`` in mixed precision) with the step as ``state.common_step``. The
universal format has one spelling (see format.py) and records which one the source used.
"""
from __future__ import annotations

import json
from typing import Any, List, Optional, Tuple

import torch

from ...errors import CheckpointError
from ...universal import Entry, Role, encode_value, tensor_name
from ...universal.format import OPTIM_PREFIX

_SOURCE_ROLES = {"param": Role.FP32_PARAM, "fp32_param": Role.FP32_PARAM,
                 "exp_avg": Role.EXP_AVG, "exp_avg_sq": Role.EXP_AVG_SQ}


class OptimizerFlavor:
    """How the source spelled its optimizer state (strings, stored in the manifest)."""

    DISTRIBUTED = "distributed"  # fully_reshardable
    LOCAL = "local"              # megatron's non-distributed (FP32 or mixed-precision) optimizer
    NONE = "none"                # saved without optimizer state


def plan_entries(source) -> Tuple[List[Entry], str]:
    """Universal entries for every tensor of `source` (a `sources.Source`), and the optimizer
    flavor found."""
    entries: List[Entry] = []
    flavor = OptimizerFlavor.NONE
    for key in source.keys():
        dtype, shape = source.meta(key)
        role, param = Role.WEIGHT, key
        if key.startswith("optimizer.") and not key.startswith(OPTIM_PREFIX):
            # e.g. the distributed optimizer's dp_reshardable buffers: flat, layout-specific
            raise CheckpointError("optimizer state is saved in a layout-specific format; the "
                                  "universal format needs per-parameter state (the distributed "
                                  "optimizer's 'fully_reshardable' format, or the non-distributed "
                                  "optimizer)", file=source.directory, tensor=key)
        if key.startswith(OPTIM_PREFIX):
            kind, _, param = key[len(OPTIM_PREFIX):].partition(".")
            if kind not in _SOURCE_ROLES:
                raise CheckpointError(f"optimizer state {kind!r} is not supported by the universal "
                                      f"format (Adam's param/fp32_param/exp_avg/exp_avg_sq are)",
                                      file=source.directory, tensor=key)
            role = _SOURCE_ROLES[kind]
            if flavor != OptimizerFlavor.DISTRIBUTED:
                flavor = OptimizerFlavor.DISTRIBUTED if kind == "param" else OptimizerFlavor.LOCAL
        entries.append(Entry(tensor_name(role, param), role, param, key, dtype, shape))
    names = {e.name for e in entries}
    if flavor != OptimizerFlavor.NONE:
        # fp32 weights with a non-distributed optimizer: the weights are the main weights, so the
        # universal checkpoint gets an explicit fp32 copy and every consumer reads one spelling.
        for e in [e for e in entries if e.role is Role.WEIGHT]:
            main = tensor_name(Role.FP32_PARAM, e.key)
            if main not in names:
                if e.dtype != torch.float32:
                    raise CheckpointError(f"no fp32 main weight for a {e.dtype} parameter",
                                          file=source.directory, tensor=e.key)
                entries.append(Entry(main, Role.FP32_PARAM, e.key, e.source_key, e.dtype, e.shape))
    entries.sort(key=lambda e: e.name)
    return entries, flavor


def _optimizer_common(common: dict) -> Optional[dict]:
    """The dict holding `param_groups` inside common['optimizer'] (nested once for wrappers)."""
    opt = common.get("optimizer")
    while isinstance(opt, dict) and "param_groups" not in opt:
        opt = opt.get("optimizer")
    return opt


def optimizer_manifest(common: dict, flavor: str, directory: str) -> Optional[dict]:
    if flavor == OptimizerFlavor.NONE:
        return None
    opt = _optimizer_common(common)
    if opt is None:
        raise CheckpointError("optimizer tensors are present but common.pt has no param_groups",
                              file=directory)
    groups, steps = [], set()
    for g in opt["param_groups"]:
        g = dict(g)
        g.pop("params", None)
        if "step" in g:
            steps.add(float(g.pop("step")))
        groups.append(g)
    common_step = (opt.get("state") or {}).get("common_step")
    if common_step is not None:
        steps.add(float(common_step))
    if len(steps) != 1:
        raise CheckpointError(f"expected one optimizer step shared by every param group, found "
                              f"{sorted(steps)}", file=directory)
    return {"flavor": flavor, "step": steps.pop(), "param_groups": groups,
            "sharding_type": (common.get("optimizer") or {}).get("param_state_sharding_type")}


def manifest_fields(source, common: dict, flavor: str) -> dict:
    """The manifest's Megatron fields (the writer adds format, objects and the tensor table)."""
    run_config = json.loads(common["run_config"]) if "run_config" in common else {}
    data = run_config.get("data", {})
    model = run_config.get("model") or _model_from_megatron_args(common.get("args"))
    par = run_config.get("parallel", {})
    return {
        "iteration": int(common.get("iteration", 0)),
        "consumed_train_samples": int(common.get("consumed_train_samples", 0)),
        "consumed_valid_samples": int(common.get("consumed_valid_samples", 0)),
        "skipped_train_samples": int(common.get("skipped_train_samples", getattr(
            common.get("args"), "skipped_train_samples", 0)) or 0),
        "checkpoint_version": common.get("checkpoint_version"),
        "scheduler": common.get("opt_param_scheduler"),
        "optimizer": optimizer_manifest(common, flavor, source.directory),
        "model_config": model,
        "tokenizer": {"tokenizer_type": data.get("tokenizer_type"),
                      "vocab_size": model.get("vocab_size"),
                      "padded_vocab_size": model.get("padded_vocab_size"),
                      "make_vocab_size_divisible_by": data.get("make_vocab_size_divisible_by")},
        "source": {"format": source.kind, "directory": source.directory,
                   "layout": {"tp": par.get("tensor_model_parallel_size"),
                              "pp": par.get("pipeline_model_parallel_size"),
                              "vpp": par.get("virtual_pipeline_model_parallel_size"),
                              "world_size": par.get("world_size"),
                              "use_distributed_optimizer": par.get("use_distributed_optimizer")}},
        "run_config": run_config,
        # megatron's common.pt as saved, so universal -> torch_dist restores it exactly.
        "megatron_common": encode_value(common),
    }


_MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "seq_length", "max_position_embeddings", "vocab_size", "padded_vocab_size",
                 "untie_embeddings_and_output_weights", "bf16", "fp16", "init_method_std",
                 "hidden_dropout", "attention_dropout", "position_embedding_type", "rotary_base",
                 "rotary_percent", "normalization", "norm_epsilon", "swiglu", "add_bias_linear")


def _model_from_megatron_args(args: Any) -> dict:
    """Megatron-LM's own checkpoints carry its argparse Namespace instead of our run config."""
    if args is None:
        return {}
    model = {k: getattr(args, k) for k in _MODEL_FIELDS if hasattr(args, k)}
    if hasattr(args, "group_query_attention"):
        # Megatron-LM ignores --num-query-groups without --group-query-attention.
        model["num_query_groups"] = (getattr(args, "num_query_groups", None)
                                     if args.group_query_attention else None)
    return model
