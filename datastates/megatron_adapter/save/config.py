"""What a `LazyCheckpointer` is configured with: `LazySaveConfig` (one frozen dataclass, checked
when made) and `FailurePolicy`. The trainer builds it from its flags
(`megatron.training.checkpointing.lazy.lazy_save_config`); nothing here reads `argv`."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from ...config import Checksum
from .plan import StructurePolicy

__all__ = ["FailurePolicy", "LazySaveConfig"]


class FailurePolicy(str, enum.Enum):
    """What a failed save (full disk, I/O error, hung writer) does to the run."""

    STOP = "stop"          # raise the agreed error on every rank
    CONTINUE = "continue"  # warn, and train on without further checkpoints


@dataclass(frozen=True)
class LazySaveConfig:
    """Settings of one rank's `LazyCheckpointer`; a contradiction raises ValueError when it is
    made."""

    root: str
    """The --save directory (Megatron layout: iter_XXXXXXX/ and the tracker)."""
    cache_bytes: int = 1 << 30
    """Host cache per rank (the engine's bounded buffer)."""
    checksum: Checksum = Checksum.CRC32C
    """Per-chunk checksum, verified on every load."""
    drain_timeout_s: float = 1800.0
    """Longest single wait on the writers before it is reported as a hung writer."""
    failure_policy: FailurePolicy = FailurePolicy.STOP
    """What an agreed save failure does (see FailurePolicy)."""
    run_config_json: Optional[str] = None
    """Written to ROOT/run_config.json beside the tracker when it changed (None: not written)."""
    universal_every_n: Optional[int] = None
    """Merge every N-th committed checkpoint into a universal one, in the background (None: off)."""
    universal_root: Optional[str] = None
    """Root of the universal checkpoints (None: ROOT/universal)."""
    universal_workers: int = 1
    """Merge worker processes (`merge.background.MergerConfig.workers`)."""
    background_nice: int = 5
    """Niceness added to the engines' writer (and migration) threads. Copy threads keep their
    priority, and so do the in-memory level's writers: they checksum what its next save waits
    for."""
    local_dir: Optional[str] = None
    """Node-local directory of this rank (e.g. NVMe): shards become durable there first, then
    migrate in the background to ROOT; a version commits only once every rank's shards are
    durable in ROOT. None: written to ROOT directly."""
    fully_parallel_save: bool = True
    """Spread the writes of replicated shards over the data-parallel group (megatron's
    FullyParallelSaveStrategyWrapper); False: the first data-parallel rank writes them."""
    local_keep: int = 2
    """With `local_dir`: local copies kept (newest first); older ones are removed after each
    commit, never one still migrating nor the newest committed one."""
    structure_policy: StructurePolicy = StructurePolicy.CHECK
    """When megatron-core's validation and shard distribution are reused (`plan.py`): CHECK
    compares a structural fingerprint every save; ASSUME_CONSTANT
    (--ckpt-assume-constant-structure) validates the first save only."""
    peer_replica_bytes: Optional[int] = None
    """With `local_dir`: after each commit, send this rank's files to the next node of a ring,
    holding at most this many bytes of one version per rank (`peer_replica`); None: off. With
    `non_persistent_in_memory`: the in-memory versions are replicated instead, the newest
    complete one whenever the previous transfer is done (latest wins)."""
    non_persistent_root: Optional[str] = None
    """A second root that saves may name (Megatron-LM's non-persistent checkpoints): prepared at
    start-up, committed and tracked like `root`, never merged to universal."""
    non_persistent_node_local: bool = False
    """`non_persistent_root` is this rank's node-local directory (Megatron-LM's `local` type):
    its versions stay on each node, each rank writes all it holds, each node's leader commits
    its node (`node_local`)."""
    non_persistent_keep: int = 1
    """Complete versions `after_commit`'s retention keeps under `non_persistent_root`
    (--keep-last-n-non-persistent): in memory, each rank's engine keeps a reusable shard file for
    each of them and for the one being written (`in_memory.versions_held`)."""

    verify_replicas_every: Optional[int] = None
    """--ckpt-verify-replicas: every this many saves (counted over both lanes), the
    data-parallel replicas of each tensor are compared before the version commits
    (`replica_check`); None: never."""

    non_persistent_in_memory: bool = False
    """The node-local versions are in memory (Megatron-LM's `in_memory` type, a tmpfs such as
    /dev/shm): their engine copies each tensor straight into the shard file's pages
    (`WriteMode.MAPPED`: one copy, no host cache); with CUDA, those pages are registered for DMA,
    and where that fails (`cuda_dma_probe`) the copy goes through the pinned host cache."""

    checksum_threads: Optional[int] = None
    """Threads per rank that checksum the in-memory level's versions (its engine's writers: the
    copies land in the shard files' pages, and a version commits, which the level's next save
    waits for, once every piece is checksummed). None: where the copies land by DMA (CUDA), as
    many as keep pace with the copy (`checksum.threads_for_device_copies`); else one, which has
    nothing to do where the copy thread checksums as it copies (CPU tensors, `copycrc`)."""

    offload_steady_saves: bool = True
    """Steady saves (their lane's structure unchanged in the previous save, as every rank
    agreed) run on the save worker (`offload.SaveWorker`), during the next
    forward/backward, from what `save_built`'s caller captured in its call; the training thread
    joins it before the optimizer step (and an in-memory version's agreement and commit, which
    the worker makes during that step, at the next save call). False: every save runs in its
    call."""

    def __post_init__(self) -> None:
        if self.cache_bytes <= 0:
            raise ValueError(f"cache_bytes must be positive, found {self.cache_bytes}")
        if self.local_keep < 1:
            raise ValueError(f"local_keep must be >= 1, found {self.local_keep}")
        if self.non_persistent_keep < 1:
            raise ValueError(f"non_persistent_keep must be >= 1, found {self.non_persistent_keep}")
        if self.peer_replica_bytes is not None and self.local_dir is None and \
                not self.non_persistent_in_memory:
            raise ValueError("peer replicas are held in the node-local directory or in the "
                             "in-memory level: set local_dir or non_persistent_in_memory")
        if self.non_persistent_node_local and self.non_persistent_root is None:
            raise ValueError("non_persistent_node_local needs non_persistent_root")
        if self.non_persistent_in_memory and not self.non_persistent_node_local:
            raise ValueError("non_persistent_in_memory needs non_persistent_node_local")
        if self.verify_replicas_every is not None and self.verify_replicas_every <= 0:
            raise ValueError(f"verify_replicas_every must be positive, found "
                             f"{self.verify_replicas_every}")
        if self.checksum_threads is not None and self.checksum_threads < 1:
            raise ValueError(f"checksum_threads must be >= 1, found {self.checksum_threads}")
        if self.universal_every_n is not None and self.universal_every_n <= 0:
            raise ValueError(f"universal_every_n must be positive, found {self.universal_every_n}")
