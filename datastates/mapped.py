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

With CUDA, the slots' pages are registered with the driver (`cudaHostRegister`) when a slot is
mapped, so that a device-to-host copy lands in them by DMA, as into pinned memory, and the level
still holds each byte once; without that a copy into pageable pages is staged through a driver
buffer. `cuda_dma_probe` tells at start whether the file system's pages can be registered (a
failure there falls back to the pinned host cache, one line saying why). A file of its own, when
every slot is taken, is not registered (registering costs more than it saves for one copy).
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from .devices import use_device

logger = logging.getLogger(__name__)

__all__ = ["MappedShard", "SlotPool", "cuda_dma_probe", "map_new_file"]

_PROBE_BYTES = 1 << 16

#: cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the one
#: current where it was registered; neither mapped into the device's address space nor read-only.
_REGISTER_PORTABLE = 1


def _own_thread(fn: Callable[[], int]) -> int:
    """`fn()` run in a thread of its own, on the caller's current CUDA device. The CUDA runtime
    keeps a failed call's error as that host thread's "last error", and torch's next kernel-launch
    check in the same thread would raise it against an unrelated kernel; a failed registration
    stays in the thread that made it. (A new thread's current device is device 0: `devices`.)"""
    out: List = []
    device = torch.cuda.current_device()

    def run() -> None:
        try:
            use_device(device)
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out.append(e)

    t = threading.Thread(target=run, name="datastates-cuda-register")
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _cuda_register(mapping: torch.Tensor) -> Optional[str]:
    """Pin `mapping`'s pages for DMA; None when done, else what failed."""
    ptr, size = mapping.data_ptr(), mapping.numel()
    cudart = torch.cuda.cudart()
    err = _own_thread(lambda: int(cudart.cudaHostRegister(ptr, size, _REGISTER_PORTABLE)))
    return None if err == 0 else f"cudaHostRegister returned cudaError {err}"


def _cuda_unregister(mapping: torch.Tensor) -> None:
    """Undo `_cuda_register` (before the mapping goes: the driver would keep the pages pinned)."""
    ptr = mapping.data_ptr()
    cudart = torch.cuda.cudart()
    err = _own_thread(lambda: int(cudart.cudaHostUnregister(ptr)))
    if err != 0:
        logger.info("DataStates: cudaHostUnregister returned cudaError %d for a slot", err)


def cuda_dma_probe(directory: str) -> Optional[str]:
    """Whether a device-to-host copy can land in registered pages of files under `directory`:
    a small file there is mapped, registered, copied into from the device and read back.
    None when it works; otherwise the reason, for the caller's one line."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    path = os.path.join(directory, f".dma-probe-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        fd, mapping = map_new_file(path, _PROBE_BYTES)
        os.close(fd)
        try:
            failed = _cuda_register(mapping)
            if failed is not None:
                return failed
            try:
                src = torch.arange(_PROBE_BYTES, device="cuda").remainder(251).to(torch.uint8)
                mapping.copy_(src, non_blocking=True)
                torch.cuda.current_stream().synchronize()
                if not torch.equal(mapping, src.cpu()):
                    return "a device-to-host copy into the registered pages read back wrong"
            finally:
                _cuda_unregister(mapping)
        finally:
            os.unlink(path)
    except (OSError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None



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
    registered: bool = False


class SlotPool:
    """One rank's reusable shard files under `directory` (on the same file system as the version
    directories: a shard file is a hard link to a slot). With `register_with_cuda`, each slot's
    mapping is registered with CUDA for DMA while the pool maps it."""

    def __init__(self, directory: str, rank: int, capacity: int,
                 register_with_cuda: bool = False):
        self.directory, self.rank, self.capacity = directory, rank, capacity
        self.register_with_cuda = register_with_cuda
        self._register_failed = False  # said once; that slot's copies are staged by the driver
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
            self._register(slot)
        elif slot.size != size:  # another shard layout: resized, mapped anew
            self._release(slot)
            with open(slot.path, "r+b") as f:
                os.ftruncate(f.fileno(), size)
                slot.mapping = _reserve_and_map(f.fileno(), slot.path, size)
            slot.size = size
            self._register(slot)
        if os.path.lexists(shard_path):
            os.unlink(shard_path)
        os.link(slot.path, shard_path)
        return os.open(shard_path, os.O_WRONLY), slot.mapping

    def _register(self, slot: _Slot) -> None:
        if not self.register_with_cuda or slot.mapping is None:
            return
        failed = _cuda_register(slot.mapping)
        slot.registered = failed is None
        if failed is not None and not self._register_failed:
            self._register_failed = True
            logger.warning("DataStates: rank %d: could not register slot %s with CUDA (%s); "
                           "its device-to-host copies are staged through the driver",
                           self.rank, slot.path, failed)

    @staticmethod
    def _release(slot: _Slot) -> None:
        """Unregister and drop the slot's mapping (only while no save copies into it: the slot
        is free, or the engine is closing after its last save)."""
        if slot.registered:
            _cuda_unregister(slot.mapping)
            slot.registered = False
        slot.mapping = None

    def close(self) -> None:
        """Drop the mappings and the pool's links (the versions keep theirs)."""
        for s in self.slots:
            self._release(s)
            try:
                os.unlink(s.path)
            except OSError as err:
                logger.info("DataStates: could not remove slot %s: %s", s.path, err)
        self.slots = []
