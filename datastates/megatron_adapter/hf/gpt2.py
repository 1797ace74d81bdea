"""Universal checkpoint <-> Hugging Face ``GPT2LMHeadModel`` names and ``config.json``.

megatron-core's GPT with learned absolute position embeddings, LayerNorm with biases, a non-gated
GELU MLP and full multi-head attention is GPT-2: the mapping only renames, unstacks the layer axis,
transposes (GPT-2's Conv1D stores weights as [in, out]) and reorders the fused QKV (megatron
interleaves it per head: [head][q|k|v][head_dim]; GPT-2 concatenates [q|k|v]).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from ...universal import UniversalCheckpoint
from .common import (LAYERS as _L, Layout, Plan, Rule, architecture_fields, export_plan,
                        hf_dtype, refuse, refuse_import, special_token_ids)

__all__ = ["APPROXIMATE_GELUS", "gpt2_config", "gpt2_layout", "gpt2_model_config",
           "gpt2_tensors"]

#: GPT-2's tanh approximations of GELU; megatron-core's GPT computes the exact (erf) GELU.
APPROXIMATE_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")

_GPT2 = ("Only megatron GPT models with learned position embeddings, LayerNorm, biases, a "
         "non-gated GELU MLP and full multi-head attention map onto GPT-2 names; rotary models "
         "export as Llama")


def _require(u: UniversalCheckpoint, ok: bool, why: str) -> None:
    refuse(u, "GPT-2", [] if ok else [why], _GPT2)


def gpt2_config(u: UniversalCheckpoint) -> dict:
    """The GPT-2 config.json for `u`, after checking that the architecture maps."""
    mc = u.manifest["model_config"]
    h, heads, layers = mc["hidden_size"], mc["num_attention_heads"], mc["num_layers"]
    arch = architecture_fields(mc)
    refuse(u, "GPT-2", [why for bad, why in (
        (arch["normalization"] != "LayerNorm", f"{arch['normalization']} (GPT-2 has LayerNorm)"),
        (arch["swiglu"], "a SwiGLU MLP (GPT-2's MLP is GELU, not gated)"),
        (arch["query_groups"] != heads, f"grouped-query attention ({arch['query_groups']} query "
                                        f"groups for {heads} heads)"),
        (not arch["add_bias_linear"], "no biases (--disable-bias-linear)")) if bad], _GPT2)
    _require(u, u.has("embedding.position_embeddings.weight"),
             "no learned position embeddings (rotary or none)")
    _require(u, u.has(_L + "self_attention.linear_qkv.layer_norm_bias"),
             "no LayerNorm bias (RMSNorm?)")
    for name in ("self_attention.linear_qkv.bias", "self_attention.linear_proj.bias",
                 "mlp.linear_fc1.bias", "mlp.linear_fc2.bias"):
        _require(u, u.has(_L + name), f"no {name} (model trained without biases)")
    qkv = u.info(_L + "self_attention.linear_qkv.weight").shape
    _require(u, qkv == (layers, 3 * h, h), f"fused QKV has shape {list(qkv)}, expected "
             f"{[layers, 3 * h, h]} (grouped-query attention?)")
    fc1 = u.info(_L + "mlp.linear_fc1.weight").shape
    _require(u, fc1 == (layers, mc["ffn_hidden_size"], h), f"MLP input projection has shape "
             f"{list(fc1)}, expected {[layers, mc['ffn_hidden_size'], h]} (gated MLP?)")
    vocab = u.info("embedding.word_embeddings.weight").shape[0]
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": vocab, "n_positions": mc["max_position_embeddings"],
            "n_embd": h, "n_layer": layers, "n_head": heads, "n_inner": mc["ffn_hidden_size"],
            "activation_function": "gelu", "layer_norm_epsilon": arch["norm_epsilon"],
            "initializer_range": mc.get("init_method_std", 0.02),
            "resid_pdrop": mc.get("hidden_dropout", 0.1), "embd_pdrop": mc.get("hidden_dropout", 0.1),
            "attn_pdrop": mc.get("attention_dropout", 0.1),
            "tie_word_embeddings": not mc.get("untie_embeddings_and_output_weights", False),
            **special_token_ids(mc), "torch_dtype": hf_dtype(u),
            "megatron_iteration": u.iteration,
            "megatron_vocab_size": mc.get("vocab_size")}


def _qkv_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """megatron [heads*(q|k|v)*head_dim, ...] -> [q_all | k_all | v_all, ...]."""
    per_head = w.reshape(heads, 3, -1, *w.shape[1:])
    return per_head.transpose(0, 1).reshape(w.shape)


def _qkv_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `_qkv_to_hf`."""
    parts = w.reshape(3, heads, -1, *w.shape[1:])
    return parts.transpose(0, 1).reshape(w.shape)


def _t(t: torch.Tensor) -> Tuple[torch.Tensor]:
    return (t.t(),)


def _t_join(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return ts[0].t()


def gpt2_layout(cfg: dict) -> Layout:
    """GPT-2's mapping for the Hugging Face config `cfg` (its field names)."""
    heads = cfg["n_head"]
    p = "transformer.h.{i}."
    layer = [
        Rule(_L + "self_attention.linear_qkv.layer_norm_weight", (p + "ln_1.weight",)),
        Rule(_L + "self_attention.linear_qkv.layer_norm_bias", (p + "ln_1.bias",)),
        Rule(_L + "self_attention.linear_qkv.weight", (p + "attn.c_attn.weight",),
             lambda t: (_qkv_to_hf(t, heads).t(),), lambda ts: _qkv_from_hf(ts[0].t(), heads)),
        Rule(_L + "self_attention.linear_qkv.bias", (p + "attn.c_attn.bias",),
             lambda t: (_qkv_to_hf(t, heads),), lambda ts: _qkv_from_hf(ts[0], heads)),
        Rule(_L + "self_attention.linear_proj.weight", (p + "attn.c_proj.weight",), _t, _t_join),
        Rule(_L + "self_attention.linear_proj.bias", (p + "attn.c_proj.bias",)),
        Rule(_L + "mlp.linear_fc1.layer_norm_weight", (p + "ln_2.weight",)),
        Rule(_L + "mlp.linear_fc1.layer_norm_bias", (p + "ln_2.bias",)),
        Rule(_L + "mlp.linear_fc1.weight", (p + "mlp.c_fc.weight",), _t, _t_join),
        Rule(_L + "mlp.linear_fc1.bias", (p + "mlp.c_fc.bias",)),
        Rule(_L + "mlp.linear_fc2.weight", (p + "mlp.c_proj.weight",), _t, _t_join),
        Rule(_L + "mlp.linear_fc2.bias", (p + "mlp.c_proj.bias",)),
    ]
    last = [Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",)),
            Rule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",))]
    if not cfg["tie_word_embeddings"]:
        last.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return Layout(cfg["n_layer"],
                  [Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",)),
                   Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",))],
                  layer, last)


def gpt2_tensors(u: UniversalCheckpoint, cfg: dict) -> Plan:
    """(HF name, loader) pairs in GPT-2's order; loaders read lazily, one tensor at a time."""
    return export_plan(u, gpt2_layout(cfg))


def gpt2_model_config(hf: dict, path: str, approximate_gelu_ok: bool = False) -> Tuple[dict, dict]:
    """The inverse of `gpt2_config`: (the layout's config: ``hf`` with the fields `gpt2_layout`
    reads filled in; megatron's model config) for the Hugging Face config.json `hf` at `path`.
    Refuses, naming each, what megatron's GPT cannot express; a tanh-approximate GELU (the
    original GPT-2's ``gelu_new``) only with `approximate_gelu_ok` (logits then differ slightly)."""
    h, act = hf["n_embd"], hf.get("activation_function", "gelu_new")
    gelu_ok = act == "gelu" or (approximate_gelu_ok and act in APPROXIMATE_GELUS)
    problems = [why for bad, why in (
        (not gelu_ok, f"activation_function {act!r} (megatron's GPT uses the exact 'gelu'"
                      + ("; --allow-approximate-gelu converts it anyway, with slightly "
                         "different logits)" if act in APPROXIMATE_GELUS else ")")),
        (not hf.get("scale_attn_weights", True), "unscaled attention (scale_attn_weights false)"),
        (hf.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx"),
        (hf.get("add_cross_attention", False), "cross-attention layers")) if bad]
    refuse_import(path, "GPT2LMHeadModel", problems, "Supported: GELU MLP, scaled self-attention")
    tied = bool(hf.get("tie_word_embeddings", True))
    cfg = dict(hf, tie_word_embeddings=tied)
    model = {"num_layers": hf["n_layer"], "hidden_size": h, "num_attention_heads": hf["n_head"],
             "ffn_hidden_size": hf.get("n_inner") or 4 * h, "seq_length": hf["n_positions"],
             "max_position_embeddings": hf["n_positions"],
             "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
             "norm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)), "swiglu": False,
             "num_query_groups": None, "add_bias_linear": True,
             "untie_embeddings_and_output_weights": not tied,
             "init_method_std": hf.get("initializer_range", 0.02),
             "hidden_dropout": float(hf.get("resid_pdrop", 0.1)),
             "attention_dropout": float(hf.get("attn_pdrop", 0.1))}
    return cfg, model
