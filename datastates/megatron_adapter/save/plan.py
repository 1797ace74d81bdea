"""Cached save plans: what a lazy save may skip while the sharded structure stays the same.

Everything megatron-core checks before a save depends only on the *structure* of the sharded
state dict: which ShardedTensors/ShardedObjects there are, their keys, dtypes, local and global
shapes, global offsets, replica ids. Its sharding validation (an `all_gather_object` of every
rank's shard metadata, then rank 0 checks that the main replicas tile each global tensor) and the
fully-parallel wrapper's distribution of replicated shards are recomputed per save although they
give the same answer every time. This module decides, per save, whether they can be reused.

Call order, every rank, once per save (collective under `StructurePolicy.CHECK`):
  1) `plan = cache.prepare(items, extra_shards)` before the save, with the sharded items of the
     dict after megatron's factories (`preprocess.split`): takes the structural fingerprint (one
     pass over the items; values are not looked at) and, with `CHECK`, agrees across ranks
     whether every rank's fingerprint equals its previous one (one all-reduce of one integer on
     the control plane).
  2) `plan.validate` is what to pass as `validate_access_integrity`; `plan.reuse_distribution`
     False means the caller must drop a cached fully-parallel wrapper (its distribution belongs
     to the old structure). While it is True, megatron's save call has nothing left to do that
     `preprocess.split` did not (no validation, no collective): the caller may skip it.
  3) `cache.confirm()` once the save call succeeded, `cache.forget()` if it raised.
Policies (`StructurePolicy`): CHECK (default) never reuses a plan made for another structure;
ASSUME_CONSTANT (Megatron-LM's `--ckpt-assume-constant-structure`) validates the first save only
and skips even the fingerprint afterwards: the user vouches that nothing changes.

Skipping megatron's validation also skips its check that the common (non-sharded) state is equal
on every rank; it runs again whenever the structure changes (as under Megatron's flag, where it
never runs again). With ASSUME_CONSTANT a save has no collective at all, so other ranks may start
writing shards before rank 0 has set aside room for the commit marker (see
`LazyCheckpointer.save`); with CHECK the plan check's all-reduce still orders them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)

from ... import control_plane
from ...flatten import TensorShard

__all__ = ["PreparedSave", "SavePlanCache", "StructurePolicy", "fingerprint"]


class StructurePolicy(str, enum.Enum):
    CHECK = "check"  # fingerprint every save; reuse only while every rank's is unchanged
    ASSUME_CONSTANT = "assume_constant"  # --ckpt-assume-constant-structure: validate once


@dataclass(frozen=True)
class PreparedSave:
    validate: bool
    """Run megatron-core's sharding validation on this save (`validate_access_integrity`)."""
    reuse_distribution: bool
    """A fully-parallel wrapper's cached distribution of replicated shards is still valid."""
    failed: bool = False
    """The caller's own preparation failed on some rank (`prepare(local_failed=...)`): every
    rank that knows it skips the save call (see `prepare`)."""
    along: Tuple[int, ...] = ()
    """The caller's values passed as `prepare(along=...)`, each the maximum over every rank."""


def fingerprint(sharded_state_dict: Any, extra_shards: Sequence[TensorShard] = ()) -> List[tuple]:
    """Everything a save plan depends on, in the dict's order (or the items' of a list); no
    tensor data is read. Two saves with equal fingerprints get the same validation result, the
    same distribution of replicated shards and the same engine layout."""
    out: List[tuple] = []
    for item in nested_values(sharded_state_dict):
        if isinstance(item, ShardedTensor):
            data, r = item.data, item.flattened_range
            out.append(("T", item.key, data.dtype, data.shape, item.global_shape,
                        item.global_offset, item.axis_fragmentations, item.replica_id,
                        item.prepend_axis_num, None if r is None else (r.start, r.stop),
                        item.allow_shape_mismatch))
        elif isinstance(item, ShardedObject):
            out.append(("O", item.key, item.global_shape, item.global_offset, item.replica_id))
        elif isinstance(item, ShardedTensorFactory):  # the caller applies them first
            raise TypeError(f"fingerprint: apply megatron's factories first ({item.key!r}), "
                            "e.g. with preprocess.split")
    for sh in extra_shards:
        out.append(("X", sh.key, sh.data.dtype, tuple(sh.data.shape), sh.global_shape,
                    sh.global_offset))
    return out


class SavePlanCache:
    """Per-rank memory of the previous save's structure (see module doc for the call order)."""

    def __init__(self, policy: StructurePolicy = StructurePolicy.CHECK):
        self.policy = policy
        self._previous: Optional[List[tuple]] = None
        self._staged: Optional[List[tuple]] = None
        self._saved_once = False
        #: Saves whose plan was rebuilt / reused (for the report and the tests).
        self.rebuilt = 0
        self.reused = 0

    def prepare(self, sharded_state_dict: Any, extra_shards: Sequence[TensorShard] = (),
                local_failed: bool = False, agree: bool = False,
                along: Sequence[int] = ()) -> PreparedSave:
        """`sharded_state_dict`: the save's dict, or its sharded items, with megatron's factories
        applied (`preprocess.split` does both). `local_failed`: the caller's preparation of this
        save (rank 0's directory) failed here. Under CHECK it rides on the plan check's all-reduce,
        so every rank learns it before megatron's collectives and skips the save call (`failed`);
        under ASSUME_CONSTANT only `agree=True` (or a first save) adds that all-reduce: otherwise a
        save has no collective and only the failing rank skips its call. `along`: more of the
        caller's own values, reduced (maximum over the ranks) in the same all-reduce, which then
        runs under ASSUME_CONSTANT too (one round over every rank instead of two)."""
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        along = tuple(int(v) for v in along)
        if self.policy is StructurePolicy.ASSUME_CONSTANT:
            same = self._saved_once
            failed = local_failed
            if distributed and (agree or not same or along):
                failed, *along = control_plane.all_reduce([int(local_failed), *along],
                                                          op=dist.ReduceOp.MAX)
        else:
            self._staged = fingerprint(sharded_state_dict, extra_shards)
            same = self._previous is not None and self._staged == self._previous
            failed = local_failed
            if distributed:
                # One rank's change invalidates every rank's plan: the validation and the
                # distribution are collective.
                changed, failed, *along = control_plane.all_reduce(
                    [0 if same else 1, int(local_failed), *along], op=dist.ReduceOp.MAX)
                same = not changed
        if same:
            self.reused += 1
        else:
            self.rebuilt += 1
        return PreparedSave(validate=not same, reuse_distribution=same, failed=bool(failed),
                            along=tuple(along))

    @property
    def has_plan(self) -> bool:
        """Whether a save was confirmed since the last rebuild: the next one reuses its plan
        unless some rank's structure changed (under CHECK; under ASSUME_CONSTANT it does)."""
        return self._saved_once if self.policy is StructurePolicy.ASSUME_CONSTANT \
            else self._previous is not None

    def confirm(self) -> None:
        """3) after `dist_checkpointing.save` returned: the structure just saved (and, on a
        rebuild, validated) is the one the next save is compared with."""
        if self.policy is StructurePolicy.CHECK:
            self._previous, self._staged = self._staged, None
        self._saved_once = True

    def forget(self) -> None:
        """After a failed save call: the next save rebuilds and validates everything."""
        self._previous = self._staged = None
        self._saved_once = False
