"""Per-chunk checksums: which algorithms exist, their names in an index, how to compute them.

The writer thread checksums every byte it writes, while training runs on the same cores, so the
algorithm's speed is the engine's largest CPU cost after the copy itself. Measured on one core of
our 2-core machines (256 MiB buffers): zlib.crc32 3.7 GB/s, crc32c (SSE4.2 instruction) 17.9 GB/s.
CRC-32C (Castagnoli) is also the checksum storage systems use for the same job (iSCSI, ext4 and
Btrfs metadata, cloud object stores). Both functions release the GIL on large buffers.
"""
from __future__ import annotations

import zlib
from typing import Callable

from .config import Checksum
from .errors import CheckpointError

__all__ = ["ChecksumFn", "DEVICE_COPY_THREADS", "NAMES", "from_name", "function",
           "threads_for_device_copies"]

#: Name recorded in each index (the "checksum" field) for each algorithm.
NAMES = {Checksum.CRC32C: "crc32c", Checksum.CRC32: "zlib-crc32", Checksum.NONE: "none"}
_BY_NAME = {v: k for k, v in NAMES.items()}

ChecksumFn = Callable[[memoryview], int]


def _crc32c() -> ChecksumFn:
    try:
        import crc32c  # hardware CRC32C where the CPU has it, slicing-by-8 otherwise
    except ImportError as e:
        raise CheckpointError("the crc32c checksum needs the 'crc32c' package (pip install "
                              "crc32c; it is in requirements.txt), which is not installed: "
                              f"{e}") from e
    return crc32c.crc32c


def function(kind: Checksum) -> ChecksumFn:
    """The function computing `kind` over a buffer (0 for Checksum.NONE)."""
    if kind is Checksum.CRC32C:
        return _crc32c()
    if kind is Checksum.CRC32:
        return zlib.crc32
    return lambda _buf: 0


def from_name(name: object, **where) -> Checksum:
    """The algorithm an index names; CheckpointError (with `where`: rank, file) if unknown."""
    if name not in _BY_NAME:
        raise CheckpointError(f"unknown checksum algorithm {name!r}: expected one of "
                              f"{sorted(_BY_NAME)}", **where)
    return _BY_NAME[name]


#: Most checksum threads `threads_for_device_copies` gives one rank.
DEVICE_COPY_THREADS = 4


def threads_for_device_copies(cpus: int, ranks_on_node: int) -> int:
    """Checksum threads per rank for an engine whose copies land by DMA (CUDA) and whose writers
    checksum each piece after it lands (the in-memory level's: nothing else is left for them to
    do). One thread sets the pace otherwise: CRC-32C runs at 11-18 GB/s on one core (11-12 on
    the AMD EPYC of our 2-core VMs, 2026-12-07; 17.9 on the earlier ones), a device-to-host
    copy at 40.5 GB/s (the H200, docs/GPU.md), so one thread checksums a 1.31 GB version in
    75-120 ms where its copy takes 32 ms, and an iteration 45 ms. Four keep up; never more
    than half of this rank's share of the `cpus` it may run on (its training thread, data
    loading and the node's other ranks keep the rest), at least one."""
    return max(1, min(DEVICE_COPY_THREADS, cpus // max(1, ranks_on_node) // 2))
