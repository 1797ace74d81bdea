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


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """Every test starts without a default process group, whichever tests ran before it in this
    process (the suite runs its files on two workers, in no fixed order): a converter called
    in-process makes the one-process group it needs and, as the one-shot process it is written
    for, leaves it to the interpreter's exit."""
    yield
    import sys

    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from megatron.training.initialize import destroy_distributed

        destroy_distributed()
