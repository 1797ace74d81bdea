"""`inspect`: what a checkpoint holds (universal, DataStates or torch_dist), as a dict or text."""
from __future__ import annotations

import json
import os
from typing import Any, Dict

from ..universal import DTYPE_NAMES, UniversalCheckpoint
from .resolve import UNIVERSAL_KIND, locate
from .merge.sources import open_source


def describe(path: str, allow_unsafe_pickle: bool = False) -> Dict[str, Any]:
    """What the checkpoint `path` names (anything `locate` takes) holds. Reads metadata only:
    a universal checkpoint's manifest and index are verified against its commit marker, its
    tensor data is not read."""
    found = locate(path)
    directory = found.directory
    if found.kind == UNIVERSAL_KIND:
        with UniversalCheckpoint(directory, allow_unsafe_pickle=allow_unsafe_pickle) as u:
            m = u.manifest
            tensors = {n: {"dtype": e["dtype"], "shape": e["shape"], "role": e["role"],
                           "bytes": _nbytes(u.info(n).dtype.itemsize, e["shape"]),
                           "file": e["file"]} for n, e in m["tensors"].items()}
            opt = m["optimizer"]
            return {"path": directory, "format": f"universal v{m['format_version']}",
                    "iteration": m["iteration"],
                    "consumed_train_samples": m["consumed_train_samples"],
                    "layout": m["source"]["layout"], "source_format": m["source"]["format"],
                    "optimizer": None if opt is None else {"flavor": opt["flavor"],
                                                           "step": opt["step"]},
                    "checksums": (f"crc32c per {u.chunk_bytes}-byte chunk" if u.checksummed
                                  else "none (written before checksums existed)"),
                    "files": len(set(u.weight_map.values())), "tensors": tensors}
    source = open_source(directory, allow_unsafe_pickle=allow_unsafe_pickle)
    try:
        common = source.common()
        run = json.loads(common["run_config"]) if "run_config" in common else {}
        par = run.get("parallel", {})
        tensors = {}
        for k in source.keys():
            dtype, shape = source.meta(k)
            tensors[k] = {"dtype": DTYPE_NAMES.get(dtype, str(dtype)), "shape": list(shape),
                          "bytes": _nbytes(dtype.itemsize, shape)}
        return {"path": directory, "format": source.kind, "iteration": common.get("iteration"),
                "consumed_train_samples": common.get("consumed_train_samples"),
                "layout": {"tp": par.get("tensor_model_parallel_size"),
                           "pp": par.get("pipeline_model_parallel_size"),
                           "world_size": par.get("world_size"),
                           "use_distributed_optimizer": par.get("use_distributed_optimizer")},
                "files": len([f for f in os.listdir(directory)]), "tensors": tensors}
    finally:
        source.close()


def _nbytes(itemsize: int, shape) -> int:
    n = itemsize
    for s in shape:
        n *= s
    return n


def render(info: Dict[str, Any]) -> str:
    total = sum(t["bytes"] for t in info["tensors"].values())
    lines = [f"path:        {info['path']}", f"format:      {info['format']}",
             f"iteration:   {info['iteration']}",
             f"samples:     {info['consumed_train_samples']}",
             f"layout:      {info['layout']}"]
    if "optimizer" in info:
        lines.append(f"optimizer:   {info['optimizer']}")
    if "checksums" in info:
        lines.append(f"checksums:   {info['checksums']}")
    lines.append(f"tensors:     {len(info['tensors'])}, {total} bytes ({total / 2**20:.1f} MiB) in "
                 f"{info['files']} files")
    width = max((len(n) for n in info["tensors"]), default=0)
    for name, t in sorted(info["tensors"].items()):
        lines.append(f"  {name:<{width}}  {t['dtype']:>4}  {str(t['shape']):<16} {t['bytes']:>12}")
    return "\n".join(lines)
