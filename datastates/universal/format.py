"""The universal checkpoint format: what is on disk and how to read any box of it.

A universal checkpoint is parallelism-agnostic: one full (unsharded) tensor per sharded parameter
key, as megatron-core's dist_checkpointing names it, plus the optimizer's fp32 main weights and
Adam moments under the same key with a role prefix. Layout of a committed directory::

    manifest.json                      format, version, iteration, counters, scheduler, optimizer
                                       param groups and step, model config, tokenizer, source layout,
                                       small objects, and a table of every tensor's role
    model.safetensors.index.json       Hugging Face-style {"metadata": {...}, "weight_map": {...}}
    model-00001-of-0000N.safetensors   tensors, split by size (any safetensors reader opens them)
    UNIVERSAL_COMMIT.json              written last; readers trust only a directory that has it

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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointError
from ..fileio import confined_path, read_confined, safe_join
from .objects import DTYPE_BY_NAME, decode_object, decode_value, legacy_pickles

FORMAT_NAME = "datastates-universal"
FORMAT_VERSION = 2  # 2: objects without pickles (objects.py); 1 is still read
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


def is_committed(directory: str) -> bool:
    path = os.path.join(directory, COMMIT_FILE)
    try:
        doc = json.loads(read_confined(path, what="commit marker"))
    except (OSError, ValueError, CheckpointError):
        return False
    return isinstance(doc, dict) and doc.get("format") == FORMAT_NAME


class UniversalCheckpoint:
    """Read-only view of a committed universal checkpoint.

    Reads are memory-mapped (safetensors ``safe_open`` slices): a rank that asks for its box of a
    tensor touches only the pages of that box.
    """

    def __init__(self, directory: str, allow_unsafe_pickle: bool = False):
        self.directory = directory
        self.allow_unsafe_pickle = allow_unsafe_pickle
        if not os.path.isdir(directory):
            raise CheckpointError("universal checkpoint directory does not exist", file=directory)
        if not is_committed(directory):
            raise CheckpointError(f"not a committed universal checkpoint (no valid {COMMIT_FILE}): "
                                  "its merge did not finish; merge or convert it again",
                                  file=directory)
        self.manifest = _read_json(os.path.join(directory, MANIFEST_FILE))
        if self.manifest.get("format") != FORMAT_NAME:
            raise CheckpointError(f"manifest format is {self.manifest.get('format')!r}, expected "
                                  f"{FORMAT_NAME!r}", file=directory)
        if int(self.manifest.get("format_version", 0)) > FORMAT_VERSION:
            raise CheckpointError(f"format version {self.manifest['format_version']} is newer than "
                                  f"this reader ({FORMAT_VERSION}); upgrade datastates",
                                  file=directory)
        self._refuse_unsafe_objects()
        index = _read_json(os.path.join(directory, INDEX_FILE))
        self.weight_map: Dict[str, str] = _checked_weight_map(directory, index,
                                                              self.manifest["tensors"])
        self._handles: Dict[str, Any] = {}
        self._infos: Dict[str, TensorInfo] = {}
        for name, entry in self.manifest["tensors"].items():
            self._infos[name] = TensorInfo(name, DTYPE_BY_NAME[entry["dtype"]],
                                           tuple(entry["shape"]), self.weight_map[name])

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

    def _handle(self, file: str):
        from safetensors import safe_open

        if file not in self._handles:
            # Names were checked in __init__; symlinks again here, and safetensors gets the
            # resolved path.
            real = confined_path(self.directory, os.path.join(self.directory, file),
                                 what=f"manifest names file {file!r}, which")
            self._handles[file] = safe_open(real, framework="pt")
        return self._handles[file]

    def read(self, name: str, offset: Optional[Sequence[int]] = None,
             shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The box of tensor `name` at `offset` (default origin) with `shape` (default: to the
        end); only that box is read."""
        info = self.info(name)
        off = tuple(offset) if offset is not None else (0,) * len(info.shape)
        shp = tuple(shape) if shape is not None else tuple(g - o for g, o in zip(info.shape, off))
        if (len(off) != len(info.shape) or len(shp) != len(info.shape)
                or any(o < 0 or s < 0 or o + s > g for o, s, g in zip(off, shp, info.shape))):
            raise CheckpointError(f"box at {list(off)} of shape {list(shp)} does not fit in "
                                  f"{list(info.shape)}", file=self.directory, tensor=name)
        handle = self._handle(info.file)
        if not info.shape:
            return handle.get_tensor(name)
        sl = handle.get_slice(name)
        return sl[tuple(slice(o, o + s) for o, s in zip(off, shp))]

    def close(self) -> None:
        self._handles.clear()

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


def _read_json(path: str) -> Any:
    try:
        return json.loads(read_confined(path, what=os.path.basename(path)))
    except OSError as e:
        raise CheckpointError(f"cannot read: {e}", file=path) from e
    except ValueError as e:
        raise CheckpointError(f"not valid JSON: {e}", file=path) from e
