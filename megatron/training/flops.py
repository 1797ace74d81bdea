"""Floating-point operations of one training iteration: Megatron-LM's model-FLOP count.

The count is Megatron-LM's (`num_floating_point_operations` in its training.py, dense transformer
branch, every sample `seq_length` tokens): every GEMM runs three times (forward, weight gradient,
input gradient) at 2 FLOPs per multiply-add; attention counts the QKV projections with grouped
query heads, the output projection and the causal half of the score and value products; the MLP
counts two GEMMs, three with SwiGLU (gate and up projections); the logits count one GEMM with the
padded vocabulary. Norms, softmax, embeddings lookups and the optimizer are not counted.

Activation recomputation is not counted either, as in Megatron-LM: this is the model's FLOP count
(what MFU divides by), not the hardware's, so runs with and without recomputation compare.
(Megatron-LM's older paper formula, arXiv 2104.04473 appendix, added one more forward pass for
full recomputation and did not halve attention for the causal mask.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.training.config import ModelConfig

__all__ = ["TransformerShape", "num_floating_point_operations", "shape_of",
           "throughput_tflops_per_gpu"]


@dataclass(frozen=True)
class TransformerShape:
    """What the FLOP count depends on. Defaults describe a GPT-2 model (multi-head attention,
    GeLU MLP); the other fields are Megatron-LM's flags of the same name."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    padded_vocab_size: int
    num_query_groups: Optional[int] = None
    """Key/value heads (grouped-query attention); None: one per attention head."""
    kv_channels: Optional[int] = None
    """Width of one attention head; None: hidden_size / num_attention_heads."""
    swiglu: bool = False
    """Gated MLP: the first projection is two GEMMs of ffn_hidden_size (gate and up)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads and self.kv_channels is None:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}; give kv_channels")
        groups = self.num_query_groups
        if groups is not None and (groups < 1 or self.num_attention_heads % groups):
            raise ValueError(f"num_query_groups must divide num_attention_heads "
                             f"{self.num_attention_heads}, got {groups}")


def shape_of(model: ModelConfig) -> TransformerShape:
    """The shape of the model this trainer builds (GPT-2 style or Llama-style: grouped-query
    attention, SwiGLU)."""
    return TransformerShape(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, ffn_hidden_size=model.ffn_hidden_size,
        seq_length=model.seq_length, padded_vocab_size=model.padded_vocab_size,
        num_query_groups=model.num_query_groups, swiglu=model.swiglu)


def num_floating_point_operations(shape: TransformerShape, batch_size: int) -> float:
    """FLOPs of one iteration over `batch_size` samples (forward and backward)."""
    s = shape
    head = s.kv_channels if s.kv_channels is not None else s.hidden_size // s.num_attention_heads
    groups = s.num_query_groups if s.num_query_groups is not None else s.num_attention_heads
    query = head * s.num_attention_heads
    key_value = 2 * head * groups
    gemm = 3 * 2  # forward + two backward GEMMs; 2 FLOPs per multiply-add
    mlp_gemms = 3 if s.swiglu else 2
    per_token = gemm * (
        s.num_layers * s.hidden_size * s.ffn_hidden_size * mlp_gemms   # MLP
        + s.num_layers * (s.hidden_size * (query + key_value)           # QKV projection
                          + query * s.hidden_size)                      # output projection
        + s.hidden_size * s.padded_vocab_size)                          # logits
    # QK^T and (softmax)V: 2 GEMMs of seq x seq x query per sample, half of it under the causal
    # mask.
    per_squared_token = gemm * s.num_layers * query * 2 / 2
    tokens = batch_size * s.seq_length
    return float(tokens * per_token + tokens * s.seq_length * per_squared_token)


def throughput_tflops_per_gpu(flops_per_iteration: float, seconds_per_iteration: float,
                              world_size: int) -> float:
    """Megatron-LM's `throughput per GPU (TFLOP/s/GPU)`: the iteration's FLOPs over its time and
    every rank (on CPU runs a rank stands for a GPU)."""
    if seconds_per_iteration <= 0:
        return 0.0
    return flops_per_iteration / (seconds_per_iteration * 1e12 * world_size)
