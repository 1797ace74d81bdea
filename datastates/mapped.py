"""`WriteMode.MAPPED`: shard files that the copy threads write into through a shared mapping.

On a memory file system (tmpfs, /dev/shm) the shard file's pages are the level itself, so each
byte is copied once, from the live tensor into them. What a fresh file costs, though, is more than
the copy: for 280 MB on our 2-core VMs, reserving it (posix_fallocate: allocating and zeroing
pages) took ~65 ms, the first copy through a new mapping ~125 ms (a page fault per 4 KiB page),
removing it later ~50 ms, against ~27 ms for the same copy into pages already mapped.

So an engine given a slot directory keeps its shard files' inodes, and their mappings, alive in
a pool of slots (`SlotPool`): a save's shard file is a hard link to a slot, and a slot is free
again once no version directory links it any more (its link count is 1: whoever removes old
versions, e.g. retention, has removed that one). Nothing has to be told when a version goes, and
the bytes of a version that still exists are never written again. The pool holds at most
`capacity` slots; a save that finds none free then gets a file of its own.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

__all__ = ["MappedShard", "SlotPool", "map_new_file"]


class MappedShard:
    """A shard file's shared mapping, with what `Copier` and the writers' checksum need of a
    host cache: `buffer`, `view`, `memview`."""

    def __init__(self, mapping: torch.Tensor):
        self.buffer = mapping

    def view(self, start: int, nbytes: int) -> torch.Tensor:
        return self.buffer[start:start + nbytes]

    def memview(self, start: int, nbytes: int) -> memoryview:
        return memoryview(self.buffer.numpy()[start:start + nbytes])


def map_new_file(path: str, size: int) -> Tuple[int, Optional[torch.Tensor]]:
    """(write descriptor, shared mapping) of a new file at `path` of `size` bytes, its space
    reserved first (a full tmpfs fails here, not as SIGBUS in a copy); no mapping when empty."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        return fd, _reserve_and_map(fd, path, size)
    except BaseException:
        os.close(fd)
        raise


def _reserve_and_map(fd: int, path: str, size: int) -> Optional[torch.Tensor]:
    """The file of `fd` (at `path`) reserved to `size` bytes and mapped shared; None if empty."""
    if size == 0:
        return None
    os.posix_fallocate(fd, 0, size)
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


@dataclass
class _Slot:
    path: str
    size: int
    mapping: Optional[torch.Tensor]


class SlotPool:
    """One rank's reusable shard files under `directory` (on the same file system as the version
    directories: a shard file is a hard link to a slot)."""

    def __init__(self, directory: str, rank: int, capacity: int):
        self.directory, self.rank, self.capacity = directory, rank, capacity
        self.slots: List[_Slot] = []
        os.makedirs(directory, exist_ok=True)
        prefix = self._prefix()
        for name in os.listdir(directory):  # an earlier process's: only our links go
            if name.startswith(prefix):
                os.unlink(os.path.join(directory, name))

    def _prefix(self) -> str:
        return f"r{self.rank:05d}-"

    def take(self, shard_path: str, size: int) -> Optional[Tuple[int, Optional[torch.Tensor]]]:
        """A file at `shard_path` of `size` bytes, mapped: a free slot linked there (a new slot
        while the pool has room), as (write descriptor, mapping); None when every slot is still
        linked from a version and the pool is full."""
        free = [s for s in self.slots if os.stat(s.path).st_nlink == 1]
        slot = next((s for s in free if s.size == size), free[0] if free else None)
        if slot is None:
            if len(self.slots) >= self.capacity:
                return None
            path = os.path.join(self.directory, f"{self._prefix()}{len(self.slots)}.bin")
            fd, mapping = map_new_file(path, size)
            os.close(fd)
            slot = _Slot(path, size, mapping)
            self.slots.append(slot)
        elif slot.size != size:  # another shard layout: resized, mapped anew
            slot.mapping = None
            with open(slot.path, "r+b") as f:
                os.ftruncate(f.fileno(), size)
                slot.mapping = _reserve_and_map(f.fileno(), slot.path, size)
            slot.size = size
        if os.path.lexists(shard_path):
            os.unlink(shard_path)
        os.link(slot.path, shard_path)
        return os.open(shard_path, os.O_WRONLY), slot.mapping

    def close(self) -> None:
        """Drop the mappings and the pool's links (the versions keep theirs)."""
        for s in self.slots:
            s.mapping = None
            try:
                os.unlink(s.path)
            except OSError as err:
                logger.info("DataStates: could not remove slot %s: %s", s.path, err)
        self.slots = []
