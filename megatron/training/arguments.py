"""Megatron-LM-style command line: parse flags, check them, and build the typed RunConfig.

Only entry points call this module; the library receives the frozen dataclasses of ``config.py``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import signal
from typing import Optional, Sequence, Tuple

from megatron.training.config import (
    CheckpointConfig,
    CkptFailurePolicy,
    CkptFormat,
    DataConfig,
    LoggingConfig,
    LrDecayStyle,
    ModelConfig,
    Normalization,
    OptimizerConfig,
    ParallelConfig,
    PositionEmbeddingType,
    RecomputeGranularity,
    RecomputeMethod,
    RunConfig,
    STRICTNESS,
    SchedulerOnResume,
    TrainingConfig,
    shared_memory_dir,
)
from megatron.training.tokenizer import TokenizerType, build_tokenizer
from megatron.training.log import say


class ArgumentError(ValueError):
    """A flag, or a combination of flags, that cannot describe a valid run."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would call sys.exit(2) here; the entry point decides.
        raise ArgumentError(message)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None,
                   help="transformer layers (all pipeline stages together); this, --hidden-size, "
                   "--num-attention-heads and --seq-length are required unless "
                   "--use-checkpoint-args takes them from the --load checkpoint")
    g.add_argument("--hidden-size", type=int, default=None, help="width of the residual stream")
    g.add_argument("--num-attention-heads", type=int, default=None,
                   help="attention (query) heads per layer")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="width of the MLP (default 4 * hidden size; with --swiglu "
                        "int((4 * hidden size * 2 / 3) / 64) * 64, as Megatron-LM)")
    g.add_argument("--seq-length", type=int, default=None, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="size of the learned position-embedding table (default --seq-length); "
                        "unused with --position-embedding-type rope")
    g.add_argument("--position-embedding-type", choices=[t.value for t in PositionEmbeddingType],
                   default=PositionEmbeddingType.LEARNED_ABSOLUTE.value,
                   help="learned_absolute (GPT-2, default) or rope (rotary, Llama)")
    g.add_argument("--rotary-base", type=int, default=None,
                   help=f"base of the rotary frequencies (rope; default {ROPE_DEFAULTS['rotary_base']})")
    g.add_argument("--rotary-percent", type=float, default=None,
                   help="fraction of each head's channels that are rotated (rope; default "
                        f"{ROPE_DEFAULTS['rotary_percent']})")
    g.add_argument("--normalization", choices=[n.value for n in Normalization],
                   default=Normalization.LAYER_NORM.value,
                   help="norm of every layer and the final norm: LayerNorm (default) or RMSNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of every norm")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centered norm weights: every norm multiplies by 1 + its weight, "
                        "which starts at 0 (Megatron-LM's; weight decay then pulls towards 1)")
    g.add_argument("--swiglu", action="store_true",
                   help="gated MLP with SiLU (fc1 makes two halves: silu(a) * b) instead of GeLU")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention: --num-query-groups key/value heads, each "
                        "shared by a group of query heads")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads with --group-query-attention (default 1, as "
                        "Megatron-LM)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="no biases in the attention and MLP linear layers")
    g.add_argument("--hidden-dropout", type=float, default=0.1,
                   help="dropout after attention and MLP")
    g.add_argument("--attention-dropout", type=float, default=0.1,
                   help="dropout on attention probabilities")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="std of the normal initialisation of weight matrices")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="give the output layer its own weights instead of the word embeddings")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times TP")
    g.add_argument("--use-mcore-models", action="store_true", dest="use_mcore_models_deprecated",
                   help="deprecated Megatron-LM flag, ignored there too: the model is always "
                        "megatron-core's")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="channels per attention head; only --hidden-size / "
                        "--num-attention-heads (megatron-core's default) is built here")
    g.add_argument("--attention-backend", choices=("auto", "flash", "fused", "unfused", "local"),
                   default="auto",
                   help="transformer-engine's attention kernels on a GPU (megatron-core sets "
                        "its NVTE_* switches); local: megatron-core's own attention (the local "
                        "layer spec, as on CPU)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="megatron-core's fused cross entropy over the vocabulary-parallel logits")
    g.add_argument("--cross-entropy-fusion-impl", choices=("native", "te"), default="native",
                   help="with --cross-entropy-loss-fusion: megatron-core's own kernel (native) or "
                        "transformer-engine's (te)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="normalise the loss by the tokens of the whole global batch (gradients "
                        "scaled once, after the data-parallel reduction) instead of per "
                        "micro-batch")


def _add_mixed_precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true",
                   help="model in bfloat16, fp32 main parameters in the optimizer")
    g.add_argument("--fp16", action="store_true",
                   help="model in float16, fp32 main parameters, loss scaling")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale (with --fp16 or --bf16); default with --fp16: dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=None,
                   help="dynamic loss scaling: starting scale (default "
                        f"{LOSS_SCALE_DEFAULTS['initial_loss_scale']:.0f} = 2**32)")
    g.add_argument("--min-loss-scale", type=float, default=None,
                   help="dynamic loss scaling: smallest scale (default "
                        f"{LOSS_SCALE_DEFAULTS['min_loss_scale']})")
    g.add_argument("--loss-scale-window", type=float, default=None,
                   help="dynamic loss scaling: iterations without overflow before the scale "
                        f"doubles (default {LOSS_SCALE_DEFAULTS['loss_scale_window']})")
    g.add_argument("--hysteresis", type=int, default=None,
                   help="dynamic loss scaling: overflows tolerated before the scale halves "
                        f"(default {LOSS_SCALE_DEFAULTS['hysteresis']})")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="ranks that split each layer's matrices (TP)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages (PP)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per model chunk for the interleaved pipeline schedule")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers on the first pipeline stage (uneven split)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers on the last pipeline stage (uneven split)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split norm and dropout activations along the sequence over the TP ranks")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over the data-parallel ranks (ZeRO-1)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context parallelism is not built here: 1 only")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: reduce gradients over the data-parallel ranks in bf16 "
                        "(default fp32)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce gradients bucket by bucket during backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer and --overlap-grad-reduce: all-gather "
                   "updated parameters during the next forward pass (gathered before a "
                   "checkpoint or a validation)")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="how long a collective of the training may wait before it fails")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="gradient bucket size in elements with --overlap-grad-reduce (default "
                   "max(40M, 1M * data-parallel size))")


#: The signals --exit-signal may name: every one a process can catch.
_HANDLED_SIGNALS = sorted(s.name for s in signal.Signals
                          if s not in (signal.SIGKILL, signal.SIGSTOP))


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True,
                   help="samples per forward/backward on one data-parallel rank")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step (default micro-batch size * DP)")
    g.add_argument("--train-iters", type=int, default=None,
                   help="optimizer steps of the run (or --train-samples)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="samples of the run, instead of --train-iters (Megatron-LM's sample-based "
                   "training: --train-samples // --global-batch-size iterations)")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="with --train-samples: start with a global batch of START samples and "
                   "grow it by INCREMENT, evenly over the first SAMPLES samples, up to "
                   "--global-batch-size (Megatron-LM's; a checkpoint is saved where it grows)")
    g.add_argument("--iterations-to-skip", type=int, nargs="+", default=[], metavar="N",
                   help="Megatron-LM's: where N iterations are done, read past the next one's "
                   "batch without training on it (e.g. the batches of a loss spike, skipped on "
                   "the restart from the checkpoint before it); counted as consumed and skipped "
                   "samples")
    g.add_argument("--decrease-batch-size-if-needed", action="store_true",
                   help="where --global-batch-size is not divisible by --micro-batch-size * "
                   "data-parallel size (e.g. a restart on fewer nodes), run each iteration "
                   "with the largest batch below it that is, counting the samples left out as "
                   "skipped (Megatron-LM's)")
    g.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of decay")
    g.add_argument("--lr-decay-style", choices=[s.value for s in LrDecayStyle], default="linear",
                   help="learning-rate decay after warm-up")
    g.add_argument("--override-opt_param-scheduler", dest="override_opt_param_scheduler",
                   action="store_true", help="on resume, follow this run's learning-rate and "
                   "weight-decay schedule flags instead of the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume, keep the checkpoint's schedule whatever this run's flags say")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="iterations of linear warm-up from 0 to --lr")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay length (instead of --lr-warmup-iters)")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="iterations over which the learning rate decays (default --train-iters)")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak learning rate of the word embeddings and the output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="with --decoupled-lr: their final learning rate (default --min-lr)")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="with --train-samples: samples of linear warm-up from 0 to --lr")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="with --train-samples: samples over which the learning rate decays "
                   "(default --train-samples)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="decoupled weight decay")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the global gradient norm to this (0: no clipping)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--recompute-granularity",
                   choices=[r.value for r in RecomputeGranularity], default=None,
                   help="recompute activations in the backward pass: full (whole layers, with "
                        "--recompute-method and --recompute-num-layers) or selective (core "
                        "attention only)")
    g.add_argument("--recompute-method", choices=[r.value for r in RecomputeMethod],
                   default=None,
                   help="with --recompute-granularity full: uniform (chunks of "
                        "--recompute-num-layers layers) or block (the first "
                        "--recompute-num-layers layers of each stage)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per recomputed chunk (uniform) or per stage (block)")
    g.add_argument("--seed", type=int, default=1234,
                   help="seed of python, numpy, torch and the initial weights")
    g.add_argument("--log-interval", type=int, default=100,
                   help="print a training line every N iterations")
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="validate every N iterations (0: never)")
    g.add_argument("--eval-iters", type=int, default=100, help="batches per validation")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, with --save) when the iteration is a multiple of N")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop (after saving, with --save) at the end of the first iteration that "
                        "ends more than this many minutes after the job started (0: no limit); "
                        "e.g. below a Slurm time limit, leaving room for the final save's drain")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (or --exit-signal), save at the end of the current iteration "
                   "and exit 0")
    g.add_argument("--exit-signal", choices=_HANDLED_SIGNALS, default="SIGTERM",
                   help="the signal --exit-signal-handler acts on (Megatron-LM's), e.g. SIGUSR1 "
                   "for Slurm's --signal=USR1@SECONDS warning before the time limit")
    g.add_argument("--exit-signal-handler-for-dataloader", action="store_true",
                   help="Megatron-LM's handler in data-loader workers: accepted, no effect (batches "
                   "are read on the training thread here)")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's automatic garbage collection off while training and "
                        "collect at chosen points instead, the same ones on every rank (a full "
                        "collection took ~140 ms here: at a random iteration on each rank it "
                        "holds the others up in the next collective)")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: collect every N iterations (0: only around "
                        "validation)")
    g.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                   help="on a GPU, give cached unused memory back (torch.cuda.empty_cache): 1 "
                        "after each forward/backward and validation batch, 2 also after each "
                        "optimizer step")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="with --manual-gc: do not collect before and after each validation")


def _save_interval(text: str):
    """--save-interval: a positive count of iterations, or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of iterations or 'auto', got "
                                         f"{text!r}") from None


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None, help="directory to save checkpoints in")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model flags from the --load checkpoint (Megatron-LM's rule: "
                   "its sizes where none is given, its architecture whatever is given)")
    g.add_argument("--no-use-tokenizer-model-from-checkpoint-args",
                   "--disable-use-tokenizer-model-from-checkpoint-args", action="store_false",
                   dest="use_tokenizer_model_from_checkpoint_args",
                   help="with --use-checkpoint-args: keep this launch's tokenizer flags instead of "
                   "the checkpoint's (Megatron-LM's)")
    g.add_argument("--use-mp-args-from-checkpoint-args", action="store_true",
                   help="with --use-checkpoint-args: also take the checkpoint's tensor, pipeline "
                   "and virtual pipeline sizes, whatever is given (Megatron-LM's)")
    g.add_argument("--load", type=str, default=None,
                   help="directory to resume from (a missing tracker: start from scratch)")
    g.add_argument("--save-interval", type=_save_interval, default=None,
                   help="save every N iterations (and at the end, with --save); 'auto': choose N "
                        "from the measured cost of a checkpoint and --mtbf-hours (Young/Daly), "
                        "re-evaluated at every save")
    g.add_argument("--mtbf-hours", type=float, default=None,
                   help="with --save-interval auto: the mean time between failures of the whole "
                        "job, in hours")
    g.add_argument("--no-save-optim", action="store_true",
                   help="save no optimizer or scheduler state")
    g.add_argument("--no-load-optim", action="store_true",
                   help="do not restore the optimizer and scheduler state")
    g.add_argument("--no-save-rng", action="store_true", help="save no RNG states")
    g.add_argument("--no-load-rng", action="store_true", help="do not restore the RNG states")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only; start at iteration 0 with a fresh optimizer")
    g.add_argument("--pretrained-checkpoint", type=str, default=None,
                   help="where --load holds no checkpoint to resume (none of its levels): "
                        "fine-tune from this one (weights only, iteration 0, as --finetune), so "
                        "the first launch of a fine-tuning starts from the pretrained model and "
                        "a restart resumes the fine-tuning's own checkpoints")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop with an error instead of starting from scratch when "
                        "there is no checkpoint to load (a mistyped path)")
    g.add_argument("--ckpt-convert-format", choices=[f.value for f in CkptFormat], default=None,
                   help="Megatron-LM's conversion: load --load, save it in this format as "
                        "<--ckpt-convert-save>/<format>/ and exit without training")
    g.add_argument("--ckpt-convert-save", type=str, default=None,
                   help="root of the --ckpt-convert-format checkpoint")
    g.add_argument("--ckpt-convert-update-legacy-dist-opt-format", action="store_true",
                   help="Megatron-LM's update of the distributed optimizer's pre-2024 legacy "
                        "format on load: not supported (that format is not read here)")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load the checkpoint of this iteration under --load instead of the one "
                        "its tracker names (a rollback); the non-persistent level is not read, "
                        "and --save's newer checkpoints are set aside, not overwritten")
    g.add_argument("--ckpt-format", choices=[f.value for f in CkptFormat], default="torch_dist",
                   help="torch_dist (megatron-core dist_checkpointing, reshardable; default) or "
                        "torch (one file per TP/PP rank)")
    g.add_argument("--async-save", action="store_true",
                   help="write torch_dist checkpoints in the background (megatron-core)")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="Megatron-LM's persistent writer process for --async-save: accepted; a "
                   "writer forked at each save call is used (it holds the state as of the call)")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="Megatron-LM's: save the distributed optimizer reshardable over TP/PP/DP; "
                   "this trainer always does")
    g.add_argument("--distrib-optim-fully-reshardable-mem-efficient", action="store_true",
                   help="Megatron-LM's lower-memory (gloo, one rank) variant of that save: "
                   "accepted, no effect (each rank writes its own ranges here)")
    g.add_argument("--dist-ckpt-format", dest="dist_ckpt_format_deprecated", default=None,
                   help="deprecated in Megatron-LM, no effect there nor here: see --ckpt-format")
    g.add_argument("--dist-ckpt-save-pre-mcore-014", action="store_true",
                   help="Megatron-LM's checkpoint format of before megatron-core 0.14: not "
                   "supported (refused)")
    g.add_argument("--async-lazy-save", action="store_true",
                   help="DataStates lazy asynchronous checkpointing: copy the snapshot while the "
                        "next forward/backward runs, write it in the background")
    g.add_argument("--lazy-save-cache-mb", type=int, default=None,
                   help="DataStates host cache per rank in MiB (with --async-lazy-save; default: "
                        "sized at start-up to what this rank's checkpoint can hold, at most half "
                        "of its share of the node's free memory; the log says what was chosen)")
    g.add_argument("--lazy-save-checksum", choices=["crc32c", "crc32", "none"], default=None,
                   help="per-chunk checksum of --async-lazy-save shards, verified on every load: "
                        "crc32c (CPU instruction; default), crc32 (zlib), none")
    g.add_argument("--lazy-save-checksum-threads", type=int, default=None,
                   help="threads per rank that checksum each in-memory checkpoint "
                        "(--non-persistent-ckpt-type in_memory) as its device-to-host copies "
                        "land; it is complete, and the next one can start, once they are done "
                        "(default: on GPUs as many as keep pace with the copy, at most 4 and at "
                        "most half of the rank's share of the node's cores; on CPU 1, as the "
                        "copy checksums what it copies)")
    g.add_argument("--lazy-save-local-dir", type=str, default=None,
                   help="node-local directory (e.g. NVMe) where each rank's shards become durable "
                        "first, then migrate in the background to --save; --load reads a rank's "
                        "shards from its local copy when it is intact. Placeholders: {node}, "
                        "{rank}, {local_rank}, {host} (with --async-lazy-save)")
    g.add_argument("--lazy-save-local-keep", type=int, default=None,
                   help="local copies kept under --lazy-save-local-dir, newest first (default "
                        f"{LAZY_SAVE_DEFAULTS['lazy_save_local_keep']}); older ones are removed "
                        "once a newer checkpoint is committed")
    g.add_argument("--lazy-save-peer-replica", action="store_true", default=None,
                   help="after each commit, also hold every rank's shards in node-local memory "
                        "(--lazy-save-local-dir, default a directory under /dev/shm) and on the "
                        "next node of a ring; a restarted job restores from its own node's copy, "
                        "else a peer's, else --save (with --async-lazy-save, two or more nodes)")
    g.add_argument("--lazy-save-peer-replica-mb", type=int, default=None,
                   help="MiB a rank may hold of one checkpoint with --lazy-save-peer-replica: its "
                        "own shards plus the replica it receives (default: twice this rank's "
                        "checkpoint bound); a replica that would exceed it is skipped, with a "
                        "warning")
    g.add_argument("--lazy-save-wait-persistent", action="store_true", default=None,
                   help="with a node-local non-persistent level (--non-persistent-ckpt-type "
                        "in_memory or local), a persistent save that falls due while the previous "
                        "one is still being written to --save waits in line for it (training may "
                        "then wait for the disk) instead of the default, latest wins: it is "
                        "deferred, and the first iteration after the previous one is complete is "
                        "saved instead (each deferral is logged and counted)")
    g.add_argument("--lazy-save-on-training-thread", action="store_true", default=None,
                   help="make every lazy save's work (the sharded state dict, the structure "
                        "check, the engine call) in the save call, on the training thread; by "
                        "default a save whose structure every rank found unchanged is made by a "
                        "save worker during the next forward/backward. To compare, or to rule "
                        "the worker out")
    g.add_argument("--keep-last-n-checkpoints", type=int, default=None,
                   help="keep only the newest N complete checkpoints under --save")
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="keep the checkpoints of every N-th iteration under --save; the others go "
                   "once a newer one is complete (Megatron-LM's), besides the newest "
                   "--keep-last-n-checkpoints. A save due at a retained iteration is never "
                   "deferred")
    g.add_argument("--ckpt-failure-policy", choices=[x.value for x in CkptFailurePolicy],
                   default="stop",
                   help="when a save fails (full disk, I/O error, hung writer): stop with the "
                        "error, or continue training without further checkpoints")
    g.add_argument("--ckpt-verify-replicas", type=int, nargs="?", const=1, default=None,
                   metavar="EVERY",
                   help="with --async-lazy-save: at every EVERY-th save (default every save) "
                        "compare the data-parallel replicas of each tensor before the version "
                        "commits; a disagreement (silent data corruption) refuses the version, "
                        "names the tensor and ranks, and --ckpt-failure-policy decides whether "
                        "training stops (default) or goes on without that checkpoint")
    g.add_argument("--dist-ckpt-strictness", choices=STRICTNESS, default=STRICTNESS[0],
                   help="Megatron-LM's handling of tensors the model has and the checkpoint lacks "
                   "(unexpected) or the checkpoint has and the model lacks (missing), torch_dist "
                   "and DataStates loads: assume_ok_unexpected (default: a lacking tensor fails "
                   "the load), raise_unexpected/raise_all (fail first, naming them), "
                   "log_unexpected/log_all/return_unexpected/return_all (list them; the model's "
                   "lacking tensors keep their initial values: with --finetune or "
                   "--no-load-optim), ignore_all (the same, silently)")
    g.add_argument("--ckpt-fallback-to-previous", action="store_true",
                   help="if the newest complete checkpoint is damaged, verify and load the newest "
                        "older intact one instead of failing")
    g.add_argument("--allow-unsafe-pickle", action="store_true",
                   help="load checkpoint files whose pickles name arbitrary code (only for legacy "
                        "files you trust; by default such a file is refused and nothing in it "
                        "runs)")
    g.add_argument("--ckpt-drain-timeout", type=float, default=1800.0,
                   help="seconds a wait on the background checkpoint writers may take before it "
                        "is reported as a hung writer; checkpointing's collectives give up on a "
                        "rank that does not answer after 1.1x this plus 10 s (every format; "
                        "default 1800)")
    # Megatron-LM's names for what dist_checkpointing does; see _check_megatron_ckpt_flags.
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   dest="auto_detect_ckpt_format_always",
                   help="Megatron-LM's: load --load in whatever format it is (torch, torch_dist, "
                        "DataStates, universal); this trainer always does")
    g.add_argument("--use-dist-ckpt", action="store_true", dest="use_dist_ckpt_deprecated",
                   help="deprecated Megatron-LM flag: the same as --ckpt-format torch_dist, the "
                        "default")
    g.add_argument("--ckpt-fully-parallel-save", action="store_true",
                   dest="ckpt_fully_parallel_save_deprecated",
                   help="deprecated Megatron-LM flag: fully parallel save is on by default; see "
                        "--no-ckpt-fully-parallel-save")
    g.add_argument("--no-ckpt-fully-parallel-save", action="store_false",
                   dest="ckpt_fully_parallel_save",
                   help="write each replicated shard from the first data-parallel rank instead of "
                        "spreading the writes over the data-parallel group (torch_dist and "
                        "--async-lazy-save)")
    g.add_argument("--ckpt-assume-constant-structure", action="store_true",
                   help="the sharded structure of the state (keys, shapes, dtypes, sharding) "
                        "never changes during the run: validate the first save only and reuse "
                        "its plan without checking (torch_dist and --async-lazy-save; without "
                        "the flag --async-lazy-save still reuses a plan while a cheap structural "
                        "check finds the structure unchanged)")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="each data-parallel rank reads a part of the replicated shards and they "
                        "exchange the rest (megatron-core's exchange runs on CUDA tensors: GPU "
                        "runs only)")
    g.add_argument("--non-persistent-save-interval", type=_save_interval, default=None,
                   help="Megatron-LM's non-persistent checkpoints: also save every N iterations "
                        "where no --save-interval save is due, into the non-persistent root, "
                        "which keeps only the newest one unless --keep-last-n-non-persistent "
                        "says otherwise (needs --non-persistent-ckpt-type); "
                        "'auto' (the default with --save-interval auto): this level's own "
                        "interval, from its own measured cost and --mtbf-hours")
    g.add_argument("--non-persistent-ckpt-type", choices=["global", "local", "in_memory"],
                   default=None,
                   help="global: the non-persistent root is a directory on the shared file "
                        "system (--non-persistent-global-ckpt-dir), any format; local: each "
                        "node's own storage (--non-persistent-local-ckpt-dir), never copied to "
                        "the shared file system, with --async-lazy-save. --load resumes from it "
                        "when it is at least as new as --load's tracker (local: on every node). "
                        "in_memory: each node's shared memory (/dev/shm), which outlives a crash "
                        "of the training processes, with --async-lazy-save; a restart on the same "
                        "nodes resumes from it when it is the newest")
    g.add_argument("--keep-last-n-non-persistent", type=int, default=None,
                   help="keep the newest N complete non-persistent checkpoints (default 1, as "
                        "Megatron-LM); in_memory: memory then holds N + 1 versions (the one "
                        "being written), checked at start. Older ones are what "
                        "--ckpt-fallback-to-previous resumes from when the newest is damaged")
    g.add_argument("--non-persistent-global-ckpt-dir", default=None,
                   help="root of global non-persistent checkpoints (default: <save>/"
                        "non_persistent when saving, <load>/non_persistent when loading)")
    g.add_argument("--non-persistent-local-ckpt-dir", default=None,
                   help="node-local root of --non-persistent-ckpt-type local checkpoints "
                        "(placeholders {node}, {rank}, {local_rank}, {host}); it must not be "
                        "shared between nodes")
    g.add_argument("--non-persistent-local-ckpt-algo", choices=["fully_parallel", "atomic"],
                   default=None,
                   help="accepted for Megatron-LM launch lines; no effect: DataStates' local "
                        "saves are asynchronous and every version is committed atomically")
    g.add_argument("--replication", action="store_true",
                   help="Megatron-LM's replication of local non-persistent checkpoints to peer "
                        "ranks: not supported (refused with what to use instead: "
                        "--lazy-save-peer-replica)")
    g.add_argument("--replication-jump", type=int, default=None,
                   help="Megatron-LM's spacing between ranks holding replicas (with "
                        "--replication, which is not supported)")
    g.add_argument("--replication-factor", type=int, default=2,
                   help="Megatron-LM's number of machines holding a replica (with --replication, "
                        "which is not supported)")
    g.add_argument("--universal-checkpoint-interval", type=int, default=None,
                   help="merge every N-th committed --async-lazy-save checkpoint into a universal "
                        "(any-layout) checkpoint in a background low-priority process")
    g.add_argument("--universal-merge-workers", type=int, default=1,
                   help="merge worker processes per node (started once per run by the first "
                        "rank of each node): each writes "
                        "the safetensors files of its share of the tensors; the manifest is "
                        "committed once every part is durable")
    g.add_argument("--universal-save", type=str, default=None,
                   help="root of the universal checkpoints (default: <save>/universal)")
    g.add_argument("--keep-last-n-universal", type=int, default=None,
                   help="keep only the newest N universal checkpoints under the universal root "
                        "(one a merge or a converter still reads is kept until it is done)")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="megatron-core's synthetic dataset (instead of --data-path)")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="PREFIX [PREFIX ...] of .bin/.idx files, or a blend W1 P1 W2 P2 ...")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"the {split} split's own PREFIX [PREFIX ...] or blend (Megatron-LM's; "
                       "instead of --data-path and --split)")
    g.add_argument("--split", type=str, default="969,30,1",
                   help="train,valid,test proportions of each dataset")
    g.add_argument("--tokenizer-type", choices=[t.value for t in TokenizerType],
                   default=None, help="offline tokenizer (default: GPT2BPETokenizer with "
                   "--vocab-file and --merge-file, Megatron-LM's pretrain_gpt.py default, else "
                   "NullTokenizer)")
    g.add_argument("--vocab-file", type=str, default=None,
                   help="GPT2BPETokenizer: GPT-2's vocab.json (symbol -> id)")
    g.add_argument("--merge-file", type=str, default=None,
                   help="GPT2BPETokenizer: GPT-2's merges.txt")
    g.add_argument("--tokenizer-model", type=str, default=None,
                   help="HuggingFaceTokenizer: a local directory with the tokenizer's files "
                        "(read with transformers, never downloaded; the other tokenizers read "
                        "none, so giving it to them is an error)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: ids in the text (eod gets id vocab size)")
    g.add_argument("--tiktoken-pattern", type=str, default=None,
                   help="accepted: read by Megatron-LM's TikTokenizer only, not built here (the "
                        "tokenizers here ignore it, as Megatron-LM's other tokenizers do)")
    g.add_argument("--dataloader-type", choices=["single", "cyclic", "external"], default=None,
                   help="Megatron-LM's: 'single' (one pass in order from the samples consumed) "
                   "is what this trainer does; the others are refused")
    g.add_argument("--num-workers", type=int, default=None,
                   help="Megatron-LM's data-loader workers: batches are read on the training "
                        "thread here (one line says so)")
    g.add_argument("--data-cache-path", type=str, default=None,
                   help="where megatron-core keeps the datasets' index caches (default: next to "
                        "the data; the mock dataset's are not kept)")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="read the .bin files instead of memory-mapping them")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_true",
                   dest="no_attention_mask_always",
                   help="accepted: batches never carry an attention mask here (the layer specs "
                        "build the causal mask)")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-throughput", action="store_true",
                   help="add Megatron-LM's `throughput per GPU (TFLOP/s/GPU)` to the training line")
    g.add_argument("--log-progress", action="store_true",
                   help="append job starts, --save checkpoints (with throughput, FLOPs and tokens "
                   "so far) and their deletions to <save>/progress.txt (Megatron-LM's)")
    g.add_argument("--tensorboard-dir", type=str, default=None,
                   help="write TensorBoard event files to this directory (needs the tensorboard "
                        "package)")
    g.add_argument("--tensorboard-log-interval", type=int, default=None,
                   help=f"write the training scalars every N iterations (default "
                        f"{SCALAR_DEFAULTS['tensorboard_log_interval']})")
    g.add_argument("--tensorboard-queue-size", type=int, default=None,
                   help=f"events queued before a write (default "
                        f"{SCALAR_DEFAULTS['tensorboard_queue_size']})")
    g.add_argument("--log-timers-to-tensorboard", action="store_true", default=None,
                   help="also write iteration-time, throughput and checkpoint save/load times")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                   action="store_false", default=None,
                   help="do not write the loss scale (written by default with --tensorboard-dir "
                        "or --wandb-project)")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true", default=None,
                   help="also write the validation perplexity")
    g.add_argument("--log-memory-to-tensorboard", action="store_true", default=None,
                   help="write CUDA memory counters (CUDA runs only)")
    g.add_argument("--wandb-project", type=str, default=None,
                   help="log the same scalars to this Weights & Biases project (needs wandb; "
                        "WANDB_MODE=offline writes local files only)")
    g.add_argument("--wandb-exp-name", type=str, default=None, help="name of the wandb run")
    g.add_argument("--wandb-save-dir", type=str, default=None,
                   help="local directory of the wandb files (default: <save>/wandb)")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations --profile-step-start to --profile-step-end: for "
                        "nsys (cudaProfilerStart/Stop; run under nsys --capture-range="
                        "cudaProfilerApi), or with --use-pytorch-profiler torch's profiler")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile: torch's profiler, one chrome trace per rank in "
                        "<tensorboard-dir>/../torch_profile/rank-R.json.gz")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="first profiled iteration")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="profiling stops once this iteration is done")
    g.add_argument("--profile-ranks", type=int, nargs="*", default=[],
                   help="global ranks that profile (default: every rank)")
    g.add_argument("--pytorch-profiler-collect-shapes", action="store_true",
                   help="with --use-pytorch-profiler: record operator input shapes")
    g.add_argument("--pytorch-profiler-collect-callstack", action="store_true",
                   help="with --use-pytorch-profiler: record Python call stacks")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", description="Train a GPT model with megatron-core.",
                allow_abbrev=False)
    for add in (_add_model_args, _add_mixed_precision_args, _add_parallel_args,
                _add_training_args, _add_checkpoint_args, _add_data_args, _add_logging_args):
        add(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse Megatron-LM flags; unknown flags raise ArgumentError naming them."""
    return build_parser().parse_args(argv)


def _torch_norms_patched_or_fused() -> bool:
    """On a GPU the local layer spec uses megatron-core's torch norms unless transformer-engine
    (or apex) is there, and those assert that sequence parallel and zero-centered weights are off.
    On CPU, cpu_compat builds such norms itself."""
    from megatron.training.cpu_compat import cuda_available

    if not cuda_available():
        return True
    return any(importlib.util.find_spec(m) is not None for m in ("transformer_engine", "apex"))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentError(message)


def _check_stage_layers(a: argparse.Namespace, pp: int) -> None:
    first, last = a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers
    if first is None and last is None:
        _require(a.num_layers % pp == 0, f"--num-layers {a.num_layers} is not divisible by "
                 f"--pipeline-model-parallel-size {pp} (use --decoder-first-pipeline-num-layers / "
                 "--decoder-last-pipeline-num-layers for an uneven split)")
        return
    _require(pp > 1, "--decoder-first/last-pipeline-num-layers need "
                     "--pipeline-model-parallel-size > 1")
    _require(a.num_layers_per_virtual_pipeline_stage is None,
             "an uneven pipeline split cannot be combined with "
             "--num-layers-per-virtual-pipeline-stage")
    fixed = [x for x in (first, last) if x is not None]
    _require(all(x >= 1 for x in fixed), f"first/last stage layer counts must be >= 1, got {fixed}")
    middle, rest = pp - len(fixed), a.num_layers - sum(fixed)
    _require(rest >= middle and (middle == 0 and rest == 0 or middle > 0 and rest % middle == 0),
             f"--num-layers {a.num_layers} minus the first/last stage layers ({sum(fixed)}) must "
             f"split evenly over the other {middle} pipeline stage(s), got {rest}")


def _check_parallel(a: argparse.Namespace, world_size: int) -> Optional[int]:
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    _require(tp >= 1 and pp >= 1, f"parallel sizes must be >= 1, got TP={tp} PP={pp}")
    _require(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by TP*PP = {tp}*{pp} = {tp * pp}")
    _check_stage_layers(a, pp)
    _require(a.num_attention_heads % tp == 0,
             f"--num-attention-heads {a.num_attention_heads} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    _require(a.hidden_size % a.num_attention_heads == 0,
             f"--hidden-size {a.hidden_size} is not divisible by --num-attention-heads "
             f"{a.num_attention_heads}")
    if a.sequence_parallel and tp == 1:  # Megatron-LM's rule: a warning, not an error
        _warn("Disabling sequence parallelism because tensor model parallelism is disabled "
              "(--sequence-parallel with --tensor-model-parallel-size 1), as Megatron-LM does")
        a.sequence_parallel = False
    _require(not a.apply_layernorm_1p or _torch_norms_patched_or_fused(),
             "--apply-layernorm-1p on a GPU needs transformer-engine or apex: megatron-core's "
             "plain torch norms refuse zero-centered weights (pip install transformer-engine)")
    _require(not a.sequence_parallel or _torch_norms_patched_or_fused(),
             "--sequence-parallel on a GPU needs transformer-engine or apex: megatron-core's "
             "plain torch norms refuse it (pip install transformer-engine, or drop "
             "--sequence-parallel)")
    vpp = None
    if a.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = a.num_layers // pp
        chunk = a.num_layers_per_virtual_pipeline_stage
        _require(pp > 1, "--num-layers-per-virtual-pipeline-stage needs "
                         "--pipeline-model-parallel-size > 1")
        _require(chunk >= 1 and per_stage % chunk == 0,
                 f"layers per pipeline stage ({a.num_layers} / PP {pp} = {per_stage}) are not "
                 f"divisible by --num-layers-per-virtual-pipeline-stage {chunk}")
        vpp = per_stage // chunk
        if vpp == 1:
            vpp = None  # one chunk per stage is the plain (non-interleaved) schedule
    return vpp


def _check_batch(a: argparse.Namespace, dp: int, vpp: Optional[int], pp: int) -> int:
    gbs = a.global_batch_size if a.global_batch_size is not None else a.micro_batch_size * dp
    _require(a.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {a.micro_batch_size}")
    unit = a.micro_batch_size * dp
    if a.decrease_batch_size_if_needed:
        _require(gbs >= unit, f"--global-batch-size {gbs} is below one micro-batch per "
                 f"data-parallel rank (--micro-batch-size {a.micro_batch_size} * data-parallel "
                 f"size {dp} = {unit}): --decrease-batch-size-if-needed can only decrease it")
    _require(gbs % unit == 0 or a.decrease_batch_size_if_needed,
             f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
             f"{a.micro_batch_size} * data-parallel size {dp}"
             + (f" (--decrease-batch-size-if-needed runs each iteration with "
                f"{gbs // unit * unit} samples instead)" if gbs > unit else ""))
    if vpp is not None:
        microbatches = gbs // (a.micro_batch_size * dp)
        _require(microbatches % pp == 0,
                 f"the interleaved schedule needs the number of micro-batches ({microbatches}) to "
                 f"be a multiple of --pipeline-model-parallel-size {pp}")
    return gbs


#: Flags that only --async-lazy-save reads, and their defaults (applied after the check below).
LAZY_SAVE_DEFAULTS = {"lazy_save_cache_mb": None, "lazy_save_checksum": "crc32c",
                      "lazy_save_local_dir": None,
                      "lazy_save_local_keep": 2, "lazy_save_peer_replica": False,
                      "lazy_save_peer_replica_mb": None, "lazy_save_wait_persistent": False,
                      "lazy_save_on_training_thread": False, "lazy_save_checksum_threads": None}


def default_memory_dir(save: str) -> str:
    """--lazy-save-local-dir under --lazy-save-peer-replica when not given: one subdirectory per
    node of --save's shared-memory directory (`config.shared_memory_dir`)."""
    return shared_memory_dir(save, "node{node}")


def host_cache_budget_mb() -> Tuple[int, int, int]:
    """(MiB one rank's host cache may take, ranks on this node, MiB available on it): 90% of the
    node's available memory shared by its ranks (torchrun's LOCAL_WORLD_SIZE)."""
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    free = psutil.virtual_memory().available >> 20
    return int(0.9 * free) // local, local, free


def _check_host_cache_fits(cache_mb: int) -> None:
    """Every rank of this node allocates its host cache at start-up: refuse a size the node's
    free memory cannot hold before anything is built or loaded (the allocation would otherwise
    fail later with a bare `OSError: Cannot allocate memory`, or push the node into swap)."""
    budget, local, free = host_cache_budget_mb()
    need = cache_mb * local
    _require(cache_mb <= budget,
             f"--lazy-save-cache-mb {cache_mb} on {local} rank(s) of this node needs {need} MiB of "
             f"host memory, but {free} MiB is available; lower --lazy-save-cache-mb (at most "
             f"{budget} per rank here)")


def _check_megatron_ckpt_flags(a: argparse.Namespace) -> None:
    """Megatron-LM checkpoint flags: deprecated aliases warn (as Megatron-LM does), what we do
    not support fails with one line naming what to use instead."""
    if a.use_dist_ckpt_deprecated:
        _require(a.ckpt_format == "torch_dist", "--use-dist-ckpt means --ckpt-format torch_dist, "
                 f"but --ckpt-format {a.ckpt_format} was given")
        _warn("--use-dist-ckpt is deprecated; --ckpt-format torch_dist (the default) is used")
    if a.dist_ckpt_format_deprecated:
        _warn("--dist-ckpt-format is deprecated and has no effect (as in Megatron-LM): "
              f"--ckpt-format selects the format ({a.ckpt_format} here)")
    if a.ckpt_fully_parallel_save_deprecated:
        _require(a.ckpt_fully_parallel_save, "--ckpt-fully-parallel-save and "
                 "--no-ckpt-fully-parallel-save contradict each other; pass one")
        _warn("--ckpt-fully-parallel-save is deprecated and has no effect: fully parallel save is "
              "on by default (--no-ckpt-fully-parallel-save turns it off)")
    if a.ckpt_fully_parallel_load:
        from megatron.training.cpu_compat import cuda_available

        _require(cuda_available(), "--ckpt-fully-parallel-load needs CUDA: megatron-core "
                 "exchanges the loaded shards between data-parallel ranks as CUDA tensors; drop "
                 "the flag on CPU")
    _require(not a.dist_ckpt_save_pre_mcore_014, "--dist-ckpt-save-pre-mcore-014 writes the "
             "format of megatron-core before 0.14, which this trainer does not write: drop it "
             "(megatron-core 0.14 and later read these checkpoints)")
    if a.use_persistent_ckpt_worker:
        _require(a.async_save, "--use-persistent-ckpt-worker is the writer of --async-save, "
                 "which is not given")
        _warn("--use-persistent-ckpt-worker: the --async-save writer is forked at each save "
              "call instead (on CPU megatron-core's persistent worker was seen writing values "
              "the next optimizer step had already changed)")
    if a.exit_signal != "SIGTERM" and not a.exit_signal_handler:
        _warn(f"--exit-signal {a.exit_signal} takes effect with --exit-signal-handler only (as in "
              "Megatron-LM): the signal is not handled")
    if a.use_mp_args_from_checkpoint_args and not a.use_checkpoint_args:
        _warn("--use-mp-args-from-checkpoint-args takes effect with --use-checkpoint-args only (as "
              "in Megatron-LM): the layout flags given are used")
    _require(not a.ckpt_convert_update_legacy_dist_opt_format,
             "--ckpt-convert-update-legacy-dist-opt-format updates Megatron-LM's distributed-"
             "optimizer format of before February 2024, which is not read here: convert the "
             "checkpoint with Megatron-LM first, or load it with --no-load-optim")
    if a.ckpt_convert_format is not None or a.ckpt_convert_save is not None:
        _require(a.ckpt_convert_format is not None and a.ckpt_convert_save is not None,
                 "--ckpt-convert-format and --ckpt-convert-save go together: the format to save "
                 "the loaded checkpoint in, and where")
        _require(a.load is not None or a.pretrained_checkpoint is not None,
                 "--ckpt-convert-format converts the checkpoint it loads: add --load DIR")
    _check_non_persistent_flags(a)


def _check_non_persistent_flags(a: argparse.Namespace) -> None:
    """Megatron-LM's non-persistent checkpoints: `global` is a second save root; `local` keeps
    DataStates versions on each node's storage; `in_memory` (a placeholder in Megatron-LM) in
    each node's shared memory."""
    kind = a.non_persistent_ckpt_type
    _require(kind != "in_memory" or a.async_lazy_save, "--non-persistent-ckpt-type in_memory keeps "
             "DataStates versions in each node's shared memory: add --async-lazy-save (or use "
             "--non-persistent-ckpt-type global with this format)")
    if kind == "local":
        _require(a.async_lazy_save, "--non-persistent-ckpt-type local keeps DataStates versions "
                 "on each node's storage: add --async-lazy-save (or use "
                 "--non-persistent-ckpt-type global with this format)")
        _require(a.non_persistent_local_ckpt_dir is not None, "--non-persistent-ckpt-type local "
                 "needs --non-persistent-local-ckpt-dir DIR (a node-local path, e.g. "
                 "/local_disk/ckpt or /dev/shm/ckpt-{node})")
        from datastates.megatron_adapter import expand_local_dir

        try:
            expand_local_dir(a.non_persistent_local_ckpt_dir, 0,
                             flag="--non-persistent-local-ckpt-dir")
        except Exception as err:  # noqa: BLE001 - a CheckpointError naming the placeholder
            _require(False, getattr(err, "reason", str(err)))
    for flag in _flags(a, ("non_persistent_local_ckpt_dir", "non_persistent_local_ckpt_algo")):
        _require(kind == "local", f"{flag} needs --non-persistent-ckpt-type local")
    if a.replication:  # Megatron-LM's own checks first, then what to use here instead
        _require(a.replication_jump is not None, "--replication requires the value of "
                 "--replication-jump (as in Megatron-LM)")
        _require(kind == "local", "--replication requires --non-persistent-ckpt-type local (as in "
                 f"Megatron-LM), got {kind}")
        _require(False, "--replication (Megatron-LM's copies of local non-persistent checkpoints "
                 "on peer ranks) is not supported: drop --replication, --replication-jump and "
                 "--replication-factor. With --async-lazy-save, --lazy-save-peer-replica keeps "
                 "every rank's shards of the newest committed checkpoint on its own node and on "
                 "the next node (any one node can be lost) and restores them from there at --load")
    elif a.replication_jump is not None:
        _warn("--replication-jump was specified despite not using replication. Ignoring (as "
              "Megatron-LM)")
    interval = a.non_persistent_save_interval
    if interval is None and kind is not None and a.save_interval == "auto":
        interval = a.non_persistent_save_interval = "auto"  # each level its own interval
    if interval == "auto":
        _require(a.save_interval == "auto", "--non-persistent-save-interval auto sets the "
                 "level's interval from its measured cost and --mtbf-hours, as --save-interval "
                 f"auto does for --save; it needs --save-interval auto, got --save-interval "
                 f"{a.save_interval}")
    elif interval is not None:
        _require(interval > 0, f"--non-persistent-save-interval must be >= 1, got {interval}")
    if interval is not None:
        _require(kind is not None, "--non-persistent-save-interval needs "
                 "--non-persistent-ckpt-type global, local or in_memory (Megatron-LM fails at the first "
                 "non-persistent save without a type)")
        if a.save is None:
            _warn("--non-persistent-save-interval without --save: nothing is saved (as "
                  "Megatron-LM)")
    if a.keep_last_n_non_persistent is not None:
        _require(kind is not None, "--keep-last-n-non-persistent counts the checkpoints of "
                 "--non-persistent-ckpt-type global, local or in_memory, which is not given")
        _require(a.keep_last_n_non_persistent >= 1, "--keep-last-n-non-persistent must be >= 1, "
                 f"got {a.keep_last_n_non_persistent}")
    if a.non_persistent_global_ckpt_dir is not None:
        _require(kind == "global", "--non-persistent-global-ckpt-dir needs "
                 "--non-persistent-ckpt-type global")
        for flag, root in (("--save", a.save), ("--load", a.load)):
            _require(root is None or os.path.realpath(root) != os.path.realpath(
                a.non_persistent_global_ckpt_dir), f"--non-persistent-global-ckpt-dir must "
                f"differ from {flag} ({root}): each root has its own tracker and the "
                "non-persistent one keeps only its newest checkpoint")


def _warn(message: str) -> None:
    """A start-up warning, printed once (by global rank 0) to stdout like Megatron-LM's."""
    if os.environ.get("RANK", "0") == "0":
        say(f"WARNING: {message}")


def _check_checkpointing(a: argparse.Namespace) -> None:
    given = _flags(a, LAZY_SAVE_DEFAULTS)
    _require(a.async_lazy_save or not given, f"{', '.join(given)} configure --async-lazy-save, "
             "which is not on: add --async-lazy-save, or drop the flag (it would be ignored)")
    if a.lazy_save_peer_replica:  # the node's own copy is the local level: in memory by default
        # With the in-memory level, its versions are what is replicated: no second memory copy.
        if a.lazy_save_local_dir is None and a.save is not None and \
                a.non_persistent_ckpt_type != "in_memory":
            a.lazy_save_local_dir = default_memory_dir(a.save)
        if a.lazy_save_local_keep is None:
            a.lazy_save_local_keep = 1  # only the newest committed version is held in memory
        _require(a.lazy_save_peer_replica_mb is None or a.lazy_save_peer_replica_mb > 0,
                 f"--lazy-save-peer-replica-mb must be > 0, got {a.lazy_save_peer_replica_mb}")
    _require(a.lazy_save_peer_replica_mb is None or a.lazy_save_peer_replica,
             "--lazy-save-peer-replica-mb bounds --lazy-save-peer-replica, which is not given")
    _fill_defaults(a, LAZY_SAVE_DEFAULTS)
    if a.async_lazy_save:
        _require(not a.async_save, "--async-lazy-save and --async-save are two different "
                 "asynchronous savers; pass one of them")
        _require(a.ckpt_format == "torch_dist", "--async-lazy-save writes megatron's "
                 f"dist_checkpointing layout; it needs --ckpt-format torch_dist, got {a.ckpt_format}")
        if a.lazy_save_cache_mb is not None:  # None: sized at start-up (checkpointing/lazy.py)
            _require(a.lazy_save_cache_mb > 0,
                     f"--lazy-save-cache-mb must be > 0, got {a.lazy_save_cache_mb}")
            _check_host_cache_fits(a.lazy_save_cache_mb)
        _require(a.lazy_save_local_keep >= 1,
                 f"--lazy-save-local-keep must be >= 1, got {a.lazy_save_local_keep}")
        if a.lazy_save_checksum_threads is not None:
            _require(a.lazy_save_checksum_threads >= 1, "--lazy-save-checksum-threads must be "
                     f">= 1, got {a.lazy_save_checksum_threads}")
            kind = a.non_persistent_ckpt_type
            _require(kind == "in_memory", "--lazy-save-checksum-threads checksums the in-memory "
                     "checkpoints, but --non-persistent-ckpt-type in_memory is not given"
                     + ("" if kind is None else f" (found {kind})") + ": add it, or drop the flag")
        _require(a.lazy_save_local_dir is not None or "--lazy-save-local-keep" not in given,
                 "--lazy-save-local-keep counts copies under --lazy-save-local-dir, which is not "
                 "given")
    if a.universal_checkpoint_interval is not None:
        _require(a.universal_checkpoint_interval > 0, "--universal-checkpoint-interval must be "
                 f"> 0, got {a.universal_checkpoint_interval}")
        _require(a.async_lazy_save and a.save is not None, "--universal-checkpoint-interval "
                 "merges --async-lazy-save checkpoints; it needs --async-lazy-save and --save")
    _require(a.universal_merge_workers >= 1, "--universal-merge-workers must be >= 1, got "
             f"{a.universal_merge_workers}")
    _require(a.universal_save is None or a.universal_checkpoint_interval is not None,
             "--universal-save needs --universal-checkpoint-interval N")
    _require(a.keep_last_n_universal is None or a.universal_checkpoint_interval is not None,
             "--keep-last-n-universal needs --universal-checkpoint-interval N")
    _require(a.keep_last_n_universal is None or a.keep_last_n_universal > 0,
             f"--keep-last-n-universal must be >= 1, got {a.keep_last_n_universal}")
    _require(a.keep_last_n_checkpoints is None or a.keep_last_n_checkpoints > 0,
             f"--keep-last-n-checkpoints must be >= 1, got {a.keep_last_n_checkpoints}")
    if a.save_retain_interval is not None:
        _require(a.save_retain_interval > 0, "--save-retain-interval must be >= 1, got "
                 f"{a.save_retain_interval}")
        _require(a.save_interval not in (None, "auto")
                 and a.save_retain_interval % a.save_interval == 0,
                 f"--save-retain-interval {a.save_retain_interval} must be a multiple of a fixed "
                 f"--save-interval, as in Megatron-LM (so each retained iteration is saved), got "
                 f"--save-interval {a.save_interval}")
    _require(not a.async_save or a.ckpt_format == "torch_dist",
             f"--async-save needs --ckpt-format torch_dist, got --ckpt-format {a.ckpt_format}")
    if a.ckpt_verify_replicas is not None:
        _require(a.ckpt_verify_replicas > 0, f"--ckpt-verify-replicas must be >= 1 (every how "
                 f"many saves), got {a.ckpt_verify_replicas}")
        _require(a.async_lazy_save, "--ckpt-verify-replicas compares replicas inside "
                 "--async-lazy-save's commit: add --async-lazy-save")
    _require(a.ckpt_drain_timeout > 0,
             f"--ckpt-drain-timeout must be > 0 seconds, got {a.ckpt_drain_timeout}")
    _check_megatron_ckpt_flags(a)
    _require(a.save_interval is None or a.save_interval == "auto" or a.save_interval > 0,
             f"--save-interval must be > 0 or 'auto', got {a.save_interval}")
    _require(a.save_interval != "auto" or a.mtbf_hours is not None,
             "--save-interval auto needs --mtbf-hours H (the job's mean time between failures)")
    _require(a.mtbf_hours is None or a.save_interval == "auto",
             f"--mtbf-hours is only used by --save-interval auto, got --save-interval "
             f"{a.save_interval}")
    _require(a.mtbf_hours is None or a.mtbf_hours > 0,
             f"--mtbf-hours must be > 0, got {a.mtbf_hours}")
    _require(a.save_interval is None or a.save is not None, "--save-interval needs --save DIR")
    _require(not a.async_lazy_save or a.save is not None, "--async-lazy-save writes checkpoints "
             "under --save, which is not given: add --save DIR, or drop --async-lazy-save")
    # A --load directory that does not exist yet is not an error: as Megatron-LM, the run starts
    # from scratch with a warning (checkpointing/loading.py), so `--save D --load D` restarts.


#: Flags that only configure the TensorBoard/wandb scalars (parsed as None when not given), their
#: names and their defaults (applied after the check that a writer is on).
SCALAR_DEFAULTS = {"tensorboard_log_interval": 1, "tensorboard_queue_size": 1000,
                   "log_loss_scale_to_tensorboard": True, "log_timers_to_tensorboard": False,
                   "log_validation_ppl_to_tensorboard": False, "log_memory_to_tensorboard": False}
_SCALAR_FLAGS = {"log_loss_scale_to_tensorboard": "--no-log-loss-scale-to-tensorboard"}


def _require_package(name: str, flag: str) -> None:
    """An optional dependency: refuse its flag at start-up, not at the first scalar."""
    _require(importlib.util.find_spec(name) is not None,
             f"{flag} needs the {name} package, which is not installed: pip install {name}")


def _logging_config(a: argparse.Namespace) -> LoggingConfig:
    given = _flags(a, SCALAR_DEFAULTS, _SCALAR_FLAGS)
    _require(a.tensorboard_dir is not None or a.wandb_project is not None or not given,
             f"{', '.join(given)} configure the TensorBoard/wandb scalars, which are off: add "
             "--tensorboard-dir DIR or --wandb-project NAME, or drop the flag (it would be ignored)")
    _fill_defaults(a, SCALAR_DEFAULTS)
    _require(a.tensorboard_log_interval > 0,
             f"--tensorboard-log-interval must be > 0, got {a.tensorboard_log_interval}")
    _require(a.tensorboard_queue_size > 0,
             f"--tensorboard-queue-size must be > 0, got {a.tensorboard_queue_size}")
    if a.tensorboard_dir is not None:
        _require_package("tensorboard", "--tensorboard-dir")
    wandb_only = [f for f, v in (("--wandb-exp-name", a.wandb_exp_name),
                                 ("--wandb-save-dir", a.wandb_save_dir)) if v is not None]
    _require(a.wandb_project is not None or not wandb_only,
             f"{', '.join(wandb_only)} configure wandb, which is off: add --wandb-project NAME, "
             "or drop the flag (it would be ignored)")
    _require(not a.use_pytorch_profiler or a.profile, "--use-pytorch-profiler needs --profile "
             "(which iterations: --profile-step-start, --profile-step-end)")
    _require(not (a.profile and a.use_pytorch_profiler) or a.tensorboard_dir is not None,
             "--use-pytorch-profiler writes its traces to <tensorboard-dir>/../torch_profile, as "
             "Megatron-LM: add --tensorboard-dir DIR")
    _require(not a.profile or 0 <= a.profile_step_start < a.profile_step_end,
             f"--profile needs 0 <= --profile-step-start < --profile-step-end, got "
             f"{a.profile_step_start} and {a.profile_step_end}")
    if a.wandb_project is not None:
        _require(bool(a.wandb_exp_name), "--wandb-project needs --wandb-exp-name NAME (the name "
                                         "of this run in the project)")
        _require(a.wandb_save_dir is not None or a.save is not None,
                 "--wandb-project needs a place for its local files: --wandb-save-dir DIR, or "
                 "--save DIR (then <save>/wandb)")
        _require_package("wandb", "--wandb-project")
    return LoggingConfig(
        log_interval=a.log_interval, log_throughput=a.log_throughput,
        log_progress=a.log_progress,
        tensorboard_dir=a.tensorboard_dir, tensorboard_log_interval=a.tensorboard_log_interval,
        tensorboard_queue_size=a.tensorboard_queue_size,
        log_timers_to_tensorboard=a.log_timers_to_tensorboard,
        log_loss_scale_to_tensorboard=a.log_loss_scale_to_tensorboard,
        log_validation_ppl_to_tensorboard=a.log_validation_ppl_to_tensorboard,
        log_memory_to_tensorboard=a.log_memory_to_tensorboard,
        wandb_project=a.wandb_project, wandb_exp_name=a.wandb_exp_name,
        wandb_save_dir=(a.wandb_save_dir if a.wandb_save_dir is not None or a.wandb_project is None
                        else os.path.join(a.save, "wandb")),
        profile=a.profile, use_pytorch_profiler=a.use_pytorch_profiler,
        profile_step_start=a.profile_step_start, profile_step_end=a.profile_step_end,
        profile_ranks=tuple(a.profile_ranks),
        pytorch_profiler_collect_shapes=a.pytorch_profiler_collect_shapes,
        pytorch_profiler_collect_callstack=a.pytorch_profiler_collect_callstack)


#: Flags that only --position-embedding-type rope reads, and their defaults (Megatron-LM's).
ROPE_DEFAULTS = {"rotary_base": 10000, "rotary_percent": 1.0}
#: Flags that only fp16's dynamic loss scaling reads, and their defaults (Megatron-LM's).
LOSS_SCALE_DEFAULTS = {"initial_loss_scale": 2.0 ** 32, "min_loss_scale": 1.0,
                       "loss_scale_window": 1000.0, "hysteresis": 2}


def _flags(a: argparse.Namespace, keys, names: Optional[dict] = None) -> list:
    """The flags of `keys` (a defaults dict or a sequence of dests) given on the command line
    (their default is None until filled); `names` spells flags whose name is not their dest's."""
    names = names or {}
    return [names.get(k, f"--{k.replace('_', '-')}") for k in keys if getattr(a, k) is not None]


def _fill_defaults(a: argparse.Namespace, defaults: dict) -> None:
    for key, default in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, default)


def _check_position_embedding(a: argparse.Namespace) -> None:
    rope = a.position_embedding_type == PositionEmbeddingType.ROPE.value
    given = _flags(a, ROPE_DEFAULTS)
    _require(rope or not given, f"{', '.join(given)} configure rotary embeddings, but "
             f"--position-embedding-type is {a.position_embedding_type}: add "
             "--position-embedding-type rope, or drop the flag (it would be ignored)")
    _fill_defaults(a, ROPE_DEFAULTS)
    _require(0.0 < a.rotary_percent <= 1.0,
             f"--rotary-percent must be in (0, 1], got {a.rotary_percent}")
    _require(a.rotary_base > 0, f"--rotary-base must be > 0, got {a.rotary_base}")
    max_pos = a.max_position_embeddings
    _require(max_pos is None or max_pos >= a.seq_length, f"--max-position-embeddings {max_pos} "
             f"is smaller than --seq-length {a.seq_length}")


def _check_attention(a: argparse.Namespace, tp: int) -> int:
    """Returns the number of key/value heads megatron-core will build."""
    if not a.group_query_attention:
        _require(a.num_query_groups is None, f"--num-query-groups {a.num_query_groups} needs "
                 "--group-query-attention (without it every query head has its own key/value "
                 "head)")
        return a.num_attention_heads
    groups = 1 if a.num_query_groups is None else a.num_query_groups  # Megatron-LM's default
    heads = a.num_attention_heads
    _require(groups >= 1 and heads % groups == 0, f"--num-query-groups {groups} must divide "
             f"--num-attention-heads {heads}")
    # megatron-core's rule (TransformerConfig): TP splits whole groups, or whole ranks share one.
    _require(groups % tp == 0 or tp % groups == 0, f"--num-query-groups {groups} must be a "
             f"multiple or a divisor of --tensor-model-parallel-size {tp}")
    return groups


def _check_mlp(a: argparse.Namespace, tp: int) -> int:
    """Returns the MLP width, Megatron-LM's default when not given."""
    ffn = a.ffn_hidden_size
    if ffn is None:
        # Megatron-LM: with swiglu two fc1 halves keep the parameter count near 4 * hidden,
        # rounded down to a multiple of 64.
        ffn = int((4 * a.hidden_size * 2 / 3) / 64) * 64 if a.swiglu else 4 * a.hidden_size
        _require(ffn >= 1, f"--swiglu with --hidden-size {a.hidden_size} gives an MLP width of "
                 f"{ffn} (int((4 * hidden * 2 / 3) / 64) * 64); pass --ffn-hidden-size")
    _require(ffn >= 1 and ffn % tp == 0, f"--ffn-hidden-size {ffn} must be >= 1 and divisible by "
             f"--tensor-model-parallel-size {tp}")
    return ffn


def _check_recompute(a: argparse.Namespace, pp: int) -> None:
    granularity, method, layers = a.recompute_granularity, a.recompute_method, a.recompute_num_layers
    if granularity != RecomputeGranularity.FULL.value:
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers)):
            _require(value is None, f"{flag} {value} needs --recompute-granularity full, got "
                     f"--recompute-granularity {granularity or '(not given)'}")
        return
    _require(method is not None and layers is not None, "--recompute-granularity full needs "
             "--recompute-method {uniform,block} and --recompute-num-layers N")
    most = max(ParallelConfig(
        pipeline_model_parallel_size=pp,
        decoder_first_pipeline_num_layers=a.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=a.decoder_last_pipeline_num_layers,
    ).stage_layers(a.num_layers))
    _require(1 <= layers <= most, f"--recompute-num-layers must be between 1 and the layers of a "
             f"pipeline stage ({most}), got {layers}")


def _check_precision(a: argparse.Namespace) -> None:
    _require(not (a.fp16 and a.bf16), "--fp16 and --bf16 are two model precisions; pass one")
    _require(a.loss_scale is None or a.fp16 or a.bf16, f"--loss-scale {a.loss_scale} needs "
             "--fp16 or --bf16 (fp32 training does not scale the loss)")
    _require(a.loss_scale is None or a.loss_scale > 0,
             f"--loss-scale must be > 0, got {a.loss_scale}")
    given = _flags(a, LOSS_SCALE_DEFAULTS)
    _require(not given or (a.fp16 and a.loss_scale is None), f"{', '.join(given)} configure "
             "dynamic loss scaling, which runs only with --fp16 and no --loss-scale; got "
             + ("--loss-scale" if a.loss_scale is not None else "no --fp16"))
    _fill_defaults(a, LOSS_SCALE_DEFAULTS)
    _require(a.initial_loss_scale > 0 and a.min_loss_scale > 0 and a.loss_scale_window > 0
             and a.hysteresis >= 1, "dynamic loss scaling needs --initial-loss-scale, "
             "--min-loss-scale and --loss-scale-window > 0 and --hysteresis >= 1")
    _require(a.min_loss_scale <= a.initial_loss_scale, f"--min-loss-scale {a.min_loss_scale} is "
             f"above --initial-loss-scale {a.initial_loss_scale}")


def _check_length(a: argparse.Namespace, gbs: int) -> None:
    """Iteration- or sample-based training, as Megatron-LM: the other's flags are refused; with
    --train-samples, `a.train_iters` is set to the iterations it makes."""
    _require((a.train_iters is None) != (a.train_samples is None),
             "pass one of --train-iters and --train-samples (the length of the run), got "
             + ("both" if a.train_iters is not None else "neither"))
    if a.train_iters is not None:
        _require(a.train_iters >= 0, f"--train-iters must be >= 0, got {a.train_iters}")
        for flag, value in (("--lr-decay-samples", a.lr_decay_samples),
                            ("--lr-warmup-samples", a.lr_warmup_samples or None)):
            _require(value is None, f"{flag} is for sample-based training (--train-samples); "
                     "with --train-iters use --lr-decay-iters and --lr-warmup-iters")
        return
    _require(a.train_samples >= 0, f"--train-samples must be >= 0, got {a.train_samples}")
    for flag, value in (("--lr-decay-iters", a.lr_decay_iters),
                        ("--lr-warmup-iters", a.lr_warmup_iters or None)):
        _require(value is None, f"{flag} is for iteration-based training (--train-iters); with "
                 "--train-samples use --lr-decay-samples and --lr-warmup-samples")
    a.train_iters = a.train_samples // gbs


def _check_rampup(a: argparse.Namespace, gbs: int, dp: int, vpp: Optional[int],
                  pp: int) -> None:
    """--rampup-batch-size START INCREMENT SAMPLES, as Megatron-LM takes it: sample-based training
    only; every batch size of the ramp a whole number of micro-batches (times the pipeline size
    with the interleaved schedule); `a.train_iters` set to the iterations the run then makes."""
    if a.rampup_batch_size is None:
        return
    start, increment, samples = a.rampup_batch_size
    _require(a.train_samples is not None, "--rampup-batch-size grows the batch over samples: "
             "it needs --train-samples (sample-based training), not --train-iters (as in "
             "Megatron-LM)")
    _require(start > 0 and increment > 0 and samples >= 0, "--rampup-batch-size needs START > 0, "
             f"INCREMENT > 0 and SAMPLES >= 0, got {start} {increment} {samples}")
    _require(start <= gbs and (gbs - start) % increment == 0, f"--rampup-batch-size {start} "
             f"{increment} {samples}: --global-batch-size {gbs} must be START plus a whole "
             "number of INCREMENTs")
    unit = a.micro_batch_size * dp * (pp if vpp is not None else 1)
    _require(start % unit == 0 and increment % unit == 0, f"--rampup-batch-size {start} "
             f"{increment} {samples}: START and INCREMENT must be multiples of {unit} (micro-batch "
             f"size {a.micro_batch_size} * data-parallel size {dp}"
             + (f" * PP {pp}, for the interleaved schedule)" if vpp is not None else ")")
             + ", so that every batch of the ramp is whole micro-batches")
    a.train_iters = rampup_iterations(a.train_samples, tuple(a.rampup_batch_size), gbs,
                                      a.micro_batch_size, dp)


def rampup_iterations(train_samples: int, rampup: tuple, gbs: int, micro_batch_size: int,
                      dp: int) -> int:
    """Megatron-LM's count of the iterations --train-samples makes with --rampup-batch-size
    (`update_train_iters`): through the ramp (while the samples consumed are at most its
    length), the batch each iteration has; after it, whole global batches (a partial last one
    is dropped). With megatron-core's own calculator, so the batches are the ones it gives."""
    from megatron.core.num_microbatches_calculator import \
        RampupBatchsizeNumMicroBatchesCalculator

    calc = RampupBatchsizeNumMicroBatchesCalculator(gbs, micro_batch_size, dp, False, 1,
                                                    *rampup)
    iterations = consumed = 0
    while consumed <= rampup[2] and consumed <= train_samples:
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    return iterations


def _check_warmup(a: argparse.Namespace) -> None:
    samples = a.train_samples is not None
    unit, length = ("samples", a.train_samples) if samples else ("iters", a.train_iters)
    warmup = a.lr_warmup_samples if samples else a.lr_warmup_iters
    decay = (a.lr_decay_samples if samples else a.lr_decay_iters) or length
    if a.lr_warmup_fraction is not None:
        _require(warmup == 0, f"--lr-warmup-fraction {a.lr_warmup_fraction} and "
                 f"--lr-warmup-{unit} {warmup} both set the warm-up; pass one")
        _require(0.0 <= a.lr_warmup_fraction < 1.0, "--lr-warmup-fraction must be >= 0 and < 1 "
                 f"(a fraction of the decay length), got {a.lr_warmup_fraction}")
        return
    _require(warmup >= 0 and (warmup < decay or length == 0),
             f"--lr-warmup-{unit} must be >= 0 and smaller than the decay length "
             f"(--lr-decay-{unit}, default --train-{unit}) {decay}, got {warmup}")


def check_required_model_flags(a: argparse.Namespace) -> None:
    """The model flags a launch must give (argparse's message), unless --use-checkpoint-args
    took them from the checkpoint (`checkpointing.checkpoint_args`), which runs first."""
    missing = [f"--{name.replace('_', '-')}" for name in
               ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
               if getattr(a, name) is None]
    _require(not missing, "the following arguments are required: " + ", ".join(missing)
             + (" (--use-checkpoint-args found no checkpoint that gives them)"
                if a.use_checkpoint_args else ""))


def _model_config(a: argparse.Namespace, tp: int, pp: int, vocab_size: int) -> ModelConfig:
    """Check the model and precision flags; the resolved ModelConfig."""
    _check_position_embedding(a)
    groups = _check_attention(a, tp)
    ffn = _check_mlp(a, tp)
    _check_recompute(a, pp)
    _check_precision(a)
    _require(a.norm_epsilon > 0, f"--norm-epsilon must be > 0, got {a.norm_epsilon}")
    if a.cross_entropy_loss_fusion and a.cross_entropy_fusion_impl == "te":
        _require_package("transformer_engine", "--cross-entropy-fusion-impl te")
    head = a.hidden_size // a.num_attention_heads
    _require(a.kv_channels in (None, head), f"--kv-channels {a.kv_channels}: only --hidden-size "
             f"/ --num-attention-heads = {head} is built here (megatron-core's default)")
    return ModelConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads, ffn_hidden_size=ffn, seq_length=a.seq_length,
        max_position_embeddings=a.max_position_embeddings or a.seq_length,
        vocab_size=vocab_size,
        padded_vocab_size=_padded_vocab(vocab_size, a.make_vocab_size_divisible_by, tp),
        hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
        init_method_std=a.init_method_std,
        untie_embeddings_and_output_weights=a.untie_embeddings_and_output_weights, bf16=a.bf16,
        fp16=a.fp16, position_embedding_type=PositionEmbeddingType(a.position_embedding_type),
        rotary_base=a.rotary_base, rotary_percent=a.rotary_percent,
        normalization=Normalization(a.normalization), norm_epsilon=a.norm_epsilon,
        apply_layernorm_1p=a.apply_layernorm_1p,
        swiglu=a.swiglu, num_query_groups=groups if a.group_query_attention else None,
        add_bias_linear=a.add_bias_linear,
        recompute_granularity=(None if a.recompute_granularity is None
                               else RecomputeGranularity(a.recompute_granularity)),
        recompute_method=(None if a.recompute_method is None
                          else RecomputeMethod(a.recompute_method)),
        recompute_num_layers=a.recompute_num_layers, attention_backend=a.attention_backend,
        cross_entropy_fusion=a.cross_entropy_fusion_impl if a.cross_entropy_loss_fusion else None,
        calculate_per_token_loss=a.calculate_per_token_loss)


def _check_data(a: argparse.Namespace) -> None:
    _require(a.dataloader_type in (None, "single"), f"--dataloader-type {a.dataloader_type} "
             "(Megatron-LM's " + ("random sampler, reshuffled every epoch" if a.dataloader_type
                                  == "cyclic" else "data loader built by the caller") +
             ") is not supported: the trainer reads each split once, in order, from the samples "
             "consumed (Megatron-LM's 'single'); drop the flag or pass --dataloader-type single")
    if a.num_workers is not None:
        _require(a.num_workers >= 0, f"--num-workers must be >= 0, got {a.num_workers}")
        _warn(f"--num-workers {a.num_workers}: this trainer has no data-loader workers; each "
              "micro-batch is read on the training thread (from the memory-mapped .bin files, "
              "or made by the mock dataset)")
    per_split = [(f"--{name}-data-path", getattr(a, f"{name}_data_path"))
                 for name in ("train", "valid", "test")]
    given = [flag for flag, value in per_split if value]
    named = (["--mock-data"] if a.mock_data else []) + (["--data-path"] if a.data_path else [])
    sources = len(named) + int(bool(given))
    _require(sources == 1, "give exactly one of --mock-data, --data-path PREFIX [PREFIX ...], or "
             "--train-data-path (with --valid-data-path, --test-data-path: each split its own)"
             + (f"; got {', '.join(named + given)}" if sources > 1 else ""))
    _require(not given or per_split[0][1], f"{', '.join(given)} name the other splits' data; "
             "add --train-data-path")
    for flag, value in [("--data-path", a.data_path)] + per_split:
        for item in value or ():
            try:
                float(item)
                continue  # a blend weight
            except ValueError:
                pass
            _require(os.path.isfile(item + ".bin") and os.path.isfile(item + ".idx"),
                     f"{flag} {item!r}: expected {item}.bin and {item}.idx "
                     f"(made by tools/preprocess_data.py)")


def _padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return ((vocab + multiple - 1) // multiple) * multiple


def build_run_config(a: argparse.Namespace, world_size: Optional[int] = None) -> RunConfig:
    """Check the parsed flags against each other and the world size; return the frozen config."""
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    check_required_model_flags(a)
    vpp = _check_parallel(a, world_size)
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    dp = world_size // (tp * pp)
    gbs = _check_batch(a, dp, vpp, pp)
    _check_checkpointing(a)
    _check_data(a)
    _check_length(a, gbs)
    _check_rampup(a, gbs, dp, vpp, pp)
    _require(a.decoupled_min_lr is None or a.decoupled_lr is not None,
             "--decoupled-min-lr needs --decoupled-lr (it is the final learning rate of the "
             "parameter group --decoupled-lr makes)")
    _require(not (a.override_opt_param_scheduler and a.use_checkpoint_opt_param_scheduler),
             "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict "
             "each other; pass one of them")
    _require(a.log_interval > 0, f"--log-interval must be > 0, got {a.log_interval}")
    _require(not a.overlap_param_gather or a.use_distributed_optimizer,
             "--overlap-param-gather needs --use-distributed-optimizer (it overlaps that "
             "optimizer's all-gather of the updated parameters)")
    _require(not a.overlap_param_gather or a.overlap_grad_reduce,
             "--overlap-param-gather needs --overlap-grad-reduce, as in Megatron-LM")
    _require(a.context_parallel_size == 1, f"--context-parallel-size {a.context_parallel_size}: "
             "context parallelism is not built here (1 only)")
    _require(not a.grad_reduce_in_bf16 or a.bf16, "--grad-reduce-in-bf16 needs --bf16 (the "
             "gradients are reduced in the model's precision otherwise)")
    _require(a.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be > 0, got "
             f"{a.distributed_timeout_minutes}")
    _require(a.ddp_bucket_size is None or a.ddp_bucket_size > 0,
             f"--ddp-bucket-size must be > 0 elements, got {a.ddp_bucket_size}")
    _check_warmup(a)
    if a.tokenizer_type is None:
        bpe = a.vocab_file is not None and a.merge_file is not None
        a.tokenizer_type = (TokenizerType.GPT2_BPE if bpe else TokenizerType.NULL).value
    if a.mock_data and a.vocab_size is None and a.tokenizer_type == "NullTokenizer":
        raise ArgumentError("--mock-data with NullTokenizer needs --vocab-size")
    tokenizer = build_tokenizer(a.tokenizer_type, a.vocab_size, a.tokenizer_model,
                                a.vocab_file, a.merge_file)
    model = _model_config(a, tp, pp, tokenizer.vocab_size)
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=a.sequence_parallel,
        use_distributed_optimizer=a.use_distributed_optimizer, world_size=world_size,
        overlap_grad_reduce=a.overlap_grad_reduce, overlap_param_gather=a.overlap_param_gather,
        ddp_bucket_size=a.ddp_bucket_size, grad_reduce_in_bf16=a.grad_reduce_in_bf16,
        distributed_timeout_minutes=a.distributed_timeout_minutes,
        decoder_first_pipeline_num_layers=a.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=a.decoder_last_pipeline_num_layers)
    optimizer = OptimizerConfig(
        lr=a.lr, min_lr=a.min_lr, lr_decay_style=LrDecayStyle(a.lr_decay_style),
        lr_warmup_iters=a.lr_warmup_iters, lr_warmup_fraction=a.lr_warmup_fraction,
        lr_decay_iters=a.lr_decay_iters, lr_warmup_samples=a.lr_warmup_samples,
        lr_decay_samples=a.lr_decay_samples, decoupled_lr=a.decoupled_lr,
        decoupled_min_lr=a.decoupled_min_lr,
        weight_decay=a.weight_decay, clip_grad=a.clip_grad, adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2, adam_eps=a.adam_eps,
        scheduler_on_resume=(SchedulerOnResume.OVERRIDE if a.override_opt_param_scheduler else
                             SchedulerOnResume.CHECKPOINT if a.use_checkpoint_opt_param_scheduler
                             else SchedulerOnResume.MUST_MATCH),
        loss_scale=a.loss_scale, initial_loss_scale=a.initial_loss_scale,
        min_loss_scale=a.min_loss_scale, loss_scale_window=a.loss_scale_window,
        hysteresis=a.hysteresis)
    _require(a.manual_gc_interval >= 0,
             f"--manual-gc-interval must be >= 0, got {a.manual_gc_interval}")
    _require(a.ckpt_step is None or (a.load and a.ckpt_step >= 0),
             "--ckpt-step names an iteration under --load, which is not given"
             if not a.load else f"--ckpt-step must be >= 0, got {a.ckpt_step}")
    _require(a.exit_duration_in_mins is None or a.exit_duration_in_mins >= 0,
             f"--exit-duration-in-mins must be >= 0 minutes (0: no limit), got "
             f"{a.exit_duration_in_mins}")
    _require(all(n >= 0 for n in a.iterations_to_skip), "--iterations-to-skip takes iteration "
             f"counts >= 0, got {' '.join(map(str, a.iterations_to_skip))}")
    training = TrainingConfig(
        micro_batch_size=a.micro_batch_size, global_batch_size=gbs, train_iters=a.train_iters,
        train_samples=a.train_samples,
        rampup_batch_size=None if a.rampup_batch_size is None else tuple(a.rampup_batch_size),
        decrease_batch_size_if_needed=a.decrease_batch_size_if_needed,
        iterations_to_skip=tuple(sorted(set(a.iterations_to_skip))), seed=a.seed,
        eval_interval=a.eval_interval, eval_iters=a.eval_iters,
        exit_interval=a.exit_interval, exit_duration_in_mins=a.exit_duration_in_mins or None,
        exit_signal_handler=a.exit_signal_handler, exit_signal=a.exit_signal,
        manual_gc=a.manual_gc,
        manual_gc_interval=a.manual_gc_interval, manual_gc_eval=a.manual_gc_eval,
        empty_unused_memory_level=a.empty_unused_memory_level)
    checkpoint = CheckpointConfig(
        save=a.save, load=a.load,
        save_interval=None if a.save_interval == "auto" else a.save_interval,
        save_interval_auto=a.save_interval == "auto", mtbf_hours=a.mtbf_hours,
        ckpt_format=CkptFormat(a.ckpt_format), async_save=a.async_save,
        save_optim=not a.no_save_optim, load_optim=not a.no_load_optim,
        save_rng=not a.no_save_rng, load_rng=not a.no_load_rng, finetune=a.finetune,
        pretrained_checkpoint=a.pretrained_checkpoint, ckpt_step=a.ckpt_step,
        exit_on_missing_checkpoint=a.exit_on_missing_checkpoint,
        ckpt_convert_format=a.ckpt_convert_format and CkptFormat(a.ckpt_convert_format),
        ckpt_convert_save=a.ckpt_convert_save,
        async_lazy_save=a.async_lazy_save, lazy_save_cache_mb=a.lazy_save_cache_mb,
        lazy_save_checksum=a.lazy_save_checksum, lazy_save_local_dir=a.lazy_save_local_dir,
        lazy_save_local_keep=a.lazy_save_local_keep,
        lazy_save_peer_replica=a.lazy_save_peer_replica,
        lazy_save_peer_replica_mb=a.lazy_save_peer_replica_mb,
        lazy_save_wait_persistent=a.lazy_save_wait_persistent,
        lazy_save_on_training_thread=a.lazy_save_on_training_thread,
        lazy_save_checksum_threads=a.lazy_save_checksum_threads,
        keep_last_n_checkpoints=a.keep_last_n_checkpoints,
        save_retain_interval=a.save_retain_interval,
        non_persistent_save_interval=(None if a.non_persistent_save_interval == "auto"
                                      else a.non_persistent_save_interval),
        non_persistent_save_interval_auto=a.non_persistent_save_interval == "auto",
        non_persistent_ckpt_type=a.non_persistent_ckpt_type,
        keep_last_n_non_persistent=a.keep_last_n_non_persistent or 1,
        non_persistent_global_ckpt_dir=a.non_persistent_global_ckpt_dir,
        non_persistent_local_ckpt_dir=a.non_persistent_local_ckpt_dir,
        ckpt_fully_parallel_save=a.ckpt_fully_parallel_save,
        ckpt_assume_constant_structure=a.ckpt_assume_constant_structure,
        ckpt_fully_parallel_load=a.ckpt_fully_parallel_load,
        ckpt_failure_policy=CkptFailurePolicy(a.ckpt_failure_policy),
        ckpt_verify_replicas=a.ckpt_verify_replicas,
        ckpt_fallback_to_previous=a.ckpt_fallback_to_previous,
        dist_ckpt_strictness=a.dist_ckpt_strictness,
        allow_unsafe_pickle=a.allow_unsafe_pickle,
        ckpt_drain_timeout=a.ckpt_drain_timeout,
        universal_checkpoint_interval=a.universal_checkpoint_interval,
        universal_save=a.universal_save, keep_last_n_universal=a.keep_last_n_universal,
        universal_merge_workers=a.universal_merge_workers)
    data = DataConfig(
        mock_data=a.mock_data, data_path=tuple(a.data_path or ()), split=a.split,
        train_data_path=tuple(a.train_data_path or ()),
        valid_data_path=tuple(a.valid_data_path or ()),
        test_data_path=tuple(a.test_data_path or ()),
        tokenizer_type=a.tokenizer_type, vocab_size=a.vocab_size, vocab_file=a.vocab_file,
        merge_file=a.merge_file, tokenizer_model=a.tokenizer_model,
        make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
        data_cache_path=a.data_cache_path, mmap_bin_files=a.mmap_bin_files)
    return RunConfig(model=model, parallel=parallel, optimizer=optimizer, training=training,
                     checkpoint=checkpoint, data=data,
                     logging=_logging_config(a))
