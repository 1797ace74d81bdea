"""What lazy saves keep of each other's sharded state dict.

A level may save up to every iteration (the in-memory one, or --save with --save-interval 1), and
the training thread builds megatron-core's sharded state dict for each save although, while the
model's and optimizer's tensors are the same objects at the same addresses, most of it can only
come out the same. `SaveStateCache` keeps the parts that are a function of those tensors and their
layout, checks per save (one walk, no tensor data read) that they still apply, and builds only the
small values that change (learning rate, step, loss scale) anew:

- `ModelStateCache`: the model's ``sharded_state_dict()`` (~2-5 ms per save for the 117M GPT on
  our CPU);
- `OptimizerStateCache`: megatron's non-distributed optimizer's (FP32Optimizer, or
  Float16OptimizerWithFloat16Params for bf16/fp16; alone or as the one optimizer of a
  ChainedOptimizer): ~3 ms per save for the 117M GPT;
- `DistOptBoxesCache`: with the distributed optimizer, this DP rank's boxes of its state
  (`distopt_shards`, saved beside megatron's dict): 2.4 of the 8.7 ms a save cost the training
  loop for the 27M GPT on our CPU.

Each save gets its own copy of the dicts and ShardedTensors (a save changes them in place: replica
ids claimed, factories applied) holding the same live tensors megatron's would. Whatever a cache
does not know (another optimizer class, Transformer Engine's extra state, factories) is built by
megatron every time, as without the cache.
"""
from __future__ import annotations

import copy
from typing import Any, List, Optional

import torch

from datastates import TensorShard

from megatron.training.checkpointing import distopt_shards
from megatron.training.checkpointing.contents import model_sharded_state_dict
from megatron.training.model import unwrap

__all__ = ["DistOptBoxesCache", "ModelStateCache", "OptimizerStateCache", "SaveStateCache"]


class ModelStateCache:
    """The model's ``sharded_state_dict()`` kept between saves while it can only be the same:
    every parameter and buffer is the same tensor object at the same address, with the same
    dtype and shape, and the dict holds nothing else that could change (`_cacheable`: no
    factories, no objects such as Transformer Engine's extra state; then it is built every
    time)."""

    def __init__(self) -> None:
        self._key: Optional[list] = None
        self._sd: Optional[dict] = None  # None with a key: this model is built every time
        #: Saves served from the cache / built (for tests and the profile; the optimizer's part
        #: is kept only while `built` stays the same).
        self.reused = 0
        self.built = 0

    def get(self, model) -> dict:
        key = _model_identity(model)
        if self._key == key and self._sd is not None:
            self.reused += 1
            return _fresh(self._sd)
        self.built += 1
        sd = model_sharded_state_dict(model)
        self._key, self._sd = key, (sd if _cacheable(sd) else None)
        return sd if self._sd is None else _fresh(sd)


def _model_identity(model) -> list:
    """What a model's sharded state dict depends on, cheaply: every module (object), and each
    of its parameters' and buffers' name, object, address, dtype and shape (the dict holds those
    very tensors). One walk over the modules without building names (`named_parameters` took
    ~0.8 ms for the 117M GPT)."""
    out: list = []
    stack = [unwrap(chunk) for chunk in reversed(model)]
    while stack:
        m = stack.pop()
        out.append(id(m))
        for tensors in (m._parameters, m._buffers):
            for name, t in tensors.items():
                if t is not None:
                    out.append((name, id(t), t.data_ptr(), t.dtype, t.shape))
        stack.extend(c for c in reversed(m._modules.values()) if c is not None)
    return out


def _cacheable(sd: dict) -> bool:
    """Whether `sd` holds nothing that may change while the model's tensors stay: ShardedTensors
    (their data is those tensors) and ShardedObjects of None (megatron's own linear layers'
    `_extra_state`: their class returns None, always; Transformer Engine's is not None, and
    changes with fp8 scaling, so a model with such layers is built for every save)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    return all((type(v) is ShardedTensor and v.flattened_range is None)
               or (type(v) is ShardedObject and v.data is None) for v in nested_values(sd))


def _fresh(obj):
    """`obj`'s dicts and lists copied, each ShardedTensor a shallow copy (same data tensor)."""
    if isinstance(obj, dict):
        return {k: _fresh(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fresh(v) for v in obj]
    return _copy(obj)


def _copy(sharded):
    out = object.__new__(type(sharded))
    out.__dict__.update(sharded.__dict__)
    return out


#: The keys megatron-core 0.16's non-distributed optimizers give their sharded state dict, in its
#: order: FP32Optimizer's is the torch optimizer's; Float16OptimizerWithFloat16Params wraps it.
_TORCH_KEYS = ["state", "param_groups"]
_FLOAT16_KEYS = (["optimizer", "grad_scaler", "fp32_from_fp16_params"],
                 ["optimizer", "fp32_from_fp16_params"])  # (without a grad scaler: bf16)


class OptimizerStateCache:
    """megatron's non-distributed optimizer's sharded state dict kept between saves while the
    model's part came from `ModelStateCache` (the optimizer's ShardedTensors take their key,
    shapes, offsets and replica id from the model's) and every state tensor (Adam's moments, the
    fp32 main parameters) is the same object at the same address. Per save only the
    small values are taken from the optimizer anew, as megatron takes them: ``param_groups``
    (learning rate, weight decay; ``params`` as a LocalNonpersistentObject), the common step
    and the grad scaler's state. What megatron built is kept only if it has the shape this
    class rebuilds (`_shape_known`); tests/test_model_state_cache.py compares both."""

    def __init__(self) -> None:
        self._owner: Any = None  # the megatron optimizer the template was built from
        self._template: Optional[dict] = None
        self._ptrs: List[int] = []  # the template's tensors' addresses, in walk order
        self._model_built = -1  # `ModelStateCache.built` when the template was made
        self.reused = 0
        self.built = 0

    def get(self, optimizer, model_sd: dict, model_built: int, metadata: dict) -> dict:
        """`model_sd` comes from `ModelStateCache`, which has built the model's dict
        `model_built` times: the template is used while it was made from the latest of them
        (a model built for every save, never kept, changes the count every time)."""
        inner = _single(optimizer)
        if self._template is not None and inner is self._owner and \
                model_built == self._model_built:
            sd = self._refresh(inner)
            if sd is not None:
                self.reused += 1
                return sd
        self.built += 1
        sd = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)
        self._owner = self._template = None
        if inner is not None and _shape_known(sd):
            self._owner, self._template, self._model_built = inner, sd, model_built
            self._ptrs = [t.data.data_ptr() for t in _template_tensors(sd)]
            out = self._refresh(inner)
            if out is not None:  # (a copy: a save changes its dict in place)
                return out
            self._owner = self._template = None
        return sd

    def _refresh(self, inner) -> Optional[dict]:
        """megatron's dict for this save from the template, or None if a tensor changed."""
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

        raw = inner.state_dict()
        float16 = "optimizer" in self._template
        torch_raw = raw["optimizer"] if float16 else raw
        held = self._template["optimizer"] if float16 else self._template
        ptrs = iter(self._ptrs)
        state: dict = {}
        live = torch_raw["state"]
        if len(live) != len(held["state"]) - ("common_step" in held["state"]):
            return None
        for pid, saved in held["state"].items():
            if pid == "common_step":
                continue
            tensors = live.get(pid)
            if tensors is None or len(tensors) - ("step" in tensors) != len(saved):
                return None
            row = {}
            for key, sharded in saved.items():
                if not _same(tensors.get(key), sharded, ptrs):
                    return None
                row[key] = _copy(sharded)
            state[pid] = row
        step = _common_step(inner, torch_raw)
        if step:
            state["common_step"] = step
        groups = [_copy_group(group) for group in torch_raw["param_groups"]]
        for group in groups:
            group["params"] = LocalNonpersistentObject(group["params"])
        out = {"state": state, "param_groups": groups}
        if not float16:
            return out
        mains = raw["fp32_from_fp16_params"]
        kept = self._template["fp32_from_fp16_params"]
        if [len(g) for g in mains] != [len(g) for g in kept]:
            return None
        fp32 = []
        for live_group, group in zip(mains, kept):
            row = []
            for t, sharded in zip(live_group, group):
                if not _same(t, sharded, ptrs):
                    return None
                row.append(_copy(sharded))
            fp32.append(row)
        whole = {"optimizer": out}
        if "grad_scaler" in raw:
            whole["grad_scaler"] = raw["grad_scaler"]
        whole["fp32_from_fp16_params"] = fp32
        return whole


def _common_step(inner, torch_raw: dict):
    """megatron's `_extract_common_per_param_step` (the first parameter's step, which every
    parameter must share), with one comparison of every step tensor at once instead of one per
    parameter (0.3 ms for the 117M GPT's 100; on a GPU, each of those waits for the device).
    Anything else (steps that differ, are not tensors or do not stack) goes to megatron's."""
    steps = [s["step"] for s in torch_raw["state"].values() if s.get("step") is not None]
    if not steps:
        return None
    if all(type(s) is torch.Tensor for s in steps):
        try:
            stacked = torch.stack(steps)
        except RuntimeError:
            stacked = None
        if stacked is not None and bool((stacked == steps[0]).all()):
            return steps[0]
    return inner._extract_common_per_param_step(torch_raw)


_IMMUTABLE = (bool, int, float, str, type(None))


def _copy_group(group: dict) -> dict:
    """`copy.deepcopy` of a torch optimizer's param group as its `state_dict()` gives it: plain
    values and tuples or lists of them (``betas``, ``params``) copied without a call per item."""
    out = {}
    for k, v in group.items():
        t = type(v)
        if t in _IMMUTABLE:
            out[k] = v
        elif (t is tuple or t is list) and all(type(x) in _IMMUTABLE for x in v):
            out[k] = v if t is tuple else list(v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _same(t, sharded, addresses) -> bool:
    """Whether the optimizer's tensor `t` is the template's `sharded` one, at its address (the
    next of `addresses`)."""
    return t is sharded.data and t.data_ptr() == next(addresses)


def _single(optimizer):
    """The megatron optimizer whose sharded state dict `OptimizerStateCache` can rebuild: an
    FP32Optimizer or Float16OptimizerWithFloat16Params, alone or the one optimizer of a
    ChainedOptimizer (which then returns that one's dict as it is); else None."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer, \
        Float16OptimizerWithFloat16Params

    if type(optimizer) is ChainedOptimizer:
        if len(optimizer.chained_optimizers) != 1:
            return None
        optimizer = optimizer.chained_optimizers[0]
    return optimizer if type(optimizer) in (FP32Optimizer, Float16OptimizerWithFloat16Params) \
        else None


def _template_tensors(sd: dict) -> list:
    """The template's ShardedTensors in the order `_refresh` meets them."""
    held = sd.get("optimizer", sd)
    out = [sharded for pid, row in held["state"].items() if pid != "common_step"
           for sharded in row.values()]
    return out + [sharded for group in sd.get("fp32_from_fp16_params", ()) for sharded in group]


def _shape_known(sd: dict) -> bool:
    """Whether megatron's dict has exactly the shape `_refresh` rebuilds (the keys in their
    order; per parameter only plain ShardedTensors; ``params`` as LocalNonpersistentObjects)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    def torch_part(part) -> bool:
        if not isinstance(part, dict) or list(part) != _TORCH_KEYS:
            return False
        rows = [v for k, v in part["state"].items() if k != "common_step"]
        return (all(isinstance(row, dict) and all(type(s) is ShardedTensor
                                                  and s.flattened_range is None
                                                  for s in row.values()) for row in rows)
                and all(isinstance(g, dict) and type(g.get("params")) is LocalNonpersistentObject
                        for g in part["param_groups"]))

    if list(sd) == _TORCH_KEYS:
        return torch_part(sd)
    return (list(sd) in _FLOAT16_KEYS and torch_part(sd["optimizer"])
            and all(type(s) is ShardedTensor and s.flattened_range is None
                    for group in sd["fp32_from_fp16_params"] for s in group))


class DistOptBoxesCache:
    """This DP rank's boxes of the distributed optimizer's state: the last save's, while the
    optimizer holds the same tensors at the same addresses (the boxes are views of them), else
    built anew. The engine only reads them: every save is handed the same list."""

    def __init__(self) -> None:
        #: (optimizer tensors, their addresses, the boxes of them) of the last save.
        self._of: Optional[tuple] = None

    def get(self, optimizer, sd: dict) -> List[TensorShard]:
        held = distopt_shards.state_tensors(optimizer)
        addresses = [t.data_ptr() for t in held]
        cached = self._of
        if cached is None or len(cached[0]) != len(held) or cached[1] != addresses or \
                any(a is not b for a, b in zip(cached[0], held)):
            boxes = [TensorShard(view, key, gshape, goff) for key, view, gshape, goff
                     in distopt_shards.param_state_boxes(optimizer, sd)]
            self._of = cached = (held, addresses, boxes)
        return cached[2]


class SaveStateCache:
    """The caches of one lazy checkpoint manager: `build_sharded_state_dict` asks for the
    model's and the optimizer's parts, the manager for the distributed optimizer's boxes."""

    def __init__(self) -> None:
        self.model = ModelStateCache()
        self.optimizer = OptimizerStateCache()
        self.boxes = DistOptBoxesCache()

    def model_part(self, model) -> dict:
        return self.model.get(model)

    def optimizer_part(self, optimizer, model_sd: dict, metadata: dict) -> dict:
        return self.optimizer.get(optimizer, model_sd, self.model.built, metadata)
