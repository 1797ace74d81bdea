"""GPT parameter counts and checkpoint bytes from the architecture formula (no model is built).

A ``GPTArch`` is either GPT-2 style (learned absolute positions, LayerNorm, biased linear layers,
GELU MLP, tied embeddings; the defaults) or Llama style (rotary positions, RMSNorm, SwiGLU MLP, no
biases, untied embeddings, optionally grouped-query attention): the paper's five shapes are
Llama-2's and LLaMA-1's (``PAPER_MODELS``). Vocabulary padded to a multiple of
``make_vocab_size_divisible_by * tp`` (Megatron-LM's rule). ``architecture_args`` and
``memory_args`` are the pretrain_gpt.py flags of a model, so the Slurm examples
(``tools/models.py``) and the dry run launch what the formula counts; ``tools/dry_run.py`` counts
the same quantities from a model actually built and ``tests/test_tools_dry_run.py`` checks both agree.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

GPT2_VOCAB = 50257
"""The GPT-2 BPE vocabulary (Megatron-DeepSpeed's default)."""
LLAMA_VOCAB = 32000
"""The Llama / Llama-2 SentencePiece vocabulary."""


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
    rope: bool = False
    """Rotary position embeddings (no position table) instead of learned absolute positions."""
    rms_norm: bool = False
    """RMSNorm (a weight, no bias) instead of LayerNorm (weight and bias)."""
    norm_epsilon: Optional[float] = None
    """``--norm-epsilon``; None: the trainer's default (1e-5)."""
    swiglu: bool = False
    """Gated SiLU MLP: fc1 is 2 x ffn wide (gate and up), fc2 ffn -> hidden."""
    num_query_groups: Optional[int] = None
    """Key/value heads of grouped-query attention; None: one per attention head."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linear layers."""
    dropout: Optional[float] = None
    """``--hidden-dropout`` and ``--attention-dropout``; None: the trainer's default (0.1)."""
    sequence_parallel: bool = False
    """``--sequence-parallel`` (where TP > 1): norm and dropout activations split over TP."""
    recompute_granularity: Optional[str] = None
    """``--recompute-granularity`` (``selective`` or ``full``); None keeps every activation."""
    recompute_method: Optional[str] = None
    """``--recompute-method`` with full recomputation (``uniform`` or ``block``)."""
    recompute_num_layers: Optional[int] = None
    """``--recompute-num-layers`` with full recomputation."""
    micro_batch_size: int = 16
    """Sequences per micro-batch (the paper: 16)."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values): query groups x head width."""
        return self.query_groups * (self.hidden_size // self.num_attention_heads)

    def stage_layers(self, pp: int) -> list[int]:
        first, last = (self.first_stage_layers, self.last_stage_layers) if pp > 1 else (None, None)
        return layer_split(self.num_layers, pp, first, last)

    def padded_vocab(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


def llama(name: str, layers: int, hidden: int, heads: int, nodes: int, paper_gb: float, ffn: int,
          **more) -> GPTArch:
    """A Llama-family shape as Megatron-LM runs Llama: rotary positions (base 10000), RMSNorm,
    SwiGLU, no biases, untied embeddings, no dropout, the Llama vocabulary; sized for 40 GB GPUs
    with sequence parallelism and selective recomputation (tools/scale/memory.py: the memory)."""
    return GPTArch(name, layers, hidden, heads, nodes, paper_gb, ffn_hidden_size=ffn, vocab_size=LLAMA_VOCAB,
                   untie_embeddings_and_output_weights=True, rope=True, rms_norm=True, swiglu=True,
                   add_bias_linear=False, dropout=0.0, sequence_parallel=True,
                   recompute_granularity="selective", **more)


# Paper Table (PAPER.md): layers / hidden / heads / nodes of 4 A100s / checkpoint size. 7B, 13B and
# 70B are Llama-2's shapes (FFN 11008, 13824, 28672; 70B with 8 key/value heads), 30B is
# LLaMA-1's 33B (FFN 17920, norm epsilon 1e-6). 3B has no Llama counterpart: its FFN, 6912, is
# Llama's own rule (8/3 x hidden rounded up to a multiple of 256), which gives 7B's, 13B's and
# 33B's widths exactly. docs/SCALE.md says what else we chose.
PAPER_MODELS = (
    llama("3B", 30, 2560, 32, 1, 45, 6912),
    llama("7B", 32, 4096, 32, 2, 83, 11008),
    llama("13B", 40, 5120, 40, 4, 166, 13824),
    # 60 layers do not split evenly over 8 stages (DeepSpeed balanced them itself); the first and
    # last stages also hold the embeddings and the output layer, so they get fewer: 6 + 6 x 8 + 6.
    llama("30B", 60, 6656, 52, 8, 444, 17920, norm_epsilon=1e-6, first_stage_layers=6, last_stage_layers=6),
    llama("70B", 80, 8192, 64, 20, 1065, 28672, num_query_groups=8),
)


TINY = GPTArch("tiny", 4, 64, 4, 1, vocab_size=256, seq_length=32, tp=1)
"""A CPU-sized GPT (as tests/trainer_launch.py's): runs the Slurm examples on any cluster or in CI."""

MODELS = PAPER_MODELS + (TINY,)
"""Every model the Slurm examples know, by name (tools/models.py prints one for the shell)."""


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def architecture_args(arch: GPTArch) -> list[str]:
    """pretrain_gpt.py's flags for the shape and family of ``arch`` (not the sequence length,
    vocabulary or layout, which a launch chooses). A GPT-2 style model gives only the four shape
    flags, as before the Llama fields existed."""
    args = ["--num-layers", str(arch.num_layers), "--hidden-size", str(arch.hidden_size),
            "--num-attention-heads", str(arch.num_attention_heads), "--ffn-hidden-size", str(arch.ffn)]
    if arch.rope:
        args += ["--position-embedding-type", "rope"]
    if arch.rms_norm:
        args += ["--normalization", "RMSNorm"]
    if arch.norm_epsilon is not None:
        args += ["--norm-epsilon", repr(arch.norm_epsilon)]
    if arch.swiglu:
        args += ["--swiglu"]
    if arch.num_query_groups is not None:
        args += ["--group-query-attention", "--num-query-groups", str(arch.num_query_groups)]
    if not arch.add_bias_linear:
        args += ["--disable-bias-linear"]
    if arch.untie_embeddings_and_output_weights:
        args += ["--untie-embeddings-and-output-weights"]
    if arch.dropout is not None:
        args += ["--hidden-dropout", _number(arch.dropout), "--attention-dropout", _number(arch.dropout)]
    return args


def memory_args(arch: GPTArch, tp: int) -> list[str]:
    """Activation-memory flags: recomputation, and sequence parallelism where TP > 1 (the trainer
    refuses ``--sequence-parallel`` at TP=1, which has nothing to split)."""
    args = ["--sequence-parallel"] if arch.sequence_parallel and tp > 1 else []
    if arch.recompute_granularity:
        args += ["--recompute-granularity", arch.recompute_granularity]
    if arch.recompute_method:
        args += ["--recompute-method", arch.recompute_method, "--recompute-num-layers", str(arch.recompute_num_layers)]
    return args


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
    """Elements every tensor-parallel rank holds a full copy of (norms, row-parallel biases,
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
    h, f, kv = arch.hidden_size, arch.ffn, arch.kv_width
    if h % tp or f % tp or arch.num_attention_heads % tp or arch.query_groups % tp:
        raise ValueError(f"hidden {h}, ffn {f}, heads {arch.num_attention_heads} and query groups "
                         f"{arch.query_groups} must divide by TP {tp}")
    layers = arch.stage_layers(pp)[stage]
    bias = 1 if arch.add_bias_linear else 0
    qkv = h + 2 * kv           # queries, then keys and values of every query group
    fc1 = 2 * f if arch.swiglu else f
    norm = h if arch.rms_norm else 2 * h
    # Column-parallel QKV and fc1 (weights and biases) and row-parallel proj and fc2 weights are
    # split over TP; row-parallel biases and both norms are replicated.
    sharded_per_layer = (qkv * h + bias * qkv + h * h + fc1 * h + bias * fc1 + h * f) // tp
    replicated_per_layer = 2 * norm + bias * 2 * h
    sharded = layers * sharded_per_layer
    replicated = layers * replicated_per_layer
    vocab = arch.padded_vocab(tp)
    word_embedding = vocab * h // tp
    embedding_copy = 0
    if stage == 0:
        sharded += word_embedding
        if not arch.rope:
            replicated += arch.seq_length * h
    if stage == pp - 1:
        replicated += norm  # final norm
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
