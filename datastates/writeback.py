"""Kernel page-cache hints for shard files (Linux; no-ops where unavailable)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start asynchronous writeback of a just-written range; returns without waiting. ctypes
    drops the GIL for the call. Durability still comes from the fsync before the marker."""
    if _sync_file_range is not None:
        if _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sync_file_range: {os.strerror(err)}")


def drop_cached(fd: int) -> None:
    """Drop the (already fsync'd) file's clean pages: a checkpoint is not read back soon, and
    keeping it cached would push the training job's own pages out."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
