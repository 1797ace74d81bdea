"""GPU memory of one rank during training: model state held plus an activation estimate.

Model state, bytes per parameter element the rank holds (Megatron's distributed optimizer, bf16):
weights 2, gradients 4 (megatron-core accumulates into an fp32 ``main_grad`` buffer), optimizer 12
(fp32 main params + two Adam moments) divided over data-parallel ranks: 18 bytes at DP=1, as
Megatron-LM's ``report_theoretical_memory`` counts. fp32 training: weights 4, gradients 4, Adam 8/DP.

Activations, bytes kept for the backward pass per token of one micro-batch per layer (bf16, 2 B per
element; h hidden, kv the key/value width, f the FFN width, f1 the fc1 output, f for GELU and 2f
for SwiGLU, a heads, s sequence length; Korthikanti et al.'s derivation, written for either MLP):

  replicated over TP:  4h (both norm inputs) + 2h (QKV input) + 2h (fc1 input) + 2h (dropout masks)
  split over TP:       2(h + 2kv) (Q, K, V) + 2h (projection input) + 2 f1 (fc1 output) + 2f (fc2 input)
                       + 2as (softmax output) + 3as (attention dropout mask and output)

Dropout terms only with dropout > 0. Sequence parallelism splits the replicated part over TP as
well; selective recomputation drops the ``as`` terms (core attention is recomputed; they are the
unfused attention's, which our local layer spec builds, so the estimate is an upper bound where
flash attention runs). GPT-2 with f = 4h and kv = h gives the paper's 34h + 5as. Full
recomputation keeps 2h per recomputed chunk's input (split over TP under sequence parallelism)
plus one chunk's full activations while it is rerun. The last stage adds its logits, 2 B bf16 and
a 4 B fp32 softmax per vocabulary entry of its TP shard. With the 1F1B schedule stage i holds
min(PP - i, micro-batches) micro-batches; the paper runs one micro-batch per iteration (global
batch = micro-batch x DP), so every stage holds one. Not counted: CUDA context, NCCL and
allocator overheads (``RESERVE_FRACTION`` of the GPU is set aside for them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["A100_40GB_BYTES", "RESERVE_FRACTION", "ActivationShape", "GpuMemory", "activation_bytes",
           "fits", "gpu_memory", "state_bytes"]

A100_40GB_BYTES = 40 * 2**30
"""Memory of the paper's GPUs (A100-40GB: 40 GiB, 42.9 GB)."""
RESERVE_FRACTION = 0.1
"""Share of the GPU kept for what the estimate leaves out (CUDA context, NCCL buffers, fragmentation)."""


@dataclass(frozen=True)
class ActivationShape:
    """What the activation estimate of one pipeline stage depends on."""

    seq_length: int
    micro_batch_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    kv_width: int
    """Query groups x head width (= hidden without grouped-query attention)."""
    swiglu: bool
    dropout: bool
    """Any dropout > 0 (masks are kept)."""
    padded_vocab_size: int
    tp: int
    sequence_parallel: bool
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None


def _per_layer(shape: ActivationShape, with_attention_scores: bool) -> float:
    """Bytes one layer keeps for one micro-batch on one TP rank."""
    h, f, kv, a, s = (shape.hidden_size, shape.ffn_hidden_size, shape.kv_width, shape.num_attention_heads,
                      shape.seq_length)
    fc1 = 2 * f if shape.swiglu else f
    replicated = 4 * h + 2 * h + 2 * h + (2 * h if shape.dropout else 0)
    split = 2 * (h + 2 * kv) + 2 * h + 2 * fc1 + 2 * f
    if with_attention_scores:
        split += 2 * a * s + (3 * a * s if shape.dropout else 0)
    t = shape.tp
    per_token = (replicated / t if shape.sequence_parallel else replicated) + split / t
    return s * shape.micro_batch_size * per_token


def activation_bytes(shape: ActivationShape, layers: int, last_stage: bool) -> float:
    """Bytes of activations one micro-batch keeps on one TP rank of a stage of ``layers`` layers."""
    tokens = shape.seq_length * shape.micro_batch_size
    full = _per_layer(shape, with_attention_scores=shape.recompute_granularity != "selective")
    if shape.recompute_granularity == "full":
        kept_input = 2 * shape.hidden_size * tokens / (shape.tp if shape.sequence_parallel else 1)
        n = shape.recompute_num_layers
        if shape.recompute_method == "uniform":  # chunk inputs, and one chunk rerun at a time
            chunks = -(-layers // n)
            total = chunks * kept_input + min(n, layers) * full
        else:  # block: the first n layers keep their inputs, the others everything
            recomputed = min(n, layers)
            total = recomputed * kept_input + (layers - recomputed) * full + (full if recomputed else 0)
    else:
        total = layers * full
    if last_stage:
        total += 6 * tokens * shape.padded_vocab_size / shape.tp
    return total


def state_bytes(params: int, bf16: bool, dp: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes for ``params`` elements held by one rank."""
    weights = params * (2 if bf16 else 4)
    optimizer = params * (12 if bf16 else 8) / dp
    return weights, params * 4, optimizer


@dataclass(frozen=True)
class GpuMemory:
    """Bytes one rank needs at its peak (the end of a forward pass)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def gpu_memory(params: int, bf16: bool, dp: int, shape: ActivationShape, layers: int, stage: int, pp: int,
               microbatches: int = 1) -> GpuMemory:
    """Peak memory of one TP rank of pipeline ``stage`` holding ``params`` elements."""
    in_flight = min(pp - stage, microbatches)
    weights, gradients, optimizer = state_bytes(params, bf16, dp)
    return GpuMemory(weights, gradients, optimizer,
                     in_flight * activation_bytes(shape, layers, last_stage=stage == pp - 1))


def fits(memory: GpuMemory, capacity: int = A100_40GB_BYTES) -> bool:
    """True when the estimate leaves RESERVE_FRACTION of the GPU free."""
    return memory.total <= capacity * (1 - RESERVE_FRACTION)
