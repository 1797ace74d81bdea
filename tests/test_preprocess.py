"""`preprocess.split`: megatron-core's save preprocessing in one walk must give what megatron's own
four walks give (the sharded items in its order, a common state that `torch.save` writes to the
same bytes), because the steady lazy save writes common.pt and the shards from it instead of
calling megatron's save. Checked on generated nestings (every container and leaf kind megatron's
walks tell apart) and on the trainer's real state dict.
"""
import io
import random
from collections import OrderedDict

import pytest
import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

from datastates.megatron_adapter.save.preprocess import CONTENT_METADATA_KEY, split


def _megatron(sd, content_metadata, claim):
    """What megatron's `dist_checkpointing.save` hands its strategies, with no validation, after
    the lazy path's replica claim (node-local levels)."""
    if claim:  # what the lazy path did before its one walk: every replica this rank's to write
        for item in nested_values(sd):
            if hasattr(item, "replica_id"):
                item.replica_id = 0
    if content_metadata is not None:
        sd[CONTENT_METADATA_KEY] = content_metadata
    sharded, common = save_preprocess(sd, validate_access_integrity=False)
    return list(nested_values(sharded)), common


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _same(a, b) -> bool:
    """Same containers (exact types, keys in order), the very same leaf objects."""
    if type(a) in (dict, list) or type(b) in (dict, list):
        if type(a) is not type(b) or len(a) != len(b):
            return False
        if isinstance(a, dict):
            return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
        return all(_same(x, y) for x, y in zip(a, b))
    return a is b


def _build(key, data, replica_id, flattened_range):
    return {"w": ShardedTensor.from_rank_offsets(f"{key}.w", data, replica_id=replica_id),
            "b": [ShardedTensor.from_rank_offsets(f"{key}.b", data[0], replica_id=replica_id)]}


class _Gen:
    """Seeded nestings of everything megatron's walks tell apart: dicts (and a dict subclass),
    lists, empty ones (one shared empty list among them), tuples (leaves, even holding a
    ShardedTensor), LocalNonpersistentObjects, ShardedTensors (replicated, flattened, with an
    empty flattened range), ShardedObjects and, with `factories`, ShardedTensorFactories."""

    def __init__(self, seed: int, factories: bool):
        self.r = random.Random(seed)
        self.n = 0
        self.factories = factories
        self.shared_empty: list = []

    def tensor(self):
        self.n += 1
        t = ShardedTensor.from_rank_offsets(f"t{self.n}", torch.full((2, 3), float(self.n)),
                                            replica_id=self.r.choice([0, 1, (0, 1)]))
        roll = self.r.random()
        if roll < 0.1:
            t.flattened_range = slice(2, 2)  # dropped by megatron
        elif roll < 0.15:
            t.flattened_range = slice(0, 4)
        return t

    def leaf(self):
        self.n += 1
        kind = self.r.randrange(12)
        if kind == 0:
            return self.n
        if kind == 1:
            return f"s{self.n}"
        if kind == 2:
            return (self.n, self.tensor())
        if kind == 3:
            return LocalNonpersistentObject(self.r.choice([self.n, {"x": self.tensor()}]))
        if kind == 4:
            return ShardedObject(f"o{self.n}", {"v": self.n}, (1,), (0,), replica_id=0)
        if kind == 5:
            return self.r.choice([{}, [], OrderedDict(), self.shared_empty])
        if kind == 6:
            return None
        if kind == 7 and self.factories:
            return ShardedTensorFactory(f"f{self.n}", torch.ones(2, 2), _build, lambda x: x,
                                        replica_id=0)
        return self.tensor()

    def node(self, depth: int):
        if depth == 0 or self.r.random() < 0.3:
            return self.leaf()
        width = self.r.randrange(0, 5)
        if self.r.random() < 0.5:
            return [self.node(depth - 1) for _ in range(width)]
        d = OrderedDict() if self.r.random() < 0.1 else {}
        for i in range(width):
            d[f"k{i}"] = self.node(depth - 1)
        return d

    def state_dict(self):
        return {f"top{i}": self.node(4) for i in range(self.r.randrange(1, 6))}


def _canon(obj):
    """`obj` as plain values, for two copies built from one seed (factories build new objects)."""
    if isinstance(obj, dict):
        return (type(obj).__name__, [(k, _canon(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_canon(v) for v in obj])
    if isinstance(obj, ShardedTensor):
        return ("T", obj.key, obj.global_offset, obj.replica_id, obj.flattened_range,
                obj.data.tolist())
    if isinstance(obj, ShardedObject):
        return ("O", obj.key, obj.replica_id, obj.data)
    return ("leaf", obj if obj is None or isinstance(obj, (int, str)) else type(obj).__name__)


@pytest.mark.parametrize("claim", [False, True])
def test_split_is_megatrons_preprocessing_on_generated_nestings(claim):
    kinds = set()
    for seed in range(300):
        meta = None if seed % 3 == 0 else {"format": f"m{seed}", "nested": {}}
        sd = _Gen(seed, factories=False).state_dict()
        mine = split(sd, meta, claim=claim)
        items, common = _megatron(sd, meta, claim)  # the same dict, so the same objects
        assert [id(v) for v in mine.items] == [id(v) for v in items], seed
        assert _same(mine.common, common), seed
        assert _bytes(mine.common) == _bytes(common), seed
        kinds.update(type(v).__name__ for v in items)
        kinds.update(f"flat{v.flattened_range}" for v in items if getattr(v, "flattened_range",
                                                                          None))
    assert {"ShardedTensor", "ShardedObject", "flatslice(0, 4, None)"} <= kinds

    made = 0
    for seed in range(300, 400):  # with factories: applied in place by both, so two copies
        a, b = _Gen(seed, True).state_dict(), _Gen(seed, True).state_dict()
        made += any(isinstance(v, ShardedTensorFactory) for v in nested_values(a))
        mine = split(a, {"m": 1}, claim=claim)
        items, common = _megatron(b, {"m": 1}, claim)
        assert [_canon(v) for v in mine.items] == [_canon(v) for v in items], seed
        assert _canon(mine.common) == _canon(common), seed
        assert _bytes(mine.common) == _bytes(common), seed
        assert _canon(a) == _canon(b), seed  # the factories applied to the dict, as megatron does
    assert made > 20


def test_split_on_the_trainers_state_dict(monkeypatch):
    """The trainer's dict as a lazy save gets it (model, optimizer after a step, RNG, common
    state), through the state caches as the save path takes it."""
    from megatron.training.arguments import build_run_config, parse_args
    from megatron.training.checkpointing.contents import OPTIMIZER_METADATA, \
        build_sharded_state_dict
    from megatron.training.checkpointing.state_cache import SaveStateCache
    from megatron.training.training import _data_iterators, setup, train_step

    from trainer_launch import TINY_MODEL, free_port

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    trainer = setup(build_run_config(parse_args(TINY_MODEL + ["--num-layers", "2",
                                                              "--train-iters", "4"])))
    train_step(trainer, _data_iterators(trainer, trainer.datasets.train, 0))
    cache = SaveStateCache()
    for claim in (False, True, False):
        sd = build_sharded_state_dict(trainer.state, trainer.config, is_loading=False,
                                      include_optim=True, include_rng=True, cache=cache)
        mine = split(sd, dict(OPTIMIZER_METADATA), claim=claim)
        items, common = _megatron(sd, dict(OPTIMIZER_METADATA), claim)
        assert [id(v) for v in mine.items] == [id(v) for v in items]
        assert len(items) > 20 and any(isinstance(v, ShardedObject) for v in items)
        assert _same(mine.common, common) and _bytes(mine.common) == _bytes(common)
        assert {"args", "iteration", CONTENT_METADATA_KEY} <= set(common)
        opt = common["optimizer"]
        groups = opt.get("optimizer", opt)["param_groups"]
        assert "lr" in groups[0] and "params" not in groups[0]  # params: LocalNonpersistent
    assert cache.model.reused == 2
