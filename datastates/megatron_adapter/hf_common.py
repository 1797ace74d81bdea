"""What every Hugging Face export shares: the architecture check, the dtype, the special token ids
and per-layer reads of the universal checkpoint's stacked tensors.

A universal checkpoint stacks each transformer-layer tensor along a leading layer axis
(``decoder.layers.<name>`` has shape [num_layers, ...]); Hugging Face names one tensor per layer,
so every exporter reads one layer slice at a time, lazily, through `layer_loader`.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ..errors import CheckpointError
from ..universal import UniversalCheckpoint

__all__ = ["LAYERS", "Loader", "Plan", "architecture_fields", "hf_dtype", "layer_loader",
           "refuse", "special_token_ids"]

LAYERS = "decoder.layers."
Loader = Callable[[], torch.Tensor]
Plan = List[Tuple[str, Loader]]
"""(Hugging Face tensor name, loader) pairs in the order they are written."""

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def refuse(u: UniversalCheckpoint, target: str, problems: List[str], expected: str) -> None:
    """Raise one error naming every part of the model that `target` cannot express."""
    if problems:
        raise CheckpointError(f"cannot export to a Hugging Face {target} model: "
                              f"{'; '.join(problems)}. {expected}", file=u.directory)


def architecture_fields(mc: dict) -> dict:
    """The run config's architecture choices; manifests written before the Llama flags existed
    describe GPT-2 style models, so missing fields take the GPT-2 defaults."""
    heads = mc["num_attention_heads"]
    return {"position_embedding_type": mc.get("position_embedding_type", "learned_absolute"),
            "normalization": mc.get("normalization", "LayerNorm"),
            "swiglu": bool(mc.get("swiglu", False)),
            "query_groups": mc.get("num_query_groups") or heads,
            "add_bias_linear": mc.get("add_bias_linear", True),
            "rotary_percent": float(mc.get("rotary_percent", 1.0)),
            "rotary_base": mc.get("rotary_base", 10000),
            "norm_epsilon": float(mc.get("norm_epsilon", 1e-5))}


def hf_dtype(u: UniversalCheckpoint) -> str:
    """``torch_dtype`` of the export: the dtype the model's weights are stored in (fp32, bf16 or
    fp16; the fp32 main copies live under optimizer.* and are not exported)."""
    dtype = u.info("embedding.word_embeddings.weight").dtype
    if dtype not in _DTYPES:
        raise CheckpointError(f"model weights are stored as {dtype}; a Hugging Face export "
                              f"supports {sorted(_DTYPES.values())}", file=u.directory)
    return _DTYPES[dtype]


def special_token_ids(mc: dict) -> dict:
    """bos/eos ids inside the vocabulary. Megatron GPT tokenizers use their end-of-document id for
    both, and ours (NullTokenizer, ByteLevelTokenizer, like GPT-2's BPE) put it last: id
    ``vocab_size - 1`` of the unpadded vocabulary. Without a recorded vocabulary there is no id."""
    vocab = mc.get("vocab_size")
    eod: Optional[int] = int(vocab) - 1 if vocab else None
    return {"bos_token_id": eod, "eos_token_id": eod}


def layer_loader(u: UniversalCheckpoint, name: str, i: int,
                 fn: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Loader:
    """A loader of layer `i` of ``decoder.layers.<name>``, passed through `fn` (reads only that
    layer's bytes)."""
    full = LAYERS + name

    def load() -> torch.Tensor:
        shape = u.info(full).shape
        return fn(u.read(full, (i,) + (0,) * (len(shape) - 1), (1,) + tuple(shape[1:]))[0]) \
            .contiguous()
    return load
