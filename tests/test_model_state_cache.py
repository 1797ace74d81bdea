"""`state_cache`: the model's and the non-distributed optimizer's sharded state dicts kept between
the in-memory level's saves only while they can only be what megatron would build again. One
process, a tiny GPT built as the trainer builds it; the in-memory level's runs
(test_in_memory_level, test_peer_replica) check what the saves hold end to end.
"""
import pytest
import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from trainer_launch import TINY_MODEL, free_port


def _trainer(monkeypatch, *flags):
    from megatron.training.arguments import build_run_config, parse_args
    from megatron.training.training import setup

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    # the process group goes with the conftest's autouse fixture
    return setup(build_run_config(parse_args(TINY_MODEL + ["--num-layers", "2",
                                                           "--train-iters", "4", *flags])))


@pytest.fixture
def model(monkeypatch):
    return _trainer(monkeypatch).state.model


def _tensors(sd):
    return {(v.key, tuple(v.global_offset)): v for v in nested_values(sd)
            if isinstance(v, ShardedTensor)}


def test_reused_only_while_the_tensors_stay_and_each_save_gets_its_own_copy(model,
                                                                                monkeypatch):
    from megatron.training.checkpointing.contents import model_sharded_state_dict
    from megatron.training.checkpointing.state_cache import ModelStateCache

    cache = ModelStateCache()
    first = cache.get(model)
    assert (cache.built, cache.reused) == (1, 0)
    fresh = model_sharded_state_dict(model)
    # What a save changes in place (the in-memory level claims every replica) stays in its copy.
    for v in nested_values(first):
        v.replica_id = 7
    second = cache.get(model)
    assert (cache.built, cache.reused) == (1, 1)
    a, b = _tensors(second), _tensors(fresh)
    assert a.keys() == b.keys() and len(a) > 10
    for k, sh in a.items():
        assert sh.data is b[k].data and sh is not _tensors(first)[k]  # the live tensor itself
        assert sh.replica_id == b[k].replica_id != 7
        assert (sh.global_shape, sh.prepend_axis_num) == (b[k].global_shape, b[k].prepend_axis_num)
    objects = [v for v in nested_values(second) if isinstance(v, ShardedObject)]
    assert objects and all(o.data is None for o in objects)  # megatron's layers' _extra_state

    # (One test: the trainer's set-up is once per process.) Rebuilt when a tensor is replaced
    # or moved, and never kept with objects that change.
    from megatron.training.model import unwrap

    cache = ModelStateCache()
    cache.get(model)
    gpt = unwrap(model[0])
    layer = gpt.decoder.layers[0].mlp.linear_fc1
    # A parameter replaced by another object: the new one is saved.
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
    sd = cache.get(model)
    assert cache.built == 2 and any(sh.data is layer.weight for sh in _tensors(sd).values())
    # Its storage swapped under the same object (`.data = ...`): rebuilt again.
    layer.weight.data = layer.weight.data.clone()
    cache.get(model)
    assert cache.built == 3
    cache.get(model)
    assert (cache.built, cache.reused) == (3, 1)
    # Layers whose extra state is not None (Transformer Engine's changes with fp8 scaling): the
    # dict is built for every save.
    row = gpt.decoder.layers[0].mlp.linear_fc2  # (the output layer's class must stay empty)
    monkeypatch.setattr(type(row), "get_extra_state", lambda self: torch.ones(1))
    cache = ModelStateCache()
    cache.get(model)
    cache.get(model)
    assert (cache.built, cache.reused) == (2, 0)


def _described(obj):
    """`obj` as comparable values: dict keys in order, each ShardedTensor's fields and the
    identity of its data, a LocalNonpersistentObject's content, a tensor's identity."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    if isinstance(obj, dict):
        return [(k, _described(v)) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_described(v) for v in obj])
    if isinstance(obj, ShardedTensor):
        return ("ST", obj.key, obj.global_shape, obj.global_offset, obj.replica_id,
                obj.prepend_axis_num, obj.dtype, obj.axis_fragmentations, id(obj.data))
    if isinstance(obj, LocalNonpersistentObject):
        return ("local", obj.unwrap())
    if isinstance(obj, torch.Tensor):
        return ("tensor", id(obj), obj.item() if obj.numel() == 1 else None)
    return obj


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_optimizer_part_is_what_megatron_builds_with_this_steps_values(monkeypatch, precision):
    from megatron.training.checkpointing.contents import OPTIMIZER_METADATA, \
        model_sharded_state_dict
    from megatron.training.checkpointing.state_cache import SaveStateCache
    from megatron.training.training import _data_iterators, train_step

    trainer = _trainer(monkeypatch, *(["--bf16"] if precision == "bf16" else []))
    state = trainer.state
    data = _data_iterators(trainer, trainer.datasets.train, 0)
    train_step(trainer, data)  # the optimizer's state exists from its first step on

    def megatrons():
        return state.optimizer.sharded_state_dict(dict(model_sharded_state_dict(state.model)),
                                                  is_loading=False, metadata=OPTIMIZER_METADATA)

    def cached():
        return cache.optimizer_part(state.optimizer, dict(cache.model_part(state.model)),
                                    OPTIMIZER_METADATA)

    cache = SaveStateCache()
    first = cached()
    assert (cache.optimizer.built, cache.optimizer.reused) == (1, 0)
    assert _described(first) == _described(megatrons())
    for _ in range(2):
        train_step(trainer, data)  # a new learning rate and step (the warm-up is 1 iteration)
        second = cached()
        assert _described(second) == _described(megatrons())
    assert (cache.optimizer.built, cache.optimizer.reused) == (1, 2)
    groups = (second.get("optimizer", second))["param_groups"]
    assert groups[0]["lr"] != (first.get("optimizer", first))["param_groups"][0]["lr"]
    assert ("grad_scaler" in second) is False  # bf16 runs without a loss scaler
    # Each save has its own ShardedTensors (a save claims replicas in place).
    held = [v for v in nested_values(second) if isinstance(v, ShardedTensor)]
    assert len(held) > 10
    for v in held:
        v.replica_id = 7
    assert _described(cached()) == _described(megatrons())

    # A state tensor replaced by another object (e.g. a load into new tensors): rebuilt, and the
    # new tensor is what is saved.
    inner = state.optimizer.chained_optimizers[0].optimizer
    param = next(iter(inner.state))
    inner.state[param]["exp_avg"] = inner.state[param]["exp_avg"].clone()
    third = cached()
    assert cache.optimizer.built == 2
    assert any(v.data is inner.state[param]["exp_avg"] for v in nested_values(third)
               if isinstance(v, ShardedTensor))
    assert _described(third) == _described(megatrons())
    # The model's part rebuilt: so is the optimizer's (its tensors take the model's layout), even
    # when the optimizer's part was not asked for in that save.
    cache.model._key = None
    cached()
    assert cache.optimizer.built == 3
    cache.model._key = None
    cache.model_part(state.model)  # (a save without the optimizer's part)
    cached()
    assert cache.optimizer.built == 4
    # Per-parameter steps that differ (megatron saves one): its error, from a reused template too.
    cached()
    assert cache.optimizer.reused == 4
    steps = [s["step"] for s in inner.state.values()]
    steps[-1].add_(1)
    with pytest.raises(ValueError, match="step differs per parameter"):
        cached()
    steps[-1].sub_(1)
    assert _described(cached()) == _described(megatrons())
