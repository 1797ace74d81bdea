"""The tensor files of a universal checkpoint: per-chunk checksums, and boxes read verified.

Integrity (manifest fields, written by `writer.write_universal` and `upgrade_universal`):
    ``checksum``: {"algorithm": "crc32c", "chunk_bytes": 1048576}
    ``tensors.<name>.crc32c``: the CRC-32C of each ``chunk_bytes`` piece of the tensor's bytes
        (row-major, as safetensors stores them; the last piece may be shorter)
A box is verified chunk by chunk: a reader checks only the chunks that hold bytes of the box it
reads, each chunk once per open checkpoint. Why per chunk rather than per tensor: a resharded load
reads boxes (a PP stage's layers, a TP slice) through memory-mapped slices and touches only their
pages; a per-tensor checksum would make every rank read every whole tensor it has a part of. With
1 MiB chunks a box split along its leading dimensions costs at most one chunk more on each side of
each contiguous run of bytes; a slice of the last dimension (row-parallel weights) checks the rows
it spans, pages the kernel's readahead brings in anyway.

Reading: each file is memory-mapped once; its safetensors header is parsed here, so a file that
is truncated, or whose header disagrees with the manifest (missing tensor, other dtype or shape),
is refused naming file and tensor before a byte of data is touched (touching bytes past the end of
a truncated mapped file would kill the process with SIGBUS).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from typing import List, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointError
from ..fileio import open_confined
from .objects import DTYPE_BY_NAME, DTYPE_NAMES

__all__ = ["CHECKSUM_ALGORITHM", "CHUNK_BYTES", "TensorFile", "box_chunks",
           "check_checksum_list", "checksum_fields", "chunk_checksums", "crc32c", "tensor_bytes",
           "verify_chunks"]

CHECKSUM_ALGORITHM = "crc32c"
CHUNK_BYTES = 1 << 20
#: safetensors refuses headers larger than this; so do we (a damaged length must not make us
#: read gigabytes of "header").
_MAX_HEADER = 100 << 20
#: A box made of more contiguous runs than this is checked over the chunks between its first and
#: last byte (cheaper to compute; such boxes touch nearly every chunk of that range anyway).
_MAX_RUNS = 1 << 20


def crc32c(data) -> int:
    """CRC-32C of a buffer (the engine's implementation: the CPU instruction where there is one)."""
    return _crc_fn()(data)


def checksum_fields(chunk_bytes: int = CHUNK_BYTES) -> dict:
    """The manifest's ``checksum`` object."""
    return {"algorithm": CHECKSUM_ALGORITHM, "chunk_bytes": chunk_bytes}


def chunk_checksums(data: memoryview, chunk_bytes: int = CHUNK_BYTES) -> List[int]:
    """CRC-32C of each `chunk_bytes` piece of `data` (a tensor's bytes)."""
    fn = _crc_fn()
    return [fn(data[i:i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes safetensors writes for `t` (row-major, native little-endian)."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _crc_fn():
    from ..checksum import Checksum, function

    return function(Checksum.CRC32C)


def box_chunks(shape: Sequence[int], itemsize: int, offset: Sequence[int],
               box: Sequence[int], chunk_bytes: int) -> List[int]:
    """Indices of the `chunk_bytes` chunks of a row-major tensor of `shape` that hold any byte of
    the box at `offset` with shape `box` (ascending)."""
    nbytes = itemsize
    for s in shape:
        nbytes *= s
    if nbytes == 0 or any(b == 0 for b in box):
        return []
    nchunks = -(-nbytes // chunk_bytes)
    strides = [itemsize] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    # Dimensions after the last partial one are whole: each run of contiguous bytes spans them.
    partial = [i for i in range(len(shape)) if box[i] != shape[i]]
    if not partial:
        return list(range(nchunks))
    k = partial[-1]
    run = box[k] * strides[k]
    starts = torch.tensor([sum(o * s for o, s in zip(offset, strides))], dtype=torch.int64)
    runs = 1
    for b in box[:k]:
        runs *= b
    if runs > _MAX_RUNS:
        first, last = int(starts[0]) // chunk_bytes, \
            (int(starts[0]) + sum((b - 1) * s for b, s in zip(box, strides)) + itemsize - 1) \
            // chunk_bytes
        return list(range(first, last + 1))
    for i in range(k - 1, -1, -1):  # every combination of the leading indices of the box
        steps = torch.arange(box[i], dtype=torch.int64) * strides[i]
        starts = (starts[None, :] + steps[:, None]).reshape(-1)
    first, last = starts // chunk_bytes, (starts + run - 1) // chunk_bytes
    edges = torch.zeros(nchunks + 1, dtype=torch.int64)
    edges.index_add_(0, first, torch.ones_like(first))
    edges.index_add_(0, last + 1, -torch.ones_like(last))
    return torch.nonzero(torch.cumsum(edges[:-1], 0) > 0).reshape(-1).tolist()


class TensorFile:
    """One safetensors file, memory-mapped read-only, its header checked.

    Call order: `span(name, dtype, shape)` for a tensor (checks the header against what the
    manifest says), then `bytes_of` / `tensor_of` for its data; `close()` at the end."""

    def __init__(self, path: str, directory: str, what: str):
        self.path = path
        try:
            fd = open_confined(path, directory=directory, what=what)
        except OSError as e:
            raise CheckpointError(f"cannot open tensor file: {e}", file=path) from e
        try:
            self.size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise CheckpointError(f"tensor file is truncated: {self.size} bytes, too short "
                                      "for a safetensors header", file=path)
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > self.size:
                raise CheckpointError(f"tensor file is truncated or damaged: its header claims "
                                      f"{n} bytes, the file has {self.size}", file=path)
            raw = os.pread(fd, n, 8)
            # Read-only and shared, as safetensors maps its files: a private writable mapping
            # would count against strict overcommit limits for the whole file size.
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if self.size else None
        finally:
            os.close(fd)
        try:
            header = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"tensor file header is not valid JSON (damaged): {e}",
                                  file=path) from e
        if not isinstance(header, dict):
            raise CheckpointError("tensor file header is not a JSON object (damaged)", file=path)
        self._header = header
        self._data_start = 8 + n
        self._view = memoryview(self._mm) if self._mm is not None else memoryview(b"")

    def listing(self) -> dict:
        """{tensor name: (dtype name, shape)} as the header says (``__metadata__`` left out); a
        tensor of a dtype we do not know is listed with its dtype name as found."""
        return {k: (v.get("dtype"), tuple(v.get("shape") or ())) for k, v in self._header.items()
                if k != "__metadata__" and isinstance(v, dict)}

    def span(self, name: str, dtype: torch.dtype, shape: Tuple[int, ...]) -> Tuple[int, int]:
        """(start, nbytes) of tensor `name` in the file, refused unless the header holds it with
        the manifest's dtype and shape and the file holds all of its bytes."""
        entry = self._header.get(name)
        if not isinstance(entry, dict):
            raise CheckpointError("the manifest puts this tensor in this file, whose header does "
                                  "not hold it (file replaced, or manifest edited)",
                                  file=self.path, tensor=name)
        want = f"{DTYPE_NAMES.get(dtype, dtype)}{list(shape)}"
        found = f"{entry.get('dtype')}{entry.get('shape')}"
        if DTYPE_BY_NAME.get(entry.get("dtype")) != dtype or entry.get("shape") != list(shape):
            raise CheckpointError(f"the file's header says {found}, the manifest {want}; "
                                  "expected both to agree (one of them was replaced or edited)",
                                  file=self.path, tensor=name)
        offsets = entry.get("data_offsets")
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offsets)
                or offsets[1] - offsets[0] != nbytes):
            raise CheckpointError(f"the file's header gives data_offsets {offsets!r} for "
                                  f"{found}, expected a range of {nbytes} bytes (damaged)",
                                  file=self.path, tensor=name)
        start = self._data_start + offsets[0]
        if start + nbytes > self.size:
            raise CheckpointError(f"tensor file is truncated: the tensor ends at byte "
                                  f"{start + nbytes}, the file has {self.size} bytes",
                                  file=self.path, tensor=name)
        return start, nbytes

    def bytes_of(self, start: int, nbytes: int) -> memoryview:
        return self._view[start:start + nbytes]

    def tensor_of(self, start: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
        """The whole tensor as a read-only view of the mapping (no byte read until it is used;
        copy out of it, never write to it)."""
        count = dtype.itemsize
        for s in shape:
            count *= s
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            # torch warns that the mapping is read-only: callers copy out of the view, never
            # write to it (`UniversalCheckpoint.read` clones its box).
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=count, offset=start)
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        try:
            self._view.release()
            if self._mm is not None:
                self._mm.close()
        except BufferError:  # a view still lives somewhere: the GC unmaps it with the view
            pass


def verify_chunks(file: TensorFile, name: str, start: int, nbytes: int, expected: List[int],
                  chunk_bytes: int, chunks: Sequence[int]) -> None:
    """Check the CRC-32C of chunks `chunks` of the tensor at `start`; CheckpointError naming file,
    tensor, bytes, expected and found on the first mismatch."""
    fn = _crc_fn()
    for i in chunks:
        lo, hi = i * chunk_bytes, min((i + 1) * chunk_bytes, nbytes)
        found = fn(file.bytes_of(start + lo, hi - lo))
        if found != expected[i]:
            raise CheckpointError(f"checksum mismatch in bytes [{lo}, {hi}) of the tensor (file "
                                  f"offset {start + lo}): expected crc32c {expected[i]:#010x}, "
                                  f"found {found:#010x}; the file was damaged after it was "
                                  "written", file=file.path, tensor=name)


def check_checksum_list(value, name: str, nbytes: int, chunk_bytes: int,
                        manifest_path: str) -> Optional[List[int]]:
    """A tensor's ``crc32c`` list from the manifest, refused unless it has one entry per chunk."""
    if value is None:
        return None
    want = -(-nbytes // chunk_bytes)
    if (not isinstance(value, list) or len(value) != want
            or not all(isinstance(c, int) and 0 <= c < 1 << 32 for c in value)):
        raise CheckpointError(f"expected {want} crc32c values (one per {chunk_bytes}-byte chunk), "
                              f"found {len(value) if isinstance(value, list) else value!r}",
                              file=manifest_path, tensor=name)
    return value
