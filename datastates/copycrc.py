"""One pass over each saved byte: copy into the host cache and CRC-32C in the same loop.

The engine's background CPU per byte saved was three passes over memory: `memmove` into the cache
(glibc's ordinary stores below its 192 MiB non-temporal threshold: each destination line is read
before it is written), `crc32c` over the cache (a second read from memory), then the O_DIRECT
write. `_copycrc.c` copies with non-temporal stores and folds each word into the chunk's CRC while
it is in a register, three interleaved CRCs per 12 KiB block. Measured on our 2-core VM (512 MiB,
one thread): memmove then crc32c 0.26-0.28 CPU-s/GB, this 0.13-0.16, the same CRC values;
prefetching the next block's pages (see `_copycrc.c`) brought 1 GiB from 0.10-0.11 to 0.075-0.086.

The C file is compiled into `datastates/_copycrc.so` by `scripts/build_copycrc.sh` (which
`scripts/setup_venv.sh` runs); it uses no Python API, so ctypes loads it on any Python version, and
drops the GIL for each call. Where it is missing or does not load (no C compiler, a CPU without
SSE4.2, another architecture), the engine keeps copying with memmove and checksumming in its
writer thread: the same bytes and the same checksums, one more pass over memory.
"""
from __future__ import annotations

import ctypes
import os

__all__ = ["available", "copy_crc32c", "library_path", "load", "unavailable_reason"]

#: Below this many bytes the copy uses ordinary stores: the bytes may still be in the cache when
#: the writer reads them, and non-temporal stores gain nothing on a few lines.
STREAM_MIN_BYTES = 64 * 1024


def library_path() -> str:
    """Where scripts/build_copycrc.sh puts the library: next to this module."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_copycrc.so")


def load(path: str):
    """The initialized C function from the library at `path`, or raise OSError saying why not."""
    lib = ctypes.CDLL(path)
    if not lib.ds_copy_crc32c_init():
        raise OSError("this CPU has no SSE4.2 crc32 instruction")
    fn = lib.ds_copy_crc32c
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
                   ctypes.c_int]
    fn.restype = ctypes.c_uint32
    return fn


def _load_default():
    try:
        return load(library_path()), None
    except OSError as e:
        return None, f"{library_path()}: {e}"


_fn, unavailable_reason = _load_default()
available = _fn is not None


def copy_crc32c(dst: int, src: int, nbytes: int, crc: int = 0) -> int:
    """Copy `nbytes` from address `src` to address `dst` (not overlapping) and return their
    CRC-32C continued from `crc` (the `crc32c` package's convention). Only when `available`."""
    return _fn(dst, src, nbytes, crc, nbytes >= STREAM_MIN_BYTES)
