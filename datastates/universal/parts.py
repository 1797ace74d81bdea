"""A universal checkpoint written by several merge workers at once, committed by one.

The tensors are split among `parts` workers (`plan_parts`: whole safetensors files, balanced by
bytes; the plan depends only on the source's tensor table, so every worker, on any node that sees
the source and the output directory, computes the same one). Order:
  1) each worker k (`write_part`) writes its files into the shared temporary directory ``tmp``
     (``<dst>.tmp-<tag>``), each fsynced, then its part record ``PART-<k>.json`` (the checksums of
     its tensors), atomically (temporary file, fsync, rename, directory fsync);
  2) once every worker has reported its part, one process (`commit_parts`) checks that the
     records of all `parts` parts are there and cover every tensor, removes them, writes the
     index, the manifest and the commit marker (`writer.finish`) and renames ``tmp`` to ``dst``.
A worker killed anywhere leaves no part record, so step 2) refuses (or is never asked) and no
universal checkpoint is committed; whoever coordinates removes ``tmp`` (or the next merge into the
same destination does), and the previous universal checkpoints are untouched.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Dict, List, Optional, Tuple

from ..errors import CheckpointError
from ..fileio import atomic_write, hold_for_reading, read_confined
from .format import Entry, is_committed, shard_file_name
from .tensor_files import CHUNK_BYTES
from .writer import (DEFAULT_MAX_FILE_BYTES, MergeResult, MergeSource, encode_objects, finish,
                     group_files, publish, write_tensors)

Files = List[Tuple[str, List[Entry]]]


def part_record(tmp: str, part: int) -> str:
    return os.path.join(tmp, f"PART-{part:05d}.json")


def plan_parts(entries: List[Entry], parts: int,
               max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> List[Files]:
    """The files of each of `parts` workers: the tensors grouped into files of at most
    `max_file_bytes` and at most a `parts`-th of the total (so every worker gets some), then
    each file, largest first, given to the worker with the fewest bytes so far."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, found {parts}")
    total = sum(e.nbytes for e in entries)
    groups = group_files(entries, max(1, min(max_file_bytes, -(-total // parts))))
    names = [shard_file_name(i + 1, len(groups)) for i in range(len(groups))]
    sizes = [sum(e.nbytes for e in g) for g in groups]
    plan: List[Files] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(groups)), key=lambda i: (-sizes[i], i)):
        k = min(range(parts), key=lambda k: (load[k], k))
        plan[k].append((names[i], groups[i]))
        load[k] += sizes[i]
    for files in plan:
        files.sort()
    return plan


def write_part(source: MergeSource, tmp: str, part: int, parts: int, *,
               max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
               max_bytes_per_s: Optional[float] = None, chunk_bytes: int = CHUNK_BYTES,
               create: bool = True) -> int:
    """Step 1) for worker `part` of `parts`; returns the bytes it wrote. `create=False`: `tmp`
    must exist already (made by the coordinator; a merge it abandoned and removed then fails
    here instead of leaving a directory nobody removes). The part record appears atomically, so
    another process (on another node) may take its existence as the part being durable."""
    t0 = time.perf_counter()
    with hold_for_reading(source.directory):
        files = plan_parts(source.entries(), parts, max_file_bytes)[part]
        if create:
            os.makedirs(tmp, exist_ok=True)
        elif not os.path.isdir(tmp):
            raise CheckpointError("the merge's temporary directory is gone (the merge was "
                                  "abandoned)", file=tmp)
        nbytes = sum(e.nbytes for _, g in files for e in g)
        crcs = write_tensors(source, tmp, files, nbytes, t0, max_bytes_per_s=max_bytes_per_s,
                             chunk_bytes=chunk_bytes)
        doc = {"part": part, "parts": parts, "chunk_bytes": chunk_bytes, "crc32c": crcs,
               "files": [name for name, _ in files]}
        atomic_write(part_record(tmp, part), json.dumps(doc, sort_keys=True).encode())
    return nbytes


def _read_records(tmp: str, parts: int, chunk_bytes: int) -> Dict[str, List[int]]:
    crcs: Dict[str, List[int]] = {}
    for k in range(parts):
        path = part_record(tmp, k)
        try:
            doc = json.loads(read_confined(path, what="part record"))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"merge part {k} of {parts} did not finish (its worker failed "
                                  f"or was killed): {err}", file=path) from None
        if (not isinstance(doc, dict) or doc.get("parts") != parts
                or doc.get("chunk_bytes") != chunk_bytes
                or not isinstance(doc.get("crc32c"), dict)):
            raise CheckpointError(f"expected the record of part {k} of {parts} with chunk_bytes "
                                  f"{chunk_bytes}, found {str(doc)[:200]}", file=path)
        crcs.update(doc["crc32c"])
    return crcs


def commit_parts(source: MergeSource, tmp: str, dst: str, parts: int, *,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 chunk_bytes: int = CHUNK_BYTES, overwrite: bool = False) -> MergeResult:
    """Step 2): commit the universal checkpoint whose `parts` parts are durable in `tmp` (one
    committed at `dst` meanwhile is kept unless `overwrite`). On any error `tmp` is removed and
    nothing is committed."""
    t0 = time.perf_counter()
    dst = os.path.abspath(dst)
    try:
        with hold_for_reading(source.directory):
            objects = encode_objects(source)
            entries = source.entries()
            crcs = _read_records(tmp, parts, chunk_bytes)
            plan = plan_parts(entries, parts, max_file_bytes)
            weight_map = {e.name: name for files in plan for name, g in files for e in g}
            missing = sorted(set(weight_map) - set(crcs))
            if missing:
                raise CheckpointError(f"the part records hold no checksums for {len(missing)} "
                                      f"tensors, e.g. {missing[:3]}", file=tmp)
            for k in range(parts):
                os.unlink(part_record(tmp, k))
            finish(source, tmp, entries, weight_map, objects, crcs,
                   len(set(weight_map.values())), chunk_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if is_committed(dst) and not overwrite:
        shutil.rmtree(tmp, ignore_errors=True)  # another merge committed it meanwhile
        return MergeResult(dst, source.iteration(), 0, time.perf_counter() - t0, skipped=True)
    publish(tmp, dst)
    total = sum(e.nbytes for e in entries)
    return MergeResult(dst, source.iteration(), total, time.perf_counter() - t0, skipped=False)
