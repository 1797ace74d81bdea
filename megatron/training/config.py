"""Typed, frozen configuration of a training run. The library sees only these, never argv.

``arguments.py`` builds a ``RunConfig`` from Megatron-LM-style flags; the resolved config is saved
as JSON next to the checkpoints (``run_config.json``) so a run can be reproduced.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

#: Megatron-LM's default place of `global` non-persistent checkpoints under --save / --load.
NON_PERSISTENT_SUBDIR = "non_persistent"


def shared_memory_dir(root: str, level: str) -> str:
    """A per-user directory in /dev/shm (memory that outlives the training processes, not the
    node) for the memory levels of the checkpoints of `root` (--save, or --load when loading):
    one per root, so that a new launch with the same nodes and root finds it and no other root's
    memory is ever taken for its own; `level` names the subdirectory (one per level, each with a
    {node} placeholder where the node's own directory differs)."""
    import getpass
    import hashlib
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    digest = hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:12]
    return os.path.join(base, f"datastates-{getpass.getuser()}-{digest}", level)


class SchedulerOnResume(str, enum.Enum):
    """Which learning-rate/weight-decay schedule a resumed run follows (Megatron-LM's flags)."""

    MUST_MATCH = "must_match"      # default: a checkpoint with another schedule is refused
    CHECKPOINT = "checkpoint"      # --use-checkpoint-opt_param-scheduler: keep the checkpoint's
    OVERRIDE = "override"          # --override-opt_param-scheduler: this run's flags win


#: Megatron-LM's --dist-ckpt-strictness values (megatron-core's StrictHandling), the default first.
STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
              "raise_all", "return_unexpected", "return_all", "ignore_all")
#: Those that load a checkpoint lacking some of the model's tensors (they keep their values).
LENIENT_STRICTNESS = ("log_unexpected", "log_all", "return_unexpected", "return_all",
                      "ignore_all")


class CkptFormat(str, enum.Enum):
    """On-disk checkpoint format (``--ckpt-format``)."""

    TORCH_DIST = "torch_dist"
    TORCH = "torch"


class CkptFailurePolicy(str, enum.Enum):
    """What training does when a checkpoint cannot be saved (``--ckpt-failure-policy``)."""

    STOP = "stop"
    """Stop: every rank raises the error (exit status 2 from pretrain_gpt.py). Default."""
    CONTINUE = "continue"
    """Warn once and keep training with checkpointing switched off for the rest of the run (no
    further saves, no retry: a full disk rarely frees itself, and retrying would cost a stall
    per iteration). Earlier complete checkpoints stay loadable."""


class PositionEmbeddingType(str, enum.Enum):
    """How token positions enter the model (``--position-embedding-type``)."""

    LEARNED_ABSOLUTE = "learned_absolute"
    """A learned table of max_position_embeddings vectors added to the word embeddings (GPT-2)."""
    ROPE = "rope"
    """Rotary embeddings applied to queries and keys in every layer (Llama); no table."""


class Normalization(str, enum.Enum):
    """Norm of every transformer layer and of the final norm (``--normalization``)."""

    LAYER_NORM = "LayerNorm"
    RMS_NORM = "RMSNorm"


class RecomputeGranularity(str, enum.Enum):
    """Activation recomputation (``--recompute-granularity``), megatron-core's names."""

    FULL = "full"
    """Keep only each recomputed layer's input; rerun the whole layer in the backward pass."""
    SELECTIVE = "selective"
    """Recompute only the core attention (softmax and its inputs), the memory-heavy part."""


class RecomputeMethod(str, enum.Enum):
    """Which layers full recomputation covers (``--recompute-method``)."""

    UNIFORM = "uniform"
    """Split each stage's layers into chunks of recompute_num_layers; keep each chunk's input."""
    BLOCK = "block"
    """Recompute the first recompute_num_layers layers of each pipeline stage, keep the rest."""


class LrDecayStyle(str, enum.Enum):
    """Learning-rate decay after warm-up (``--lr-decay-style``), as OptimizerParamScheduler names it."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"
    INVERSE_SQUARE_ROOT = "inverse-square-root"


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    """Number of transformer layers (all pipeline stages together)."""
    hidden_size: int
    """Width of the residual stream."""
    num_attention_heads: int
    """Attention heads per layer; divisible by the tensor-parallel size."""
    ffn_hidden_size: int
    """Width of the MLP; when not given 4 * hidden_size, or with swiglu
    int((4 * hidden_size * 2 / 3) / 64) * 64 (Megatron-LM's rule: about the same parameters)."""
    seq_length: int
    """Tokens per sample."""
    max_position_embeddings: int
    """Size of the learned position-embedding table; at least seq_length (seq_length when not
    given). Unused by rope, which has no table."""
    vocab_size: int
    """Tokenizer vocabulary (eod included), before padding."""
    padded_vocab_size: int
    """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by * TP, as Megatron does."""
    hidden_dropout: float = 0.1
    """Dropout after attention and MLP."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    init_method_std: float = 0.02
    """Std of the normal initialisation of weight matrices."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weights instead of reusing the word embeddings."""
    bf16: bool = False
    """Run the model in bfloat16 with fp32 main parameters in the optimizer."""
    fp16: bool = False
    """Run the model in float16 with fp32 main parameters and loss scaling (see OptimizerConfig)."""
    position_embedding_type: PositionEmbeddingType = PositionEmbeddingType.LEARNED_ABSOLUTE
    """Learned absolute positions (GPT-2) or rotary embeddings (Llama)."""
    rotary_base: int = 10000
    """Base of the rotary embedding frequencies (rope only)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary embeddings rotate (rope only)."""
    normalization: Normalization = Normalization.LAYER_NORM
    """LayerNorm (GPT-2) or RMSNorm (Llama) in every layer and as the final norm."""
    apply_layernorm_1p: bool = False
    """Zero-centered norm weights (Megatron-LM's --apply-layernorm-1p): each norm scales by
    1 + weight, the weight starting at 0; checkpoints and universal checkpoints store the weight,
    a Hugging Face export adds the 1."""
    norm_epsilon: float = 1e-5
    """Epsilon of every norm."""
    swiglu: bool = False
    """Gated MLP with SiLU: fc1 produces two halves, silu(first) * second goes into fc2."""
    num_query_groups: Optional[int] = None
    """Key/value heads of grouped-query attention, each shared by num_attention_heads /
    num_query_groups query heads; None: plain multi-head attention (one per query head)."""
    add_bias_linear: bool = True
    """Biases in every linear layer (attention qkv and projection, both MLP layers)."""
    recompute_granularity: Optional[RecomputeGranularity] = None
    """Activation recomputation; None keeps every activation for the backward pass."""
    recompute_method: Optional[RecomputeMethod] = None
    """Which layers full recomputation covers (required with full, None with selective)."""
    recompute_num_layers: Optional[int] = None
    """Layers per recomputed chunk (uniform) or recomputed layers per stage (block)."""
    attention_backend: str = "auto"
    """Megatron-LM's --attention-backend: transformer-engine's attention kernels on a GPU
    (auto, flash, fused, unfused; megatron-core sets TE's switches), or local: megatron-core's
    own attention, the local layer spec (always so without CUDA and TE)."""
    cross_entropy_fusion: Optional[str] = None
    """Megatron-LM's --cross-entropy-loss-fusion with its --cross-entropy-fusion-impl: "native"
    (megatron-core's fused vocabulary-parallel cross entropy) or "te"; None: not fused."""
    calculate_per_token_loss: bool = False
    """Normalise the loss by the tokens of the global batch: megatron-core's schedule sums the
    micro-batches' token losses and scales the gradients by the total tokens after the
    data-parallel reduction, instead of averaging per micro-batch."""

    @property
    def query_groups(self) -> int:
        """Key/value heads as megatron-core counts them (one per query head without GQA)."""
        return self.num_query_groups or self.num_attention_heads


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Ranks that split each layer's matrices (TP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages (PP)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline stage for the interleaved schedule (VPP); None = not interleaved."""
    sequence_parallel: bool = False
    """Split layer-norm and dropout activations along the sequence over the TP ranks."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over the data-parallel ranks (ZeRO-1)."""
    overlap_grad_reduce: bool = False
    """Reduce each bucket of gradients over the data-parallel ranks as soon as backward has made
    it, overlapping backward (Megatron-LM's --overlap-grad-reduce)."""
    overlap_param_gather: bool = False
    """With the distributed optimizer: all-gather the updated parameters during the next forward
    pass, bucket by bucket, instead of in the optimizer step (--overlap-param-gather). A
    checkpoint or a validation gathers them first (`model.params_gathered`)."""
    grad_reduce_in_bf16: bool = False
    """With bf16: gradients are accumulated and reduced over the data-parallel ranks in bf16
    instead of fp32 (Megatron-LM's --grad-reduce-in-bf16)."""
    ddp_bucket_size: Optional[int] = None
    """Gradient bucket size in elements with overlap_grad_reduce; None: megatron-core's
    default, max(40M, 1M * data-parallel size)."""
    distributed_timeout_minutes: int = 10
    """How long a collective of the training's process groups may wait before it fails
    (Megatron-LM's --distributed-timeout-minutes); checkpointing's own collectives have theirs
    (--ckpt-drain-timeout)."""
    world_size: int = 1
    """Total ranks; data-parallel size = world_size / (TP * PP)."""
    decoder_first_pipeline_num_layers: Optional[int] = None
    """Layers on the first pipeline stage (uneven split); None = even split."""
    decoder_last_pipeline_num_layers: Optional[int] = None
    """Layers on the last pipeline stage (uneven split); None = even split."""

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    def stage_layers(self, num_layers: int) -> list:
        """Layers per pipeline stage (Megatron-LM's rule): the first/last stage counts when given,
        the remaining layers split evenly over the other stages."""
        pp = self.pipeline_model_parallel_size
        first, last = self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        if pp == 1:
            return [num_layers]
        fixed = [x for x in (first, last) if x is not None]
        per = (num_layers - sum(fixed)) // (pp - len(fixed)) if pp > len(fixed) else 0
        return [per if first is None else first] + [per] * (pp - 2) + [per if last is None else last]


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_decay_style: LrDecayStyle = LrDecayStyle.LINEAR
    """Shape of the decay after warm-up."""
    lr_warmup_iters: int = 0
    """Iterations of linear warm-up from 0 to lr."""
    lr_warmup_fraction: Optional[float] = None
    """Warm-up as a fraction of the decay length (Megatron-LM's --lr-warmup-fraction); when set,
    lr_warmup_iters is 0."""
    decoupled_lr: Optional[float] = None
    """Peak learning rate of the word embeddings and the output layer (their own parameter
    group, Megatron-LM's --decoupled-lr); None: --lr."""
    decoupled_min_lr: Optional[float] = None
    """With decoupled_lr: their final learning rate; None: --min-lr."""
    lr_warmup_samples: int = 0
    """With train_samples: samples of linear warm-up (Megatron-LM's --lr-warmup-samples)."""
    lr_decay_samples: Optional[int] = None
    """With train_samples: samples over which lr decays; train_samples when not given."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which lr decays; train_iters when not given."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    scheduler_on_resume: SchedulerOnResume = SchedulerOnResume.MUST_MATCH
    """Which schedule a resumed run follows when the checkpoint's differs from this run's."""
    loss_scale: Optional[float] = None
    """Static loss scale (fp16 or bf16); None: dynamic loss scaling with fp16, none with bf16."""
    initial_loss_scale: float = 2.0 ** 32
    """Dynamic loss scaling (fp16): the scale the run starts from."""
    min_loss_scale: float = 1.0
    """Dynamic loss scaling (fp16): the scale never drops below this."""
    loss_scale_window: float = 1000
    """Dynamic loss scaling (fp16): iterations without overflow before the scale doubles."""
    hysteresis: int = 2
    """Dynamic loss scaling (fp16): overflows tolerated before the scale halves."""


@dataclass(frozen=True)
class TrainingConfig:
    micro_batch_size: int
    """Samples per forward/backward on one data-parallel rank."""
    global_batch_size: int
    """Samples per optimizer step over all data-parallel ranks."""
    train_iters: int
    """Optimizer steps of the whole run (train_samples // global_batch_size with train_samples)."""
    train_samples: Optional[int] = None
    """Samples of the whole run for Megatron-LM's sample-based training (--train-samples): the
    learning-rate schedule then counts in the samples flags; None: iteration-based."""
    rampup_batch_size: Optional[Tuple[int, int, int]] = None
    """Megatron-LM's --rampup-batch-size (start, increment, samples): the global batch grows from
    start by increment, evenly over the first `samples` samples, up to global_batch_size
    (megatron-core's calculator gives each iteration's; sample-based training only)."""
    decrease_batch_size_if_needed: bool = False
    """Megatron-LM's: where global_batch_size is not a multiple of micro_batch_size times the
    data-parallel size, each iteration runs the largest multiple below it (megatron-core's
    calculator's running batch) and the rest counts as skipped samples."""
    iterations_to_skip: Tuple[int, ...] = ()
    """Megatron-LM's --iterations-to-skip: where this many iterations are done, the next one's
    batch is read past without a forward/backward or an optimizer step (no log line, save or
    validation for it), counted as consumed and skipped samples."""
    seed: int = 1234
    """Seed of python, numpy, torch and the tensor-parallel RNG tracker."""
    eval_interval: int = 1000
    """Run validation every this many iterations (0 disables)."""
    eval_iters: int = 100
    """Batches per validation."""
    exit_interval: Optional[int] = None
    """Stop (after saving if --save is set) when the iteration is a multiple of this."""
    exit_duration_in_mins: Optional[float] = None
    """Stop (after saving if --save is set) at the end of the first iteration that ends more than
    this many minutes after the job started (the earliest rank's start, as Megatron-LM counts)."""
    exit_signal_handler: bool = False
    """On `exit_signal`: save a checkpoint at the end of the current iteration and exit 0."""
    exit_signal: str = "SIGTERM"
    """The signal's name (Megatron-LM's --exit-signal), e.g. SIGUSR1 for Slurm's --signal."""
    manual_gc: bool = False
    """Python's automatic garbage collection is off while training; it runs at the points below,
    the same iterations on every rank (Megatron-LM's --manual-gc)."""
    manual_gc_interval: int = 0
    """With manual_gc: a collection every this many iterations (0: none between iterations)."""
    manual_gc_eval: bool = True
    """With manual_gc: a collection before and after each validation."""
    empty_unused_memory_level: int = 0
    """Megatron-LM's: on a GPU, torch.cuda.empty_cache() after each forward/backward and
    validation batch (1), and after each optimizer step too (2); 0: never."""

    def num_microbatches(self, data_parallel_size: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    """Directory to save checkpoints in (None: never save)."""
    load: Optional[str] = None
    """Directory to resume from (None: start from scratch)."""
    save_interval: Optional[int] = None
    """Save every this many iterations."""
    save_interval_auto: bool = False
    """--save-interval auto: the interval follows measured checkpoint costs and `mtbf_hours`."""
    mtbf_hours: Optional[float] = None
    """The job's mean time between failures (hours), for --save-interval auto."""
    ckpt_format: CkptFormat = CkptFormat.TORCH_DIST
    """On-disk format."""
    async_save: bool = False
    """Write torch_dist checkpoints in the background (megatron-core AsyncCallsQueue)."""
    save_optim: bool = True
    """Include the optimizer and scheduler state."""
    load_optim: bool = True
    """Restore the optimizer and scheduler state."""
    save_rng: bool = True
    """Include python/numpy/torch/TP-tracker RNG states."""
    load_rng: bool = True
    """Restore the RNG states."""
    finetune: bool = False
    """Load weights only; start at iteration 0 with fresh optimizer, scheduler and RNG."""
    ckpt_convert_format: Optional[CkptFormat] = None
    """Megatron-LM's --ckpt-convert-format: save the loaded checkpoint in this format under
    `ckpt_convert_save` and end the run without training."""
    ckpt_convert_save: Optional[str] = None
    """Where the converted checkpoint goes (as ``<ckpt_convert_save>/<format>/``)."""
    pretrained_checkpoint: Optional[str] = None
    """Megatron-LM's: where `load` (with its levels) holds nothing to resume, fine-tune from this
    checkpoint (as `finetune`)."""
    exit_on_missing_checkpoint: bool = False
    """With `load`: an error instead of starting from scratch when it holds nothing to load."""
    ckpt_step: Optional[int] = None
    """Load this iteration under `load` instead of the one its tracker names (Megatron-LM's
    --ckpt-step: a rollback); the non-persistent level is not read."""
    async_lazy_save: bool = False
    """Save with DataStates: the snapshot is copied while the next forward/backward runs, written
    by background threads, and committed once every rank's shards are durable."""
    lazy_save_cache_mb: Optional[int] = None
    """Size of the DataStates host cache per rank, MiB (bounded; larger tensors stream through).
    None: sized at start-up from this rank's checkpoint (`checkpointing.lazy.size_host_cache`)."""
    lazy_save_checksum: str = "crc32c"
    """Per-chunk checksum of DataStates shards: "crc32c" (CPU instruction, ~5x cheaper than
    zlib's crc32 here), "crc32" (zlib) or "none" (reads cannot detect corruption)."""
    lazy_save_local_dir: Optional[str] = None
    """Node-local directory (placeholders {node}, {rank}, {local_rank}, {host}): shards become
    durable there first and migrate to --save in the background; --load prefers an intact local
    copy of a rank's shards. None: written to --save directly."""
    lazy_save_local_keep: int = 2
    """Local copies kept under lazy_save_local_dir (newest first; never one still migrating nor
    the newest committed one)."""
    lazy_save_peer_replica: bool = False
    """Hold every rank's shards of the newest committed checkpoint on its node (the local dir)
    and on the next node of a ring; restore from there before --save."""
    lazy_save_peer_replica_mb: Optional[int] = None
    """MiB one rank may hold of one checkpoint (own shards + the replica it receives); None:
    twice this rank's checkpoint bound."""
    lazy_save_wait_persistent: bool = False
    """With a node-local non-persistent level: a persistent save that falls due while the
    previous one is still in flight waits in line (False: it is deferred, latest wins)."""
    lazy_save_on_training_thread: bool = False
    """Every lazy save's work is made in its save call, on the training thread (False: a save
    whose structure every rank found unchanged is made by the save worker during the next
    forward/backward, `LazySaveConfig.offload_steady_saves`)."""
    lazy_save_checksum_threads: Optional[int] = None
    """Threads per rank checksumming each in-memory version as its copies land
    (`LazySaveConfig.checksum_threads`); None: as many as keep pace with a device-to-host copy
    on GPUs, one on CPU."""
    ckpt_fully_parallel_save: bool = True
    """Spread the writes of replicated shards over the data-parallel group (Megatron-LM's
    default); False: the first data-parallel rank writes them."""
    ckpt_assume_constant_structure: bool = False
    """Megatron-LM's flag: the sharded structure never changes, so only the first save is
    validated and later ones reuse its plan unchecked (without it, --async-lazy-save reuses a
    plan only while a structural fingerprint is unchanged on every rank)."""
    ckpt_fully_parallel_load: bool = False
    """Each data-parallel rank reads part of the replicated shards and they exchange the rest
    (megatron-core's FullyParallelLoadStrategyWrapper; CUDA only)."""
    keep_last_n_checkpoints: Optional[int] = None
    """Keep only the newest N complete checkpoints under --save (None: keep all)."""
    save_retain_interval: Optional[int] = None
    """Megatron-LM's --save-retain-interval: the checkpoints of iterations that are multiples of
    it are kept; of the others, the newest (keep_last_n_checkpoints of them, default 1) go once a
    newer one is complete. A persistent save due at a retained iteration is never deferred."""
    non_persistent_save_interval: Optional[int] = None
    """Megatron-LM's non-persistent checkpoints: also save every this many iterations (where no
    persistent save is due) under `non_persistent_root`, which keeps the newest
    `keep_last_n_non_persistent`."""
    keep_last_n_non_persistent: int = 1
    """Complete non-persistent checkpoints kept, newest first (Megatron-LM keeps one). In memory
    the level holds one more: the version being written."""
    non_persistent_save_interval_auto: bool = False
    """--non-persistent-save-interval auto (the default under --save-interval auto when a
    non-persistent type is given): the level's interval follows its own measured cost."""
    non_persistent_ckpt_type: Optional[str] = None
    """"global" (a second root on the shared file system), "local" (each node's own storage,
    --async-lazy-save only), "in_memory" (each node's shared memory, /dev/shm: survives a crash
    of the training processes, not of the node; --async-lazy-save only) or None, as Megatron-LM's
    types; with it set, --load resumes from the non-persistent root when it is at least as
    new."""
    non_persistent_global_ckpt_dir: Optional[str] = None
    """Root of the global non-persistent checkpoints (None: <save>/non_persistent, and
    <load>/non_persistent when loading, as Megatron-LM)."""
    non_persistent_local_ckpt_dir: Optional[str] = None
    """Root of the local non-persistent checkpoints on each node (placeholders {node}, {rank},
    {local_rank}, {host}, expanded per rank: `datastates.megatron_adapter.expand_local_dir`)."""
    ckpt_failure_policy: CkptFailurePolicy = CkptFailurePolicy.STOP
    """What to do when a save fails on any rank (full disk, I/O error, hung writer); see
    CkptFailurePolicy. Applies to --async-lazy-save."""
    ckpt_verify_replicas: Optional[int] = None
    """--ckpt-verify-replicas: every this many saves, the data-parallel replicas of each tensor
    are compared before the version commits (None: never)."""
    dist_ckpt_strictness: str = STRICTNESS[0]
    """Megatron-LM's --dist-ckpt-strictness (a `STRICTNESS` value): what a torch_dist or DataStates
    load does with tensors the model has and the checkpoint lacks ("unexpected") or the
    checkpoint has and the model lacks ("missing"); see `LENIENT_STRICTNESS`."""
    ckpt_fallback_to_previous: bool = False
    """When the newest complete checkpoint is damaged, verify and load the newest older one that
    is intact instead of failing (every checksum of each candidate is read first)."""
    allow_unsafe_pickle: bool = False
    """Read pickles in a checkpoint that name arbitrary code (legacy files you trust). Off: --load
    reads every file without running code and refuses such a pickle, naming file and object."""
    ckpt_drain_timeout: float = 1800.0
    """Seconds any single wait on the background checkpoint writers may take (snapshot wait before
    the optimizer step, durability wait, drain at exit) before it is reported as a hung writer."""
    universal_checkpoint_interval: Optional[int] = None
    """Merge every N-th committed --async-lazy-save checkpoint into a universal checkpoint, in a
    separate low-priority process while training continues (None: never)."""
    universal_merge_workers: int = 1
    """Merge worker processes (persistent, started once per run on rank 0); each writes its share
    of the tensors' files, the manifest is committed once every part is durable."""
    universal_save: Optional[str] = None
    """Root of the merged universal checkpoints (None: <save>/universal); --load it to resume at
    any TP/PP/DP."""
    keep_last_n_universal: Optional[int] = None
    """Keep only the newest N universal checkpoints under the universal root (None: keep all);
    one that a merge or a converter still reads is kept until it is done."""

    def non_persistent_root(self, base: Optional[str]) -> Optional[str]:
        """Where non-persistent checkpoints of the root `base` (--save or --load) live; None when
        they are off or there is no such root. For the local type: the template of the node-local
        root (expanded per rank by the caller)."""
        if self.non_persistent_ckpt_type is None:
            return None
        if self.non_persistent_ckpt_type == "local":
            return self.non_persistent_local_ckpt_dir
        if self.non_persistent_ckpt_type == "in_memory":
            # One directory per node (several "nodes" may share one machine's /dev/shm).
            return None if base is None else shared_memory_dir(base, "in_memory/node{node}")
        if self.non_persistent_global_ckpt_dir or base is None:
            return self.non_persistent_global_ckpt_dir
        return os.path.join(base, NON_PERSISTENT_SUBDIR)

    @property
    def non_persistent_node_local(self) -> bool:
        """Whether non-persistent versions stay on each node ("local" and "in_memory"): every
        rank writes all it holds, each node's leader commits its node, and a resume takes them
        only at the same layout, when every node holds the same newest one."""
        return self.non_persistent_ckpt_type in ("local", "in_memory")

    def non_persistent_save_root(self) -> Optional[str]:
        """Where this run saves non-persistent checkpoints (None: it does not)."""
        if not (self.save and (self.non_persistent_save_interval
                               or self.non_persistent_save_interval_auto)):
            return None
        return self.non_persistent_root(self.save)


@dataclass(frozen=True)
class DataConfig:
    mock_data: bool = False
    """Use megatron-core's synthetic mock dataset."""
    data_path: tuple = ()
    """Megatron blend: either prefixes, or alternating weight and prefix."""
    split: str = "969,30,1"
    """Train/valid/test proportions of each dataset."""
    train_data_path: tuple = ()
    """Megatron-LM's per-split data: the train split's own blend (then `data_path` is empty)."""
    valid_data_path: tuple = ()
    """The validation split's own blend (empty: no validation data)."""
    test_data_path: tuple = ()
    """The test split's own blend (empty: none)."""
    tokenizer_type: str = "NullTokenizer"
    """Offline tokenizer, see megatron.training.tokenizer."""
    vocab_size: Optional[int] = None
    """For NullTokenizer: number of ids in the text (eod gets id vocab_size)."""
    vocab_file: Optional[str] = None
    """For GPT2BPETokenizer: GPT-2's vocab.json."""
    merge_file: Optional[str] = None
    """For GPT2BPETokenizer: GPT-2's merges.txt."""
    tokenizer_model: Optional[str] = None
    """For HuggingFaceTokenizer: the local directory of its files."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times TP."""
    data_cache_path: Optional[str] = None
    """Where megatron-core caches the datasets' sample indices (None: next to the data)."""
    mmap_bin_files: bool = True
    """Memory-map the .bin files (Megatron-LM's default; --no-mmap-bin-files reads them)."""


@dataclass(frozen=True)
class LoggingConfig:
    """What the run reports and where: the log line, TensorBoard, Weights & Biases (Megatron-LM's
    logging flags). Scalars are written by the rank that prints the training line (the last one)
    and, for committed checkpoints, by rank 0 (see `metrics`)."""

    log_interval: int = 100
    """Print a training line every this many iterations."""
    log_throughput: bool = False
    """Add `throughput per GPU (TFLOP/s/GPU)` to the training line (Megatron-LM's FLOP count)."""
    log_progress: bool = False
    """Megatron-LM's --log-progress: append job starts, persistent saves and deletions to
    <save>/progress.txt (`checkpointing.progress`)."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard event files here (None: no TensorBoard)."""
    tensorboard_log_interval: int = 1
    """Write the training scalars every this many iterations."""
    tensorboard_queue_size: int = 1000
    """Events a TensorBoard writer queues before it writes them out."""
    log_timers_to_tensorboard: bool = False
    """Also write iteration-time, throughput and the checkpoint save/load times."""
    log_loss_scale_to_tensorboard: bool = True
    """Write the loss scale (1.0 unless a loss scaler is in use)."""
    log_validation_ppl_to_tensorboard: bool = False
    """Also write the validation perplexity."""
    log_memory_to_tensorboard: bool = False
    """Write the CUDA caching allocator's memory counters (nothing on a CPU run)."""
    wandb_project: Optional[str] = None
    """Log the same scalars to this Weights & Biases project (None: no wandb)."""
    wandb_exp_name: Optional[str] = None
    """Name of the wandb run (required with wandb_project)."""
    wandb_save_dir: Optional[str] = None
    """Local directory of the wandb files; None: <save>/wandb."""
    profile: bool = False
    """Megatron-LM's --profile: iterations profile_step_start..profile_step_end are profiled, for
    nsys (cudaProfilerStart/Stop) or, with use_pytorch_profiler, by torch's profiler."""
    use_pytorch_profiler: bool = False
    """torch.profiler instead of nsys: a chrome trace per rank in
    <tensorboard_dir>/../torch_profile/rank-R.json.gz (Megatron-LM's place)."""
    profile_step_start: int = 10
    """First profiled iteration."""
    profile_step_end: int = 12
    """Profiling stops once this iteration is done."""
    profile_ranks: tuple = ()
    """Global ranks that profile; empty: every rank."""
    pytorch_profiler_collect_shapes: bool = False
    """Record operator input shapes (torch's profiler)."""
    pytorch_profiler_collect_callstack: bool = False
    """Record Python call stacks (torch's profiler)."""

    @property
    def writes_scalars(self) -> bool:
        return self.tensorboard_dir is not None or self.wandb_project is not None


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, resolved; saved as run_config.json next to the checkpoints."""

    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    data: DataConfig
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_json(self) -> str:
        """The config as JSON; encoded once per instance (every field is frozen), since every
        checkpoint saves it (~0.4 ms on our VMs)."""
        cached = self.__dict__.get("_json")
        if cached is None:
            def encode(obj):
                if isinstance(obj, enum.Enum):
                    return obj.value
                raise TypeError(f"cannot encode {type(obj).__name__}")

            cached = json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True,
                                default=encode)
            object.__setattr__(self, "_json", cached)  # not a field: eq, hash, replace ignore it
        return cached
