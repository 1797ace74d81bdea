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

from typing import List

import torch

from ..universal import UniversalCheckpoint
from .hf_common import (LAYERS, Plan, architecture_fields, hf_dtype, layer_loader, refuse,
                        special_token_ids)

__all__ = ["llama_config", "llama_tensors"]

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


def _qkv_part(t: torch.Tensor, cfg: dict, part: int) -> torch.Tensor:
    """Rows of q (part 0), k (1) or v (2) from megatron's per-group [q heads; k; v] layout."""
    groups, d = cfg["num_key_value_heads"], cfg["head_dim"]
    per_group = cfg["num_attention_heads"] // groups
    g = t.reshape(groups, (per_group + 2) * d, *t.shape[1:])
    start, stop = [(0, per_group * d), (per_group * d, (per_group + 1) * d),
                   ((per_group + 1) * d, (per_group + 2) * d)][part]
    return g[:, start:stop].reshape(-1, *t.shape[1:])


def llama_tensors(u: UniversalCheckpoint, cfg: dict) -> Plan:
    """(HF name, loader) pairs in Llama's order; loaders read lazily, one tensor at a time."""
    ffn = cfg["intermediate_size"]
    attn_norm = _norm_name(u, "self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
    mlp_norm = _norm_name(u, "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
    out: Plan = [("model.embed_tokens.weight", lambda: u.read("embedding.word_embeddings.weight"))]
    suffixes = ["weight"] + (["bias"] if cfg["attention_bias"] else [])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", layer_loader(u, attn_norm, i)))
        for s in suffixes:
            for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                out.append((f"{p}self_attn.{proj}.{s}", layer_loader(
                    u, f"self_attention.linear_qkv.{s}", i,
                    lambda t, part=part: _qkv_part(t, cfg, part))))
            out.append((f"{p}self_attn.o_proj.{s}",
                        layer_loader(u, f"self_attention.linear_proj.{s}", i)))
        out.append((p + "post_attention_layernorm.weight", layer_loader(u, mlp_norm, i)))
        for s in suffixes:
            out += [(f"{p}mlp.gate_proj.{s}",
                     layer_loader(u, f"mlp.linear_fc1.{s}", i, lambda t: t[:ffn])),
                    (f"{p}mlp.up_proj.{s}",
                     layer_loader(u, f"mlp.linear_fc1.{s}", i, lambda t: t[ffn:])),
                    (f"{p}mlp.down_proj.{s}", layer_loader(u, f"mlp.linear_fc2.{s}", i))]
    out.append(("model.norm.weight", lambda: u.read("decoder.final_layernorm.weight")))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", lambda: u.read("output_layer.weight")))
    return out
