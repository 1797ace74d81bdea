"""Export a universal checkpoint to Hugging Face safetensors with a GPT-2 `config.json`.

megatron-core's GPT with learned absolute position embeddings, LayerNorm with biases, a non-gated
GELU MLP and full multi-head attention is GPT-2: the mapping below only renames, unstacks the
layer axis, transposes (GPT-2's Conv1D stores weights as [in, out]) and reorders the fused QKV
(megatron interleaves it per head: [head][q|k|v][head_dim]; GPT-2 concatenates [q|k|v]). Any other
architecture (rotary embeddings, RMSNorm, gated MLP, grouped-query attention, no biases) is refused
with the reason, rather than exported to names that would load and compute something else.
"""
from __future__ import annotations

import os
import shutil
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError
from ..fileio import fsync_dir, fsync_file, give_default_mode, hold_for_reading
from ..universal import UniversalCheckpoint, unchecked_warning, write_json
from .resolve import locate_universal

HF_WEIGHTS = "model.safetensors"
_L = "decoder.layers."


def _require(u: UniversalCheckpoint, ok: bool, why: str) -> None:
    if not ok:
        raise CheckpointError(f"cannot export to a Hugging Face GPT-2 model: {why}. Only "
                              "megatron GPT models with learned position embeddings, LayerNorm, "
                              "biases, a non-gated GELU MLP and full multi-head attention map onto "
                              "GPT-2 names", file=u.directory)


def gpt2_config(u: UniversalCheckpoint) -> dict:
    """The GPT-2 config.json for `u`, after checking that the architecture maps."""
    mc = u.manifest["model_config"]
    h, heads, layers = mc["hidden_size"], mc["num_attention_heads"], mc["num_layers"]
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
            "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
            "initializer_range": mc.get("init_method_std", 0.02),
            "resid_pdrop": mc.get("hidden_dropout", 0.1), "embd_pdrop": mc.get("hidden_dropout", 0.1),
            "attn_pdrop": mc.get("attention_dropout", 0.1),
            "tie_word_embeddings": not mc.get("untie_embeddings_and_output_weights", False),
            "torch_dtype": "bfloat16" if mc.get("bf16") else "float32",
            "megatron_iteration": u.iteration,
            "megatron_vocab_size": mc.get("vocab_size")}


def _split_qkv(w: torch.Tensor, heads: int) -> torch.Tensor:
    """megatron [heads*(q|k|v)*head_dim, ...] -> [q_all | k_all | v_all, ...]."""
    head_dim = w.shape[0] // (3 * heads)
    per_head = w.reshape(heads, 3, head_dim, *w.shape[1:])
    return torch.cat([per_head[:, i].reshape(heads * head_dim, *w.shape[1:]) for i in range(3)])


def gpt2_tensors(u: UniversalCheckpoint, cfg: dict) -> List[Tuple[str, Callable[[], torch.Tensor]]]:
    """(HF name, loader) pairs in GPT-2's order; loaders read lazily, one tensor at a time."""
    heads = cfg["n_head"]
    out: List[Tuple[str, Callable[[], torch.Tensor]]] = [
        ("transformer.wte.weight", lambda: u.read("embedding.word_embeddings.weight")),
        ("transformer.wpe.weight", lambda: u.read("embedding.position_embeddings.weight"))]

    def layer(name: str, i: int, fn=lambda t: t):
        return lambda: fn(u.read(_L + name, (i,) + (0,) * (len(u.info(_L + name).shape) - 1),
                                 (1,) + u.info(_L + name).shape[1:])[0]).contiguous()

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


def export_hf(src: str, out_dir: str,
              progress: Optional[Callable[[int, int, str], None]] = None,
              allow_unsafe_pickle: bool = False,
              warn: Optional[Callable[[str], None]] = None) -> dict:
    """Write ``config.json`` + ``model.safetensors`` (model weights in the model's dtype) into
    `out_dir` (created; refused if it holds files). `src` is anything `locate_universal` takes
    (a universal checkpoint or root, or a --save root whose checkpoint was merged). Every weight
    read is verified against its checksums first; a damaged one fails the export and nothing is
    left in `out_dir`. Files get the permissions open() gives (0644 under umask 0022). `warn`
    hears about a checkpoint without checksums. Returns the config."""
    from safetensors.torch import save_file

    directory = locate_universal(src).directory
    with hold_for_reading(directory), \
            UniversalCheckpoint(directory, allow_unsafe_pickle=allow_unsafe_pickle) as u:
        if not u.checksummed and warn is not None:
            warn(unchecked_warning(directory))
        cfg = gpt2_config(u)
        plan = gpt2_tensors(u, cfg)
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
