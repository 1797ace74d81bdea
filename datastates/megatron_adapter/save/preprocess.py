"""megatron-core's save preprocessing in one walk, for the saves that need nothing else of its call.

`dist_checkpointing.save` prepares a sharded state dict in four walks before its strategies see
it (`save_preprocess`): factories applied, LocalNonpersistentObjects dropped, the ShardedBase items
split from the rest (the common state, which becomes common.pt), ShardedTensors with an empty
flattened range dropped. The lazy path walked the same dict twice more before that (the node-local
level's replica claim, the save plan's fingerprint). At the 117M GPT's ~300 tensors each walk
costs 0.3-0.5 ms of the training thread, and a level that saves every iteration pays them every
iteration.

`split` does all of it in one walk: the sharded items in the order megatron's sharded part lists
them (`nested_values`), and the common state dict megatron would build, container for container
(new dicts and lists where megatron makes new ones, the caller's objects where it keeps them, so
`torch.save` writes the same bytes). tests/test_preprocess.py compares both with megatron's own
functions, on generated nestings and on the trainer's real state dicts.

When megatron's call does nothing more than that (`LazyCheckpointer.save`, while the save plan is
reused: no validation, so no collective in it), the save skips it: common.pt is serialized from
`common` by the same strategy megatron would call, the sharded strategy's `async_save` gets
`items`, and metadata.json is written by the commit thread, as for every lazy save.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
)

__all__ = ["CONTENT_METADATA_KEY", "Split", "split"]

#: Where megatron's save puts its `content_metadata` argument
#: (`serialization._CONTENT_METADATA_KEY`).
CONTENT_METADATA_KEY = "content_metadata"


class Split(NamedTuple):
    items: List[ShardedBase]
    """ShardedTensors and ShardedObjects, in megatron's order (its sharded part's
    `nested_values`), the caller's objects."""
    common: dict
    """What megatron saves as common.pt."""


class _Factory(Exception):
    """A ShardedTensorFactory met in the walk: megatron's `apply_factories` runs first."""


def split(sharded_state_dict: dict, content_metadata: Optional[dict] = None,
          claim: bool = False) -> Split:
    """megatron's `save_preprocess` (without its validation) in one walk. Like megatron's save,
    it puts `content_metadata` (when given) into `sharded_state_dict` and applies its factories
    in place. `claim`: every item's replica id is set to 0 on the way, so this rank writes all
    it holds (a node-local version: each node's copy loads back alone)."""
    if content_metadata is not None:
        sharded_state_dict[CONTENT_METADATA_KEY] = content_metadata
    items: List[ShardedBase] = []
    try:
        common = _dict(sharded_state_dict, items, claim)
    except _Factory:
        apply_factories(sharded_state_dict)
        items = []
        common = _dict(sharded_state_dict, items, claim)
    return Split(items, common)


def _sharded(v: ShardedBase, items: List[ShardedBase], claim: bool) -> None:
    if isinstance(v, ShardedTensorFactory):
        raise _Factory
    if claim:
        v.replica_id = 0
    r = v.flattened_range if isinstance(v, ShardedTensor) else None
    if r is not None and r.start == r.stop:
        return  # megatron's `filter_out_empty_flatten_tensor`
    items.append(v)


# The two walks below follow megatron's `extract_matching_values` as `save_preprocess` composes
# it (non-persistent objects out, then the sharded items out): in a dict, an empty list or dict
# is kept as a new empty one and a non-empty one only if something common is left in it; in a
# list, an empty one is kept as it is (the same object) and a non-empty one as in a dict.

def _dict(x: dict, items: List[ShardedBase], claim: bool) -> dict:
    out = {}
    for k, v in x.items():
        if isinstance(v, (dict, list)):
            if not v:
                out[k] = {} if isinstance(v, dict) else []
                continue
            c = _dict(v, items, claim) if isinstance(v, dict) else _list(v, items, claim)
            if c:
                out[k] = c
        elif isinstance(v, ShardedBase):
            _sharded(v, items, claim)
        elif not isinstance(v, LocalNonpersistentObject):
            out[k] = v
    return out


def _list(x: list, items: List[ShardedBase], claim: bool) -> list:
    out = []
    for v in x:
        if isinstance(v, (dict, list)) and v:
            c = _dict(v, items, claim) if isinstance(v, dict) else _list(v, items, claim)
            if c:
                out.append(c)
        elif isinstance(v, ShardedBase):
            _sharded(v, items, claim)
        elif not isinstance(v, LocalNonpersistentObject):
            out.append(v)
    return out
