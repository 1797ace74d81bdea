"""Fault points and bounded waits, without a training job."""
import threading

import pytest
import torch

from datastates import CheckpointEngine, CheckpointError, EngineConfig, faults
from datastates.faults import FaultSpec, parse_spec


@pytest.mark.parametrize("text,spec", [
    ("2", FaultSpec(2.0)), ("0.5@7", FaultSpec(0.5, 7)), ("1@3:1", FaultSpec(1.0, 3, 1)),
    ("4:0", FaultSpec(4.0, None, 0)), ("3#2", FaultSpec(3.0, nth=2)),
    ("3#1:0", FaultSpec(3.0, None, 0, 1)),
])
def test_fault_spec_parses(text, spec):
    assert parse_spec("X", text) == spec


@pytest.mark.parametrize("text", ["", "abc", "1@x", "1@2:y", "-1", "1#0", "1#y"])
def test_bad_fault_spec_names_the_variable_and_the_expected_form(text):
    with pytest.raises(CheckpointError, match=r"DATASTATES_FAULT_DELAY_FLUSH=.*expected|>= 0"):
        parse_spec("DATASTATES_FAULT_DELAY_FLUSH", text)


def test_fault_point_pauses_only_the_named_step_and_rank(monkeypatch, capfd):
    monkeypatch.setenv("DATASTATES_FAULT_DELAY_FLUSH", "0@3:1")
    faults.reload_from_env()
    try:
        faults.fault_point("flush", 3, 0)
        faults.fault_point("flush", 2, 1)
        faults.fault_point("copy", 3, 1)
        assert capfd.readouterr().err == ""
        faults.fault_point("flush", 3, 1)
        assert capfd.readouterr().err == "DATASTATES_FAULT phase=flush step=3 rank=1 delay=0\n"
    finally:
        monkeypatch.delenv("DATASTATES_FAULT_DELAY_FLUSH")
        faults.reload_from_env()


def test_an_occurrence_counts_the_calls_of_its_rank_whatever_their_step(monkeypatch, capfd):
    """'#2': the second time the phase is reached on the rank, whichever version that is (where
    latest wins decides which versions reach it), and only that time."""
    monkeypatch.setenv("DATASTATES_FAULT_DELAY_REPLICA", "0#2:0")
    monkeypatch.setenv("DATASTATES_FAULT_FAIL_WRITE", "error#3")
    faults.reload_from_env()
    try:
        for step, rank in [(1, 1), (1, 0), (3, 1), (5, 1)]:
            faults.fault_point("replica", step, rank)
        assert capfd.readouterr().err == ""
        faults.fault_point("replica", 4, 0)
        assert capfd.readouterr().err == "DATASTATES_FAULT phase=replica step=4 rank=0 delay=0\n"
        faults.fault_point("replica", 6, 0)
        assert capfd.readouterr().err == ""
        faults.fail_point("write", 1, 0)
        faults.fail_point("write", 1, 1)
        with pytest.raises(RuntimeError, match="injected failure of step 'write'"):
            faults.fail_point("write", 2, 0)
        faults.fail_point("write", 3, 0)
    finally:
        monkeypatch.delenv("DATASTATES_FAULT_DELAY_REPLICA")
        monkeypatch.delenv("DATASTATES_FAULT_FAIL_WRITE")
        faults.reload_from_env()


def _hung_engine(release):
    def hook(event, info):
        if event == "fsync":
            release.wait()  # a writer stuck in storage until the test lets it go

    return CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20, write_hook=hook))


def test_durable_wait_and_close_time_out_naming_the_stuck_save(tmp_path):
    release = threading.Event()
    eng = _hung_engine(release)
    try:
        eng.save({"w": torch.arange(1000.0)}, str(tmp_path / "v"), step=7)
        eng.wait_for_snapshot(timeout=60)  # the copy is not hung, only the writer
        with pytest.raises(CheckpointError) as err:
            eng.wait_for_durable(timeout=0.2)
        msg = str(err.value)
        assert "timed out after 0.2 s" in msg and "step 7" in msg and "hung" in msg
        assert err.value.rank == 0 and err.value.file.endswith("v/shard_r00000.bin")
        assert "all bytes written, fsync/index/marker not done" in msg
        with pytest.raises(CheckpointError, match="close .* timed out after 0.2 s"):
            eng.close(timeout=0.2)
        assert not (tmp_path / "v" / "done_r00000.json").exists()
    finally:
        release.set()


def test_torch_format_files_are_loaded_without_running_code(tmp_path):
    """The legacy torch format is read with weights_only=True plus numpy RNG globals: a real
    payload loads, a forged one is refused before anything runs."""
    import os
    import random

    import numpy as np

    from megatron.training.checkpointing.loading import safe_torch_load
    from datastates.safe_load import UnsafePickleError

    path = tmp_path / "model_optim_rng.pt"
    payload = {"random": random.getstate(), "np": np.random.get_state(), "w": torch.ones(3),
               "run_config": "{}", "iteration": 3}
    torch.save(payload, path)
    loaded = safe_torch_load(str(path))
    assert loaded["np"][0] == "MT19937" and np.array_equal(loaded["np"][1], payload["np"][1])
    assert torch.equal(loaded["w"], payload["w"]) and loaded["random"] == payload["random"]

    marker = tmp_path / "PWNED"

    class Forged:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save({"run_config": Forged()}, path)
    with pytest.raises(UnsafePickleError, match=r"model_optim_rng.pt holds a pickle that names "
                                                r"posix.mkdir.*--allow-unsafe-pickle"):
        safe_torch_load(str(path))
    assert not marker.exists()


def test_free_space_in_a_failed_save_names_the_root_it_measured(tmp_path):
    """A failed non-persistent save reports the free space of its own root, named as such."""
    from datastates.megatron_adapter.save.checkpointer import _free_space

    local = tmp_path / "local"
    local.mkdir()
    text = _free_space(str(tmp_path), str(local), f"non-persistent root {tmp_path}")
    assert text.startswith(f" (free space under non-persistent root {tmp_path}: ")
    assert f"; under --lazy-save-local-dir {local}: " in text
    assert _free_space(str(tmp_path)).startswith(" (free space under --save: ")
    assert _free_space(str(tmp_path / "missing")) == ""


def test_control_plane_rows_are_padded_to_one_width_and_never_cut():
    from datastates import control_plane

    assert control_plane.padded([3, 1], 4) == [3, 1, -1, -1]
    assert control_plane.padded([], 2, fill=0) == [0, 0]
    with pytest.raises(ValueError, match="3 values do not fit a row of 2"):
        control_plane.padded([1, 2, 3], 2)  # the ranks' rows would no longer line up
