"""megatron-core dist_checkpointing save/load strategies for DataStates (and safe torch_dist loads).

megatron-core describes *what* is saved (`sharded_state_dict()`: ShardedTensor shards with global
shapes and offsets, ShardedObjects); the engine decides *how bytes move*. This module translates
the first into the second, and registers a load strategy under our own backend name, so that stock
`megatron.core.dist_checkpointing.load` reads our checkpoints (resharding included) as soon as
`datastates` has been imported (see `datastates/__init__.py`).

Save, call order (every rank):
  1) `dist_checkpointing.save(sd, dir, sharded_strategy=save_strategy(engine, dp_group),
     async_sharded_save=True)`: rank 0 writes common.pt; `async_save` hands this rank's main-replica
     shards to the engine (small objects serialized now, tensors copied lazily) and returns an
     AsyncRequest holding megatron's finalize function (metadata.json). Nothing has been copied.
  2) every rank, before anything mutates parameters or optimizer state:
     `engine.wait_for_snapshot()`.
  3) every rank, once all ranks agree their shards are durable: run the request's finalize
     functions (rank 0 writes metadata.json, then a barrier), then rank 0 `try_commit(dir, world)`
     writes the commit marker last. Readers refuse a directory without it.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import torch

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    default_strategies,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.core import CONFIG_FNAME
from megatron.core.dist_checkpointing.strategies.common import (
    TorchCommonLoadStrategy,
    TorchCommonSaveStrategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner as _MCORE_PLANNER,
    TorchDistLoadShardedStrategy,
)

from ... import control_plane, fileio
from ...engine import CheckpointEngine, SaveHandle
from ...errors import CheckpointError
from ...layout import local_version_dir
from ...reader import CheckpointReader
from ...safe_dcp import SafeFileSystemReader
from ...safe_load import SafeBytesMixin, reraise_dcp_failure, torch_load
from ...flatten import TensorShard
from ..paths import COMMON_FILENAME, saved_common, sharded_backend
# A module reference, not its names: importing payload first imports megatron.core, whose import
# hook imports this module while payload is still half-initialised.
from . import payload as _payload

BACKEND = "datastates"
BACKEND_VERSION = 1


class DataStatesSaveStrategy(AsyncSaveShardedStrategy):
    """Hands shards to a `CheckpointEngine`; the returned request does no work of its own.
    With a `PayloadPlan` (kept by the caller across saves), the payload is refilled from it
    (`checked`: the caller proved the structure unchanged, `PayloadPlan.flatten`); with
    `defer_copies`, the caller starts the copies (`engine.start_copies()`) once its save call is
    done."""

    def __init__(self, engine: CheckpointEngine, step: int,
                 extra_shards: Sequence[TensorShard] = (),
                 payload_plan: Optional[_payload.PayloadPlan] = None,
                 defer_copies: bool = False, checked: bool = False):
        super().__init__(BACKEND, BACKEND_VERSION)
        self.engine = engine
        self.step = step
        self.extra_shards = extra_shards
        self.payload_plan = payload_plan
        self.defer_copies = defer_copies
        self.checked = checked
        self.handle: Optional[SaveHandle] = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def async_save(self, sharded_state_dict, checkpoint_dir) -> AsyncRequest:
        if self.payload_plan is None:
            state = _payload.engine_payload(sharded_state_dict, self.extra_shards)
        else:
            state = self.payload_plan.flatten(sharded_state_dict, self.extra_shards,
                                              self.engine.cfg.allow_pickle, self.checked)
        self.handle = self.engine.save(state, str(checkpoint_dir), step=self.step,
                                       defer_copies=self.defer_copies)
        return AsyncRequest(None, (), [])

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        self.async_save(sharded_state_dict, checkpoint_dir)
        self.engine.wait_for_durable(self.handle)


def save_strategy(engine: CheckpointEngine, step: int, dp_group=None, cached_wrapper=None,
                  extra_shards: Sequence[TensorShard] = (),
                  payload_plan: Optional[_payload.PayloadPlan] = None,
                  defer_copies: bool = False, checked: bool = False):
    """Our strategy wrapped so replicated shards are written once, spread across the DP group
    (megatron's FullyParallelSaveStrategyWrapper assigns each replicated shard one writer).
    Pass the previous wrapper back as `cached_wrapper` to reuse its cached distribution."""
    base = DataStatesSaveStrategy(engine, step, extra_shards, payload_plan, defer_copies,
                                  checked)
    if dp_group is None or torch.distributed.get_world_size(dp_group) == 1:
        return base, base
    if cached_wrapper is None:
        cached_wrapper = FullyParallelSaveStrategyWrapper(base, dp_group, do_cache_distribution=True)
    cached_wrapper.base_strategy = base
    return cached_wrapper, base


class DurableCommonSaveStrategy(TorchCommonSaveStrategy):
    """megatron's common.pt, byte for byte what `torch.save` writes, but durable and atomic
    (temp + fsync + rename), and a full disk surfaces as OSError(ENOSPC) naming the file: stock
    `torch.save` to a path reports it as "[enforce fail at inline_container.cc] unexpected pos".
    With `defer`, the bytes are serialized in the call (the state as of the save) and
    `defer(path, data)` is asked to write them durably, e.g. on a background thread whose
    completion the caller awaits before committing the version. `writes` says whether this rank
    writes it (default: rank 0; a node-local version: each node's leader)."""

    def __init__(self, backend: str, version: int,
                 defer: Optional[Callable[[str, bytes], None]] = None,
                 writes: Optional[bool] = None):
        super().__init__(backend, version)
        self.defer = defer
        self.writes = writes

    def save_common(self, common_state_dict, checkpoint_dir) -> None:
        writes = torch.distributed.get_rank() == 0 if self.writes is None else self.writes
        if not writes:
            return
        buf = io.BytesIO()
        torch.save(common_state_dict, buf)
        path = os.path.join(str(checkpoint_dir), COMMON_FILENAME)
        if self.defer is not None:
            self.defer(path, buf.getvalue())
        else:
            fileio.atomic_write(path, buf.getbuffer())


def write_metadata(checkpoint_dir: str) -> None:
    """metadata.json as megatron's save finalize writes it for our backend (on rank 0 only): for
    the other leaders of a node-local version."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    save_config(CheckpointingConfig(BACKEND, BACKEND_VERSION), checkpoint_dir)


@contextlib.contextmanager
def durable_common_save(defer: Optional[Callable[[str, bytes], None]] = None,
                        writes: Optional[bool] = None) -> Iterator[None]:
    """Within the block, `dist_checkpointing.save` writes common.pt with
    `DurableCommonSaveStrategy(defer=defer, writes=writes)` (megatron-core 0.16.1 refuses an
    explicit `common_strategy` argument and looks the default up in its registry on every save).
    Restored on exit, so saves outside our lazy path keep megatron's own behaviour."""
    table = default_strategies[StrategyAction.SAVE_COMMON.value]
    key = ("torch", 1)
    previous = table[key]  # registered when megatron's strategies package is imported
    table[key] = DurableCommonSaveStrategy("torch", 1, defer, writes)
    try:
        yield
    finally:
        table[key] = previous


class _DropOverwriteWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Overwriting old incomplete / corrupted checkpoint" not in record.getMessage()


@contextlib.contextmanager
def quiet_overwrite_warning() -> Iterator[None]:
    """Within the block, megatron's "Overwriting old incomplete / corrupted checkpoint..." is not
    logged: `dist_checkpointing.save` prints it for any non-empty directory, and ours holds the
    room set aside for its commit marker before the call. The caller checks for real leftovers
    itself (`LazyCheckpointer.save`)."""
    target = logging.getLogger("megatron.core.dist_checkpointing.serialization")
    drop = _DropOverwriteWarning()
    target.addFilter(drop)
    try:
        yield
    finally:
        target.removeFilter(drop)


class DataStatesLoadStrategy(LoadShardedStrategy):
    """Reads any layout's shards back at this rank's layout (slices by global offsets)."""

    def __init__(self, verify: bool = True, allow_pickle: bool = False,
                 local_dir: Optional[str] = None):
        self.verify = verify
        self.allow_pickle = allow_pickle
        self.local_dir = local_dir
        #: After `load`: {"sources": {"local"|"shared": (bytes, seconds)}, "fallbacks": {saved
        #: rank: why its local copy was dropped}, "local_copy": directory or None}.
        self.last_read: Optional[Dict[str, Any]] = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _objects(self, reader: CheckpointReader) -> Dict[str, Any]:
        objects: Dict[str, Any] = {}
        for rank in reader.ranks():
            objects.update(reader.load_objects(rank)[_payload.OBJECTS])
        return objects

    def load(self, sharded_state_dict, checkpoint_dir):
        reader = CheckpointReader(str(checkpoint_dir), verify=self.verify,
                                  allow_pickle=self.allow_pickle, local_dir=self.local_dir)
        try:
            objects = None
            known = set(reader.tensor_keys(shards_only=True))

            def load_one(item):
                nonlocal objects
                if isinstance(item, ShardedObject):
                    if objects is None:
                        objects = self._objects(reader)
                    if item.unique_key not in objects:
                        raise CheckpointError(f"object {item.unique_key!r} is not in the checkpoint "
                                              "(saved with another model or layout?)",
                                              file=str(checkpoint_dir))
                    return objects[item.unique_key]
                if not isinstance(item, ShardedTensor):
                    return item
                if item.key not in known:
                    raise CheckpointError("tensor is not in the checkpoint (saved with another "
                                          "model?)", file=str(checkpoint_dir), tensor=item.key)
                return _read_shard(reader, item)

            return dict_list_map_inplace(load_one, sharded_state_dict)
        finally:
            self.last_read = {"sources": reader.read_stats(), "fallbacks": dict(reader.fallbacks),
                              "local_copy": None if self.local_dir is None else
                              local_version_dir(self.local_dir, str(checkpoint_dir))}
            reader.close()

    def load_tensors_metadata(self, checkpoint_dir):
        reader = CheckpointReader(str(checkpoint_dir), verify=False)
        try:
            out = {}
            for key in reader.tensor_keys(shards_only=True):
                meta = reader.tensor_meta(key)
                out[key] = ShardedTensor.from_rank_offsets(
                    key, torch.empty(meta.global_shape, dtype=meta.dtype, device="meta"))
            return out
        finally:
            reader.close()

    def load_sharded_metadata(self, checkpoint_dir):
        out = dict(self.load_tensors_metadata(checkpoint_dir))
        reader = CheckpointReader(str(checkpoint_dir), verify=False, allow_pickle=self.allow_pickle)
        try:
            for unique_key in self._objects(reader):
                out[unique_key] = ShardedObject.empty_from_unique_key(unique_key)
        finally:
            reader.close()
        return out

    def check_backend_compatibility(self, loaded_backend):
        if loaded_backend != BACKEND:
            raise CheckpointError(f"checkpoint backend is {loaded_backend!r}, expected {BACKEND!r}")

    def check_version_compatibility(self, loaded_version):
        if int(loaded_version) > BACKEND_VERSION:
            raise CheckpointError(f"checkpoint backend version {loaded_version} is newer than this "
                                  f"reader ({BACKEND_VERSION}); upgrade datastates")


def read_sharded_tensor(sh: ShardedTensor, saved_shape, saved_dtype: torch.dtype,
                        read: Callable[[tuple, tuple], torch.Tensor], *,
                        where: str = "", name: Optional[str] = None) -> torch.Tensor:
    """This rank's box of `sh` from a saved global tensor of `saved_shape`, read with
    `read(global_offset, shape)` (only that box is read). With `allow_shape_mismatch` (e.g. a
    vocabulary padded differently at another TP), the part outside the saved shape is zero.
    Shared by every reader of ours (DataStates shards, universal checkpoints)."""
    want, saved = tuple(sh.global_shape), tuple(saved_shape)
    local = tuple(sh.local_shape)
    box = (1,) * sh.prepend_axis_num + local
    if saved == want:
        out = read(tuple(sh.global_offset), box)
    elif sh.allow_shape_mismatch and len(saved) == len(want):
        out = torch.zeros(box, dtype=saved_dtype)
        lo = tuple(sh.global_offset)
        hi = tuple(min(o + b, g) for o, b, g in zip(lo, box, saved))
        if all(h > o for o, h in zip(lo, hi)):
            out[tuple(slice(0, h - o) for o, h in zip(lo, hi))] = \
                read(lo, tuple(h - o for o, h in zip(lo, hi)))
    else:
        raise CheckpointError(f"global shape mismatch: checkpoint {list(saved)}, model "
                              f"{list(want)}", file=where or None, tensor=name or sh.key)
    if out.dtype != sh.dtype:
        out = out.to(sh.dtype)
    return out.reshape(local)


def _read_shard(reader: CheckpointReader, sh: ShardedTensor) -> torch.Tensor:
    meta = reader.tensor_meta(sh.key)
    data = sh.data
    box = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    if (isinstance(data, torch.Tensor) and data.device.type == "cpu" and data.dtype == meta.dtype
            and data.is_contiguous() and tuple(data.shape) == tuple(sh.local_shape)
            and tuple(meta.global_shape) == tuple(sh.global_shape)
            and sh.flattened_range is None):
        # Into the tensor the state dict already holds, as torch_dist's load does: no new
        # allocation, and the reader's buffer is reused from one read to the next.
        reader.read(sh.key, tuple(sh.global_offset), box, out=data.detach().view(box))
        return data
    return read_sharded_tensor(sh, meta.global_shape, meta.dtype,
                               lambda off, shape: reader.read(sh.key, off, shape),
                               where=reader.directory)


class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron's common.pt (and per-object ``.pt`` files) read with `safe_load.torch_load`:
    `weights_only=True` whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says, a refusal naming the file
    and the offending global, and plain pickle only with `allow_unsafe_pickle`."""

    def __init__(self, allow_unsafe_pickle: bool = False):
        super().__init__()
        self.allow_unsafe_pickle = allow_unsafe_pickle

    def load_common(self, checkpoint_dir):
        return saved_common(str(checkpoint_dir), self.allow_unsafe_pickle)

    def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
        def load_one(sh_obj):
            # the key comes from this run's model, not from the checkpoint
            path = os.path.join(str(checkpoint_dir), f"{sh_obj.unique_key}.pt")
            return torch_load(path, file=path, allow_unsafe=self.allow_unsafe_pickle)

        return dict_list_map_inplace(load_one, sharded_objects_state_dict)


#: Reentrant: megatron-core's `load_sharded_metadata` (a --dist-ckpt-strictness other than the
#: default) calls `load_tensors_metadata` on the same strategy, inside the first patch.
_PATCH_LOCK = threading.RLock()


class SafeTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
    """megatron-core's torch_dist load without its two pickle reads: PyTorch DCP reads the
    ``.metadata`` file with `pickle.load` and every saved object (e.g. ``rng_state``) with
    `torch.load(weights_only=False)`. megatron looks its reader factory and planner class up as
    module globals on each call, so for the length of a call we hand it `SafeFileSystemReader` and
    a planner with `SafeBytesMixin` (the lock keeps two loads in one process from interleaving)."""

    def __init__(self, allow_unsafe_pickle: bool = False):
        super().__init__()
        self.allow_unsafe_pickle = allow_unsafe_pickle

    @contextlib.contextmanager
    def _safe_readers(self, checkpoint_dir) -> Iterator[None]:
        from megatron.core.dist_checkpointing.strategies import torch as mtorch

        unsafe, directory = self.allow_unsafe_pickle, str(checkpoint_dir)

        def reader(path, cache_metadata=False):
            return SafeFileSystemReader(path, allow_unsafe=unsafe)

        class Planner(SafeBytesMixin, _MCORE_PLANNER):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=directory, allow_unsafe=unsafe, **kwargs)

        with _PATCH_LOCK:
            saved = mtorch._get_filesystem_reader, mtorch.MCoreLoadPlanner
            mtorch._get_filesystem_reader, mtorch.MCoreLoadPlanner = reader, Planner
            try:
                yield
            finally:
                mtorch._get_filesystem_reader, mtorch.MCoreLoadPlanner = saved

    def load(self, sharded_state_dict, checkpoint_dir):
        with self._safe_readers(checkpoint_dir):
            try:
                return super().load(sharded_state_dict, checkpoint_dir)
            except BaseException as err:  # DCP's CheckpointException is a BaseException
                reraise_dcp_failure(err)
                raise

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        with self._safe_readers(checkpoint_dir):
            return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir):
        with self._safe_readers(checkpoint_dir):
            return super().load_sharded_metadata(checkpoint_dir)


class AgreedLoadStrategy(LoadShardedStrategy):
    """`base`'s reads of a checkpoint's tensors, agreed on by every rank (`control_plane.agree`):
    a shard damaged where one rank reads stops every rank with one error naming the ranks that
    found it (`describe` words each), instead of one line per rank or a rank left waiting in the
    next collective. Every rank calls `load` at the same point of `dist_checkpointing.load` (its
    last step, after its collectives; inside `FullyParallelLoadStrategyWrapper`, before its
    exchange), so the agreement meets no other collective."""

    def __init__(self, base: LoadShardedStrategy, what: str,
                 describe: Callable[[BaseException], Optional[str]] = str):
        super().__init__()
        self.base, self.what, self.describe = base, what, describe

    def load(self, sharded_state_dict, checkpoint_dir):
        return control_plane.agree(lambda: self.base.load(sharded_state_dict, checkpoint_dir),
                                   self.what, describe=self.describe)

    def load_tensors_metadata(self, checkpoint_dir, *args, **kwargs):
        return self.base.load_tensors_metadata(checkpoint_dir, *args, **kwargs)

    def load_sharded_metadata(self, checkpoint_dir):
        return self.base.load_sharded_metadata(checkpoint_dir)

    @property
    def can_handle_sharded_objects(self):
        return self.base.can_handle_sharded_objects

    def check_backend_compatibility(self, loaded_backend):
        return self.base.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version):
        return self.base.check_version_compatibility(loaded_version)


def load_strategies(checkpoint_dir: str, allow_unsafe_pickle: bool = False,
                    local_dir: Optional[str] = None):
    """(sharded, common) load strategies for `dist_checkpointing.load` that read the checkpoint in
    `checkpoint_dir` without running code from it (unless `allow_unsafe_pickle`). The backend is
    the one its metadata.json names: ours or megatron's torch_dist. `local_dir`: this rank's
    node-local directory (ours only): intact local copies of shards are read from there."""
    backend = sharded_backend(str(checkpoint_dir))
    if backend is None:
        raise CheckpointError(f"no readable {CONFIG_FNAME} naming a sharded backend: not a "
                              "dist_checkpointing checkpoint", file=str(checkpoint_dir))
    common = SafeCommonLoadStrategy(allow_unsafe_pickle)
    if backend == BACKEND:
        return DataStatesLoadStrategy(allow_pickle=allow_unsafe_pickle,
                                      local_dir=local_dir), common
    if backend == "torch_dist":
        return SafeTorchDistLoadStrategy(allow_unsafe_pickle), common
    raise CheckpointError(f"{CONFIG_FNAME} names sharded backend {backend!r}; "
                          f"expected {BACKEND!r} or 'torch_dist'", file=str(checkpoint_dir))


def register() -> None:
    """Make stock `dist_checkpointing.load` route checkpoints whose metadata.json names our backend
    to `DataStatesLoadStrategy` (the ('torch_dist', 1) key is re-registered by megatron-core on
    every lookup, so we use a name of our own)."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, BACKEND_VERSION,
                              DataStatesLoadStrategy())


register()  # importing this module is enough (see _megatron_hook)
