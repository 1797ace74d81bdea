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


def test_deepspeed_call_shape_snapshots_cuda_state_before_the_optimizer_step(tmp_path):
    """DeepSpeed's call shape (what its DataStatesCheckpointEngine calls; no deepspeed import):
    bf16 parameters and fp32 Adam moments on the device, saved lazily; the device-side Adam step
    is held by our optimizer pre-hook until the snapshot is in the pinned cache; the tag loads
    back onto the device as it was at save time."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(2048, 1024, device="cuda"))
    opt = torch.optim.Adam([w], lr=1e-2)
    w.grad = torch.randn_like(w)
    opt.step()
    engine = CheckpointEngine({"datastates_ckpt": {"host_cache_size": 0.01}}, 0)
    assert engine._engine._cache.buffer.is_pinned()
    tag = tmp_path / "global_step1"
    tag.mkdir()
    state = {"module": {"w": w.detach().to(torch.bfloat16)}, "optimizer": opt.state_dict()}
    expected = {"w": state["module"]["w"].to("cpu", copy=True),
                "exp_avg": opt.state[w]["exp_avg"].to("cpu", copy=True)}
    engine.save(state["module"], str(tag / "mp_rank_00_model_states.pt"))
    engine.save(state["optimizer"], str(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    opt.step()  # waits for the snapshot, then changes the moments in place
    engine.wait(persist=True)
    assert (tmp_path / "latest").read_text() == "global_step1"
    model = engine.load(str(tag / "mp_rank_00_model_states.pt"), map_location="cuda")
    optim = engine.load(str(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                        map_location=torch.device("cpu"))
    assert model["w"].is_cuda and torch.equal(model["w"].cpu(), expected["w"])
    assert torch.equal(optim["state"][0]["exp_avg"], expected["exp_avg"])
    assert not torch.equal(opt.state[w]["exp_avg"].cpu(), expected["exp_avg"])
    engine.close()


def _shm_dir(name):
    """A new directory in /dev/shm (the in-memory level's file system); the caller removes it."""
    import os
    import shutil
    d = f"/dev/shm/datastates-test-{os.getpid()}-{name}"
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def test_mapped_slots_are_registered_and_take_device_copies_by_dma():
    """The in-memory level's engine on CUDA (issue 30): the probe passes on /dev/shm; each slot's
    mapping is registered (seen as pinned), copies land in it bit-exactly from CUDA tensors, a
    small and a large one, contiguous or not, through more pieces than `COPIES_IN_FLIGHT`; a
    change after `wait_for_snapshot` does not reach the version; closing unregisters."""
    import shutil

    from datastates import WriteMode
    from datastates.engine import COPIES_IN_FLIGHT
    from datastates.mapped import cuda_dma_probe

    root = _shm_dir("mapped")
    try:
        assert cuda_dma_probe(root) is None
        g = torch.Generator(device="cuda").manual_seed(1)
        state = {"w": torch.randn(2048, 1024, device="cuda", generator=g),
                 "t": torch.randn(512, 300, device="cuda", generator=g).to(torch.bfloat16).t(),
                 "b": torch.randn(7, device="cuda", generator=g)}
        cfg = EngineConfig(host_cache_bytes=64 * 1024, chunk_bytes=1 << 18,
                           write_mode=WriteMode.MAPPED, mapped_slot_dir=f"{root}/slots")
        assert state["w"].nbytes // cfg.chunk_bytes > COPIES_IN_FLIGHT
        with CheckpointEngine(cfg) as eng:
            for step in (1, 2):
                expected = {k: v.cpu() for k, v in state.items()}
                h = eng.save(state, f"{root}/v{step}", step=step)
                eng.wait_for_snapshot()
                for t in state.values():
                    t.add_(1)
                eng.wait_for_durable(h)
                slots = eng._slots.slots
                assert slots and all(s.registered and s.mapping.is_pinned() for s in slots)
                loaded = CheckpointReader(f"{root}/v{step}").load_state()
                for k in expected:
                    assert torch.equal(loaded[k], expected[k]), (step, k)
            slots = list(eng._slots.slots)
        assert all(not s.registered and s.mapping is None for s in slots)  # closed
    finally:
        shutil.rmtree(root, ignore_errors=True)
