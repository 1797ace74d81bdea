"""The threads that issue CUDA calls for a rank's tensors (the engine's copy threads, the save
worker) take the CUDA device of the thread that created them (`datastates/devices.py`): a new
thread's is GPU 0. No GPU here: `torch.cuda.set_device` is recorded instead of called, which
shows the wiring; tests/test_engine_cuda.py runs the copies themselves on a GPU."""
import threading

import torch

from datastates import CheckpointEngine, EngineConfig, devices
from datastates.megatron_adapter.save.offload import SaveWorker


def _record_set_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append((threading.current_thread().name, d)))
    return calls


def test_without_cuda_no_device_is_taken_or_set(monkeypatch):
    calls = _record_set_device(monkeypatch)
    assert devices.creator_device() is None  # this machine has no GPU: no CUDA call is made
    devices.use_device(None)
    assert calls == []


def test_copy_threads_run_on_the_device_of_the_thread_that_made_the_engine(monkeypatch, tmp_path):
    calls = _record_set_device(monkeypatch)
    monkeypatch.setattr(devices, "creator_device", lambda: 3)
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20, copy_threads=2)) as eng:
        eng.wait_for_durable(eng.save({"w": torch.arange(1000.0)}, str(tmp_path / "v"), step=1))
    assert sorted(calls) == [("datastates-copy-0", 3), ("datastates-copy-1", 3)]


def test_save_worker_jobs_run_on_the_given_device(monkeypatch):
    calls = _record_set_device(monkeypatch)
    worker = SaveWorker(device=5)
    ran = []
    worker.submit(lambda: ran.append(threading.current_thread().name))
    worker.join()
    worker.close()
    assert calls == [(ran[0], 5)] and ran[0].startswith("datastates-save")
