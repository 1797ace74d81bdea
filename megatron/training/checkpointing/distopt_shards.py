"""The distributed optimizer's state, saved lazily: each DP rank's own ranges, no gather.

megatron-core's `fully_reshardable` format builds, inside `sharded_state_dict()`, a full copy of
every parameter's main weight and Adam moments on every DP rank (an all-gather plus a
`gc.collect()`), so the save call itself costs time proportional to the optimizer state. Here each
DP rank instead describes the slices it already owns: a DP rank owns a contiguous range of each
parameter's flattened (TP-local) tensor, which we cut into boxes (each contiguous in memory) of the
same global tensors, under the same keys (`optimizer.state.{param,exp_avg,exp_avg_sq}.<param key>`).
The boxes are views of the live tensors, copied by the engine while the next forward/backward runs.
A parameter that megatron-core saves through a ShardedTensorFactory (swiglu's fc1, whose local rows
are two slices of the global tensor) is cut into the pieces the factory builds first.

Loading a DataStates checkpoint is the same in reverse (`param_state_sharded_tensors`): each DP
rank asks for the boxes of its own ranges at the run's layout, as ShardedTensors whose data are
views of the optimizer's tensors, and the reader assembles each box from the saved pieces (any
TP/PP/DP) straight into the optimizer. megatron's `fully_reshardable` load instead has every rank
read the whole TP-local tensors of every parameter into zero-filled buffers the size of the model
(`get_parameter_state_dp_zero`) and keep 1/DP of them. A node-local version (whose node holds only
its ranks' pieces) loads the same way: at its own layout each rank's boxes are the ones it saved.
"""
from __future__ import annotations

import math
from typing import Iterator, List, Sequence, Tuple

import torch

from megatron.training.model import leaf_sharded_tensors

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


def _pieces(entry, param: torch.Tensor) -> List[Tuple[object, int]]:
    """(ShardedTensor, flat index of its first element in `param`) for each global piece of a
    parameter: the parameter itself, or the contiguous views a ShardedTensorFactory cuts it into
    (swiglu's fc1: the first half of its rows belongs to one global row range, the second half to
    another)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(entry, ShardedTensor):
        return [(entry, 0)]
    assert isinstance(entry, ShardedTensorFactory)
    pieces = []
    for sh in leaf_sharded_tensors(entry.build()):
        start, rest = divmod(sh.data.data_ptr() - param.data_ptr(), param.element_size())
        if rest or not sh.data.is_contiguous() or start < 0 \
                or start + sh.data.numel() > param.numel():
            raise ValueError(f"{entry.key}: a checkpoint piece is not a contiguous part of its "
                             "parameter; the lazy distributed-optimizer save cannot describe it")
        pieces.append((sh, start))
    return pieces


def param_range_boxes(entry, param: torch.Tensor, start: int, end: int) -> Iterator[tuple]:
    """Boxes of the flat range [start, end) of `param` (a DP rank's share), whose sharded-state
    entry is `entry`: (key, global shape, global offset, box shape, flat index in `param`)."""
    for sh, base in _pieces(entry, param):
        # The part of the range inside this piece, in the piece's own flat indices.
        lo, hi = max(start, base) - base, min(end, base + sh.data.numel()) - base
        local = (1,) * sh.prepend_axis_num + tuple(sh.data.shape)
        for off, shape, flat in flat_range_boxes(lo, hi, local):
            goff = tuple(g + o for g, o in zip(sh.global_offset, off))
            yield sh.key, tuple(sh.global_shape), goff, shape, base + flat


def param_state_boxes(optimizer, model_sharded_state_dict) -> List[Tuple[str, torch.Tensor,
                                                                          Tuple[int, ...],
                                                                          Tuple[int, ...]]]:
    """(key, live view, global shape, global offset) for every box of this DP rank's main params
    and Adam moments."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    dopt = _distributed(optimizer)
    by_param = {id(sh.data): sh for sh in nested_values(model_sharded_state_dict)
                if isinstance(sh, (ShardedTensor, ShardedTensorFactory))}
    out = []
    for model_param, prange, tensors in _own_ranges(dopt):
        entry = by_param.get(id(model_param))
        if entry is None:
            raise ValueError("a parameter of the distributed optimizer is missing from the "
                             "model's sharded state dict")
        for key, gshape, goff, shape, flat in param_range_boxes(entry, model_param, prange.start,
                                                                prange.end):
            first, n = flat - prange.start, math.prod(shape)
            for k in STATE_KEYS:
                view = tensors[k].detach().view(-1)[first:first + n].view(shape)
                out.append((f"optimizer.state.{k}.{key}", view, gshape, goff))
    return out


def state_tensors(optimizer) -> List[torch.Tensor]:
    """Every tensor `param_state_boxes` takes views of, in its order (a save keeps its boxes
    while these are the same tensors at the same addresses, `lazy.LazyCheckpointManager`)."""
    return [tensors[k] for _, _, tensors in _own_ranges(_distributed(optimizer))
            for k in STATE_KEYS]


def _own_ranges(dopt) -> Iterator[tuple]:
    """(model param, this DP rank's flat range of it, its main param and Adam moments) for every
    parameter of the distributed optimizer `dopt`, in its buffers' order."""
    for gbuf_range_maps in dopt.gbuf_ranges:
        for bucket_maps in gbuf_range_maps.values():
            for bucket in bucket_maps:
                for model_param, ranges in bucket["param_map"].items():
                    yield (model_param, ranges["param"],
                           dopt._get_main_param_and_optimizer_states(model_param))


def param_state_sharded_tensors(optimizer, model_sharded_state_dict) -> list:
    """The boxes `param_state_boxes` describes, as ShardedTensors whose data are views of this DP
    rank's main params and Adam moments: a load reads each box in place. The optimizer's state
    must exist (`init_distributed_optimizer_state`) and be kept by its `load_state_dict`
    (`state_pointers` checks it)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [ShardedTensor(key, view, view.dtype, tuple(view.shape), tuple(gshape), tuple(goff),
                          axis_fragmentations=None)
            for key, view, gshape, goff in param_state_boxes(optimizer, model_sharded_state_dict)]


def allocate_state(optimizer) -> bool:
    """Give a fresh distributed optimizer's torch Adam/AdamW its state tensors, uninitialized,
    through the optimizer's own `load_state_dict`, for a load that then reads every element of
    them in place (`param_state_sharded_tensors` covers each main param's whole range). What
    megatron-core does instead on CPU is a dummy optimizer step over zero gradients (~0.4 s per
    60M parameters here). False, and nothing done, for another inner optimizer (TE's or Apex's
    FusedAdam, the hybrid CPU offload) or one that already has state."""
    inner = _distributed(optimizer).optimizer
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or inner.state:
        return False
    current = inner.state_dict()
    state, index = {}, 0
    for group in inner.param_groups:
        for param in group["params"]:
            entry = {"step": torch.tensor(0.0), "exp_avg": torch.empty_like(param),
                     "exp_avg_sq": torch.empty_like(param)}
            if group.get("amsgrad"):
                entry["max_exp_avg_sq"] = torch.zeros_like(param)
            state[index] = entry
            index += 1
    inner.load_state_dict({"state": state, "param_groups": current["param_groups"]})
    return True


def state_pointers(optimizer) -> List[int]:
    """Where each of this DP rank's main params and Adam moments lives, in a fixed order: equal
    before and after a load when the optimizer kept the tensors a load read into."""
    return [tensors[k].data_ptr() for _, _, tensors in _own_ranges(_distributed(optimizer))
            for k in STATE_KEYS]
