"""Writing safetensors files at disk speed: reader threads feed the writing thread.

Why not `safetensors.torch.save_file`: it serializes a whole file's tensors after all of them were
read (reads and writes never overlap) and leaves every byte dirty in the page cache until the
final fsync (measured: 8.7 s of a 11.9 s merge of 1 GiB in `serialize_file`, docs/UNIVERSAL.md).
Here the header is written first (every tensor's dtype and shape is known from the plan), then:

  reader threads  (one; `readers` where the source may be read concurrently, so one thread
                  checksums while another waits for the disk) read each tensor from the source
                  (`read(entry, out)`, into a page-aligned buffer reused from tensor to tensor:
                  no page faults on fresh memory), compute the CRC-32C of its chunks (the C
                  function drops the GIL) and hand it over in file order; at most `queue_bytes`
                  are read and not yet written (one tensor larger than that goes alone);
  writing thread  (the caller) appends each tensor's bytes to the file (`sink.Sink`: O_DIRECT
                  through one aligned staging buffer where the file system takes it, else the
                  page cache with early writeback), so the disk writes while the next tensor is
                  read, and fsyncs each file at its end.

The files are safetensors as the library writes them: an 8-byte little-endian header length, a
JSON header (``__metadata__`` and, per tensor, dtype, shape and data_offsets) padded with spaces
(the format's padding), then the tensors' bytes back to back; within a file tensors are ordered
by decreasing item size, then name, so every tensor is aligned to its item size. The header is
padded to end on a page boundary (the library pads to 8 bytes; both are valid safetensors): the
data then starts page-aligned, and a tensor whose predecessors fill whole pages is written with
O_DIRECT straight from its read buffer, with no staging copy (`sink.Sink.write`).
"""
from __future__ import annotations

import json
import struct
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..buffers import BufferPool
from ..errors import CheckpointError
from .format import Entry
from .objects import DTYPE_NAMES
from .sink import ALIGN, Sink
from .tensor_files import chunk_checksums, tensor_bytes

QUEUE_BYTES = 256 << 20
Read = Callable[[Entry, torch.Tensor], torch.Tensor]  # (entry, buffer it may fill) -> tensor
Written = Callable[[Entry], None]  # after each tensor's bytes are written


def file_order(entries: Sequence[Entry]) -> List[Entry]:
    """The order of a file's tensors: larger item sizes first (alignment), then by name."""
    return sorted(entries, key=lambda e: (-e.dtype.itemsize, e.name))


def header_bytes(entries: Sequence[Entry], metadata: Dict[str, str], align: int = 8) -> bytes:
    """The safetensors header (length prefix included) of a file holding `entries` in order,
    padded with spaces to a multiple of `align` bytes (a multiple of 8)."""
    doc: Dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for e in entries:
        doc[e.name] = {"dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                       "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % align)
    return struct.pack("<Q", len(raw)) + raw


class _Pipeline:
    """Tensors between the reader threads and the writing thread, in file order.

    Reader threads take tensor indices in turn (`claim`: index i is claimed only after i - 1, and
    only while the bytes claimed and not yet written stay within `limit`; one tensor larger than
    that goes alone), read and checksum them in parallel, and `put` each result under its index;
    the writing thread `get`s them in order. Claiming in order means the tensor the writer waits
    for always has its bytes: no deadlock however the threads interleave."""

    def __init__(self, sizes: Sequence[int], limit: int):
        self.sizes, self.limit = sizes, limit
        self.used, self.next, self.stopped = 0, 0, False
        self.done: Dict[int, object] = {}
        self.cond = threading.Condition()

    def claim(self) -> Optional[int]:
        """The next index to read, its bytes counted; None when every index is claimed or the
        pipeline stopped."""
        with self.cond:
            while True:
                if self.stopped or self.next >= len(self.sizes):
                    return None
                n = self.sizes[self.next]
                if not self.used or self.used + n <= self.limit:
                    i, self.next = self.next, self.next + 1
                    self.used += n
                    self.cond.notify_all()
                    return i
                self.cond.wait()

    def put(self, i: int, item: object) -> None:
        with self.cond:
            self.done[i] = item
            self.cond.notify_all()

    def get(self, i: int) -> object:
        with self.cond:
            while i not in self.done:
                self.cond.wait()
            return self.done.pop(i)

    def written(self, nbytes: int) -> None:
        with self.cond:
            self.used -= nbytes
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


def _checked(read: Read, e: Entry, out: torch.Tensor, directory: str) -> torch.Tensor:
    t = read(e, out)
    if tuple(t.shape) != e.shape or t.dtype != e.dtype:
        raise CheckpointError(f"read {t.dtype}{list(t.shape)}, metadata says "
                              f"{e.dtype}{list(e.shape)}", file=directory, tensor=e.source_key)
    return t.contiguous()


def write_files(files: Sequence[Tuple[str, Sequence[Entry]]], read: Read, *, directory: str,
                metadata: Dict[str, str], chunk_bytes: int, written: Optional[Written] = None,
                after_file: Optional[Callable[[int], None]] = None,
                queue_bytes: int = QUEUE_BYTES, direct: bool = True,
                readers: int = 1) -> Dict[str, List[int]]:
    """Write each ``(path, entries)`` of `files` as one safetensors file, fsynced, reading the
    tensors with `read` on `readers` other threads (`directory` names the source in errors;
    more than one only where `read` may run concurrently). Returns every tensor's chunk
    checksums by name. `after_file(i)` runs after file i is durable."""
    plan = [(path, file_order(entries)) for path, entries in files]
    order = [e for _, entries in plan for e in entries]
    pipe = _Pipeline([e.nbytes for e in order], queue_bytes)
    pool = BufferPool(keep_bytes=queue_bytes)

    def produce() -> None:
        while (i := pipe.claim()) is not None:
            e = order[i]
            try:
                lease = pool.take(e.nbytes)
                out = lease[:e.nbytes].view(e.dtype).view(e.shape)
                t = _checked(read, e, out, directory)
                if t.data_ptr() != out.data_ptr() or not e.nbytes:
                    lease = None  # the source gave a tensor of its own
                del out
                pipe.put(i, (t, chunk_checksums(tensor_bytes(t), chunk_bytes), lease))
            except BaseException as err:  # handed to the writing thread, which raises it
                pipe.put(i, err)
                return

    threads = [threading.Thread(target=produce, name=f"universal-merge-reader-{k}", daemon=True)
               for k in range(max(1, readers))]
    for th in threads:
        th.start()
    crcs: Dict[str, List[int]] = {}
    try:
        first = 0
        for i, (path, entries) in enumerate(plan):
            _write_one(path, entries, first, pipe, pool, crcs, metadata, written, direct)
            first += len(entries)
            if after_file is not None:
                after_file(i)
    finally:
        pipe.stop()
        for th in threads:
            th.join()
    return crcs


def _write_one(path: str, entries: List[Entry], first: int, pipe: _Pipeline, pool: BufferPool,
               crcs: Dict[str, List[int]], metadata: Dict[str, str],
               written: Optional[Written], direct: bool) -> None:
    """File `path` from the pipeline's tensors `first`, `first` + 1, ... (`entries`)."""
    sink = Sink(path, direct=direct)
    try:
        header = header_bytes(entries, metadata, align=ALIGN if sink.direct else 8)
        sink.write(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        for k, e in enumerate(entries, first):
            item = pipe.get(k)
            if isinstance(item, BaseException):
                raise item
            t, crc, lease = item
            sink.write(t.reshape(-1).view(torch.uint8) if t.numel() else
                       torch.empty(0, dtype=torch.uint8))
            crcs[e.name] = crc
            del item, t
            if lease is not None:
                pool.give(lease)
            pipe.written(e.nbytes)
            if written is not None:
                written(e)
        sink.close()
    finally:
        sink.abort()


def throttle(max_bytes_per_s: Optional[float], t0: float) -> Callable[[int], None]:
    """A callback that sleeps so that `done` bytes take at least done / max_bytes_per_s
    seconds since `t0` (no-op without a limit)."""

    def wait(done: int) -> None:
        if max_bytes_per_s:
            ahead = done / max_bytes_per_s - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)

    return wait
