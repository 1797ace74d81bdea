"""Page-aligned host buffers, reused.

Why: a merge or conversion reads gigabytes through buffers of a few MiB to a few hundred MiB.
A fresh `torch.empty` of that size is a fresh mmap: the kernel zeroes every page on its first
touch and unmaps it again on free (page faults and `clear_page` were ~12% of a merge's CPU,
`perf`, docs/UNIVERSAL.md). A buffer taken from a pool is already mapped. Page alignment (of the
start and of the capacity) is what O_DIRECT reads and writes need.
"""
from __future__ import annotations

import mmap
import threading
from typing import List

import torch

PAGE = 4096


def round_up(n: int, align: int = PAGE) -> int:
    return -(-n // align) * align


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` rounded up to the page, on its own anonymous mapping (page
    aligned, storage offset 0: some torch functions, e.g. `set_rng_state`, misread views that
    start inside their storage). Unmapped when the tensor is freed."""
    return torch.frombuffer(mmap.mmap(-1, round_up(max(nbytes, 1))), dtype=torch.uint8)


class BufferPool:
    """Free page-aligned buffers, handed out by `take(nbytes)` (the smallest free one that is
    large enough, else a new one) and returned by `give(buf)` once nothing reads them. At most
    `keep_bytes` are kept free; the largest go first beyond that. Thread-safe."""

    def __init__(self, keep_bytes: int = 512 << 20):
        self.keep_bytes = keep_bytes
        self._free: List[torch.Tensor] = []
        self._free_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A page-aligned uint8 buffer of at least `nbytes`, rounded up to the page (its
        contents are undefined)."""
        need = round_up(max(nbytes, 1))
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if need <= b.numel() <= 2 * need]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                self._free_bytes -= buf.numel()
                return buf
        return aligned_empty(need)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer that `take` handed out; the caller keeps no view of it."""
        with self._lock:
            self._free.append(buf)
            self._free_bytes += buf.numel()
            while self._free_bytes > self.keep_bytes and self._free:
                big = self._free.pop(max(range(len(self._free)),
                                         key=lambda i: self._free[i].numel()))
                self._free_bytes -= big.numel()
