"""`ModelStateCache`: the model's sharded state dict kept between the in-memory level's saves only
while it can only be what megatron would build again. One process, a tiny GPT built as the
trainer builds it (no training); the in-memory level's runs (test_in_memory_level,
test_peer_replica) check what the saves hold end to end.
"""
import pytest
import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from trainer_launch import TINY_MODEL, free_port


@pytest.fixture
def model(monkeypatch):
    from megatron.training.arguments import build_run_config, parse_args
    from megatron.training.training import setup

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    trainer = setup(build_run_config(parse_args(TINY_MODEL + ["--num-layers", "2",
                                                              "--train-iters", "2"])))
    return trainer.state.model  # the process group goes with the conftest's autouse fixture


def _tensors(sd):
    return {(v.key, tuple(v.global_offset)): v for v in nested_values(sd)
            if isinstance(v, ShardedTensor)}


def test_reused_only_while_the_tensors_stay_and_each_save_gets_its_own_copy(model,
                                                                                monkeypatch):
    from megatron.training.checkpointing.contents import ModelStateCache, model_sharded_state_dict

    cache = ModelStateCache()
    first = cache.get(model)
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
