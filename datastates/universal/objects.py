"""How a universal checkpoint stores its small objects (manifest.json), without pickles.

Format version 2 (see `encode_object`): JSON, or the engine's typed JSON encoding with tensors
inlined, or an io.BytesIO's bytes. Format version 1 stored everything JSON could not hold as
``torch.save`` pickles (``torch_b64``); they are still read, with `weights_only=True` only (see
`decode_object`), and `tools/convert_checkpoint.py upgrade-universal` rewrites them.
"""
from __future__ import annotations

import base64
import io
import json
import os
from typing import Any, List, Tuple

import torch

from ..errors import CheckpointError
from ..safe_load import UNSAFE_PICKLE_FLAG, torch_load
from ..flatten import decode_skeleton, flatten_state

DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
               torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
               torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
DTYPE_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


def encode_object(value: Any) -> dict:
    """A small object as JSON that loads without running code (format version 2):
    ``{"json": v}`` when plain JSON holds it; otherwise ``{"typed": skeleton, "tensors": [...]}``,
    the engine's typed encoding (`datastates.flatten`: tuples, bytes, dtypes, enums, numpy arrays,
    Namespaces) with its tensors inlined as raw bytes; an ``io.BytesIO`` (what some Transformer
    Engine versions return as ``_extra_state``) as ``{"bytesio_b64": ...}``. A type none of these
    can hold is refused by name (never pickled)."""
    try:
        json.dumps(value, allow_nan=False)
        return {"json": value}
    except (TypeError, ValueError):
        pass
    if isinstance(value, io.BytesIO):
        return {"bytesio_b64": base64.b64encode(value.getvalue()).decode("ascii")}
    skeleton, entries = flatten_state(value, allow_pickle=False)
    tensors = []
    for e in entries:
        if e.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"cannot store a {e.dtype} tensor in a universal object",
                                  tensor=e.key)
        raw = e.tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        tensors.append({"dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                        "b64": base64.b64encode(raw).decode("ascii")})
    return {"typed": skeleton, "tensors": tensors}


def legacy_pickles(manifest: dict) -> Tuple[List[str], bool]:
    """Where a manifest of format 1 holds ``torch_b64`` pickles: the object keys, and whether
    ``megatron_common`` holds any."""
    keys = [k for k, v in manifest.get("objects", {}).items()
            if isinstance(v, dict) and "torch_b64" in v]
    return keys, '"torch_b64"' in json.dumps(manifest.get("megatron_common"))


def upgrade_command(directory: str) -> str:
    return (f"python tools/convert_checkpoint.py upgrade-universal {directory} "
            f"{UNSAFE_PICKLE_FLAG}")


def decode_object(doc: dict, *, file: str = "manifest.json", key: str = "",
                  allow_unsafe_pickle: bool = False) -> Any:
    """Inverse of `encode_object`. Universal checkpoints of format version 1 stored non-JSON
    objects as ``torch_b64`` pickles: those are read with `weights_only=True` (enough for tensors,
    containers and numpy RNG states) and anything else is refused, naming the object and the
    command that rewrites the manifest without pickles."""
    if "json" in doc:
        return doc["json"]
    if "typed" in doc:
        tensors = []
        for t in doc.get("tensors", []):
            dtype = DTYPE_BY_NAME.get(t.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"object {key!r} holds a tensor of unknown dtype "
                                      f"{t.get('dtype')!r}", file=file)
            raw = bytearray(base64.b64decode(t["b64"]))
            flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            tensors.append(flat.reshape(t["shape"]))
        return decode_skeleton(doc["typed"], tensors, allow_pickle=False)
    if "bytesio_b64" in doc:
        return io.BytesIO(base64.b64decode(doc["bytesio_b64"]))
    if "torch_b64" in doc:
        return torch_load(base64.b64decode(doc["torch_b64"]), file=file,
                          what=f"object {key!r} (a format-1 pickle)",
                          allow_unsafe=allow_unsafe_pickle,
                          way_forward="If you trust this checkpoint, rewrite its objects without "
                                      "pickles with: "
                                      + upgrade_command(os.path.dirname(file) or "."))
    raise CheckpointError(f"object {key!r} has none of the encodings json/typed/bytesio_b64/"
                          f"torch_b64: {sorted(doc)[:4]}", file=file)


def encode_value(value: Any) -> Any:
    """Lossless, readable JSON for megatron's common state: tuples and small tensors are tagged,
    anything else falls back to `encode_object`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: encode_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v) for v in value]}
    if isinstance(value, torch.Tensor) and value.numel() <= 16 and value.dtype in DTYPE_NAMES:
        return {"__tensor__": {"dtype": DTYPE_NAMES[value.dtype], "shape": list(value.shape),
                               "data": value.flatten().tolist()}}
    return {"__object__": encode_object(value)}


def decode_value(value: Any, **opts) -> Any:
    """Inverse of `encode_value`; `opts` go to `decode_object` (file, allow_unsafe_pickle)."""
    if isinstance(value, list):
        return [decode_value(v, **opts) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(decode_value(v, **opts) for v in value["__tuple__"])
    if "__tensor__" in value:
        t = value["__tensor__"]
        dtype = DTYPE_BY_NAME[t["dtype"]]
        return torch.tensor(t["data"], dtype=dtype).reshape(t["shape"])
    if "__object__" in value:
        return decode_object(value["__object__"], **opts)
    return {k: decode_value(v, **opts) for k, v in value.items()}
