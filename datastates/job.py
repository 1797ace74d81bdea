"""What one save is: its handle for the caller and the state its threads share."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from .errors import CheckpointError
from .flatten import TensorEntry
from .telemetry import SaveRecord


@dataclass(eq=False)
class SaveHandle:
    """Identifies one `save` call; pass it to `wait_for_durable` / `wait_for_commit`."""

    id: int
    step: int
    directory: str


@dataclass(eq=False)
class SaveJob:
    """Bookkeeping of one save; fields change under the engine's lock."""

    handle: SaveHandle
    entries: List[TensorEntry]
    skeleton: Any
    shard_path: str
    fd: int
    dfd: int  # O_DIRECT descriptor of the same file, or -1
    file_offsets: List[int]
    total_bytes: int
    t_start: float
    ready_events: Dict[Any, Any] = field(default_factory=dict)
    chunks: List[List[List[int]]] = field(default_factory=list)  # per entry: [off, nbytes, crc]
    write_dir: str = ""  # where the shard is written: the version directory or its local copy
    t_local: Optional[float] = None  # when the local copy became durable (level 3)
    entries_copied: int = 0
    inflight: int = 0  # pieces handed to writers and not yet processed
    bytes_written: int = 0
    t_copied: Optional[float] = None
    t_first_write: Optional[float] = None
    blocked_s: float = 0.0
    peak_cache: int = 0
    error: Optional[CheckpointError] = None
    finalizing: bool = False
    done: bool = False
    record: Optional[SaveRecord] = None
    reported: bool = False
    mapped: bool = False  # WriteMode.MAPPED: copies land in `mapping`, the shard file's pages
    mapping: Any = None  # a uint8 tensor over the shared mapping of the shard file
    copier: Any = None  # the Copier into `mapping`
    files_open: bool = False  # the shard file is made and open (`CheckpointEngine._open_files`)
    files_lock: Any = field(default_factory=threading.Lock)  # the writers' first write makes it

    @property
    def copied(self) -> bool:
        return self.entries_copied == len(self.entries) or self.error is not None


#: Big tensors start on a page boundary (O_DIRECT needs aligned file offsets and buffers).
FILE_ALIGN = 4096
#: Tensors up to this size are packed, 64-byte aligned, into shared blocks: one cache block, one
#: write and one queue hand-off per block instead of per tensor (models have many small tensors).
SMALL_TENSOR_BYTES = 256 * 1024
SMALL_ALIGN = 64


class Segment(NamedTuple):
    """Part of a cache block: bytes [offset, offset + nbytes) of tensor `entry`, at `pos` in the
    block; `crc` is their CRC-32C when the copy computed it (else the writer does)."""

    entry: int
    offset: int
    nbytes: int
    pos: int
    crc: Optional[int] = None


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def is_small(nbytes: int, max_block: int) -> bool:
    """Whether a tensor is packed with others (else it is streamed alone, in pieces)."""
    return nbytes <= min(SMALL_TENSOR_BYTES, max_block)


def plan_layout(entries: List[TensorEntry], max_block: int) -> Tuple[List[int], List[List[int]]]:
    """File offset of every tensor, and the copy groups: a big tensor alone, or a run of small
    tensors laid out contiguously (a block of at most `max_block` bytes starting on a page)."""
    offsets: List[int] = []
    groups: List[List[int]] = []
    off = 0
    bundle: List[int] = []
    for i, e in enumerate(entries):
        if is_small(e.nbytes, max_block):
            pos = _align(off, SMALL_ALIGN)
            if bundle and pos + e.nbytes - offsets[bundle[0]] > max_block:
                groups.append(bundle)
                bundle = []
            if not bundle:
                pos = _align(off, FILE_ALIGN)
            bundle.append(i)
        else:
            if bundle:
                groups.append(bundle)
                bundle = []
            pos = _align(off, FILE_ALIGN)
            groups.append([i])
        offsets.append(pos)
        off = pos + e.nbytes
    if bundle:
        groups.append(bundle)
    return offsets, groups
