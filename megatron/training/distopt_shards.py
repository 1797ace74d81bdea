"""The distributed optimizer's state, saved lazily: each DP rank's own ranges, no gather.

megatron-core's `fully_reshardable` format builds, inside `sharded_state_dict()`, a full copy of
every parameter's main weight and Adam moments on every DP rank (an all-gather plus a
`gc.collect()`), so the save call itself costs time proportional to the optimizer state. Here each
DP rank instead describes the slices it already owns: a DP rank owns a contiguous range of each
parameter's flattened (TP-local) tensor, which we cut into boxes (each contiguous in memory) of the
same global tensors, under the same keys (`optimizer.state.{param,exp_avg,exp_avg_sq}.<param key>`).
The boxes are views of the live tensors, copied by the engine while the next forward/backward runs.

Loading is unchanged: megatron's `fully_reshardable` load asks for whole TP-local boxes of those
keys, and the DataStates reader assembles any box from the saved pieces, at any TP/PP/DP.
"""
from __future__ import annotations

import math
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
Box = Tuple[Tuple[int, ...], Tuple[int, ...], int]  # (offset, shape, flat start)


def flat_range_boxes(start: int, end: int, shape: Sequence[int]) -> Iterator[Box]:
    """Cover the row-major flat range [start, end) of an array of `shape` with boxes that are each
    contiguous in memory; yields (offset, box shape, flat index of the box's first element)."""
    shape = tuple(shape)
    if start >= end:
        return
    if not shape:
        yield (), (), start
        return
    inner = math.prod(shape[1:])
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(end, inner)
    if i0 == i1:
        for off, shp, f in flat_range_boxes(r0, r1, shape[1:]):
            yield (i0,) + off, (1,) + shp, f + i0 * inner
        return
    if r0:
        for off, shp, f in flat_range_boxes(r0, inner, shape[1:]):
            yield (i0,) + off, (1,) + shp, f + i0 * inner
        i0 += 1
    if i1 > i0:
        yield (i0,) + (0,) * (len(shape) - 1), (i1 - i0,) + shape[1:], i0 * inner
    if r1:
        for off, shp, f in flat_range_boxes(0, r1, shape[1:]):
            yield (i1,) + off, (1,) + shp, f + i1 * inner


def supported(optimizer) -> bool:
    """A single megatron DistributedOptimizer with plain fp32 main params and Adam moments."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return (len(inner) == 1 and isinstance(inner[0], DistributedOptimizer)
            and not inner[0].config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def _distributed(optimizer):
    return getattr(optimizer, "chained_optimizers", [optimizer])[0]


def optimizer_common_state(optimizer) -> dict:
    """What megatron's `fully_reshardable` sharded_state_dict holds besides the parameter state
    (param groups with the step, grad scaler), with an empty parameter state: the lazily saved
    boxes below fill it at load time."""
    state = _distributed(optimizer).state_dict()
    state["param_state"] = {}
    state["param_state_sharding_type"] = "fully_reshardable"
    return state


def param_state_boxes(optimizer, model_sharded_state_dict) -> List[Tuple[str, torch.Tensor,
                                                                          Tuple[int, ...],
                                                                          Tuple[int, ...]]]:
    """(key, live view, global shape, global offset) for every box of this DP rank's main params
    and Adam moments."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    dopt = _distributed(optimizer)
    by_param: Dict[int, ShardedTensor] = {
        id(sh.data): sh for sh in nested_values(model_sharded_state_dict)
        if isinstance(sh, ShardedTensor)}
    out = []
    for gbuf_range_maps in dopt.gbuf_ranges:
        for bucket_maps in gbuf_range_maps.values():
            for bucket in bucket_maps:
                for model_param, ranges in bucket["param_map"].items():
                    sh: Optional[ShardedTensor] = by_param.get(id(model_param))
                    if sh is None:
                        raise ValueError("a parameter of the distributed optimizer is missing from "
                                         "the model's sharded state dict")
                    local = (1,) * sh.prepend_axis_num + tuple(model_param.shape)
                    prange = ranges["param"]
                    tensors = dopt._get_main_param_and_optimizer_states(model_param)
                    for off, shape, flat in flat_range_boxes(prange.start, prange.end, local):
                        lo = flat - prange.start
                        n = math.prod(shape)
                        goff = tuple(g + o for g, o in zip(sh.global_offset, off))
                        for k in STATE_KEYS:
                            view = tensors[k].detach().view(-1)[lo:lo + n].view(shape)
                            out.append((f"optimizer.state.{k}.{sh.key}", view,
                                        tuple(sh.global_shape), goff))
    return out
