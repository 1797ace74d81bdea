"""The per-rank index: what a shard file holds and how to check it.

Index document (JSON), one per rank:
  format, format_version   repeated from FORMAT.json so that an index is self-describing
  rank, world_size, step
  checksum                 "crc32c", "zlib-crc32" or "none": algorithm of the per-chunk checksums
  tensors: list of {key, dtype, shape, global_shape, global_offset, is_shard, file, offset,
                    nbytes, chunks: [[byte offset in tensor, nbytes, checksum], ...]}
           tensor i's bytes: the row-major image of its local `shape`, at
           file[offset:offset+nbytes]
  objects                  the JSON skeleton of the rank's state (see state.py); tensor leaves
                           refer to `tensors` by position
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import checksum, fileio, layout
from .errors import CheckpointError

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
    getattr(torch, "uint16", None), getattr(torch, "uint32", None),
    getattr(torch, "uint64", None)) if d is not None}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise CheckpointError(f"dtype {dtype} is not supported by the checkpoint format")
    return name


def build_index(cfg, step: int, entries, file_offsets, chunks, skeleton) -> dict:
    tensors = []
    for e, off, ch in zip(entries, file_offsets, chunks):
        tensors.append({
            "key": e.key, "dtype": dtype_name(e.dtype), "shape": list(e.shape),
            "global_shape": list(e.global_shape), "global_offset": list(e.global_offset),
            "is_shard": e.is_shard, "file": layout.shard_file(cfg.rank), "offset": off,
            "nbytes": e.nbytes, "chunks": sorted(ch)})
    return dict(layout.format_header(), rank=cfg.rank, world_size=cfg.world_size, step=step,
                checksum=checksum.NAMES[cfg.checksum], tensors=tensors, objects=skeleton)


@dataclass(frozen=True)
class ShardMeta:
    """One saved tensor (shard) as the index describes it, validated."""

    rank: int
    key: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    is_shard: bool
    path: str
    offset: int
    nbytes: int
    chunks: Tuple[Tuple[int, int, int], ...]


def _ints(v: Any, what: str, rank: int, key: str, path: str) -> Tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and x >= 0 for x in v):
        raise CheckpointError(f"index field {what} should be a list of non-negative ints, found "
                              f"{v!r}", rank=rank, file=path, tensor=key)
    return tuple(v)


def parse_tensor(doc: dict, rank: int, directory: str, index_path: str,
                 checked: Optional[Dict[str, str]] = None) -> ShardMeta:
    """One index entry, validated. `checked` caches file name -> path across the entries of an
    index, so that each distinct file is resolved (an lstat per path component) once."""
    key = doc.get("key")
    if not isinstance(key, str):
        raise CheckpointError(f"index entry without a string key: {str(doc)[:80]}", rank=rank,
                              file=index_path)
    dtype = _DTYPES.get(doc.get("dtype"))
    if dtype is None:
        raise CheckpointError(f"unknown dtype {doc.get('dtype')!r}", rank=rank, file=index_path,
                              tensor=key)
    name = doc.get("file")
    path = checked.get(name) if checked is not None and isinstance(name, str) else None
    if path is None:
        path = fileio.safe_join(directory, name, rank=rank)
        if checked is not None:
            checked[name] = path
    shape = _ints(doc.get("shape"), "shape", rank, key, index_path)
    gshape = _ints(doc.get("global_shape"), "global_shape", rank, key, index_path)
    goff = _ints(doc.get("global_offset"), "global_offset", rank, key, index_path)
    nbytes = doc.get("nbytes")
    esize = torch.empty((), dtype=dtype).element_size()
    if (len(gshape) != len(shape) or len(goff) != len(shape)
            or any(o + s > g for o, s, g in zip(goff, shape, gshape))
            or nbytes != math.prod(shape) * esize):
        raise CheckpointError(f"inconsistent index entry: shape {shape}, global shape {gshape}, "
                              f"offset {goff}, nbytes {nbytes}", rank=rank, file=index_path,
                              tensor=key)
    offset = doc.get("offset")
    if not isinstance(offset, int) or offset < 0:
        raise CheckpointError(f"index field offset should be a non-negative int, found {offset!r}",
                              rank=rank, file=index_path, tensor=key)
    chunks = tuple(tuple(c) for c in doc.get("chunks", []))
    pos = 0
    for c in chunks:
        if len(c) != 3 or c[0] != pos:
            raise CheckpointError(f"chunk list does not tile the tensor at byte {pos}: {c}",
                                  rank=rank, file=index_path, tensor=key)
        pos += c[1]
    if pos != nbytes:
        raise CheckpointError(f"chunks cover {pos} bytes, tensor has {nbytes}", rank=rank,
                              file=index_path, tensor=key)
    return ShardMeta(rank, key, dtype, shape, gshape, goff, bool(doc.get("is_shard")), path,
                     offset, nbytes, chunks)


def parse_index(doc: Any, rank: int, directory: str, index_path: str) -> List[ShardMeta]:
    layout.check_format(doc, index_path, rank)
    checksum.from_name(doc.get("checksum"), rank=rank, file=index_path)
    tensors: Sequence[Any] = doc.get("tensors")
    if not isinstance(tensors, list):
        raise CheckpointError("index has no tensor list", rank=rank, file=index_path)
    checked: Dict[str, str] = {}
    return [parse_tensor(t, rank, directory, index_path, checked) for t in tensors]
