"""Typed configuration of the checkpoint engine."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from .errors import CheckpointError

MiB = 1 << 20


class CommitPolicy(enum.Enum):
    """Who writes a version's commit marker."""

    #: The caller runs `try_commit(directory, world_size)` itself (e.g. from its own coordinator).
    MANUAL = "manual"
    #: The engine of rank 0 calls `try_commit` for its pending versions: on its writer thread right
    #: after its own rank marker, and again in every `poll()` / `wait_for_durable()` /
    #: `wait_for_commit()` until every rank's marker is present.
    RANK0 = "rank0"


class WriteMode(enum.Enum):
    """How shard bytes reach the file."""

    #: pwrite through the page cache (plus early writeback, see `early_writeback`).
    BUFFERED = "buffered"
    #: O_DIRECT writes straight from the page-aligned host cache: no page-cache copy, less CPU per
    #: byte. Pieces that cannot be aligned (rows of non-contiguous tensors) and filesystems
    #: without O_DIRECT (tmpfs) fall back to buffered writes.
    DIRECT = "direct"
    #: The copy threads write straight into a shared mapping of the shard file, created at its
    #: final size with its space reserved first (posix_fallocate: a full file system fails the
    #: save call, never a copy): each byte is copied once, from the live tensor into the file's
    #: pages, and the host cache is not used. Meant for memory file systems (tmpfs, /dev/shm),
    #: where those pages are the level itself (the in-memory level). CUDA tensors are copied
    #: into the mapping too: by DMA into a slot of `mapped_slot_dir` (registered with CUDA),
    #: staged by the driver into a file of its own (pageable memory).
    MAPPED = "mapped"


class Checksum(enum.Enum):
    """Checksum computed per written chunk and verified on every read."""

    #: CRC-32C (Castagnoli) with the CPU's crc32 instruction (the `crc32c` package): ~18 GB/s on
    #: one core of our 2-core machines. The default.
    CRC32C = "crc32c"
    #: zlib.crc32: ~3.7 GB/s on the same core; what versions before crc32c wrote.
    CRC32 = "crc32"
    #: No checksum (reads cannot detect corruption).
    NONE = "none"


#: Signature of `EngineConfig.write_hook`: (event, info) -> None. Events: "write" before each chunk
#: is written (info: rank, file, tensor, offset, nbytes), "fsync" before the shard file is fsync'd.
WriteHook = Callable[[str, Mapping[str, Any]], None]


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one `CheckpointEngine` (one per process / rank)."""

    rank: int = 0
    """This process's rank; names its shard, index and marker files."""

    world_size: int = 1
    """Number of ranks that write into each version directory; a version is committed only when
    every rank 0..world_size-1 has written its marker."""

    host_cache_bytes: int = 256 * MiB
    """Size of the host cache (level 1 -> level 2 staging), allocated and touched once when the
    engine is built, reused by every save, freed at close(). Pinned when CUDA is available.
    Copies wait for writers when it is full; tensors larger than it are streamed through it in
    chunks."""

    chunk_bytes: int = 64 * MiB
    """Largest piece a tensor is copied and written in (clipped to half the cache). Each piece has
    its own checksum, so a partial read verifies only what it touches."""

    copy_threads: int = 1
    """Threads copying live tensors into the cache (CPU tensors; CUDA copies are issued by the same
    threads onto one copy stream)."""

    writer_threads: int = 1
    """Threads writing cached chunks to the shard files."""

    checksum: Checksum = Checksum.CRC32C
    """Checksum per chunk; its name ("crc32c", "zlib-crc32" or "none") is recorded in each index,
    and readers verify with whichever algorithm the index names."""

    commit_policy: CommitPolicy = CommitPolicy.RANK0
    """Who writes the commit marker; see `CommitPolicy`."""

    allow_pickle: bool = False
    """Store small objects the safe JSON encoding cannot represent with pickle instead of raising.
    Readers then need allow_pickle=True as well."""

    telemetry_path: Optional[str] = None
    """If set, one JSON line per completed save (a `SaveRecord`) is appended to this file."""

    background_nice: int = 0
    """Niceness added to the engine's writer (and migration) threads (Linux), so that training
    threads win the cores when both want them. Copy threads are never lowered: the training loop
    waits for them in wait_for_snapshot. 0 leaves the priority alone."""

    local_dir: Optional[str] = None
    """Level 3: if set, each version is first written to the node-local directory
    `local_dir/<basename of the version directory>` and then migrated in the background (one extra
    thread) to the version directory given to `save`; the save counts as durable once the
    migrated copy and its rank marker are there. The local copy is kept for fast restore
    (`CheckpointReader(..., local_dir=...)`)."""

    write_mode: WriteMode = WriteMode.DIRECT
    """See `WriteMode`."""

    early_writeback: bool = True
    """Ask the kernel to start writing each chunk to disk as soon as it is in the page cache
    (Linux sync_file_range), so disk writes overlap the copy and the final fsync has little left
    to do; after the fsync the file's pages are dropped from the page cache (it is not read
    back soon)."""

    fsync: bool = True
    """fsync shard and index files before writing the rank marker. Only tests and benchmarks of
    the page cache should turn this off; a marker is a durability promise."""

    mapped_slot_dir: Optional[str] = None
    """WriteMode.MAPPED: a directory on the version directories' file system where the engine
    keeps up to `mapped_slots` shard files (inodes and mappings) for reuse: each save's shard
    is a hard link to a slot no version links any more (`datastates/mapped.py`), so its pages
    are neither allocated, faulted in nor freed again. None: a new file per save."""

    mapped_slots: int = 4
    """Slots of `mapped_slot_dir` (a save that finds none free gets a file of its own)."""

    write_hook: Optional[WriteHook] = None
    """Test hook run in the writer thread (see `WriteHook`); may sleep (throttle) or raise (fault
    injection). None in production."""

    on_durable: Optional[Callable[[Any], None]] = None
    """Called with a save's `SaveHandle` on the engine's thread as soon as that save is durable on
    this rank (rank marker written; for rank 0 under `CommitPolicy.RANK0`, commit tried), so a
    caller can commit larger units of its own without polling. Must be quick and must not call the
    engine; what it raises is logged and dropped."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise CheckpointError(f"EngineConfig: expected 0 <= rank < world_size, found "
                                  f"rank={self.rank}, world_size={self.world_size}")
        if self.host_cache_bytes < 64 * 1024:
            raise CheckpointError(f"EngineConfig: host_cache_bytes must be at least 65536, found "
                                  f"{self.host_cache_bytes}")
        if self.chunk_bytes < 4096:
            raise CheckpointError(f"EngineConfig: chunk_bytes must be at least 4096, found "
                                  f"{self.chunk_bytes}")
        if self.copy_threads < 1 or self.writer_threads < 1:
            raise CheckpointError("EngineConfig: copy_threads and writer_threads must be >= 1, "
                                  "found "
                                  f"{self.copy_threads} and {self.writer_threads}")
        if not isinstance(self.write_mode, WriteMode):
            raise CheckpointError(f"EngineConfig: write_mode must be a WriteMode, found "
                                  f"{self.write_mode!r}")
        if not isinstance(self.checksum, Checksum):
            raise CheckpointError(f"EngineConfig: checksum must be a Checksum, found "
                                  f"{self.checksum!r}")
        if not isinstance(self.commit_policy, CommitPolicy):
            raise CheckpointError(f"EngineConfig: commit_policy must be a CommitPolicy, found "
                                  f"{self.commit_policy!r}")
