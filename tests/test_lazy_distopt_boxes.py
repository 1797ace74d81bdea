"""flat_range_boxes: a DP rank's flat range of a parameter, cut into memory-contiguous boxes."""
import math
import random

import pytest
import torch

from megatron.training.checkpointing.distopt_shards import flat_range_boxes


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (1, 6, 5), (4, 1, 3, 2), ()])
def test_boxes_cover_the_range_exactly_once_and_are_contiguous(shape):
    rng = random.Random(0)
    n = math.prod(shape)
    flat = torch.arange(n, dtype=torch.float32)
    for _ in range(60):
        a = rng.randrange(0, n)
        b = rng.randrange(a, n + 1)
        out = torch.full(shape, -1.0)
        for off, shp, first in flat_range_boxes(a, b, shape):
            box = tuple(slice(o, o + s) for o, s in zip(off, shp))
            assert bool((out[box] == -1).all()), "a box overlaps another"
            # Contiguous: the box is exactly flat[first : first + size] in row-major order.
            out[box] = flat[first:first + math.prod(shp)].view(shp)
        expected = torch.full((n,), -1.0)
        expected[a:b] = flat[a:b]
        assert torch.equal(out.reshape(-1), expected), (shape, a, b)


def test_box_count_is_small():
    # A range inside a 3-D tensor needs at most 2 * (ndim - 1) + 1 boxes.
    boxes = list(flat_range_boxes(5, 53, (4, 3, 5)))
    assert 1 <= len(boxes) <= 5


def test_swiglu_fc1_boxes_land_in_both_global_halves():
    """swiglu's fc1 rows on TP rank r are [W_r; V_r] while the saved global tensor is
    [W_0 .. W_tp-1; V_0 .. V_tp-1]: any DP rank's flat range of the local tensor must land there
    (layer axis prepended as megatron-core does for stacked layers)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    from megatron.training.checkpointing.distopt_shards import param_range_boxes

    tp, ffn, hidden, layers, layer = 2, 6, 3, 4, 2
    w = torch.arange(ffn * hidden, dtype=torch.float32).view(ffn, hidden)
    v = -1.0 - torch.arange(ffn * hidden, dtype=torch.float32).view(ffn, hidden)
    expected = torch.cat([w, v])  # the global tensor, whatever the TP size
    rng = random.Random(0)
    for rank in range(tp):
        rows = slice(rank * ffn // tp, (rank + 1) * ffn // tp)
        local = torch.cat([w[rows], v[rows]]).contiguous()  # what linear_fc1 holds on this rank
        offsets = ((0, layer, layers),)
        sh = ShardedTensor.from_rank_offsets("decoder.layers.mlp.linear_fc1.weight", local,
                                             *offsets, (1, rank, tp), prepend_axis_num=1)
        factory = apply_swiglu_sharded_factory(sh, offsets)
        for _ in range(20):
            a = rng.randrange(0, local.numel())
            b = rng.randrange(a + 1, local.numel() + 1)
            got = torch.full((layers,) + tuple(expected.shape), float("nan"))
            for key, gshape, goff, shape, flat in param_range_boxes(factory, local, a, b):
                assert key == sh.key and gshape == (layers, 2 * ffn, hidden)
                box = tuple(slice(o, o + s) for o, s in zip(goff, shape))
                got[box] = local.view(-1)[flat:flat + math.prod(shape)].view(shape)
            mask = ~torch.isnan(got)
            assert mask.sum() == b - a and bool(mask[layer].any()) and mask.sum() == mask[layer].sum()
            assert torch.equal(got[layer][mask[layer]], expected[mask[layer]]), (rank, a, b)


def test_a_save_reuses_the_boxes_only_while_the_optimizer_holds_the_same_tensors(monkeypatch):
    """The lazy save keeps the last save's boxes (views of the optimizer's tensors) while the
    optimizer holds the same tensor objects at the same addresses; a replaced tensor, or one
    whose storage moved (`.data =`), makes it build them again."""
    from megatron.training.checkpointing import distopt_shards
    from megatron.training.checkpointing.state_cache import DistOptBoxesCache

    held = [torch.zeros(4), torch.zeros(6)]
    built = []

    def boxes(optimizer, sd):
        built.append(len(built))
        return [(f"k{i}", t.view(-1)[:2], (len(t),), (0,)) for i, t in enumerate(held)]

    monkeypatch.setattr(distopt_shards, "state_tensors", lambda optimizer: list(held))
    monkeypatch.setattr(distopt_shards, "param_state_boxes", boxes)
    cache = DistOptBoxesCache()

    def save():
        return cache.get(None, {})

    first = save()
    held[0].add_(1)  # an optimizer step: in place
    assert save() is first and len(built) == 1
    held[1] = torch.ones(6)  # a new tensor
    second = save()
    assert len(built) == 2 and second[1].data.data_ptr() == held[1].data_ptr()
    held[0].data = torch.full((4,), 3.0)  # same object, other storage
    third = save()
    assert len(built) == 3 and torch.equal(third[0].data, torch.full((2,), 3.0))
    assert save() is third
