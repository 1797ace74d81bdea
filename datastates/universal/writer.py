"""Writing a universal checkpoint atomically, from any `MergeSource`.

The writer knows the universal format only; what a source's keys mean (e.g. megatron's optimizer
spelling, common.pt) is the source's business (`datastates.megatron_adapter.merge.sources`).

Order (one process):
  1) plan the tensors and group them into files of at most `max_file_bytes` (a tensor larger than
     that gets a file of its own);
  2) write every safetensors file into ``<dst>.tmp-<pid>/``, each fsynced, with the CRC-32C of
     every 1 MiB chunk of every tensor (`tensor_files`): a reader thread reads the tensors while
     this one writes them (`stream`; at most `stream.QUEUE_BYTES` of tensors in memory);
  3) write the index and the manifest (with the checksums; fsynced), then the commit marker
     (with the CRC-32C of both), fsync the directory;
  4) rename the temporary directory to ``<dst>`` and fsync the parent.
A process killed anywhere before 4) leaves only a ``.tmp-`` directory, which no reader accepts and
the next merge into the same parent removes; a merge that fails (a damaged source, a full disk)
removes its own. A committed ``<dst>`` is never rewritten unless asked, so running the same merge
twice is a no-op. Files get the permissions open() gives (0644 under umask 0022).
"""
from __future__ import annotations

import abc
import glob
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError
from ..faults import fault_point
from ..fileio import atomic_write, fsync_dir, hold_for_reading, read_confined
from .format import COMMIT_FILE, FORMAT_NAME, FORMAT_VERSION, INDEX_FILE, MANIFEST_FILE, Entry, \
    UniversalCheckpoint, is_committed, read_commit, shard_file_name
from .objects import DTYPE_NAMES, encode_object
from .stream import throttle, write_files
from .tensor_files import CHUNK_BYTES, checksum_fields, crc32c

Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, current tensor)


class MergeSource(abc.ABC):
    """A checkpoint to merge into the universal format. Call order (one process):
      1) `iteration()`; 2) `objects()` (small objects, read before any tensor so a bad one fails
      early); 3) `entries()`; 4) `read_into(entry.source_key, out)` per entry;
      5) `manifest_fields()`;
      6) `close()`."""

    directory: str
    kind: str = "abstract"
    #: Threads that may call `read`/`read_into` at once (the writer reads ahead with them).
    read_threads: int = 1

    @abc.abstractmethod
    def iteration(self) -> int: ...

    @abc.abstractmethod
    def objects(self) -> Dict[str, Any]: ...

    @abc.abstractmethod
    def entries(self) -> List[Entry]: ...

    @abc.abstractmethod
    def read(self, key: str) -> torch.Tensor: ...

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """The tensor `key`, written into `out` (a buffer of its shape and dtype that the
        writer reuses) where the source can; else a tensor of the source's own."""
        return self.read(key)

    @abc.abstractmethod
    def manifest_fields(self) -> Dict[str, Any]:
        """Source-specific manifest fields: at least ``iteration``; the writer adds ``format``,
        ``format_version``, ``objects`` and ``tensors``."""

    def close(self) -> None:
        pass
DEFAULT_MAX_FILE_BYTES = 2 << 30
FILE_METADATA = {"format": "pt", "producer": FORMAT_NAME}


@dataclass(frozen=True)
class MergeResult:
    directory: str
    iteration: int
    bytes: int
    seconds: float
    skipped: bool  # already committed: nothing was written
    cpu_s: float = 0.0
    """CPU seconds of the merging process (all its threads) for this merge."""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 and not self.skipped else 0.0

    def to_json(self) -> dict:
        return {"directory": self.directory, "iteration": self.iteration, "bytes": self.bytes,
                "seconds": round(self.seconds, 6), "gbps": round(self.gbps, 6),
                "skipped": self.skipped, "cpu_s": round(self.cpu_s, 3)}


def group_files(entries: List[Entry], max_file_bytes: int) -> List[List[Entry]]:
    groups: List[List[Entry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    return [g for g in groups if g]


def write_json(path: str, doc) -> bytes:
    """A JSON file, fsync'd (inside a temporary directory renamed later); returns its bytes."""
    raw = json.dumps(doc, indent=1, sort_keys=True).encode()
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return raw


def _encode_named(key: str, value: Any) -> dict:
    try:
        return encode_object(value)
    except CheckpointError as err:
        raise CheckpointError(f"object {key!r} cannot be stored in a universal checkpoint: "
                              f"{err.reason}", tensor=key) from None


def _tensor_table(entries: List[Entry], weight_map: Dict[str, str],
                  crcs: Dict[str, List[int]]) -> Dict[str, dict]:
    return {e.name: {"role": e.role.value, "param": e.key, "source_key": e.source_key,
                     "dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                     "file": weight_map[e.name], "crc32c": crcs[e.name]} for e in entries}


def new_commit_marker(iteration: int, files: int, total: int, manifest: bytes,
                      index: bytes) -> dict:
    """The commit marker's content: what readers check first (format, and the checksums of the
    manifest and the index, which hold everything else's)."""
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "iteration": iteration,
            "files": files, "total_size": total, "time": time.time(),
            "manifest_crc32c": crc32c(manifest), "index_crc32c": crc32c(index)}


def publish(tmp: str, dst: str) -> None:
    """Rename the finished temporary directory `tmp` to `dst` and fsync the parent. Something
    already at `dst` (a committed checkpoint being overwritten, or an uncommitted leftover) is
    moved aside first and removed after, so `dst` never holds a mix of both."""
    parent = os.path.dirname(dst)
    aside = None
    if os.path.exists(dst):
        aside = f"{dst}.tmp-replaced-{os.getpid()}"
        os.rename(dst, aside)
    os.rename(tmp, dst)
    fsync_dir(parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def remove_stale_temporaries(dst: str) -> None:
    """Leftovers of merges into `dst` that died (only one merge per destination runs at a time)."""
    for path in glob.glob(glob.escape(dst) + ".tmp-*"):
        shutil.rmtree(path, ignore_errors=True)


def write_universal(source: MergeSource, dst: str, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                    progress: Optional[Progress] = None, overwrite: bool = False,
                    max_bytes_per_s: Optional[float] = None,
                    chunk_bytes: int = CHUNK_BYTES) -> MergeResult:
    """Merge `source` into the universal checkpoint `dst` and commit it (see module docstring).

    `max_bytes_per_s` throttles a background merge so its reads and writes leave the disk to
    the training job's own checkpoints. `chunk_bytes`: the piece each checksum covers (readers
    take it from the manifest)."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    iteration = source.iteration()
    dst = os.path.abspath(dst)
    if is_committed(dst) and not overwrite:
        return MergeResult(dst, iteration, 0, time.perf_counter() - t0, skipped=True)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    remove_stale_temporaries(dst)
    tmp = f"{dst}.tmp-{os.getpid()}"
    # Retention (of this process or another) keeps the source until the merge is done.
    with hold_for_reading(source.directory):
        objects = encode_objects(source)
        entries = source.entries()
        groups = group_files(entries, max_file_bytes)
        weight_map = {e.name: shard_file_name(i + 1, len(groups))
                      for i, g in enumerate(groups) for e in g}
        total = sum(e.nbytes for e in entries)
        files = [(shard_file_name(i + 1, len(groups)), g) for i, g in enumerate(groups)]
        os.makedirs(tmp)
        try:
            crcs = write_tensors(source, tmp, files, total, t0, progress, max_bytes_per_s,
                                 chunk_bytes)
            finish(source, tmp, entries, weight_map, objects, crcs, len(groups), chunk_bytes)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed merge leaves nothing behind
            raise
    publish(tmp, dst)
    return MergeResult(dst, iteration, total, time.perf_counter() - t0, skipped=False,
                       cpu_s=time.process_time() - cpu0)


def encode_objects(source: MergeSource) -> Dict[str, dict]:
    """The source's small objects as the manifest stores them (read before any tensor, so a
    forged or unreadable one fails a merge early)."""
    return {k: _encode_named(k, v) for k, v in sorted(source.objects().items())}


def write_tensors(source: MergeSource, tmp: str, files: List[Tuple[str, List[Entry]]],
                  total: int, t0: float, progress: Optional[Progress] = None,
                  max_bytes_per_s: Optional[float] = None,
                  chunk_bytes: int = CHUNK_BYTES) -> Dict[str, List[int]]:
    """Step 2) of the module docstring: `files` (name, entries) into the directory `tmp`.
    Returns each tensor's chunk checksums."""
    done = [0]
    wait = throttle(max_bytes_per_s, t0)
    iteration = source.iteration()

    def written(e: Entry) -> None:
        done[0] += e.nbytes
        wait(done[0])
        if progress is not None:
            progress(done[0], total, e.name)

    def after_file(i: int) -> None:
        if i == 0:  # crash tests: a kill here leaves a half-written .tmp- directory
            fault_point("merge", iteration, 0)

    return write_files([(os.path.join(tmp, name), g) for name, g in files],
                       lambda e, out: source.read_into(e.source_key, out),
                       directory=source.directory,
                       metadata=FILE_METADATA, chunk_bytes=chunk_bytes, written=written,
                       after_file=after_file, readers=source.read_threads)


def finish(source: MergeSource, tmp: str, entries: List[Entry], weight_map: Dict[str, str],
           objects: Dict[str, dict], crcs: Dict[str, List[int]], nfiles: int,
           chunk_bytes: int) -> None:
    """Step 3) of the module docstring: index, manifest and commit marker into `tmp`, whose
    tensor files are all durable."""
    total = sum(e.nbytes for e in entries)
    index = write_json(os.path.join(tmp, INDEX_FILE),
                       {"metadata": {"total_size": total, "format": FORMAT_NAME,
                                     "format_version": FORMAT_VERSION}, "weight_map": weight_map})
    manifest = write_json(os.path.join(tmp, MANIFEST_FILE),
                          dict(source.manifest_fields(), format=FORMAT_NAME,
                               format_version=FORMAT_VERSION, objects=objects,
                               checksum=checksum_fields(chunk_bytes),
                               tensors=_tensor_table(entries, weight_map, crcs)))
    write_json(os.path.join(tmp, COMMIT_FILE),
               new_commit_marker(source.iteration(), nfiles, total, manifest, index))
    fsync_dir(tmp)


def rewrite_manifest(directory: str, manifest: dict) -> None:
    """Replace the manifest of the committed universal checkpoint `directory` so that a crash
    anywhere leaves a checkpoint that loads: 1) the commit marker loses the manifest's checksum
    (the old manifest still loads, unverified); 2) the new manifest replaces the old atomically;
    3) the commit marker gets the new manifest's checksum and format version."""
    commit_path = os.path.join(directory, COMMIT_FILE)
    commit = read_commit(directory)
    if commit is None:
        raise CheckpointError(f"not a committed universal checkpoint (no valid {COMMIT_FILE})",
                              file=directory)
    commit.pop("manifest_crc32c", None)
    atomic_write(commit_path, json.dumps(commit, indent=1, sort_keys=True).encode())
    raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
    atomic_write(os.path.join(directory, MANIFEST_FILE), raw)
    commit.update(manifest_crc32c=crc32c(raw), format_version=FORMAT_VERSION)
    atomic_write(commit_path, json.dumps(commit, indent=1, sort_keys=True).encode())


def upgrade_universal(directory: str, allow_unsafe_pickle: bool = False) -> int:
    """Rewrite a format-1 universal checkpoint's manifest so that its objects hold no pickles
    (format 2); tensors are untouched. Pickles `weights_only=True` can read are converted without
    the opt-in; any other needs `allow_unsafe_pickle` (the file is then trusted, its code runs).
    The manifest is replaced with `rewrite_manifest` (a crash leaves a checkpoint that loads).
    Returns how many objects were rewritten (0: nothing to do)."""
    from .objects import decode_object, decode_value, encode_object, encode_value, legacy_pickles

    manifest_path = os.path.join(directory, MANIFEST_FILE)
    with UniversalCheckpoint(directory, allow_unsafe_pickle=allow_unsafe_pickle) as u:
        m = dict(u.manifest)
    pickled, in_common = legacy_pickles(m)
    if not pickled and not in_common:
        return 0
    opts = dict(file=manifest_path, allow_unsafe_pickle=allow_unsafe_pickle)
    objects = dict(m["objects"])
    for key in pickled:
        objects[key] = encode_object(decode_object(objects[key], key=key, **opts))
    m["objects"] = objects
    if in_common:
        m["megatron_common"] = encode_value(decode_value(m["megatron_common"], **opts))
    m["format_version"] = FORMAT_VERSION
    rewrite_manifest(directory, m)
    return len(pickled) + int(in_common)


def add_checksums(directory: str, allow_unsafe_pickle: bool = False) -> int:
    """Give a universal checkpoint written before checksums existed the CRC-32C of every chunk of
    its tensors, as its files are now (damage that happened before cannot be detected), and the
    commit marker the checksum of its index and manifest. Returns how many tensors were
    checksummed (0: it had checksums already)."""
    with UniversalCheckpoint(directory, allow_unsafe_pickle=allow_unsafe_pickle) as u:
        if u.checksummed:
            return 0
        m = dict(u.manifest)
        m["tensors"] = {name: dict(entry, crc32c=u.file_checksums(name, CHUNK_BYTES))
                        for name, entry in u.manifest["tensors"].items()}
    m["checksum"] = checksum_fields(CHUNK_BYTES)
    commit = read_commit(directory)
    if commit is not None and "index_crc32c" not in commit:
        index = read_confined(os.path.join(directory, INDEX_FILE), what=INDEX_FILE)
        commit["index_crc32c"] = crc32c(index)
        atomic_write(os.path.join(directory, COMMIT_FILE),
                     json.dumps(commit, indent=1, sort_keys=True).encode())
    rewrite_manifest(directory, m)
    return len(m["tensors"])
