"""Where a merge reads from: a committed DataStates checkpoint or a Megatron torch_dist one.

Both expose the same small interface (`Source`), so the writer never knows which format it merges.
Neither needs megatron: DataStates shards are read with `CheckpointReader` (any global box,
assembled from every rank's shards), torch_dist with PyTorch DCP's `FileSystemReader`.
"""
from __future__ import annotations

import io
import json
import os
from typing import Any, Dict, List, Tuple

import torch

from ..errors import CheckpointError
from ..layout import read_iteration, safe_join
from ..reader import CheckpointReader
from ..safe_load import (SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata,
                         reraise_dcp_failure, torch_load)

COMMON_FILE = "common.pt"
RNG_OBJECT = "rng_state/"  # per-rank RNG streams: meaningless at another layout, never merged


class Source:
    """A checkpoint to merge. Call order: `common()`, `keys()`/`meta()`, `read()` per key,
    `objects()`, `close()`."""

    kind = "abstract"

    def __init__(self, directory: str, allow_unsafe_pickle: bool = False):
        self.directory = directory
        self.allow_unsafe_pickle = allow_unsafe_pickle

    def common(self) -> dict:
        """megatron's common state (iteration, counters, scheduler, optimizer param groups)."""
        path = os.path.join(self.directory, COMMON_FILE)
        if not os.path.isfile(path):
            raise CheckpointError(f"no {COMMON_FILE}: not a megatron dist_checkpointing checkpoint",
                                  file=self.directory)
        # Plain dicts, numbers, strings and a few tensors (Megatron-LM adds its argparse args).
        return torch_load(path, file=path, allow_unsafe=self.allow_unsafe_pickle)

    def keys(self) -> List[str]:
        raise NotImplementedError

    def meta(self, key: str) -> Tuple[torch.dtype, Tuple[int, ...]]:
        raise NotImplementedError

    def read(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def objects(self) -> Dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class DataStatesSource(Source):
    """A committed `--async-lazy-save` checkpoint (refused when not committed)."""

    kind = "datastates"

    def __init__(self, directory: str, verify: bool = True, threads: int = 1,
                 allow_unsafe_pickle: bool = False):
        super().__init__(directory, allow_unsafe_pickle)
        # One reader thread by default: a background merge should take as little CPU from
        # training as it can (and a thread pool per read costs more than it saves here).
        self.reader = CheckpointReader(directory, verify=verify, threads=threads,
                                       allow_pickle=allow_unsafe_pickle)

    def keys(self) -> List[str]:
        return self.reader.tensor_keys(shards_only=True)

    def meta(self, key):
        m = self.reader.tensor_meta(key)
        return m.dtype, tuple(m.global_shape)

    def read(self, key):
        return self.reader.read(key)

    def objects(self):
        out: Dict[str, Any] = {}
        for rank in self.reader.ranks():
            for k, v in self.reader.load_objects(rank)["objects"].items():
                if not k.startswith(RNG_OBJECT):
                    out[k] = v
        return out

    def close(self):
        self.reader.close()


class TorchDistSource(Source):
    """A Megatron ``torch_dist`` checkpoint (PyTorch DCP files + common.pt + metadata.json)."""

    kind = "torch_dist"

    def __init__(self, directory: str, allow_unsafe_pickle: bool = False):
        super().__init__(directory, allow_unsafe_pickle)
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta_path = os.path.join(directory, "metadata.json")
        if not os.path.isfile(meta_path):
            raise CheckpointError("no metadata.json: not a megatron dist_checkpointing checkpoint",
                                  file=directory)
        with open(meta_path) as f:
            backend = json.load(f).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(f"sharded backend is {backend!r}, expected 'torch_dist'",
                                  file=directory)
        md = read_dcp_metadata(directory, allow_unsafe=allow_unsafe_pickle)
        self._tensors = {k: v for k, v in md.state_dict_metadata.items()
                         if isinstance(v, TensorStorageMetadata)}
        self._bytes = [k for k in md.state_dict_metadata if k not in self._tensors]

    def _load(self, state: dict) -> dict:
        from torch.distributed.checkpoint import load

        unsafe = self.allow_unsafe_pickle
        try:
            load(state, storage_reader=SafeFileSystemReader(self.directory, allow_unsafe=unsafe),
                 planner=SafeLoadPlanner(directory=self.directory, allow_unsafe=unsafe),
                 no_dist=True)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            reraise_dcp_failure(err)
            raise
        return state

    def keys(self):
        return sorted(self._tensors)

    def meta(self, key):
        m = self._tensors[key]
        return m.properties.dtype, tuple(m.size)

    def read(self, key):
        dtype, shape = self.meta(key)
        return self._load({key: torch.empty(shape, dtype=dtype)})[key]

    def objects(self):
        keys = [k for k in self._bytes if not k.startswith(RNG_OBJECT)]
        if not keys:
            return {}
        loaded = self._load({k: io.BytesIO() for k in keys})
        out = {}
        for k in keys:
            v = loaded[k]  # SafeLoadPlanner has unpickled it without running code
            # megatron's torch_dist saves each object as the list of its local shards' data.
            out[k] = v[0] if isinstance(v, list) and len(v) == 1 else v
        return out


def open_source(directory: str, allow_unsafe_pickle: bool = False) -> Source:
    """The right `Source` for a megatron-layout checkpoint directory (``iter_XXXXXXX``).
    `allow_unsafe_pickle` (the tools' --allow-unsafe-pickle) reads pickles that name arbitrary
    code; without it such a file is refused (`datastates.safe_load`)."""
    meta_path = os.path.join(directory, "metadata.json")
    if not os.path.isfile(meta_path):
        raise CheckpointError("expected a checkpoint directory with metadata.json (an "
                              "iter_XXXXXXX directory of --save)", file=directory)
    with open(meta_path) as f:
        backend = json.load(f).get("sharded_backend")
    if backend == "datastates":
        return DataStatesSource(directory, allow_unsafe_pickle=allow_unsafe_pickle)
    if backend == "torch_dist":
        return TorchDistSource(directory, allow_unsafe_pickle=allow_unsafe_pickle)
    raise CheckpointError(f"sharded backend {backend!r} is not supported; expected 'datastates' or "
                          "'torch_dist'", file=directory)


TRACKER_FILE = "latest_checkpointed_iteration.txt"


def resolve_checkpoint_dir(path: str) -> str:
    """`path` itself, or for a Megatron save root the ``iter_XXXXXXX`` its tracker names."""
    tracker = os.path.join(path, TRACKER_FILE)
    if os.path.isfile(tracker):  # untrusted: a plain number, and no link out of `path`
        return safe_join(path, f"iter_{read_iteration(tracker):07d}", what="tracker")
    return path
