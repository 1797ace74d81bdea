"""Universal checkpoint -> Hugging Face ``LlamaForCausalLM`` names and ``config.json``.

megatron-core's GPT with rotary embeddings over every channel, RMSNorm and a SwiGLU MLP is Llama:
megatron's rotary embedding is the rotate-half (non-interleaved) form Hugging Face's Llama uses,
and query head j attends with key/value group j // (heads / groups) in both. The mapping only
renames, unstacks the layer axis and splits two fused tensors, in the global layout the universal
checkpoint stores (megatron-core's sharded_state_dict layout):

- ``linear_qkv`` holds, per query group in group order, [the group's q heads; k; v] rows of
  head_dim each: q_proj/k_proj/v_proj gather those rows across groups;
- SwiGLU's ``linear_fc1`` holds [all gate rows; all up rows] (megatron-core shards each half over
  TP): gate_proj is the first half, up_proj the second (silu(gate) * up in both).

Biases (without --disable-bias-linear) map onto Llama's ``attention_bias``/``mlp_bias``. Anything
Llama cannot express (partial rotary, LayerNorm, a non-gated MLP) is refused naming the part.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ...universal import UniversalCheckpoint
from .common import (LAYERS, Layout, Plan, Rule, architecture_fields, export_plan, hf_dtype,
                        refuse, refuse_import, special_token_ids)

__all__ = ["ATTN_NORM", "MLP_NORM", "llama_config", "llama_layout", "llama_model_config",
           "llama_tensors"]

ATTN_NORM = "self_attention.linear_qkv.layer_norm_weight"
MLP_NORM = "mlp.linear_fc1.layer_norm_weight"

_EXPECTED = ("Hugging Face Llama is megatron's GPT with --position-embedding-type rope, "
             "--rotary-percent 1, --normalization RMSNorm and --swiglu")


def _norm_name(u: UniversalCheckpoint, fused: str, separate: str) -> str:
    """The norm's name: fused into the next linear layer (TE-style spec) or a module of its own."""
    return fused if u.has(LAYERS + fused) else separate


def llama_config(u: UniversalCheckpoint) -> dict:
    """The Llama config.json for `u`, after checking that the architecture maps."""
    mc = u.manifest["model_config"]
    arch = architecture_fields(mc)
    h, heads, layers = mc["hidden_size"], mc["num_attention_heads"], mc["num_layers"]
    groups, ffn = arch["query_groups"], mc["ffn_hidden_size"]
    problems: List[str] = []
    if arch["rotary_percent"] != 1.0:
        problems.append(f"rotary_percent {arch['rotary_percent']} (Llama rotates every channel)")
    if arch["normalization"] != "RMSNorm":
        problems.append(f"{arch['normalization']} (Llama has RMSNorm only)")
    if not arch["swiglu"]:
        problems.append("a non-gated MLP (Llama's MLP is SwiGLU)")
    if u.has("embedding.position_embeddings.weight"):
        problems.append("a learned position-embedding table next to rope")
    refuse(u, "Llama", problems, _EXPECTED)
    head_dim = h // heads
    qkv = tuple(u.info(LAYERS + "self_attention.linear_qkv.weight").shape)
    fc1 = tuple(u.info(LAYERS + "mlp.linear_fc1.weight").shape)
    refuse(u, "Llama", [f"fused qkv has shape {list(qkv)}, expected "
                        f"{[layers, (heads + 2 * groups) * head_dim, h]}"]
           if qkv != (layers, (heads + 2 * groups) * head_dim, h) else [], _EXPECTED)
    refuse(u, "Llama", [f"fc1 has shape {list(fc1)}, expected {[layers, 2 * ffn, h]}"]
           if fc1 != (layers, 2 * ffn, h) else [], _EXPECTED)
    bias = u.has(LAYERS + "self_attention.linear_qkv.bias")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": u.info("embedding.word_embeddings.weight").shape[0],
            "hidden_size": h, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": head_dim,
            "hidden_act": "silu", "max_position_embeddings": mc["max_position_embeddings"],
            "rms_norm_eps": arch["norm_epsilon"],
            # rope_theta for transformers 4.x, rope_parameters for 5.x (which also reads the former).
            "rope_theta": float(arch["rotary_base"]),
            "rope_parameters": {"rope_type": "default", "rope_theta": float(arch["rotary_base"])},
            "attention_bias": bias, "mlp_bias": bias,
            "attention_dropout": mc.get("attention_dropout", 0.0),
            "initializer_range": mc.get("init_method_std", 0.02),
            "tie_word_embeddings": not mc.get("untie_embeddings_and_output_weights", False),
            **special_token_ids(mc), "torch_dtype": hf_dtype(u),
            "megatron_iteration": u.iteration, "megatron_vocab_size": mc.get("vocab_size")}


def _qkv_split(t: torch.Tensor, cfg: dict) -> Tuple[torch.Tensor, ...]:
    """megatron's per-group [q heads; k; v] rows -> (q rows, k rows, v rows)."""
    groups, d = cfg["num_key_value_heads"], cfg["head_dim"]
    per_group = cfg["num_attention_heads"] // groups
    g = t.reshape(groups, (per_group + 2) * d, *t.shape[1:])
    q, k, v = g.split([per_group * d, d, d], dim=1)
    return tuple(x.reshape(-1, *t.shape[1:]) for x in (q, k, v))


def _qkv_join(parts: Sequence[torch.Tensor], cfg: dict) -> torch.Tensor:
    """Inverse of `_qkv_split`: each group's q heads, then its k and v rows."""
    groups = cfg["num_key_value_heads"]
    q, k, v = (p.reshape(groups, -1, *p.shape[1:]) for p in parts)
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def llama_layout(cfg: dict, attn_norm: str = ATTN_NORM, mlp_norm: str = MLP_NORM) -> Layout:
    """Llama's mapping for the Hugging Face config `cfg` (its field names). The norms are fused
    into the next linear layer in megatron-core's sharded keys (`ATTN_NORM`, `MLP_NORM`; the
    local spec maps its own modules onto those names); older checkpoints may name them apart."""
    ffn = cfg["intermediate_size"]
    p = "model.layers.{i}."
    layer = [Rule(LAYERS + attn_norm, (p + "input_layernorm.weight",))]
    for s in ["weight"] + (["bias"] if cfg["attention_bias"] else []):
        layer += [Rule(f"{LAYERS}self_attention.linear_qkv.{s}",
                       tuple(f"{p}self_attn.{x}_proj.{s}" for x in "qkv"),
                       lambda t: _qkv_split(t, cfg), lambda ts: _qkv_join(ts, cfg)),
                  Rule(f"{LAYERS}self_attention.linear_proj.{s}", (f"{p}self_attn.o_proj.{s}",))]
    layer.append(Rule(LAYERS + mlp_norm, (p + "post_attention_layernorm.weight",)))
    for s in ["weight"] + (["bias"] if cfg["mlp_bias"] else []):
        # SwiGLU's fc1 is [all gate rows; all up rows]: silu(gate) * up in both.
        layer += [Rule(f"{LAYERS}mlp.linear_fc1.{s}", (f"{p}mlp.gate_proj.{s}",
                                                      f"{p}mlp.up_proj.{s}"),
                       lambda t: (t[:ffn], t[ffn:]), torch.cat),
                  Rule(f"{LAYERS}mlp.linear_fc2.{s}", (f"{p}mlp.down_proj.{s}",))]
    last = [Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if not cfg["tie_word_embeddings"]:
        last.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return Layout(cfg["num_hidden_layers"],
                  [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))],
                  layer, last)


def llama_tensors(u: UniversalCheckpoint, cfg: dict) -> Plan:
    """(HF name, loader) pairs in Llama's order; loaders read lazily, one tensor at a time."""
    return export_plan(u, llama_layout(cfg, _norm_name(u, ATTN_NORM, "input_layernorm.weight"),
                                       _norm_name(u, MLP_NORM, "pre_mlp_layernorm.weight")))


def _rope(hf: dict) -> Tuple[float, str]:
    """(rope theta, rope type) from transformers 5's ``rope_parameters`` or 4's ``rope_theta`` and
    ``rope_scaling``."""
    params, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), kind


def llama_model_config(hf: dict, path: str) -> Tuple[dict, dict]:
    """The inverse of `llama_config`: (the layout's config: ``hf`` with the fields `llama_layout`
    reads filled in; megatron's model config) for the Hugging Face config.json `hf` at `path`.
    Refuses, naming each, what megatron's GPT cannot express."""
    h, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    groups = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or h // heads
    theta, rope_type = _rope(hf)
    bias = bool(hf.get("attention_bias", False))
    problems = [why for bad, why in (
        (hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r} "
                                                  "(--swiglu gates with SiLU)"),
        (head_dim * heads != h, f"head_dim {head_dim} x {heads} heads != hidden_size {h} "
                                "(megatron's heads are hidden_size / heads wide)"),
        (heads % groups != 0, f"{groups} key/value heads for {heads} query heads"),
        (rope_type != "default", f"rope scaling {rope_type!r} (plain rope only)"),
        (theta != int(theta), f"rope_theta {theta} (--rotary-base takes an integer)"),
        (bias != bool(hf.get("mlp_bias", False)), "attention_bias != mlp_bias (megatron has "
                                                   "biases in every linear layer or none)"),
        (hf.get("pretraining_tp", 1) != 1, f"pretraining_tp {hf.get('pretraining_tp')}"))
        if bad]
    refuse_import(path, "LlamaForCausalLM", problems, "Supported: SiLU-gated MLP, plain rope, "
                  "head_dim = hidden_size / heads, biases everywhere or nowhere")
    tied = bool(hf.get("tie_word_embeddings", False))
    cfg = dict(hf, num_key_value_heads=groups, head_dim=head_dim, attention_bias=bias,
               mlp_bias=bias, tie_word_embeddings=tied)
    model = {"num_layers": layers, "hidden_size": h, "num_attention_heads": heads,
             "ffn_hidden_size": hf["intermediate_size"],
             "seq_length": hf["max_position_embeddings"],
             "max_position_embeddings": hf["max_position_embeddings"],
             "position_embedding_type": "rope", "rotary_base": int(theta), "rotary_percent": 1.0,
             "normalization": "RMSNorm", "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
             "swiglu": True, "num_query_groups": groups if groups != heads else None,
             "add_bias_linear": bias, "untie_embeddings_and_output_weights": not tied,
             "init_method_std": hf.get("initializer_range", 0.02), "hidden_dropout": 0.0,
             "attention_dropout": float(hf.get("attention_dropout", 0.0))}
    return cfg, model
