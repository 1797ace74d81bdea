"""Fixtures shared by several test modules."""
from __future__ import annotations

import pytest


@pytest.fixture
def one_rank_group(tmp_path):
    """A default process group of one gloo rank (what the control plane's collectives need)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()
