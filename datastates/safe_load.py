"""Reading a checkpoint never runs code: the one module of ours that deserializes pickles.

A checkpoint is untrusted input (downloaded, shared on a cluster file system, converted by someone
else). Pickle runs whatever callable a file names, so every pickle a read path meets goes through
one of these, and nothing else in the code base may call `pickle.load(s)` or `torch.load` without
`weights_only=True` (tests/test_security_source.py enforces it):

- `torch_load`: `torch.load(weights_only=True)` with a small explicit allowlist (numpy RNG states,
  argparse.Namespace). What the allowlist refuses raises `UnsafePickleError` naming the file and the
  offending global, and the one opt-in that reads it anyway (`allow_unsafe=True`, the tools' and
  trainer's `--allow-unsafe-pickle`).
- `read_dcp_metadata`: PyTorch DCP's `.metadata` file is a plain pickle (DCP reads it with
  `pickle.load`); ours is a restricted unpickler that builds only DCP's metadata dataclasses,
  torch dtypes/sizes/layouts and paths, then checks that every storage file it names stays inside
  the checkpoint directory.
- `SafeBytesMixin`: DCP saved objects read with `torch_load` (DCP's default planner unpickles every
  saved object with `weights_only=False`); `safe_dcp.py` builds DCP's reader and planner with
  these reads swapped in.
- `opt_in_pickle_loads`: the engine's own `allow_pickle` objects, read only on opt-in.
"""
from __future__ import annotations

import argparse
import functools
import io
import os
import pathlib
import pickle
import pickletools
import re
import zipfile
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .errors import CheckpointError

__all__ = ["UNSAFE_PICKLE_FLAG", "SafeBytesMixin", "UnsafePickleError", "opt_in_pickle_loads",
           "pickle_imports", "read_dcp_metadata", "reraise_dcp_failure", "safe_globals",
           "torch_load"]

UNSAFE_PICKLE_FLAG = "--allow-unsafe-pickle"


class UnsafePickleError(CheckpointError):
    """A checkpoint file holds a pickle that would run code (or build an object we do not allow)
    when loaded. Names the file and the offending global; nothing from the file was executed."""


def _opt_in_hint(way_forward: Optional[str] = None) -> str:
    return ("nothing in it was executed. " + (way_forward or (
        f"If you trust this file, rerun with {UNSAFE_PICKLE_FLAG} (loads it with plain pickle, "
        "which runs any code it names)")))


def safe_globals() -> list:
    """What `weights_only` loading may build besides tensors and containers: numpy RNG states
    (`np.random.get_state()`, saved with every RNG checkpoint) and argparse.Namespace (Megatron-LM's
    `args` in common.pt). Classes only: none of them runs code when unpickled."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)),
            argparse.Namespace]


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def torch_load(source: Union[str, io.BytesIO, bytes], *, file: str, what: str = "",
               allow_unsafe: bool = False, extra_globals: Iterable[Any] = (),
               way_forward: Optional[str] = None) -> Any:
    """`torch.load` of `source` (a path, a buffer or bytes) that never runs code from it unless
    `allow_unsafe`. `file` names the file in errors; `what` says which object inside it (e.g. a
    manifest entry) when the pickle is embedded; `way_forward` replaces the refusal's default
    advice (rerun with the opt-in flag)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(bytes(source))
    where = f"{what} in {os.path.basename(file)}" if what else os.path.basename(file)
    if allow_unsafe:
        # The one opt-in path: the caller passed --allow-unsafe-pickle for a file it trusts.
        return torch.load(source, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(safe_globals() + list(extra_globals)):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = _GLOBAL_RE.search(str(err))
        named = [found.group(1)] if found else _refused_globals(source)
        obj = (", ".join(named[:3]) if named
               else f"something weights_only loading refuses ({_why(err)})")
        raise UnsafePickleError(f"{where} holds a pickle that names {obj}, which a checkpoint may "
                                f"not contain (tensors, containers, numbers, strings, numpy RNG "
                                f"states and argparse.Namespace are allowed); "
                                f"{_opt_in_hint(way_forward)}", file=file) from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        raise CheckpointError(f"cannot read {where}: {type(err).__name__}: {_first_line(err)}",
                              file=file) from err


def _pickle_bytes(source: Union[str, io.BytesIO]) -> bytes:
    """The pickle stream of a torch file: `data.pkl` of the zip format, or the file itself."""
    if isinstance(source, io.BytesIO):
        raw = source.getvalue()
    else:
        with open(source, "rb") as f:
            raw = f.read()
    if zipfile.is_zipfile(io.BytesIO(raw)):
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            names = [n for n in z.namelist() if n.endswith("data.pkl")]
            return z.read(names[0]) if names else b""
    return raw


def pickle_imports(data: bytes, *, partial: bool = False) -> List[str]:
    """What a pickle stream would import before it could call anything, found by reading its
    opcodes (`pickletools.genops` parses, it never executes): "module.name" for GLOBAL, INST and
    STACK_GLOBAL, "copyreg extension N" for EXT1/2/4. A stream that imports nothing cannot run
    code when unpickled: every callable a REDUCE, BUILD or OBJ applies comes from one of those.
    A malformed stream raises ValueError, unless `partial`: then what was found before it."""
    named, strings, memo = [], [], {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                strings.append(arg)
            elif op.name == "MEMOIZE" and strings:
                memo[len(memo)] = strings[-1]
            elif op.name in ("BINGET", "LONG_BINGET", "GET") and arg in memo:
                strings.append(memo[arg])
            elif op.name in ("GLOBAL", "INST"):
                named.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL":
                named.append(f"{strings[-2]}.{strings[-1]}" if len(strings) >= 2
                             else "a name built on the stack")
            elif op.name in ("EXT1", "EXT2", "EXT4"):
                named.append(f"copyreg extension {arg}")
    except Exception as err:  # noqa: BLE001 - genops raises ValueError and others on bad input
        if not partial:
            raise ValueError(f"not a readable pickle stream: {_first_line(err)}") from None
    return list(dict.fromkeys(named))


def _refused_globals(source: Union[str, io.BytesIO]) -> List[str]:
    """Names of the globals a pickle would import that weights_only loading does not allow."""
    try:
        data = _pickle_bytes(source)
        allowed = set(torch._weights_only_unpickler._get_allowed_globals())
    except Exception:  # noqa: BLE001 - only used to word an error better
        return []
    allowed |= {f"{g.__module__}.{g.__qualname__}" for g in safe_globals()}
    return [n for n in pickle_imports(data, partial=True) if n not in allowed]


def _why(err: BaseException) -> str:
    """The line of torch's weights_only error that says what it refused (not its preamble)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    picked = [ln for ln in lines if "WeightsUnpickler error" in ln or "Unsupported" in ln]
    return (picked or lines or [type(err).__name__])[0][:300]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def opt_in_pickle_loads(data: bytes, *, allow: bool, file: Optional[str] = None,
                        what: str = "object") -> Any:
    """The engine's pickled small objects (saved only with EngineConfig(allow_pickle=True))."""
    if not allow:
        raise UnsafePickleError(f"checkpoint holds a pickled {what}; loading it may run arbitrary "
                                "code. Pass allow_pickle=True (the tools' and trainer's "
                                f"{UNSAFE_PICKLE_FLAG}) only if you trust the checkpoint",
                                file=file)
    return pickle.loads(data)  # opt-in: the caller trusts this checkpoint


# --------------------------------------------------------------------------- DCP .metadata

@functools.lru_cache(maxsize=1)
def _dcp_allowed() -> Dict[Tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata, planner

    allowed: Dict[Tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
        # a dataclass of one string: megatron's cached-structure save (Megatron-LM's
        # --ckpt-assume-constant-structure) stores the storage metadata it caches
        ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"): filesystem._StoragePrefix,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,  # a path string, never opened
        ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    }
    # DCP's dataclasses and enums (Metadata, ChunkStorageMetadata...; megatron also stores the
    # save plans: SavePlan, WriteItem, WriteItemType, TensorWriteData). Building one runs no code.
    for name in dir(metadata):
        obj = getattr(metadata, name)
        if isinstance(obj, type) and obj.__module__ == metadata.__name__:
            allowed[(metadata.__name__, name)] = obj
    for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData",
                 "LoadPlan", "ReadItem", "LoadItemType"):
        if hasattr(planner, name):
            allowed[(planner.__name__, name)] = getattr(planner, name)
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, allowed, path):
        super().__init__(f)
        self._allowed, self._path = allowed, path

    def find_class(self, module: str, name: str) -> Any:
        obj = self._allowed.get((module, name))
        if obj is None:
            raise UnsafePickleError(f"DCP metadata names {module}.{name}, which a checkpoint's "
                                    ".metadata may not contain (only PyTorch DCP's metadata "
                                    f"classes, dtypes and sizes); {_opt_in_hint()}",
                                    file=self._path)
        return obj


def read_dcp_metadata(directory: str, *, allow_unsafe: bool = False, name: str = ".metadata"):
    """The `Metadata` of a PyTorch DCP checkpoint (torch_dist), read without running code, with
    every storage file it names checked to lie inside `directory`."""
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as f:
            if allow_unsafe:
                md = pickle.load(f)  # opt-in: the caller trusts this checkpoint
            else:
                md = _MetadataUnpickler(f, _dcp_allowed(), path).load()
    except UnsafePickleError:
        raise
    except OSError as err:
        raise CheckpointError(f"cannot read the torch_dist metadata: {err.strerror or err}",
                              file=path) from err
    except Exception as err:  # noqa: BLE001 - truncated or forged pickles fail in many ways
        raise CheckpointError(f"torch_dist metadata is not a readable DCP .metadata file "
                              f"({type(err).__name__}: {_first_line(err)})", file=path) from err
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(md, Metadata):
        raise CheckpointError(f"torch_dist metadata holds a {type(md).__name__}, expected "
                              "torch.distributed.checkpoint.metadata.Metadata", file=path)
    _check_storage_paths(md, directory, path)
    return md


def _check_storage_paths(md, directory: str, path: str) -> None:
    root = os.path.realpath(directory)
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or os.path.isabs(rel) or "\x00" in rel \
                or ".." in rel.replace("\\", "/").split("/"):
            raise CheckpointError(f"torch_dist metadata names storage file {rel!r}; expected a "
                                  "file name inside the checkpoint directory", file=path)
        full = os.path.realpath(os.path.join(directory, rel))
        if os.path.commonpath([root, full]) != root:
            raise CheckpointError(f"torch_dist metadata names storage file {rel!r}, which resolves "
                                  f"to {full}, outside the checkpoint directory", file=path)


class SafeBytesMixin:
    """Mix into any DCP `LoadPlanner` (DCP's default one, megatron-core's `MCoreLoadPlanner`):
    saved objects (`BytesStorageMetadata`) are unpickled with `torch_load` instead of
    `torch.load(weights_only=False)`. Takes `directory=` (for errors) and `allow_unsafe=`."""

    def __init__(self, *args, directory: str = "", allow_unsafe: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._safe_directory = directory
        self._allow_unsafe = allow_unsafe

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        info = (getattr(self.metadata, "storage_data", None) or {}).get(read_item.storage_index)
        file = os.path.join(self._safe_directory, getattr(info, "relative_path", ""))
        obj = torch_load(value, file=file, what=f"saved object {fqn!r}",
                         allow_unsafe=self._allow_unsafe)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def reraise_dcp_failure(err: BaseException) -> None:
    """PyTorch DCP reports a failure on any rank as `CheckpointException` (a BaseException whose
    text is every rank's traceback). Re-raise the first of our own errors inside it, so a refused
    pickle or a forged path reaches the user as one line naming the file; else return."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, CheckpointException):
        for _, (exc, _trace) in sorted(err.failures.items()):
            if isinstance(exc, CheckpointError):
                raise exc from None
