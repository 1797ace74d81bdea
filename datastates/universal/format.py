"""The universal checkpoint format: what is on disk and how to read any box of it.

A universal checkpoint is parallelism-agnostic: one full (unsharded) tensor per sharded parameter
key, as megatron-core's dist_checkpointing names it, plus the optimizer's fp32 main weights and
Adam moments under the same key with a role prefix. Layout of a committed directory::

    manifest.json                      format, version, iteration, counters, scheduler, optimizer
                                       param groups and step, model config, tokenizer, source layout,
                                       small objects, and a table of every tensor's role
    model.safetensors.index.json       Hugging Face-style {"metadata": {...}, "weight_map": {...}}
    model-00001-of-0000N.safetensors   tensors, split by size (any safetensors reader opens them)
    UNIVERSAL_COMMIT.json              written last; readers trust only a directory that has it;
                                       holds the CRC-32C of manifest.json and of the index

Every tensor's bytes carry a CRC-32C per 1 MiB chunk in the manifest (`tensor_files`).

Tensor names (``<key>`` is a megatron sharded key such as ``decoder.layers.mlp.linear_fc1.weight``;
transformer-layer keys carry a leading layer axis, exactly as dist_checkpointing stacks them):
    ``<key>``                           model weight, in the model's dtype
    ``optimizer.state.fp32_param.<key>`` fp32 main weight
    ``optimizer.state.exp_avg.<key>``    Adam first moment (fp32)
    ``optimizer.state.exp_avg_sq.<key>`` Adam second moment (fp32)
The optimizer step (one per run: every param group shares it) is ``manifest.optimizer.step``.
"""
from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..errors import CheckpointError
from ..fileio import read_confined, safe_join
from .objects import DTYPE_BY_NAME, decode_object, decode_value, legacy_pickles
from .tensor_files import CHECKSUM_ALGORITHM, TensorFile, box_chunks, check_checksum_list, \
    chunk_checksums, crc32c, verify_chunks

FORMAT_NAME = "datastates-universal"
# 2: objects without pickles (objects.py); 1 is still read. Checksums (tensor_files.py) are an
# optional addition to version 2, not a new version: readers that predate them ignore them and
# still read the checkpoint; readers that know them verify them, and warn when they are absent.
FORMAT_VERSION = 2
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "model.safetensors.index.json"
COMMIT_FILE = "UNIVERSAL_COMMIT.json"
OPTIM_PREFIX = "optimizer.state."


class Role(str, enum.Enum):
    """What a universal tensor holds for its parameter."""

    WEIGHT = "weight"
    FP32_PARAM = "fp32_param"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"


OPTIMIZER_ROLES = (Role.FP32_PARAM, Role.EXP_AVG, Role.EXP_AVG_SQ)


def tensor_name(role: Role, key: str) -> str:
    return key if role is Role.WEIGHT else f"{OPTIM_PREFIX}{role.value}.{key}"


def split_name(name: str) -> Tuple[Role, str]:
    """Inverse of `tensor_name`."""
    for role in OPTIMIZER_ROLES:
        prefix = f"{OPTIM_PREFIX}{role.value}."
        if name.startswith(prefix):
            return role, name[len(prefix):]
    return Role.WEIGHT, name


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


@dataclass(frozen=True)
class Entry:
    """One universal tensor: its name, role and parameter key, and the source key it comes from."""

    name: str
    role: Role
    key: str
    source_key: str
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    file: str




def is_universal(directory: str) -> bool:
    """True for a directory that looks like a universal checkpoint (committed or not)."""
    return os.path.isfile(os.path.join(directory, MANIFEST_FILE))


def read_commit(directory: str) -> Optional[dict]:
    """The commit marker of `directory`, or None if it has no valid one (not committed)."""
    path = os.path.join(directory, COMMIT_FILE)
    try:
        doc = json.loads(read_confined(path, what="commit marker"))
    except (OSError, ValueError, CheckpointError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT_NAME else None


def is_committed(directory: str) -> bool:
    return read_commit(directory) is not None


def unchecked_warning(directory: str) -> str:
    """What a reader says about a checkpoint written before checksums existed."""
    return (f"universal checkpoint {directory} has no checksums (written before they were "
            "added): damage to its files cannot be detected. `python tools/convert_checkpoint.py "
            f"upgrade-universal {directory}` adds them, for the files as they are now")


class UniversalCheckpoint:
    """Read-only view of a committed universal checkpoint.

    Reads are memory-mapped (`tensor_files.TensorFile`): a rank that asks for its box of a
    tensor touches only the pages of that box, and verifies the checksums of the chunks that hold
    them. At open, the manifest and the index are verified against the checksums the commit
    marker records (checkpoints written before checksums existed have none: `checksummed` is
    False and readers warn with `unchecked_warning`).
    """

    def __init__(self, directory: str, allow_unsafe_pickle: bool = False):
        self.directory = directory
        self.allow_unsafe_pickle = allow_unsafe_pickle
        if not os.path.isdir(directory):
            raise CheckpointError("universal checkpoint directory does not exist", file=directory)
        commit = read_commit(directory)
        if commit is None:
            raise CheckpointError(f"not a committed universal checkpoint (no valid {COMMIT_FILE}): "
                                  "its merge did not finish; merge or convert it again",
                                  file=directory)
        self.manifest = _read_json(os.path.join(directory, MANIFEST_FILE),
                                   commit.get("manifest_crc32c"))
        if self.manifest.get("format") != FORMAT_NAME:
            raise CheckpointError(f"manifest format is {self.manifest.get('format')!r}, expected "
                                  f"{FORMAT_NAME!r}", file=directory)
        if int(self.manifest.get("format_version", 0)) > FORMAT_VERSION:
            raise CheckpointError(f"format version {self.manifest['format_version']} is newer than "
                                  f"this reader ({FORMAT_VERSION}); upgrade datastates",
                                  file=directory)
        self._refuse_unsafe_objects()
        index = _read_json(os.path.join(directory, INDEX_FILE), commit.get("index_crc32c"))
        self.weight_map: Dict[str, str] = _checked_weight_map(directory, index,
                                                              self.manifest["tensors"])
        self._files: Dict[str, TensorFile] = {}
        self._infos: Dict[str, TensorInfo] = {}
        for name, entry in self.manifest["tensors"].items():
            self._infos[name] = _tensor_info(name, entry, self.weight_map[name],
                                             self.manifest_path)
        self.chunk_bytes, self._crcs = self._checksums()
        self._verified: Dict[str, Set[int]] = {}

    def _checksums(self) -> Tuple[int, Dict[str, List[int]]]:
        """(chunk size, CRC-32C list per tensor); (0, {}) for a checkpoint without checksums.
        A manifest that has checksums must have them for every tensor."""
        spec = self.manifest.get("checksum")
        if spec is None:
            return 0, {}
        chunk = spec.get("chunk_bytes") if isinstance(spec, dict) else None
        if (not isinstance(spec, dict) or spec.get("algorithm") != CHECKSUM_ALGORITHM
                or not isinstance(chunk, int) or chunk <= 0):
            raise CheckpointError(f"unknown checksum {spec!r}: expected algorithm "
                                  f"{CHECKSUM_ALGORITHM!r} with a positive chunk_bytes",
                                  file=self.manifest_path)
        crcs = {}
        for name, info in self._infos.items():
            crcs[name] = check_checksum_list(self.manifest["tensors"][name].get("crc32c"), name,
                                             _nbytes(info), chunk, self.manifest_path)
            if crcs[name] is None:
                raise CheckpointError("the manifest has checksums, but none for this tensor "
                                      "(edited?)", file=self.manifest_path, tensor=name)
        return chunk, crcs

    @property
    def checksummed(self) -> bool:
        """False for a checkpoint written before checksums existed (nothing is verified)."""
        return bool(self.chunk_bytes)

    def _refuse_unsafe_objects(self) -> None:
        """Format 1 stored objects as pickles: one that `weights_only` loading refuses makes the
        whole checkpoint refused at open (naming the object and the command that rewrites it),
        whichever of its objects a caller would have asked for."""
        if self.allow_unsafe_pickle:
            return
        keys, in_common = legacy_pickles(self.manifest)
        for key in keys:
            self.object(key)
        if in_common:
            self.megatron_common()

    @property
    def manifest_path(self) -> str:
        return os.path.join(self.directory, MANIFEST_FILE)

    def object_keys(self) -> List[str]:
        return sorted(self.manifest.get("objects", {}))

    def object(self, key: str) -> Any:
        """A small object (megatron ShardedObject) by unique key, decoded without running code
        (a format-1 pickle only with `allow_unsafe_pickle`)."""
        objects = self.manifest.get("objects", {})
        if key not in objects:
            raise CheckpointError("object is not in the universal checkpoint (another model?)",
                                  file=self.directory, tensor=key)
        return decode_object(objects[key], file=self.manifest_path, key=key,
                             allow_unsafe_pickle=self.allow_unsafe_pickle)

    def megatron_common(self) -> dict:
        """megatron's common.pt state as the source saved it."""
        return decode_value(self.manifest["megatron_common"], file=self.manifest_path,
                            allow_unsafe_pickle=self.allow_unsafe_pickle)

    @property
    def iteration(self) -> int:
        return int(self.manifest["iteration"])

    def names(self) -> List[str]:
        return sorted(self._infos)

    def has(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        if name not in self._infos:
            raise CheckpointError(f"no such tensor; the checkpoint has {len(self._infos)}, e.g. "
                                  f"{self.names()[:4]}", file=self.directory, tensor=name)
        return self._infos[name]

    def _file(self, info: TensorInfo) -> TensorFile:
        """The open file holding tensor `info` (opened at its first use; a file that is missing,
        truncated or not safetensors is refused naming the tensor that needed it)."""
        if info.file not in self._files:
            try:
                # Names were checked in __init__; symlinks again here (open_confined, O_NOFOLLOW).
                self._files[info.file] = TensorFile(
                    os.path.join(self.directory, info.file), self.directory,
                    what=f"manifest names file {info.file!r}, which")
            except CheckpointError as err:
                raise CheckpointError(err.reason, file=err.file, tensor=info.name) from err
        return self._files[info.file]

    def _checked_box(self, name: str, offset: Optional[Sequence[int]],
                     shape: Optional[Sequence[int]]):
        info = self.info(name)
        off = tuple(offset) if offset is not None else (0,) * len(info.shape)
        shp = tuple(shape) if shape is not None else tuple(g - o for g, o in zip(info.shape, off))
        if (len(off) != len(info.shape) or len(shp) != len(info.shape)
                or any(o < 0 or s < 0 or o + s > g for o, s, g in zip(off, shp, info.shape))):
            raise CheckpointError(f"box at {list(off)} of shape {list(shp)} does not fit in "
                                  f"{list(info.shape)}", file=self.directory, tensor=name)
        return info, off, shp

    def read(self, name: str, offset: Optional[Sequence[int]] = None,
             shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The box of tensor `name` at `offset` (default origin) with `shape` (default: to the
        end); only that box is read, and the checksums of the chunks it touches are verified
        (CheckpointError naming file and tensor on a mismatch)."""
        info, off, shp = self._checked_box(name, offset, shape)
        f = self._file(info)
        start, _ = f.span(name, info.dtype, info.shape)
        self._verify(f, info, start, box_chunks(info.shape, info.dtype.itemsize, off, shp,
                                                self.chunk_bytes) if self.checksummed else ())
        whole = f.tensor_of(start, info.dtype, info.shape)
        return whole[tuple(slice(o, o + s) for o, s in zip(off, shp))].clone()

    def file_checksums(self, name: str, chunk_bytes: int) -> List[int]:
        """CRC-32C of each chunk of tensor `name` as its file holds it now (to add checksums to
        a checkpoint written without them)."""
        info = self.info(name)
        f = self._file(info)
        start, nbytes = f.span(name, info.dtype, info.shape)
        return chunk_checksums(f.bytes_of(start, nbytes), chunk_bytes)

    def verify(self, name: str) -> None:
        """Check every chunk of tensor `name` (e.g. before trusting a checkpoint as a fallback)."""
        info = self.info(name)
        f = self._file(info)
        start, nbytes = f.span(name, info.dtype, info.shape)
        if self.checksummed:
            self._verify(f, info, start, range(-(-nbytes // self.chunk_bytes)))

    def _verify(self, f: TensorFile, info: TensorInfo, start: int, chunks) -> None:
        done = self._verified.setdefault(info.name, set())
        todo = [i for i in chunks if i not in done]
        if todo:
            verify_chunks(f, info.name, start, _nbytes(info), self._crcs[info.name],
                          self.chunk_bytes, todo)
            done.update(todo)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "UniversalCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _checked_weight_map(directory: str, index: Any, tensors: Any) -> Dict[str, str]:
    """The index's weight_map, refused unless it names, for exactly the manifest's tensors, the
    file the manifest names, and every file is a plain name inside `directory` (`safe_join`)."""
    path = os.path.join(directory, INDEX_FILE)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not isinstance(tensors, dict):
        raise CheckpointError(f"expected a weight_map object in {INDEX_FILE} and a tensors object "
                              f"in {MANIFEST_FILE}, found {type(weight_map).__name__} and "
                              f"{type(tensors).__name__}", file=path)
    checked = set()
    for name in sorted(set(weight_map) | set(tensors)):
        entry = tensors.get(name)
        file = entry.get("file") if isinstance(entry, dict) else None
        if weight_map.get(name) != file:
            raise CheckpointError(f"{INDEX_FILE} puts the tensor in file {weight_map.get(name)!r}, "
                                  f"{MANIFEST_FILE} in {file!r}; expected both to name the same "
                                  "file (one of them was edited)", file=path, tensor=name)
        if not isinstance(file, str) or file not in checked:  # safe_join refuses a non-string
            safe_join(directory, file, what="manifest")
            checked.add(file)
    return weight_map


def _tensor_info(name: str, entry: dict, file: str, manifest_path: str) -> TensorInfo:
    dtype, shape = DTYPE_BY_NAME.get(entry.get("dtype")), entry.get("shape")
    if dtype is None or not isinstance(shape, list) or \
            not all(isinstance(n, int) and n >= 0 for n in shape):
        raise CheckpointError(f"expected a known dtype ({sorted(DTYPE_BY_NAME)}) and a list of "
                              f"sizes, found {entry.get('dtype')!r} and {shape!r}",
                              file=manifest_path, tensor=name)
    return TensorInfo(name, dtype, tuple(shape), file)


def _nbytes(info: TensorInfo) -> int:
    n = info.dtype.itemsize
    for s in info.shape:
        n *= s
    return n


def _read_json(path: str, crc: Any = None) -> Any:
    """A JSON file, verified against `crc` (CRC-32C of its bytes, from the commit marker) when
    the marker records one."""
    try:
        raw = read_confined(path, what=os.path.basename(path))
    except OSError as e:
        raise CheckpointError(f"cannot read: {e}", file=path) from e
    if crc is not None:
        found = crc32c(raw)
        if found != crc:
            expected = f"{crc:#010x}" if isinstance(crc, int) else repr(crc)
            raise CheckpointError(f"does not match the checksum in {COMMIT_FILE}: expected crc32c "
                                  f"{expected}, found {found:#010x} (damaged or edited after the "
                                  "commit)", file=path)
    try:
        return json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"not valid JSON: {e}", file=path) from e
