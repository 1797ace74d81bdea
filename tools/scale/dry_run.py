"""Dry run: build every (pipeline stage, tensor rank) of a launch on the meta device and count.

No GPU, no process group, no memory: each rank's megatron-core ``GPTModel`` is constructed with
our trainer's ``TransformerConfig`` and layer spec under ``torch.device("meta")``, with a stand-in
process-group collection that reports the rank's TP size and rank, so every layer allocates the
shard that rank really holds. Which parameters are TP-replicated is read off the built models
(a tensor whose shape does not change between TP=1 and TP=n is replicated), not from a table.

Checkpoint bytes per rank (mixed precision + Adam): weights (bf16 or fp16 after ``Float16Module``,
or fp32), fp32 main params (bf16 only: in fp32 the weights are the main params), Adam moments
(2 x fp32), with optimizer state divided over data-parallel ranks by the distributed optimizer.
"""
from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional
from unittest import mock

import torch


@dataclass(frozen=True)
class RankCount:
    """What one (stage, TP rank) holds."""

    stage: int
    tp_rank: int
    layers: int
    params: int
    """Parameter elements held by this rank."""
    tp_replicated: int
    """Of which every TP rank holds a full copy (LayerNorms, row-parallel biases, positions)."""
    embedding_copy: int
    """Of which the last stage's copy of the tied word embeddings (PP > 1)."""


@dataclass(frozen=True)
class RankBytes:
    """Checkpoint bytes of one rank at one data-parallel rank."""

    weights: int
    main_params: int
    adam_moments: int

    @property
    def total(self) -> int:
        return self.weights + self.main_params + self.adam_moments


@dataclass(frozen=True)
class DryRunReport:
    """Per-rank counts of a layout and the checkpoint sizes they imply."""

    stage_layers: tuple
    tp: int
    dp: int
    precision: str
    """"bf16" or "fp16" (16-bit weights, fp32 main params) or "fp32"."""
    ranks: tuple
    """RankCount per (stage, tp_rank), stage-major."""

    def rank_bytes(self, count: RankCount, use_distributed_optimizer: bool = True,
                   dp_rank: int = 0, unique_only: bool = False) -> RankBytes:
        """Bytes this rank writes. ``unique_only``: drop tensors another rank also writes (TP
        replicas beyond TP rank 0, the embedding copy, weights beyond DP rank 0), which is
        what torch_dist de-duplicates; otherwise every rank writes all it holds (torch format)."""
        n = count.params
        if unique_only:
            n -= count.embedding_copy + (count.tp_replicated if count.tp_rank else 0)
        weight_bytes = 4 if self.precision == "fp32" else 2
        shard = self.dp if use_distributed_optimizer else 1
        weights = n * weight_bytes if (dp_rank == 0 or not unique_only) else 0
        main = 0 if self.precision == "fp32" else n * 4 // shard
        return RankBytes(weights=weights, main_params=main, adam_moments=n * 8 // shard)

    def total_bytes(self, unique_only: bool) -> int:
        return sum(self.rank_bytes(c, dp_rank=d, unique_only=unique_only).total
                   for c in self.ranks for d in range(self.dp))

    def unique_parameters(self) -> int:
        return sum(c.params - c.embedding_copy - (c.tp_replicated if c.tp_rank else 0) for c in self.ranks)


class _StandInGroup:
    """Answers the only questions model construction asks a process group: size and rank."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@contextmanager
def _constructing_as_rank(tp: int, tp_rank: int):
    """megatron-core asks ``torch.distributed.is_initialized()`` before asking a group its size;
    say yes while constructing so layers size themselves from the stand-in groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.training.model import ATTENTION_SWITCHES

    groups = ProcessGroupCollection()
    for f in dataclasses.fields(groups):
        setattr(groups, f.name, _StandInGroup(1, 0))
    groups.tp = _StandInGroup(tp, tp_rank)
    # A build here neither meets another build's attention switches nor leaves its own.
    with mock.patch("torch.distributed.is_initialized", return_value=True), \
            mock.patch("torch.distributed.get_rank", return_value=0), torch.device("meta"), \
            mock.patch.dict(os.environ):
        for name in ATTENTION_SWITCHES:
            os.environ.pop(name, None)
        yield groups


def _stage_shapes(model_cfg, parallel_cfg, layers: int, first: bool, last: bool, tp: int, tp_rank: int) -> dict:
    """name -> shape of one rank's parameters, from a GPTModel built on the meta device."""
    from megatron.core.models.gpt import GPTModel

    from megatron.training.model import gpt_model_args, transformer_config

    # Without the first/last-stage counts: megatron-core would otherwise build those counts for
    # every stage of this 1-stage model (a middle stage of 30B with 6 layers instead of 8).
    # Built without sequence parallelism: parameter shapes do not depend on it, megatron-core refuses
    # it at TP=1 (the reference build), and the local spec's torch norms refuse it at any TP (only
    # transformer-engine's norms support it: a GPU launch needs TE for --sequence-parallel).
    # Zero-centered norm weights (--apply-layernorm-1p) likewise: same shapes, refused by them.
    model_cfg = dataclasses.replace(model_cfg, apply_layernorm_1p=False)
    parallel = dataclasses.replace(parallel_cfg, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                   virtual_pipeline_model_parallel_size=None, world_size=tp, sequence_parallel=False,
                                   decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None)
    # One stage is built as a 1-stage model of its own layers; meta tensors need no initialization.
    config = dataclasses.replace(transformer_config(model_cfg, parallel, "gloo"), num_layers=layers,
                                 perform_initialization=False)
    with _constructing_as_rank(tp, tp_rank) as groups:
        model = GPTModel(config=config, pre_process=first, post_process=last, parallel_output=True,
                         pg_collection=groups, **gpt_model_args(model_cfg))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def dry_run(model_cfg, parallel_cfg, stage_layers: Optional[list] = None) -> DryRunReport:
    """Count parameters per (stage, TP rank) for the trainer's ``ModelConfig``/``ParallelConfig``.

    ``stage_layers`` overrides the even split (Megatron's first/last-stage layer counts)."""
    tp, pp = parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size
    if stage_layers is None:
        if model_cfg.num_layers % pp:
            raise ValueError(f"{model_cfg.num_layers} layers do not split evenly over {pp} stages; "
                             "give the per-stage layer counts")
        stage_layers = [model_cfg.num_layers // pp] * pp
    if len(stage_layers) != pp or sum(stage_layers) != model_cfg.num_layers:
        raise ValueError(f"stage layers {stage_layers} must be {pp} counts summing to {model_cfg.num_layers}")
    tied = not model_cfg.untie_embeddings_and_output_weights
    counts = []
    for stage, layers in enumerate(stage_layers):
        first, last = stage == 0, stage == pp - 1
        full = _stage_shapes(model_cfg, parallel_cfg, layers, first, last, 1, 0)
        for tp_rank in range(tp):
            shapes = full if tp == 1 else _stage_shapes(model_cfg, parallel_cfg, layers, first, last, tp, tp_rank)
            if shapes.keys() != full.keys():
                raise RuntimeError(f"stage {stage}: TP rank {tp_rank} builds other tensors than TP=1: "
                                   f"{sorted(set(shapes) ^ set(full))}")
            numel = {name: _numel(shape) for name, shape in shapes.items()}
            replicated = sum(numel[n] for n, shape in shapes.items() if shape == full[n]) if tp > 1 else 0
            # With PP > 1 the last stage holds its own copy of the tied word embeddings.
            copy = numel.get("output_layer.weight", 0) if (tied and last and not first) else 0
            counts.append(RankCount(stage, tp_rank, layers, sum(numel.values()), replicated, copy))
    precision = "bf16" if model_cfg.bf16 else "fp16" if model_cfg.fp16 else "fp32"
    return DryRunReport(tuple(stage_layers), tp, parallel_cfg.data_parallel_size, precision, tuple(counts))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
