"""What the engine is handed for one rank's sharded state dict, and its cached form.

`engine_payload` turns megatron-core's sharded state dict into the engine's nested state,
{"tensors": {"key@offsets": TensorShard}, "objects": {unique_key: data}}, this rank's main
replicas only. Flattening that for the engine (`flatten_state`) walks ~160 tensors per save of
the small GPT and builds two objects per tensor, although everything but the tensors themselves
depends only on the structure: each tensor's name, key, global shape and offset, dtype and shape,
and the skeleton of the tensor part. `PayloadPlan` keeps that from the previous save and refills
it with this save's tensors, checking each one against it; only the objects (RNG states, small
values that change every save) are encoded anew. A save whose tensors do not match (another key,
offset, shape, dtype, prepended axes or count) is planned from scratch: the plan checks for
itself, so it is never applied to a structure it was not made for, whatever the fingerprint of
`plan` or --ckpt-assume-constant-structure said.

A caller that has itself proven the structure unchanged since the plan was made (`checked`: the
save plan's fingerprint, equal on every rank, `plan.SavePlanCache` under CHECK) skips the
comparison per tensor: the refill then only takes this save's tensors, in order, and their count
is still checked. The engine lays out the refilled entries as it laid out the plan's
(`FlatState.layouts`) instead of computing their file offsets again.

Call order, one rank, per save: `plan.flatten(sharded_state_dict, extra_shards, allow_pickle)` in
the save strategy's `async_save` (after megatron's preprocessing and the fully-parallel wrapper's
choice of main replicas) gives the `FlatState` for `CheckpointEngine.save`; `plan.forget()` when
the structure changed or a save call failed.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica

from ...errors import CheckpointError
from ...flatten import FlatState, TensorEntry, TensorShard, dict_skeleton, flatten_state

__all__ = ["OBJECTS", "PayloadPlan", "TENSORS", "engine_payload"]

#: The two parts of the engine payload (and of each rank's saved object skeleton).
TENSORS, OBJECTS = "tensors", "objects"


def _local_view(sh: ShardedTensor) -> torch.Tensor:
    """The shard's data with the axes megatron prepends (e.g. the layer axis) made explicit, so
    its shape matches its global offsets."""
    if sh.flattened_range is not None:
        raise CheckpointError(f"ShardedTensor {sh.key!r} uses flattened_range, which megatron-core "
                              "0.16.1 itself rejects; use the fully_reshardable optimizer format")
    data = sh.data.detach()
    if not sh.prepend_axis_num:
        return data
    return data.reshape((1,) * sh.prepend_axis_num + tuple(data.shape))


def engine_payload(sharded_state_dict, extra_shards: Sequence[TensorShard] = ()
                   ) -> Dict[str, Dict[str, Any]]:
    """This rank's main-replica tensor shards and objects, keyed uniquely across ranks, plus
    `extra_shards` this rank alone holds (described outside megatron's ShardedTensor, e.g. the
    irregular pieces of the distributed optimizer's state)."""
    tensors: Dict[str, TensorShard] = {
        f"{t.key}@{','.join(map(str, t.global_offset))}": t for t in extra_shards}
    objects: Dict[str, Any] = {}
    for item in nested_values(sharded_state_dict):
        if isinstance(item, ShardedTensor):
            if is_main_replica(item.replica_id):
                name = f"{item.key}@{','.join(map(str, item.global_offset))}"
                tensors[name] = TensorShard(_local_view(item), item.key, tuple(item.global_shape),
                                            tuple(item.global_offset))
        elif isinstance(item, ShardedObject):
            if is_main_replica(item.replica_id):
                objects[item.unique_key] = item.data
        else:
            raise CheckpointError(f"unexpected {type(item).__name__} in a sharded state dict after "
                                  "megatron's preprocessing; expected ShardedTensor/ShardedObject")
    return {TENSORS: tensors, OBJECTS: objects}


class _Expect(NamedTuple):
    """What one tensor of the payload must be for the plan to hold it."""

    key: str
    global_offset: tuple
    global_shape: tuple
    dtype: torch.dtype
    shape: torch.Size  # of the data as handed over (before megatron's prepended axes)
    prepend: int


class _Template(NamedTuple):
    expect: List[_Expect]
    entries: List[TensorEntry]  # with no tensor: copied for each save (`TensorEntry.holding`)
    tensors_skeleton: Any  # the skeleton of the payload's "tensors" dict
    layouts: dict  # the engine's layouts of these entries (`FlatState.layouts`)


def _matches(want: _Expect, key, global_offset, global_shape, data: torch.Tensor,
             prepend: int) -> bool:
    return (key == want.key and global_offset == want.global_offset
            and global_shape == want.global_shape and data.dtype == want.dtype
            and data.shape == want.shape and prepend == want.prepend)


def _main(replica_id) -> bool:
    """megatron's `is_main_replica`, without a generator per call."""
    return replica_id == 0 if isinstance(replica_id, int) else not any(replica_id)


class PayloadPlan:
    """The structure-only part of the previous save's flattened payload (see module doc)."""

    def __init__(self) -> None:
        self._template: Optional[_Template] = None
        #: Saves flattened from scratch / refilled from the plan (for the report and the tests).
        self.built = 0
        self.refilled = 0

    def forget(self) -> None:
        self._template = None

    def flatten(self, sharded_state_dict, extra_shards: Sequence[TensorShard],
                allow_pickle: bool, checked: bool = False) -> FlatState:
        """What `flatten_state(engine_payload(...))` gives, as a `FlatState`. `checked`: the
        caller vouches that this save's structure is the one the plan was made from (see the
        module doc); the tensors are then not compared with the plan one by one."""
        if self._template is not None:
            refill = self._take if checked else self._refill
            flat = refill(self._template, sharded_state_dict, extra_shards, allow_pickle)
            if flat is not None:
                self.refilled += 1
                return flat
        self.built += 1
        return self._build(sharded_state_dict, extra_shards, allow_pickle)

    def _build(self, sharded_state_dict, extra_shards, allow_pickle: bool) -> FlatState:
        self._template = None
        payload = engine_payload(sharded_state_dict, extra_shards)
        skeleton, entries = flatten_state(payload, allow_pickle)
        expect = [_Expect(sh.key, sh.global_offset, sh.global_shape, sh.data.dtype,
                          sh.data.shape, 0) for sh in extra_shards]
        expect += [_Expect(item.key, tuple(item.global_offset), tuple(item.global_shape),
                           item.data.dtype, item.data.shape, item.prepend_axis_num)
                   for item in nested_values(sharded_state_dict)
                   if isinstance(item, ShardedTensor) and is_main_replica(item.replica_id)]
        # Names that collided in the payload's dict (one shard replaced another) leave fewer
        # entries than tensors: no plan then, every save is flattened from scratch.
        if len(expect) == len(payload[TENSORS]):
            self._template = _Template(expect, [e.holding(None) for e in entries[:len(expect)]],
                                       skeleton["items"][0][1], {})
            return FlatState(skeleton, entries, self._template.layouts)
        return FlatState(skeleton, entries)

    @staticmethod
    def _refill(t: _Template, sharded_state_dict, extra_shards,
                allow_pickle: bool) -> Optional[FlatState]:
        """The plan refilled with this save's tensors, or None if one does not match it."""
        expect, n = t.expect, len(t.expect)
        entries: List[TensorEntry] = []
        for sh in extra_shards:
            i = len(entries)
            if i == n:
                return None
            if not _matches(expect[i], sh.key, sh.global_offset, sh.global_shape, sh.data, 0):
                return None
            entries.append(t.entries[i].holding(sh.data))
        objects: Dict[str, Any] = {}
        for item in nested_values(sharded_state_dict):
            if isinstance(item, ShardedTensor):
                if not _main(item.replica_id):
                    continue
                i = len(entries)
                if i == n:
                    return None
                if item.flattened_range is not None or not _matches(
                        expect[i], item.key, item.global_offset, item.global_shape, item.data,
                        item.prepend_axis_num):
                    return None
                # The entry keeps the prepended shape; the bytes are the same without the axes.
                # A parameter is handed over as it is: the copy thread detaches it.
                entries.append(t.entries[i].holding(item.data))
            elif isinstance(item, ShardedObject):
                if _main(item.replica_id):
                    objects[item.unique_key] = item.data
            else:
                return None  # the full path raises the error that names it
        if len(entries) != n:
            return None
        return _with_objects(t, entries, objects, allow_pickle)

    @staticmethod
    def _take(t: _Template, sharded_state_dict, extra_shards,
              allow_pickle: bool) -> Optional[FlatState]:
        """`_refill` for a structure the caller checked: this save's tensors in order, or None
        if there are not as many as the plan holds."""
        data = [sh.data for sh in extra_shards]
        objects: Dict[str, Any] = {}
        for item in nested_values(sharded_state_dict):
            if isinstance(item, ShardedTensor):
                if _main(item.replica_id):
                    data.append(item.data)
            elif isinstance(item, ShardedObject):
                if _main(item.replica_id):
                    objects[item.unique_key] = item.data
            else:
                return None  # the full path raises the error that names it
        if len(data) != len(t.entries):
            return None
        return _with_objects(t, [e.holding(d) for e, d in zip(t.entries, data)], objects,
                             allow_pickle)


def _with_objects(t: _Template, entries: List[TensorEntry], objects: Dict[str, Any],
                  allow_pickle: bool) -> FlatState:
    """The refilled tensor entries and this save's objects, encoded anew."""
    objects_skeleton, entries = flatten_state(objects, allow_pickle, entries, [OBJECTS])
    return FlatState(dict_skeleton([(TENSORS, t.tensors_skeleton), (OBJECTS, objects_skeleton)]),
                     entries, t.layouts)
