"""flat_range_boxes: a DP rank's flat range of a parameter, cut into memory-contiguous boxes."""
import math
import random

import pytest
import torch

from megatron.training.distopt_shards import flat_range_boxes


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
