"""How bytes move from live tensors into the host cache (level 1).

A tensor is cut into pieces of at most `max_bytes`, in row-major order, without ever
materializing a contiguous copy of a non-contiguous tensor: concatenating the pieces' bytes gives
exactly the bytes of `tensor.contiguous()`.
"""
from __future__ import annotations

import collections
import ctypes
from typing import Callable, Deque, Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

from . import copycrc
from .cache import HostCache


def iter_pieces(t: torch.Tensor, max_bytes: int, byte_offset: int = 0
                ) -> Iterator[Tuple[torch.Tensor, int]]:
    """Yield (view, byte offset in the row-major byte image of `t`) covering `t` in order."""
    esize = t.element_size()
    nbytes = t.numel() * esize
    if nbytes == 0:
        return
    if nbytes <= max_bytes:
        yield t, byte_offset
        return
    if t.is_contiguous() or t.dim() == 1:
        flat = t.reshape(-1) if t.is_contiguous() else t  # a 1-d strided view stays a view
        step = max(1, max_bytes // esize)
        for e0 in range(0, flat.numel(), step):
            yield flat[e0:e0 + step], byte_offset + e0 * esize
        return
    row_bytes = nbytes // t.shape[0]
    rows = max_bytes // row_bytes
    if rows >= 1:
        for r0 in range(0, t.shape[0], rows):
            yield t[r0:r0 + rows], byte_offset + r0 * row_bytes
        return
    for r in range(t.shape[0]):  # one row is bigger than a piece: recurse into it
        yield from iter_pieces(t[r], max_bytes, byte_offset + r * row_bytes)


class Copier:
    """Copies one piece into a cache block. On CUDA the copy runs on a dedicated stream that first
    waits for the work the caller had queued when it called save; an event per piece tells when
    the bytes are on the host.

    With `crc32c=True` (and the `copycrc` library built), a contiguous CPU piece is copied and
    checksummed in one pass, and `issue` returns the piece's CRC-32C; otherwise None, and the
    writer checksums the cached bytes."""

    def __init__(self, cache: HostCache, crc32c: bool = False):
        self.cache = cache
        self._base = cache.buffer.data_ptr()
        self._streams = {}
        self.fused = crc32c and copycrc.available

    def _stream(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = torch.cuda.Stream(device=device)
            self._streams[device] = s
        return s

    def issue(self, piece: torch.Tensor, start: int,
              ready_event: Optional["torch.cuda.Event"] = None
              ) -> Tuple[Optional[int], Optional["torch.cuda.Event"]]:
        """Start copying `piece` to cache offset `start`: (its CRC-32C if computed on the way,
        an event that completes once the bytes are on the host, or None when they already
        are). A CUDA piece's copy is only queued on the copy stream: its source must stay alive
        and its bytes unread until the event completes (`InFlight`)."""
        nbytes = piece.numel() * piece.element_size()
        if not piece.is_cuda and piece.is_contiguous():
            # No OpenMP team (see below), ~1 us of overhead per tensor, and ctypes drops the GIL
            # for the call.
            if self.fused:
                return copycrc.copy_crc32c(self._base + start, piece.data_ptr(), nbytes), None
            ctypes.memmove(self._base + start, piece.data_ptr(), nbytes)
            return None, None
        dst = self.cache.view(start, nbytes).view(piece.dtype).view(piece.shape)
        if piece.is_cuda:
            stream = self._stream(piece.device)
            with torch.cuda.stream(stream):
                if ready_event is not None:
                    stream.wait_event(ready_event)
                dst.copy_(piece, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(stream)
            return None, landed
        # numpy's copy is single-threaded and drops the GIL. torch's copy_ would start an
        # OpenMP team from this thread whose spin-waiting competes with training on few cores.
        np.copyto(_as_numpy(dst), _as_numpy(piece), casting="no")
        return None, None


class InFlight:
    """Copies issued but not yet landed, in issue order, each with what runs once it has landed
    (hand the bytes to a writer; count a tensor as copied and drop the reference to it) or failed.

    A copy thread that waited for each device-to-host copy before issuing the next left the copy
    engine idle while it woke up, handed the piece over and issued the next one, per piece and,
    in a bundle, per small tensor. Here up to `depth` landing events are outstanding: the thread
    waits for the oldest only when one more would exceed that, or when `drain` is called (before
    it blocks on anything else, e.g. host cache space, which only handed-over pieces free). An
    entry without events (a CPU copy is done when issued) runs as soon as every entry before it
    has."""

    def __init__(self, depth: int):
        self.depth = depth
        self._q: Deque[Tuple[Sequence, Callable[[], None], Callable[[BaseException], None]]] = \
            collections.deque()
        self._events = 0

    def add(self, events: Sequence, landed: Callable[[], None],
            failed: Optional[Callable[[BaseException], None]]) -> None:
        """`landed()` once every event of `events` has completed (at once if there are none and
        nothing is pending); `failed(error)` first if waiting for one raised, then `landed()`
        all the same (it hands over or frees what the copy used). `failed` may be None only
        without events."""
        self._q.append((events, landed, failed))
        self._events += len(events)
        while self._q and (not self._q[0][0] or self._events > self.depth):
            self._pop()

    def drain(self) -> None:
        while self._q:
            self._pop()

    def _pop(self) -> None:
        events, landed, failed = self._q.popleft()
        self._events -= len(events)
        try:
            for ev in events:
                ev.synchronize()
        except Exception as e:  # noqa: BLE001 - reported through `failed`, then handed on
            failed(e)
        landed()


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of `t`'s bytes, reinterpreted as an integer type of the same element size
    (numpy has no bfloat16; a bit-exact copy needs no arithmetic type)."""
    size = t.element_size()
    if size in _SAME_SIZE_INT:
        t = t.view(_SAME_SIZE_INT[size])
    return t.numpy()
