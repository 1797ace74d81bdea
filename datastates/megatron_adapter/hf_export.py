"""Export a universal checkpoint to Hugging Face safetensors + `config.json`: GPT-2 or Llama.

The architecture is chosen from the run config: rotary position embeddings mean Llama
(`hf_llama.py`), learned absolute positions mean GPT-2 (here). Either refuses, naming the part, a
model its Hugging Face class cannot express, rather than exporting names that would load and
compute something else.

megatron-core's GPT with learned absolute position embeddings, LayerNorm with biases, a non-gated
GELU MLP and full multi-head attention is GPT-2: the mapping below only renames, unstacks the
layer axis, transposes (GPT-2's Conv1D stores weights as [in, out]) and reorders the fused QKV
(megatron interleaves it per head: [head][q|k|v][head_dim]; GPT-2 concatenates [q|k|v]).
"""
from __future__ import annotations

import os
import shutil
from typing import Callable, Dict, Optional, Tuple

import torch

from ..errors import CheckpointError
from ..fileio import fsync_dir, fsync_file, give_default_mode, hold_for_reading
from ..universal import UniversalCheckpoint, unchecked_warning, write_json
from .hf_common import (LAYERS as _L, Plan, architecture_fields, hf_dtype, layer_loader, refuse,
                        special_token_ids)
from .hf_llama import llama_config, llama_tensors
from .resolve import locate_universal

HF_WEIGHTS = "model.safetensors"
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


def _split_qkv(w: torch.Tensor, heads: int) -> torch.Tensor:
    """megatron [heads*(q|k|v)*head_dim, ...] -> [q_all | k_all | v_all, ...]."""
    head_dim = w.shape[0] // (3 * heads)
    per_head = w.reshape(heads, 3, head_dim, *w.shape[1:])
    return torch.cat([per_head[:, i].reshape(heads * head_dim, *w.shape[1:]) for i in range(3)])


def gpt2_tensors(u: UniversalCheckpoint, cfg: dict) -> Plan:
    """(HF name, loader) pairs in GPT-2's order; loaders read lazily, one tensor at a time."""
    heads = cfg["n_head"]
    out: Plan = [
        ("transformer.wte.weight", lambda: u.read("embedding.word_embeddings.weight")),
        ("transformer.wpe.weight", lambda: u.read("embedding.position_embeddings.weight"))]

    def layer(name: str, i: int, fn=lambda t: t):
        return layer_loader(u, name, i, fn)

    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        out += [
            (p + "ln_1.weight", layer("self_attention.linear_qkv.layer_norm_weight", i)),
            (p + "ln_1.bias", layer("self_attention.linear_qkv.layer_norm_bias", i)),
            (p + "attn.c_attn.weight", layer("self_attention.linear_qkv.weight", i,
                                             lambda t: _split_qkv(t, heads).t())),
            (p + "attn.c_attn.bias", layer("self_attention.linear_qkv.bias", i,
                                           lambda t: _split_qkv(t, heads))),
            (p + "attn.c_proj.weight", layer("self_attention.linear_proj.weight", i, torch.t)),
            (p + "attn.c_proj.bias", layer("self_attention.linear_proj.bias", i)),
            (p + "ln_2.weight", layer("mlp.linear_fc1.layer_norm_weight", i)),
            (p + "ln_2.bias", layer("mlp.linear_fc1.layer_norm_bias", i)),
            (p + "mlp.c_fc.weight", layer("mlp.linear_fc1.weight", i, torch.t)),
            (p + "mlp.c_fc.bias", layer("mlp.linear_fc1.bias", i)),
            (p + "mlp.c_proj.weight", layer("mlp.linear_fc2.weight", i, torch.t)),
            (p + "mlp.c_proj.bias", layer("mlp.linear_fc2.bias", i)),
        ]
    out += [("transformer.ln_f.weight", lambda: u.read("decoder.final_layernorm.weight")),
            ("transformer.ln_f.bias", lambda: u.read("decoder.final_layernorm.bias"))]
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", lambda: u.read("output_layer.weight")))
    return out


def _config_and_plan(u: UniversalCheckpoint) -> Tuple[dict, Plan]:
    if architecture_fields(u.manifest["model_config"])["position_embedding_type"] == "rope":
        cfg = llama_config(u)
        return cfg, llama_tensors(u, cfg)
    cfg = gpt2_config(u)
    return cfg, gpt2_tensors(u, cfg)


def export_hf(src: str, out_dir: str,
              progress: Optional[Callable[[int, int, str], None]] = None,
              allow_unsafe_pickle: bool = False,
              warn: Optional[Callable[[str], None]] = None) -> dict:
    """Write ``config.json`` + ``model.safetensors`` (model weights in the model's dtype) into
    `out_dir` (created; refused if it holds files): ``LlamaForCausalLM`` for a rotary model,
    ``GPT2LMHeadModel`` otherwise. `src` is anything `locate_universal` takes (a universal
    checkpoint or root, or a --save root whose checkpoint was merged). Every weight read is
    verified against its checksums first; a damaged one fails the export and nothing is left in
    `out_dir`. Files get the permissions open() gives (0644 under umask 0022). `warn` hears about
    a checkpoint without checksums. Returns the config."""
    from safetensors.torch import save_file

    directory = locate_universal(src).directory
    with hold_for_reading(directory), \
            UniversalCheckpoint(directory, allow_unsafe_pickle=allow_unsafe_pickle) as u:
        if not u.checksummed and warn is not None:
            warn(unchecked_warning(directory))
        cfg, plan = _config_and_plan(u)
        if os.path.isdir(out_dir) and os.listdir(out_dir):
            raise CheckpointError("output directory is not empty; choose a new one",
                                  file=out_dir)
        tmp = out_dir.rstrip("/") + ".tmp-hf"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            tensors: Dict[str, torch.Tensor] = {}
            for i, (name, load) in enumerate(plan):
                tensors[name] = load()
                if progress is not None:
                    progress(i + 1, len(plan), name)
            path = os.path.join(tmp, HF_WEIGHTS)
            save_file(tensors, path, metadata={"format": "pt"})
            give_default_mode(path)
            fsync_file(path)
            write_json(os.path.join(tmp, "config.json"), cfg)
            fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.rename(tmp, out_dir)
        fsync_dir(os.path.dirname(os.path.abspath(out_dir)))
    return cfg
