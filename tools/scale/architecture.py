"""GPT parameter counts and checkpoint bytes from the architecture formula (no model is built).

Layout assumed (Megatron GPT with the local layer spec, as our trainer builds it): learned absolute
position embeddings, LayerNorm with bias, biased linear layers, GELU MLP of ``ffn_hidden`` width,
word embeddings tied to the output layer, vocabulary padded to a multiple of
``make_vocab_size_divisible_by * tp`` (Megatron-LM's rule). ``tools/dry_run.py`` counts the same
quantities from a model actually built; ``tests/test_tools_scale.py`` checks that both agree.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

GPT2_VOCAB = 50257
"""The paper trains with the GPT-2 BPE vocabulary (Megatron-DeepSpeed's default)."""


@dataclass(frozen=True)
class GPTArch:
    """One GPT configuration and its parallel layout."""

    name: str
    """Label in tables (e.g. "7B")."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    nodes: int
    """Nodes the paper used; with 4 GPUs each and TP=4 this is also the pipeline size."""
    paper_checkpoint_gb: Optional[float] = None
    """Checkpoint size the paper reports (GB), for comparison only."""
    ffn_hidden_size: Optional[int] = None
    """MLP width; None means 4 * hidden_size."""
    vocab_size: int = GPT2_VOCAB
    seq_length: int = 2048
    make_vocab_size_divisible_by: int = 128
    untie_embeddings_and_output_weights: bool = False
    first_stage_layers: Optional[int] = None
    """``--decoder-first-pipeline-num-layers`` (None: even split)."""
    last_stage_layers: Optional[int] = None
    """``--decoder-last-pipeline-num-layers`` (None: even split)."""
    tp: int = 4
    """Tensor-parallel size the model is run with (the paper: 4, one node of 4 GPUs per stage)."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def stage_layers(self, pp: int) -> list[int]:
        first, last = (self.first_stage_layers, self.last_stage_layers) if pp > 1 else (None, None)
        return layer_split(self.num_layers, pp, first, last)

    def padded_vocab(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


# Paper Table (PAPER.md): layers / hidden / heads / nodes of 4 A100s / checkpoint size.
PAPER_MODELS = (
    GPTArch("3B", 30, 2560, 32, 1, 45),
    GPTArch("7B", 32, 4096, 32, 2, 83),
    GPTArch("13B", 40, 5120, 40, 4, 166),
    # 60 layers do not split evenly over 8 stages (DeepSpeed balanced them itself); the first and
    # last stages also hold the embeddings, so they get fewer layers: 6 + 6 x 8 + 6.
    GPTArch("30B", 60, 6656, 52, 8, 444, first_stage_layers=6, last_stage_layers=6),
    GPTArch("70B", 80, 8192, 64, 20, 1065),
)


TINY = GPTArch("tiny", 4, 64, 4, 1, vocab_size=256, seq_length=32, tp=1)
"""A CPU-sized GPT (as tests/trainer_launch.py's): runs the Slurm examples on any cluster or in CI."""

MODELS = PAPER_MODELS + (TINY,)
"""Every model the Slurm examples know, by name (tools/models.py prints one for the shell)."""


def model(name: str) -> GPTArch:
    for arch in MODELS:
        if arch.name == name:
            return arch
    raise KeyError(f"unknown model {name!r}; expected one of {[a.name for a in MODELS]}")


def paper_model(name: str) -> GPTArch:
    for arch in PAPER_MODELS:
        if arch.name == name:
            return arch
    raise KeyError(f"unknown paper model {name!r}; expected one of {[a.name for a in PAPER_MODELS]}")


@dataclass(frozen=True)
class RankParams:
    """Parameters held by one (pipeline stage, tensor rank), split by how they are replicated."""

    tp_sharded: int
    """Elements split across tensor-parallel ranks (each rank holds a distinct slice)."""
    tp_replicated: int
    """Elements every tensor-parallel rank holds a full copy of (LayerNorms, row-parallel biases,
    position embeddings)."""
    embedding_copy: int
    """Last-stage copy of the tied word embeddings (PP > 1): a duplicate of stage 0's, saved twice."""

    @property
    def total(self) -> int:
        return self.tp_sharded + self.tp_replicated + self.embedding_copy


def layer_split(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None) -> list[int]:
    """Layers per pipeline stage, Megatron's rule: even split, or explicit first/last stage sizes
    (``--decoder-first/last-pipeline-num-layers``) with the remaining layers split evenly."""
    if pp == 1:
        return [num_layers]
    head = [first] if first is not None else []
    tail = [last] if last is not None else []
    rest_stages = pp - len(head) - len(tail)
    rest_layers = num_layers - sum(head) - sum(tail)
    if rest_stages <= 0 or rest_layers < 0 or rest_layers % rest_stages:
        raise ValueError(
            f"--num-layers {num_layers} cannot be split over {pp} pipeline stages"
            f" (first stage {first}, last stage {last}); the middle stages need equal layer counts")
    return head + [rest_layers // rest_stages] * rest_stages + tail


def rank_params(arch: GPTArch, tp: int, pp: int, stage: int) -> RankParams:
    """Parameter elements on one TP rank of pipeline ``stage`` (all TP ranks of a stage are equal)."""
    h, f = arch.hidden_size, arch.ffn
    if h % tp or f % tp or arch.num_attention_heads % tp:
        raise ValueError(f"hidden {h}, ffn {f} and heads {arch.num_attention_heads} must divide by TP {tp}")
    layers = arch.stage_layers(pp)[stage]
    # Column-parallel QKV (3h x h + 3h bias) and fc1 (f x h + f bias), row-parallel proj (h x h)
    # and fc2 (h x f) are split over TP; row-parallel biases and both LayerNorms are replicated.
    sharded_per_layer = (3 * h * h + 3 * h + h * h + f * h + f + h * f) // tp
    replicated_per_layer = 2 * h + 2 * h + h + h
    sharded = layers * sharded_per_layer
    replicated = layers * replicated_per_layer
    vocab = arch.padded_vocab(tp)
    word_embedding = vocab * h // tp
    embedding_copy = 0
    if stage == 0:
        sharded += word_embedding
        replicated += arch.seq_length * h
    if stage == pp - 1:
        replicated += 2 * h  # final LayerNorm
        if arch.untie_embeddings_and_output_weights:
            sharded += word_embedding
        elif pp > 1:
            embedding_copy = word_embedding
    return RankParams(sharded, replicated, embedding_copy)


def unique_parameters(arch: GPTArch, tp: int = 1, pp: int = 1) -> int:
    """Distinct model parameters (what a parameter count in a paper means)."""
    total = 0
    for stage in range(pp):
        p = rank_params(arch, tp, pp, stage)
        total += p.tp_sharded * tp + p.tp_replicated
    return total


class WeightsWriter(str, enum.Enum):
    """Which data-parallel replicas write the (replicated) model weights."""

    FIRST_REPLICA = "first_replica"
    """DeepSpeed and torch.save: data-parallel rank 0 writes the weights; the paper's layout."""
    SPREAD_OVER_DP = "spread_over_dp"
    """Megatron torch_dist fully-parallel save: replicas split the weight bytes evenly."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter element of each saved state (mixed precision + Adam)."""

    weights: int = 2
    """bf16 model weights."""
    main_params: int = 4
    """fp32 master copy kept by the optimizer."""
    adam_moments: int = 8
    """fp32 exp_avg + exp_avg_sq."""

    @property
    def optimizer(self) -> int:
        return self.main_params + self.adam_moments


def checkpoint_bytes_per_rank(
    arch: GPTArch, tp: int, pp: int, dp: int = 1, state: StateBytes = StateBytes(),
    writer: WeightsWriter = WeightsWriter.FIRST_REPLICA,
) -> list[int]:
    """Bytes each of the ``tp * pp * dp`` ranks writes (stage-major, then DP, then TP).

    Optimizer state is sharded over data-parallel ranks (ZeRO-1 / distributed optimizer); every TP
    rank writes its copy of TP-replicated tensors, as DeepSpeed and torch.save do.
    """
    out = []
    for stage in range(pp):
        params = rank_params(arch, tp, pp, stage).total
        for dp_rank in range(dp):
            optimizer = params * state.optimizer / dp
            if writer is WeightsWriter.FIRST_REPLICA:
                weights = params * state.weights if dp_rank == 0 else 0
            else:
                weights = params * state.weights / dp
            out.extend([int(round(optimizer + weights))] * tp)
    return out
