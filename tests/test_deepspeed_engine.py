"""DeepSpeed's own DataStatesCheckpointEngine (deepspeed, pinned in requirements.txt) on our engine.

The launches run examples/deepspeed/train_zero.py under torchrun: `deepspeed.initialize` with the
``datastates_ckpt`` config section on CPU (DS_ACCELERATOR=cpu, gloo), so the engine class DeepSpeed
builds is its own and every save/load goes through its runtime. Two launches, a killed run and its
resume (DeepSpeed's first launch on a fresh machine also compiles its shared-memory op, ~25 s).
The in-process tests drive the DeepSpeed-facing engine directly, as that class does.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("deepspeed")

from datastates import CheckpointEngine, CheckpointError, faults  # noqa: E402
from datastates.deepspeed_engine import DeepSpeedCheckpointEngine  # noqa: E402
from datastates.deepspeed_tags import read_file, tag_commit, tag_is_committed  # noqa: E402
from datastates.safe_load import UnsafePickleError  # noqa: E402
from tests.trainer_launch import REPO, _kill_tree, convert_in_process, launch  # noqa: E402

EXAMPLE = str(REPO / "examples" / "deepspeed" / "train_zero.py")
ENV = {"DS_ACCELERATOR": "cpu"}


def _losses(stdout: str) -> dict:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("step ") and "| loss: " in line:
            out[int(line.split()[1].rstrip("/"))] = line.split("| loss: ")[1].split()[0]
    return out


def _run(args, **kw):
    return launch(2, args, timeout=300, entry=EXAMPLE, extra_env={**ENV, **kw.pop("env", {})},
                  **kw)


def test_deepspeed_runtime_saves_resumes_bit_exactly_and_survives_a_kill(tmp_path):
    # C: ZeRO-2, tags 2, 4, 6, each snapshot's copy held back 0.2 s: the optimizer step must wait
    # for it (our step pre-hook), or the saved state would be the next step's. Tag 6's flush is
    # held (60 s); training goes on, and the job is SIGKILLed at step 7 once tag 4 has committed
    # (on a loaded machine that wait may let it print step 8 first: its save cannot commit
    # before tag 6's, so the kill still lands before tag 4 is superseded).
    # (ZeRO-1's bit-exact resume through DeepSpeed's runtime is the README's DeepSpeed block, run
    # by tests/test_readme.py.)
    root = tmp_path / "z2"

    def kill_at_step_7(line, proc):
        if line.startswith("step 7/"):
            deadline = time.time() + 30
            while not os.path.exists(tag_commit(str(root / "global_step4"))):
                assert time.time() < deadline, "tag 4 never committed"
                time.sleep(0.05)
            _kill_tree(proc)

    c = _run(["--zero-stage", "2", "--steps", "8", "--save", str(root), "--save-interval", "2"],
             env={"DATASTATES_FAULT_DELAY_COPY": "0.2", "DATASTATES_FAULT_DELAY_FLUSH": "60@6"},
             on_line=kill_at_step_7)
    assert "done |" not in c.stdout, c.describe()  # killed (its exit status is reaped by the kill)
    killed = _losses(c.stdout)
    assert sorted(killed) in ([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]), c.describe()
    assert tag_is_committed(str(root / "global_step4"))
    assert not tag_is_committed(str(root / "global_step6"))
    assert (root / "latest").read_text() == "global_step4"
    _assert_datastates_files(root / "global_step4")
    # D: `latest` resumes from tag 4; steps 5-7 as the uninterrupted (killed) run printed them,
    # bit-exact. D saves tags 6 and 8 elsewhere; rank 1's save of tag 6 fails (a file of another
    # engine is in its way): no hang, one line, tag 6 never commits, the run goes on and trains
    # step 7 as the killed run did (a failed save leaves training alone), and tag 8 commits.
    out_root = tmp_path / "z2b"
    (out_root / "global_step6").mkdir(parents=True)
    (out_root / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_text("x")
    d = _run(["--zero-stage", "2", "--steps", "8", "--load", str(root), "--save", str(out_root),
              "--save-interval", "2"])
    assert d.returncode == 0 and "at step 4" in d.stdout, d.describe()
    resumed = _losses(d.stdout)
    assert sorted(resumed) == [5, 6, 7, 8], d.describe()
    after_4 = [k for k in sorted(killed) if k > 4]
    assert {k: resumed[k] for k in after_4} == {k: killed[k] for k in after_4}
    failed = [ln for ln in d.stderr.splitlines() if "failed on rank" in ln]
    assert len(failed) == 1 and "tag 'global_step6' failed on rank 1" in failed[0], d.describe()
    assert "written by another checkpoint engine" in failed[0]
    assert not tag_is_committed(str(out_root / "global_step6"))
    assert (out_root / "latest").read_text() == "global_step8"
    _assert_datastates_files(out_root / "global_step8")
    # DeepSpeed's own tools read torch.save files: ds-to-torch writes the latest tag as those,
    # and the zero_to_fp32.py DeepSpeed copied into the save directory consolidates it into the
    # parameters our engine saved (fp32 training: ZeRO's master partitions are the weights).
    out = convert_in_process("ds-to-torch", out_root, tmp_path / "z2b_torch")
    assert out.returncode == 0 and "wrote 3 file(s) of tag global_step8" in out.stdout, out
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, str(out_root / "zero_to_fp32.py"),
                          str(tmp_path / "z2b_torch"), str(tmp_path / "fp32")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out
    fp32 = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)
    ours = read_file(str(out_root / "global_step8" / "mp_rank_00_model_states.pt"))
    assert sorted(fp32) == sorted(ours["module"]) and len(fp32) == 14
    assert all(torch.equal(fp32[k], ours["module"][k]) for k in fp32)
    # Asking for the killed tag by name is refused, by name, with the one to use instead: the
    # engine's load of the tag's first file, as DeepSpeed's load_checkpoint(tag=...) calls it.
    engine = CheckpointEngine({"datastates_ckpt": {"host_cache_size": 0.01}}, 0)
    with pytest.raises(CheckpointError, match=r"tag 'global_step6' .* is not committed.* newest "
                                              r"committed tag there is 'global_step4'"):
        engine.load(str(root / "global_step6" / "mp_rank_00_model_states.pt"),
                    map_location=lambda storage, loc: storage)
    engine.close()


def _assert_datastates_files(directory):
    """The files of a tag are DataStates version directories (not torch.save files)."""
    names = sorted(os.listdir(directory))
    assert names == [".datastates", "mp_rank_00_model_states.pt",
                     "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"], names
    assert all(os.path.isdir(os.path.join(directory, n)) for n in names)


# ------------------------------------------------------------------ in-process, as DeepSpeed calls
@pytest.fixture
def ds_objects():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    scaler = DynamicLossScaler(init_scale=2.0 ** 12, scale_window=7, min_scale=1.0,
                               delayed_shift=2, consecutive_hysteresis=False)
    return {"loss_scaler": scaler, "zero_stage": ZeroStageEnum.gradients,
            "param_slice_mappings": [{"w": fragment_address(numel=6, start=0)}],
            "names": {"a", "b"}}


def test_call_shape_lazy_snapshot_objects_and_latest(tmp_path, ds_objects, caplog):
    engine = CheckpointEngine({"datastates_ckpt": {"host_cache_size": 0.01,
                                                   "parser_threads": 2}}, 0)
    assert isinstance(engine, DeepSpeedCheckpointEngine)
    w = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.ones(6)
    tag = tmp_path / "global_step3"
    tag.mkdir()
    assert engine.save({"module": {"w": w}, **ds_objects}, str(tag / "f.pt")) is None
    opt.step()  # our pre-hook waits for the snapshot before SGD changes w
    assert torch.equal(w.detach(), torch.arange(6, dtype=torch.float32) - 1)
    engine.wait(persist=True)
    assert tag_is_committed(str(tag)) and (tmp_path / "latest").read_text() == "global_step3"
    sd = engine.load(str(tag / "f.pt"), map_location=lambda storage, loc: storage)
    assert torch.equal(sd["module"]["w"], torch.arange(6, dtype=torch.float32))
    assert sd["loss_scaler"].cur_scale == 2.0 ** 12 and sd["loss_scaler"].scale_window == 7
    assert type(sd["loss_scaler"]) is type(ds_objects["loss_scaler"])
    assert sd["param_slice_mappings"][0]["w"] == ds_objects["param_slice_mappings"][0]["w"]
    assert sd["zero_stage"] is ds_objects["zero_stage"] and sd["names"] == {"a", "b"}
    # A committed tag is never rewritten (the save is skipped, with one line); an older tag
    # committed later leaves `latest` alone.
    before = (tag / "f.pt" / "shard_r00000.bin").read_bytes()
    with caplog.at_level(logging.WARNING, logger="datastates.deepspeed_engine"):
        engine.save({"w": w * 0}, str(tag / "f.pt"))
        engine.save({"w": w * 0}, str(tag / "g.pt"))
        engine.wait(persist=True)
    assert [r.getMessage().split(":")[1] for r in caplog.records] == \
        [" skipping the save of DeepSpeed tag 'global_step3'"]
    assert (tag / "f.pt" / "shard_r00000.bin").read_bytes() == before
    assert not (tag / "g.pt").exists()
    (tmp_path / "global_step1").mkdir()
    engine.save({"w": w}, str(tmp_path / "global_step1" / "f.pt"))
    engine.commit("global_step1")
    assert (tmp_path / "latest").read_text() == "global_step3"
    engine.close()


def test_load_refuses_uncommitted_tags_and_reads_torch_files_safely(tmp_path, ds_objects, caplog,
                                                                    monkeypatch):
    engine = CheckpointEngine({"datastates_ckpt": {"host_cache_size": 0.01}}, 0)
    (tmp_path / "global_step2").mkdir()
    engine.save({"x": torch.ones(3)}, str(tmp_path / "global_step2" / "f.pt"))
    engine.wait(persist=True)
    # A tag whose marker a crash cut off (this rank's files durable, the tag not committed).
    (tmp_path / "global_step5").mkdir()
    engine.save({"x": torch.zeros(3)}, str(tmp_path / "global_step5" / "f.pt"))
    engine.wait(persist=True)
    os.unlink(tag_commit(str(tmp_path / "global_step5")))
    with pytest.raises(CheckpointError, match=r"tag 'global_step5' .* not committed.*newest "
                                              r"committed tag there is 'global_step2'"):
        engine.load(str(tmp_path / "global_step5" / "f.pt"))
    # A torch.save file of DeepSpeed's default engine (switching engines): read weights_only,
    # DeepSpeed's classes allowed; one that would run code is refused, nothing executed.
    plain = tmp_path / "old" / "mp_rank_00_model_states.pt"
    plain.parent.mkdir()
    torch.save({"module": {"w": torch.arange(4.0)}, **ds_objects}, plain)
    sd = engine.load(str(plain), map_location=torch.device("cpu"))
    assert torch.equal(sd["module"]["w"], torch.arange(4.0))
    assert sd["loss_scaler"].cur_scale == 2.0 ** 12
    evil = tmp_path / "old" / "evil.pt"
    buf = io.BytesIO()
    torch.save({"x": _Evil()}, buf)
    evil.write_bytes(buf.getvalue())
    with pytest.raises(UnsafePickleError, match="allow_pickle"):
        engine.load(str(evil))
    # A background write failure fails its tag on this rank: no exception (DeepSpeed's other
    # ranks would wait for this one in their next collective), one line, `latest` kept.
    monkeypatch.setenv("DATASTATES_FAULT_FAIL_WRITE", "enospc@7")
    faults.reload_from_env()
    try:
        (tmp_path / "global_step7").mkdir()
        with caplog.at_level(logging.ERROR, logger="datastates.deepspeed_engine"):
            engine.save({"x": torch.ones(3)}, str(tmp_path / "global_step7" / "f.pt"))
            engine.wait(persist=True)
        assert "tag 'global_step7' failed on rank 0" in caplog.text
        assert "No space left on device" in caplog.text
        assert "latest stays at 'global_step2'" in caplog.text
        assert not tag_is_committed(str(tmp_path / "global_step7"))
        assert [d for d, _, _ in engine.failed_saves] == [str(tmp_path / "global_step7")]
    finally:
        monkeypatch.delenv("DATASTATES_FAULT_FAIL_WRITE")
        faults.reload_from_env()
    (tmp_path / "global_step8").mkdir()
    engine.save({"x": torch.ones(3)}, str(tmp_path / "global_step8" / "f.pt"))
    engine.wait(persist=True)
    assert (tmp_path / "latest").read_text() == "global_step8"
    with pytest.raises(CheckpointError, match="unknown key"):
        CheckpointEngine({"datastates_ckpt": {"host_cache_gb": 1}}, 0)
    with pytest.raises(CheckpointError, match="host_cache_size is the host cache in GiB"):
        CheckpointEngine({"datastates_ckpt": {"host_cache_size": 0}}, 0)
    engine.close()


def test_a_resume_from_an_older_tag_sets_the_newer_ones_aside(tmp_path, caplog):
    """DeepSpeed's load_checkpoint(tag=older) in the save directory: the other run's newer tags
    would have this run's saves of them skipped and `latest` stay on that run's newest (a restart
    would resume it). Rank 0 moves them whole aside at the first save, `latest` back first; rank
    1, saving into one of them before rank 0 got there, waits for it. Two ranks' engines in one
    process, each saving its own file of every tag, as DeepSpeed's ranks do."""
    save_dir = tmp_path / "ckpt"

    def engines():
        pair = [CheckpointEngine({"datastates_ckpt": {"host_cache_size": 0.01}}, r)
                for r in (0, 1)]
        for e in pair:
            e.world_size = 2
        return pair

    def save(pair, root, step, value, ranks=(0, 1)):
        tag = root / f"global_step{step}"
        tag.mkdir(parents=True, exist_ok=True)
        for r in ranks:
            pair[r].save({"x": torch.full((4,), float(value))}, str(tag / f"rank{r}.pt"))

    def value(root, step, r):
        return read_file(str(root / f"global_step{step}" / f"rank{r}.pt"))["x"][0].item()

    first = engines()
    for step in (2, 4, 6):
        save(first, save_dir, step, step)
        for e in first:
            e.wait(persist=True)
    for e in first:
        e.close()
    assert (save_dir / "latest").read_text() == "global_step6"
    markers = {s: (save_dir / f"global_step{s}" / ".datastates" / "COMMIT.json").read_bytes()
               for s in (4, 6)}

    second = engines()
    for r, e in enumerate(second):
        assert e.load(str(save_dir / "global_step2" / f"rank{r}.pt"))["x"][0].item() == 2.0
    rank1 = threading.Thread(target=save, args=(second, save_dir, 4, -4, (1,)))
    with caplog.at_level(logging.WARNING, logger="datastates.deepspeed_engine"):
        rank1.start()  # before rank 0's save: it waits for the other run's tag 4 to be moved
        time.sleep(0.2)
        save(second, save_dir, 4, -4, (0,))
        rank1.join(timeout=60)
        for e in second:
            e.wait(persist=True)
    assert not rank1.is_alive()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "set aside DeepSpeed tag(s) ['global_step4', 'global_step6']" \
        in lines[0] and "newer than tag 'global_step2', which this run resumed from" in lines[0]
    aside = [d for d in os.listdir(save_dir) if d.startswith("superseded-by-global_step2-")]
    assert len(aside) == 1 and sorted(os.listdir(save_dir / aside[0])) == \
        ["global_step4", "global_step6"]
    for s, marker in markers.items():  # moved whole, untouched
        assert (save_dir / aside[0] / f"global_step{s}" / ".datastates" / "COMMIT.json"
                ).read_bytes() == marker
        assert value(save_dir / aside[0], s, 1) == s
    assert tag_is_committed(str(save_dir / "global_step4"))
    assert [value(save_dir, 4, r) for r in (0, 1)] == [-4.0, -4.0]
    assert (save_dir / "latest").read_text() == "global_step4"
    for e in second:
        e.close()

    # Fine-tuning from tag 2 into another directory leaves this one alone.
    third = engines()
    for r, e in enumerate(third):
        e.load(str(save_dir / "global_step2" / f"rank{r}.pt"))
    save(third, tmp_path / "ft", 4, 40)
    for e in third:
        e.close()
    assert tag_is_committed(str(tmp_path / "ft" / "global_step4"))
    assert value(save_dir, 4, 0) == -4.0 and (save_dir / "latest").read_text() == "global_step4"
    assert len([d for d in os.listdir(save_dir) if d.startswith("superseded")]) == 1


class _Evil:
    def __reduce__(self):
        return (pickle.loads, (b"",))
