"""What the Hugging Face export and import share: the layout (which megatron tensor becomes which
Hugging Face tensors, and how), the architecture check, the dtype, the special token ids and
per-layer reads of the universal checkpoint's stacked tensors.

A universal checkpoint stacks each transformer-layer tensor along a leading layer axis
(``decoder.layers.<name>`` has shape [num_layers, ...]); Hugging Face names one tensor per layer.
A `Layout` is the one description of a model's mapping, read both ways: `export_plan` splits
each megatron tensor (one layer slice at a time, lazily, through `layer_loader`) into its Hugging
Face tensors (`to-hf`); `importer` joins them back and stacks the layers (`from-hf`). Each
`Rule`'s `join` is the exact inverse of its `split` (renames, transposes, reorders: no
arithmetic), so a round trip is bit-exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ...errors import CheckpointError
from ...universal import UniversalCheckpoint

__all__ = ["DTYPES", "LAYERS", "Layout", "Loader", "Plan", "Rule", "architecture_fields",
           "export_plan", "hf_dtype", "layer_loader", "refuse", "refuse_import",
           "special_token_ids"]

LAYERS = "decoder.layers."
Loader = Callable[[], torch.Tensor]
Plan = List[Tuple[str, Loader]]
"""(Hugging Face tensor name, loader) pairs in the order they are written."""

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""Weight dtypes both directions support, by their Hugging Face ``torch_dtype`` name."""


def _one(t: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    return (t,)


def _first(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return ts[0]


@dataclass(frozen=True)
class Rule:
    """One universal tensor and the Hugging Face tensors it becomes. `split` takes the megatron
    tensor (one layer's slice of a layered one) and returns the Hugging Face tensors in `hf`
    order; `join` is its exact inverse. `hf` names may hold ``{i}``, the layer index."""

    key: str
    hf: Tuple[str, ...]
    split: Callable[[torch.Tensor], Tuple[torch.Tensor, ...]] = _one
    join: Callable[[Sequence[torch.Tensor]], torch.Tensor] = _first

    @property
    def layered(self) -> bool:
        return self.key.startswith(LAYERS)


@dataclass(frozen=True)
class Layout:
    """A model's whole mapping, in Hugging Face's order: `first` (embeddings), `layer` (each
    transformer layer, ``{i}`` = 0 .. num_layers-1), `last` (final norm, untied output layer)."""

    num_layers: int
    first: List[Rule]
    layer: List[Rule]
    last: List[Rule] = field(default_factory=list)

    def rules(self) -> List[Rule]:
        return self.first + self.layer + self.last

    def hf_names(self) -> List[str]:
        """Every Hugging Face tensor name the layout reads or writes."""
        out = [n for r in self.first for n in r.hf]
        out += [n.format(i=i) for i in range(self.num_layers) for r in self.layer for n in r.hf]
        return out + [n for r in self.last for n in r.hf]


def is_norm_weight(key: str) -> bool:
    """A norm's scale in megatron-core's sharded keys (fused into the next linear layer, or
    separate, or the final norm); not its bias."""
    return key.endswith(("layer_norm_weight", "layernorm.weight"))


def export_plan(u: UniversalCheckpoint, layout: Layout) -> Plan:
    """(HF name, loader) pairs in the layout's order; each loader reads one megatron tensor (one
    layer of a layered one) and returns one of the Hugging Face tensors it splits into. A model
    with zero-centered norm weights (--apply-layernorm-1p: each norm scales by 1 + weight) gets
    them as Hugging Face's norms hold them, 1 + weight."""
    out: Plan = []
    one_p = bool(u.manifest["model_config"].get("apply_layernorm_1p"))

    def add(rule: Rule, i: int) -> None:
        plus = 1 if one_p and is_norm_weight(rule.key) else 0
        for j, name in enumerate(rule.hf):
            part = (lambda t, rule=rule, j=j, plus=plus: rule.split(t)[j] + plus if plus
                    else rule.split(t)[j])
            load = layer_loader(u, rule.key[len(LAYERS):], i, part) if rule.layered else \
                (lambda rule=rule, part=part: part(u.read(rule.key)).contiguous())
            out.append((name.format(i=i), load))

    for rule in layout.first:
        add(rule, 0)
    for i in range(layout.num_layers):
        for rule in layout.layer:
            add(rule, i)
    for rule in layout.last:
        add(rule, 0)
    return out


def refuse(u: UniversalCheckpoint, target: str, problems: List[str], expected: str) -> None:
    """Raise one error naming every part of the model that `target` cannot express."""
    if problems:
        raise CheckpointError(f"cannot export to a Hugging Face {target} model: "
                              f"{'; '.join(problems)}. {expected}", file=u.directory)


def refuse_import(path: str, architecture: str, problems: List[str], expected: str) -> None:
    """Raise one error naming every part of a Hugging Face model megatron's GPT cannot express."""
    if problems:
        raise CheckpointError(f"cannot convert this Hugging Face {architecture}: "
                              f"{'; '.join(problems)}. {expected}", file=path)


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
    if dtype not in DTYPES:
        raise CheckpointError(f"model weights are stored as {dtype}; a Hugging Face export "
                              f"supports {sorted(DTYPES.values())}", file=u.directory)
    return DTYPES[dtype]


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
