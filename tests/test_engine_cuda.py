"""CUDA path checks: pinned cache, copy stream, snapshot consistency. Skipped without a GPU."""
import pytest
import torch

from datastates import CheckpointEngine, CheckpointReader, EngineConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_state_round_trips_and_mutation_after_snapshot_is_not_saved(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {"w": torch.randn(1024, 1024, device="cuda", generator=g),
             "h": torch.randn(300, 7, device="cuda", generator=g).to(torch.bfloat16).t()}
    expected = {k: v.cpu() for k, v in state.items()}
    d = str(tmp_path / "v")
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20, chunk_bytes=1 << 18)) as eng:
        # Queue work on the default stream right before save: the copy stream must wait for it.
        state["w"].mul_(2)
        expected["w"] = expected["w"] * 2
        h = eng.save(state, d, step=1)
        assert eng._cache.pinned and eng._cache.buffer.is_pinned()
        eng.wait_for_snapshot()
        for t in state.values():
            t.add_(1)
        eng.wait_for_durable(h)
    loaded = CheckpointReader(d).load_state()
    assert torch.equal(loaded["w"], expected["w"])
    assert torch.equal(loaded["h"], expected["h"])


def test_copy_overlaps_a_matmul_loop(tmp_path):
    """The copy stream makes progress while the default stream runs matmuls; the saved values
    are those at save time."""
    a = torch.randn(4096, 4096, device="cuda")
    state = {f"t{i}": torch.randn(1 << 22, device="cuda") for i in range(8)}
    expected = {k: v.cpu() for k, v in state.items()}
    d = str(tmp_path / "v")
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 28)) as eng:
        h = eng.save(state, d, step=1)
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
        eng.wait_for_snapshot()
        for t in state.values():
            t.zero_()
        eng.wait_for_durable(h)
    torch.cuda.synchronize()
    loaded = CheckpointReader(d).load_state()
    for k in expected:
        assert torch.equal(loaded[k], expected[k])
