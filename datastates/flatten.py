"""What is saved: splitting a nested state into tensor entries and a safe JSON skeleton.

Small objects are encoded as JSON with type tags ({"__t__": tag, ...}) so that loading them runs
no code: no pickle, no imports. Tensor leaves are replaced by {"__t__": "tensor", "id": i} where i
indexes this rank's tensor entries.
"""
from __future__ import annotations

import argparse
import base64
import enum
import math
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import CheckpointError
from .safe_load import opt_in_pickle_loads

TAG = "__t__"


@dataclass
class TensorShard:
    """A local shard of a global tensor.

    `data` holds the elements of the global tensor `key` (shape `global_shape`) in the box that
    starts at `global_offset` and has `data.shape`. Different ranks save different shards of the
    same key; `CheckpointReader.read` reassembles any box from them.
    """

    data: torch.Tensor
    key: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(o) for o in self.global_offset)
        shape = tuple(self.data.shape)
        if len(shape) != len(self.global_shape) or len(shape) != len(self.global_offset):
            raise CheckpointError(f"TensorShard: expected data, global_shape and global_offset "
                                  f"of the same rank, found {shape}, {self.global_shape}, "
                                  f"{self.global_offset}", tensor=self.key)
        for size, off, glob in zip(shape, self.global_offset, self.global_shape):
            if off < 0 or off + size > glob:
                raise CheckpointError(f"TensorShard: box at {self.global_offset} of shape {shape} "
                                      f"does not fit in global shape {self.global_shape}",
                                      tensor=self.key)


@dataclass
class TensorEntry:
    """One tensor to save: where it comes from and where it goes in the global tensor. `tensor`
    may still require grad (the copy threads detach it, off the caller's thread)."""

    key: str
    tensor: torch.Tensor
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    is_shard: bool
    dtype: torch.dtype = torch.float32
    shape: Tuple[int, ...] = ()
    nbytes: int = 0

    def __post_init__(self) -> None:
        # Kept apart from `tensor`, which the engine drops as soon as it is copied.
        self.dtype = self.tensor.dtype
        self.shape = tuple(self.tensor.shape)
        self.nbytes = self.tensor.numel() * self.tensor.element_size()

    def holding(self, tensor: torch.Tensor) -> "TensorEntry":
        """This entry's copy for a later save of the same structure, holding `tensor`: a tensor of
        this entry's dtype and number of elements whose row-major bytes are the entry's (e.g. the
        same data without the leading axes of length 1 that `shape` has). The caller checks that
        it is; nothing is recomputed."""
        out = TensorEntry.__new__(TensorEntry)
        out.__dict__.update(self.__dict__)
        out.tensor = tensor
        return out


@dataclass(frozen=True)
class FlatState:
    """A state already split into `flatten_state`'s (skeleton, entries), to hand to
    `CheckpointEngine.save` in place of the nested state (e.g. rebuilt from a cached plan).
    `layouts`: a dict the engine keeps its file layout of `entries` in (keyed by their sizes),
    shared by the caller with the FlatStates of later saves of the same plan: a layout is then
    not computed again."""

    skeleton: Any
    entries: List[TensorEntry]
    layouts: Optional[dict] = None


def tensor_ref(i: int) -> dict:
    """The skeleton leaf that stands for tensor entry `i`."""
    return {TAG: "tensor", "id": i}


def dict_skeleton(items: Sequence[Tuple[str, Any]]) -> dict:
    """The skeleton of a dict with str keys whose values are already encoded."""
    return {TAG: "dict", "items": [[k, v] for k, v in items]}


_PLAIN = frozenset((int, str, bool, type(None)))


def _plain(seq) -> bool:
    """Whether every item of `seq` is encoded as itself (e.g. the 625 ints of Python's
    `random.getstate()`, saved with every RNG state)."""
    for v in seq:
        t = type(v)
        if t not in _PLAIN and not (t is float and math.isfinite(v)):
            return False
    return True


def _path_str(path: Sequence[Any]) -> str:
    return "/".join(str(p) for p in path) if path else "<root>"


class _Encoder:
    def __init__(self, allow_pickle: bool, entries: List[TensorEntry]):
        self.allow_pickle = allow_pickle
        self.entries = entries

    def encode(self, obj: Any, path: List[Any]) -> Any:
        if isinstance(obj, TensorShard):
            return self._tensor(obj.data, obj.key, obj.global_shape, obj.global_offset, True, path)
        if isinstance(obj, torch.Tensor):
            key = _path_str(path)
            return self._tensor(obj, key, tuple(obj.shape), (0,) * obj.dim(), False, path)
        if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
            return {TAG: "npscalar", "dtype": obj.dtype.str,
                    "b64": base64.b64encode(obj.tobytes()).decode()}
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, enum.Enum):
            cls = type(obj)
            return {TAG: "enum", "cls": f"{cls.__module__}:{cls.__qualname__}",
                    "name": obj.name}
        if isinstance(obj, int):
            return obj if type(obj) is int else int(obj)
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {TAG: "float", "v": repr(obj)}
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if not isinstance(k, (str, int, tuple)) or isinstance(k, bool):
                    raise CheckpointError(f"cannot save dict key {k!r} of type "
                                          f"{type(k).__name__} at path {_path_str(path)!r}: keys "
                                          f"must be str, int or tuple")
                items.append([self.encode(k, path + ["<key>"]), self.encode(v, path + [k])])
            return {TAG: "dict", "items": items}
        if isinstance(obj, list):
            if _plain(obj):
                return list(obj)
            return [self.encode(v, path + [i]) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and type(obj) is tuple:
            if _plain(obj):
                return {TAG: "tuple", "items": list(obj)}
            return {TAG: "tuple", "items": [self.encode(v, path + [i]) for i, v in enumerate(obj)]}
        if isinstance(obj, bytes):
            return {TAG: "bytes", "b64": base64.b64encode(obj).decode()}
        if isinstance(obj, torch.dtype):
            return {TAG: "dtype", "v": str(obj).replace("torch.", "")}
        if isinstance(obj, torch.Size):
            return {TAG: "size", "v": list(obj)}
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            return {TAG: "ndarray", "dtype": obj.dtype.str, "shape": list(obj.shape),
                    "b64": base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode()}
        if isinstance(obj, argparse.Namespace):
            return {TAG: "namespace", "v": self.encode(vars(obj), path)}
        return self._other(obj, path)

    def _tensor(self, t, key, gshape, goff, is_shard, path):
        if t.layout != torch.strided or t.is_quantized:
            raise CheckpointError(f"cannot save tensor with layout {t.layout} at path "
                                  f"{_path_str(path)!r}: only dense tensors are supported",
                                  tensor=key)
        self.entries.append(TensorEntry(key, t.detach(), tuple(gshape), tuple(goff), is_shard))
        return tensor_ref(len(self.entries) - 1)

    def _other(self, obj, path):
        if not self.allow_pickle:
            raise CheckpointError(
                f"cannot save object of type {type(obj).__module__}.{type(obj).__qualname__} at "
                f"path {_path_str(path)!r}: the safe format stores None, bool, int, float, str, "
                f"bytes, list, tuple, dict, enum, torch.dtype, torch.Size, numpy arrays and "
                f"tensors; convert it, or set EngineConfig(allow_pickle=True)")
        return {TAG: "pickle", "b64": base64.b64encode(pickle.dumps(obj)).decode()}


def flatten_state(state: Any, allow_pickle: bool, entries: Optional[List[TensorEntry]] = None,
                  path: Sequence[Any] = ()) -> Tuple[Any, List[TensorEntry]]:
    """Return (JSON-able skeleton, tensor entries) for a nested state. Raises CheckpointError on
    a type the safe format cannot hold (unless allow_pickle). To flatten one part of a larger
    state (e.g. the part a cached plan does not hold): `entries`, the tensor entries already
    taken (their `tensor_ref`s placed by the caller), to which the part's own are appended,
    numbered after them; `path`, where the part sits (the keys of its plain tensors)."""
    enc = _Encoder(allow_pickle, [] if entries is None else entries)
    skeleton = enc.encode(state, list(path))
    seen: Dict[Tuple[str, Tuple[int, ...]], int] = {}
    for e in enc.entries:
        ident = (e.key, e.global_offset)
        if ident in seen:
            raise CheckpointError("two tensors of this rank's state map to the same key and offset "
                                  f"{e.global_offset}; give TensorShards distinct keys or offsets",
                                  tensor=e.key)
        seen[ident] = 1
    return skeleton, enc.entries


def _resolve_enum(cls_path: str, name: str) -> Any:
    module, _, qual = cls_path.partition(":")
    # Importing a module may run code; we only look up modules the program already imported.
    obj = sys.modules.get(module)
    if obj is None:
        raise CheckpointError(f"checkpoint holds an enum of class {cls_path}; import module "
                              f"{module!r} before loading so it can be resolved without running "
                              f"code")
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    # Only an Enum class may be indexed: `obj[name]` on anything else could call code.
    if not (isinstance(obj, type) and issubclass(obj, enum.Enum)):
        raise CheckpointError(f"checkpoint names {cls_path} as an enum class, but it is not one")
    try:
        return obj[name]
    except KeyError:
        raise CheckpointError(f"enum {cls_path} has no member {name!r}") from None


def decode_skeleton(obj: Any, tensors: Sequence[Any], allow_pickle: bool,
                    _path: Tuple[Any, ...] = ()) -> Any:
    """Inverse of flatten_state: `tensors[i]` replaces the i-th tensor entry."""
    if isinstance(obj, list):
        return [decode_skeleton(v, tensors, allow_pickle, _path + (i,)) for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(TAG)
    rec = lambda v, *sub: decode_skeleton(v, tensors, allow_pickle, _path + sub)  # noqa: E731
    if tag == "tensor":
        return tensors[obj["id"]]
    if tag == "dict":
        out = {}
        for k, v in obj["items"]:
            key = rec(k)
            out[key] = rec(v, key)
        return out
    if tag == "tuple":
        return tuple(rec(v) for v in obj["items"])
    if tag == "float":
        return float(obj["v"])
    if tag == "bytes":
        return base64.b64decode(obj["b64"])
    if tag == "dtype":
        return getattr(torch, obj["v"])
    if tag == "size":
        return torch.Size(obj["v"])
    if tag == "ndarray":
        raw = base64.b64decode(obj["b64"])
        return np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if tag == "npscalar":
        return np.frombuffer(base64.b64decode(obj["b64"]), dtype=np.dtype(obj["dtype"]))[0]
    if tag == "enum":
        return _resolve_enum(obj["cls"], obj["name"])
    if tag == "namespace":
        return argparse.Namespace(**rec(obj["v"]))
    if tag == "pickle":
        return opt_in_pickle_loads(base64.b64decode(obj["b64"]), allow=allow_pickle,
                                   what=f"object at {_path_str(_path)!r}")
    raise CheckpointError(f"unknown type tag {tag!r} in the checkpoint's object skeleton")
