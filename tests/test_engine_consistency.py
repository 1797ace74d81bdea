"""Snapshot consistency under in-place mutation, several saves in flight, telemetry."""
import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from datastates import (CheckpointEngine, CheckpointError, CheckpointReader, EngineConfig,
                        is_committed)


class Gate:
    """Write hook that holds the writer thread until released, so a test can act while the
    flush is provably still running."""

    def __init__(self):
        self.release = threading.Event()
        self.writes = 0
        self.lock = threading.Lock()

    def __call__(self, event, info):
        if event == "write":
            with self.lock:
                self.writes += 1
            assert self.release.wait(60), "test never released the writer"


def make_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g),
            "m": [torch.randn(32, 8, generator=g).t(), torch.randint(0, 9, (10,), generator=g)],
            "step": seed}


def clone(state):
    return {"w": state["w"].clone(), "b": state["b"].clone(),
            "m": [t.clone() for t in state["m"]], "step": state["step"]}


def mutate(state):
    for t in (state["w"], state["b"], *state["m"]):
        t.add_(1)


def assert_state(loaded, expected):
    assert loaded["step"] == expected["step"]
    assert torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["b"], expected["b"])
    for x, y in zip(loaded["m"], expected["m"]):
        assert torch.equal(x, y)


def test_mutation_after_wait_for_snapshot_does_not_reach_checkpoint(tmp_path):
    gate = Gate()
    state = make_state(0)
    before = clone(state)
    d = str(tmp_path / "v")
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20, write_hook=gate)) as eng:
        h = eng.save(state, d, step=1)
        eng.wait_for_snapshot()
        # The writer is held at its first write: nothing is on disk yet.
        assert eng.poll() == [] and not is_committed(d)
        mutate(state)
        gate.release.set()
        eng.wait_for_durable(h)
    assert gate.writes >= 1
    assert not torch.equal(state["w"], before["w"])
    assert_state(CheckpointReader(d).load_state(), before)


@pytest.mark.parametrize("starter", ["start_copies", "wait_for_snapshot", "poll", "save"])
def test_deferred_copies_start_at_the_next_engine_call_and_keep_the_snapshot(tmp_path, starter):
    """`save(defer_copies=True)` hands nothing to the copy threads until `start_copies()` or the
    next wait, poll or save (each tried alone here; two copy threads, so two hand-offs): the
    version then commits on its own, holding the state of the save call."""
    state = make_state(0)
    before = clone(state)
    d = str(tmp_path / "v")
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20, copy_threads=2)) as eng:
        eng.save(state, d, step=1, defer_copies=True)
        if starter == "save":
            eng.save(make_state(1), str(tmp_path / "v2"), step=2)
        elif starter == "wait_for_snapshot":
            eng.wait_for_snapshot(timeout=60)
        else:
            getattr(eng, starter)()
        deadline = time.monotonic() + 60
        while not is_committed(d) and time.monotonic() < deadline:  # no engine call here
            time.sleep(0.01)
        assert is_committed(d), f"the held copies never started after {starter}"
        mutate(state)
    assert_state(CheckpointReader(d).load_state(), before)


def test_several_saves_in_flight_and_save_while_flushing(tmp_path, caplog):
    gate = Gate()
    telemetry = tmp_path / "telemetry.jsonl"
    state = make_state(0)
    expected = []
    cfg = EngineConfig(host_cache_bytes=1 << 20, write_hook=gate, telemetry_path=str(telemetry))
    with CheckpointEngine(cfg) as eng:
        handles = []
        for step in range(3):
            state["step"] = step
            expected.append(clone(state))
            handles.append(eng.save(state, str(tmp_path / f"v{step}"), step=step))
            eng.wait_for_snapshot()  # previous saves are still held at the writer
            mutate(state)
        assert eng.poll() == []
        gate.release.set()
        records = eng.wait_for_durable(handles[0])
        records += eng.wait_for_durable()
    assert sorted(r.step for r in records) == [0, 1, 2]
    for step in range(3):
        assert is_committed(str(tmp_path / f"v{step}"))
        assert_state(CheckpointReader(str(tmp_path / f"v{step}")).load_state(), expected[step])
    lines = [json.loads(line) for line in telemetry.read_text().splitlines()]
    assert sorted(x["step"] for x in lines) == [0, 1, 2]
    for x in lines:
        assert x["bytes"] == (64 * 64 + 64 + 32 * 8) * 4 + 10 * 8
        assert 0 < x["peak_cache_bytes"] <= 1 << 20
        assert x["durable_s"] >= x["copy_s"] >= 0 and x["committed"] is True


def test_close_drains_in_flight_saves(tmp_path):
    state = make_state(5)
    eng = CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20))
    eng.save(state, str(tmp_path / "v"), step=5)
    eng.close()
    assert is_committed(str(tmp_path / "v"))
    assert_state(CheckpointReader(str(tmp_path / "v")).load_state(), make_state(5))


def test_resaving_a_directory_withdraws_its_commit_until_the_new_save_commits(tmp_path):
    d = str(tmp_path / "v")
    gate = Gate()
    state = make_state(1)
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20)) as eng:
        eng.wait_for_durable(eng.save(make_state(0), d, step=1))
    assert is_committed(d)
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20, write_hook=gate)) as eng:
        h = eng.save(state, d, step=1)
        with pytest.raises(CheckpointError, match="still in flight"):
            eng.save(state, d, step=1)
        eng.wait_for_snapshot()
        # From the new shard's first byte on (a writer makes the files, then writes): the gate
        # holds that first write.
        deadline = time.monotonic() + 60  # a bound, never a timing assertion
        while not gate.writes:
            assert time.monotonic() < deadline, "no writer reached the first write"
            time.sleep(0.01)
        assert not is_committed(d)
        gate.release.set()
        eng.wait_for_durable(h)
    assert is_committed(d)
    assert_state(CheckpointReader(d).load_state(), make_state(1))


def test_interpreter_exit_drains_an_unclosed_engine(tmp_path):
    code = textwrap.dedent(f"""
        import torch
        from datastates import CheckpointEngine, EngineConfig
        eng = CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20))
        eng.save({{"w": torch.arange(100000.0)}}, {str(tmp_path / "v")!r}, step=1)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert is_committed(str(tmp_path / "v"))
    assert torch.equal(CheckpointReader(str(tmp_path / "v")).read("w"), torch.arange(100000.0))
