"""Where a merge reads from: a committed DataStates checkpoint or a Megatron torch_dist one.

Both are `datastates.universal.MergeSource`s, so the universal writer never knows which format it
merges nor what megatron's keys mean (`plan` maps them). Neither needs megatron itself:
DataStates shards are read with `CheckpointReader` (any global box, assembled from every rank's
shards), torch_dist with PyTorch DCP through `safe_load` (no pickle runs).
"""
from __future__ import annotations

import io
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...errors import CheckpointError
from ...reader import CheckpointReader
from ...safe_load import read_dcp_metadata, reraise_dcp_failure
from ...universal import Entry, MergeSource
from . import plan as merge_plan
from ..paths import METADATA_FILENAME, Format, saved_common, sharded_backend

# Per-rank RNG streams (ours, and Megatron-LM's copy): meaningless at another layout, never merged.
RNG_OBJECT = ("rng_state/", "rng_state_per_rank/")


class Source(MergeSource):
    """A Megatron dist_checkpointing checkpoint to merge; subclasses list and read its tensors
    (`keys`, `meta`, `read`) and objects."""

    kind = "abstract"

    def __init__(self, directory: str, allow_unsafe_pickle: bool = False):
        self.directory = directory
        self.allow_unsafe_pickle = allow_unsafe_pickle
        self._common: Optional[dict] = None
        self._flavor: Optional[str] = None

    def common(self) -> dict:
        """megatron's common state (iteration, counters, scheduler, optimizer param groups), read
        without running code (Megatron-LM adds its argparse args)."""
        if self._common is None:
            self._common = saved_common(self.directory, self.allow_unsafe_pickle)
        return self._common

    def iteration(self) -> int:
        return int(self.common().get("iteration", 0))

    def entries(self) -> List[Entry]:
        entries, self._flavor = merge_plan.plan_entries(self)
        return entries

    def manifest_fields(self) -> Dict[str, Any]:
        if self._flavor is None:
            self.entries()
        return merge_plan.manifest_fields(self, self.common(), self._flavor)

    def keys(self) -> List[str]:
        raise NotImplementedError

    def meta(self, key: str) -> Tuple[torch.dtype, Tuple[int, ...]]:
        raise NotImplementedError


class DataStatesSource(Source):
    """A committed `--async-lazy-save` checkpoint (refused when not committed)."""

    kind = "datastates"
    # Two: one checksums and assembles a tensor while the other waits for the disk (O_DIRECT
    # reads have no read-ahead). The reader's descriptors, buffers and counters are locked.
    read_threads = 2

    def __init__(self, directory: str, verify: bool = True, threads: int = 1,
                 allow_unsafe_pickle: bool = False):
        super().__init__(directory, allow_unsafe_pickle)
        # One reader thread by default: a background merge should take as little CPU from
        # training as it can (and a thread pool per read costs more than it saves here).
        # O_DIRECT: the shards are read once, so no page-cache copy and no pages left behind.
        self.reader = CheckpointReader(directory, verify=verify, threads=threads,
                                       allow_pickle=allow_unsafe_pickle, direct=True)

    def keys(self) -> List[str]:
        return self.reader.tensor_keys(shards_only=True)

    def meta(self, key):
        m = self.reader.tensor_meta(key)
        return m.dtype, tuple(m.global_shape)

    def read(self, key):
        return self.reader.read(key)

    def read_into(self, key, out):
        return self.reader.read(key, out=out)

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

        backend = sharded_backend(directory)
        if backend is None:
            raise CheckpointError(f"no readable {METADATA_FILENAME}: not a megatron "
                                  "dist_checkpointing checkpoint", file=directory)
        if backend != Format.TORCH_DIST.value:
            raise CheckpointError(f"sharded backend is {backend!r}, expected 'torch_dist'",
                                  file=directory)
        md = read_dcp_metadata(directory, allow_unsafe=allow_unsafe_pickle)
        self._tensors = {k: v for k, v in md.state_dict_metadata.items()
                         if isinstance(v, TensorStorageMetadata)}
        self._bytes = [k for k in md.state_dict_metadata if k not in self._tensors]

    def _load(self, state: dict) -> dict:
        from torch.distributed.checkpoint import load

        from ...safe_dcp import SafeFileSystemReader, SafeLoadPlanner

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
        return self.read_into(key, torch.empty(shape, dtype=dtype))

    def read_into(self, key, out):
        return self._load({key: out})[key]

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
    if not os.path.isfile(os.path.join(directory, METADATA_FILENAME)):
        raise CheckpointError(f"expected a checkpoint directory with {METADATA_FILENAME} (an "
                              "iter_XXXXXXX directory of --save)", file=directory)
    backend = sharded_backend(directory)
    if backend == Format.DATASTATES.value:
        return DataStatesSource(directory, allow_unsafe_pickle=allow_unsafe_pickle)
    if backend == Format.TORCH_DIST.value:
        return TorchDistSource(directory, allow_unsafe_pickle=allow_unsafe_pickle)
    raise CheckpointError(f"sharded backend {backend!r} is not supported; expected 'datastates' or "
                          "'torch_dist'", file=directory)
