"""tools/convert_checkpoint.py: bit-exact round trips universal <-> torch_dist, inspect, errors, what a
source path names (what --load takes) and what is missing, file permissions."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from datastates import CheckpointError
from datastates.megatron_adapter import Located, TorchDistSource, locate, locate_universal, \
    open_source
from datastates.universal import UniversalCheckpoint, decode_value, write_universal
from trainer_launch import convert_in_process
from universal_fixtures import global_tensors, write_datastates_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "convert_checkpoint.py")


def _tool(*args, umask=None, tmpdir=None):
    if umask is None and tmpdir is None and args[0] != "to-torch-dist":
        return convert_in_process(*args)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run([sys.executable, TOOL, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=None if umask is None else (lambda: os.umask(umask)))


def _same_universal(a_dir, b_dir):
    with UniversalCheckpoint(str(a_dir)) as a, UniversalCheckpoint(str(b_dir)) as b:
        assert a.names() == b.names()
        for n in a.names():
            assert torch.equal(a.read(n), b.read(n)), n
        for field in ("iteration", "optimizer", "scheduler", "objects", "model_config"):
            assert a.manifest[field] == b.manifest[field], field


def test_round_trips_through_torch_dist_are_bit_exact(tmp_path):
    src = tmp_path / "save" / "iter_0000005"
    write_datastates_checkpoint(str(src), global_tensors())
    (tmp_path / "save" / "latest_checkpointed_iteration.txt").write_text("5")
    u1 = tmp_path / "uroot" / "iter_0000005"
    out = _tool("merge", tmp_path / "save", u1, "--max-file-size-mb", "1")
    assert out.returncode == 0, out.stderr
    assert "merge [" in out.stderr and json.loads(out.stdout.splitlines()[-1])["iteration"] == 5
    (tmp_path / "uroot" / "latest_checkpointed_iteration.txt").write_text("5")
    # universal -> torch_dist -> universal; the source is a universal root, as --load takes it
    # A TMPDIR of its own, short (multiprocessing's AF_UNIX sockets go there, 107 bytes at most)
    scratch = Path(tempfile.mkdtemp(prefix="cvt-"))
    try:
        out = _tool("to-torch-dist", tmp_path / "uroot", tmp_path / "td" / "iter_0000005",
                    umask=0o022, tmpdir=scratch)
        assert out.returncode == 0, out.stderr
        assert not list(scratch.iterdir())  # its one-rank process group leaves nothing behind
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert (tmp_path / "td" / "latest_checkpointed_iteration.txt").read_text() == "5"
    _assert_modes(tmp_path / "td", "0o644")  # teammates can read it
    # The progress ends at 100% once the files are written (it stopped at ~70% before).
    last = [ln for ln in out.stderr.splitlines() if ln.startswith("to-torch-dist [")][-1]
    assert "100.0%" in last and "torch_dist files written" in last, out.stderr[-1500:]
    out = _tool("from-torch-dist", tmp_path / "td", tmp_path / "u2")
    assert out.returncode == 0, out.stderr
    _same_universal(u1, tmp_path / "u2")
    # torch_dist -> universal -> torch_dist: same keys, tensors and common state as the first
    out = _tool("to-torch-dist", tmp_path / "u2", tmp_path / "td2" / "iter_0000005")
    assert out.returncode == 0, out.stderr
    first, second = (TorchDistSource(str(tmp_path / d / "iter_0000005")) for d in ("td", "td2"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first.read(k), second.read(k)) for k in first.keys())
    assert first.objects() == second.objects()
    assert repr(first.common()) == repr(second.common())
    original = decode_value(json.load(open(u1 / "manifest.json"))["megatron_common"])
    assert first.common()["optimizer"] == original["optimizer"]


def test_inspect_and_clear_errors(tmp_path):
    src = tmp_path / "iter_0000005"
    write_datastates_checkpoint(str(src), global_tensors(optimizer_state=()))
    write_universal(open_source(str(src)), str(tmp_path / "u"))
    out = _tool("inspect", tmp_path / "u", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["iteration"] == 5 and info["format"] == "universal v2"
    assert info["tensors"]["decoder.layers.mlp.linear_fc1.weight"]["shape"] == [2, 32, 8]
    assert info["tensors"]["decoder.layers.mlp.linear_fc1.weight"]["bytes"] == 2 * 32 * 8 * 4
    text = _tool("inspect", src)
    assert text.returncode == 0 and "format:      datastates" in text.stdout
    wrong = _tool("from-torch-dist", src, tmp_path / "x")
    assert wrong.returncode == 2 and "use the merge subcommand" in wrong.stderr
    missing = _tool("to-hf", tmp_path / "nope", tmp_path / "hf")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "hf")


# ----------------------------------------------------------------- what a source path names

@pytest.fixture
def save_root(tmp_path):
    """SAVE/iter_0000005 (DataStates) with its tracker; no universal copy yet."""
    save = tmp_path / "save"
    write_datastates_checkpoint(str(save / "iter_0000005"), global_tensors(optimizer_state=()))
    (save / "latest_checkpointed_iteration.txt").write_text("5")
    return save


def _located_error(fn, *needles):
    with pytest.raises(CheckpointError) as err:
        fn()
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_sources_resolve_like_load_and_say_what_is_missing(save_root, tmp_path):
    save, it5 = save_root, save_root / "iter_0000005"
    uroot, copy = save / "universal", save / "universal" / "iter_0000005"
    merge = f"run `python tools/convert_checkpoint.py merge {it5} {copy}` first"
    assert locate(str(save)) == Located(str(it5), "datastates", "iteration 5, named by "
                                        f"{save / 'latest_checkpointed_iteration.txt'}")
    for src in (save, it5):  # a save root, or one of its iterations: no universal copy yet
        _located_error(lambda: locate_universal(str(src)), "iteration 5 is a datastates "
                       f"checkpoint and it has no universal copy yet ({copy} does not exist)",
                       merge)
    (uroot / "iter_0000005.tmp-4242").mkdir(parents=True)  # a merge running or dead
    _located_error(lambda: locate_universal(str(save)),
                   f"its merge into {copy} has not finished", merge)
    write_universal(open_source(str(it5)), str(copy))
    assert locate_universal(str(save)).directory == str(copy)
    assert "universal copy of iteration 5" in locate_universal(str(it5)).note
    # A universal root without a tracker (no merge committed through the trainer yet) ...
    _located_error(lambda: locate_universal(str(uroot)), "no latest_checkpointed_iteration.txt",
                   "iter_0000005")
    (uroot / "latest_checkpointed_iteration.txt").write_text("5")
    assert locate_universal(str(uroot)) == Located(
        str(copy), "universal", f"iteration 5, named by {uroot / 'latest_checkpointed_iteration.txt'}")
    assert locate_universal(str(copy)) == Located(str(copy), "universal")
    # A newer save that was not merged: the error names the newest universal checkpoint too.
    shutil.copytree(it5, save / "iter_0000010")
    (save / "latest_checkpointed_iteration.txt").write_text("10")
    _located_error(lambda: locate_universal(str(save)), "iteration 10 is a datastates checkpoint",
                   "the newest universal checkpoint there is iteration 5: pass " + str(uroot))
    # Never committed: the command that finishes it, with the source the manifest names.
    os.remove(copy / "UNIVERSAL_COMMIT.json")
    _located_error(lambda: locate(str(copy)), "never committed (no UNIVERSAL_COMMIT.json)",
                   f"merge {it5} {copy} --overwrite")
    (uroot / "latest_checkpointed_iteration.txt").write_text("7")
    _located_error(lambda: locate(str(uroot)), "names iteration 7", "does not exist")
    os.remove(it5 / "COMMIT.json")
    _located_error(lambda: locate(str(it5)), "the save of this checkpoint did not finish")
    _located_error(lambda: locate(str(tmp_path)), "not a checkpoint: expected manifest.json")
    _located_error(lambda: locate(str(tmp_path / "nope")), "does not exist")


def test_to_hf_takes_what_load_takes(save_root, tmp_path):
    save = save_root
    out = _tool("to-hf", save, tmp_path / "direct")  # not merged yet: merged to a scratch copy
    assert out.returncode == 0, out.stderr
    assert f"{save / 'iter_0000005'} has no universal copy: merging it to" in out.stdout
    assert (tmp_path / "direct" / "config.json").is_file()
    assert not (tmp_path / "direct.tmp-universal").exists()
    out = _tool("to-hf", tmp_path / "nope", tmp_path / "hf")  # names nothing: what is missing
    assert out.returncode == 2 and "checkpoint path does not exist" in out.stderr
    assert not (tmp_path / "hf").exists()
    uroot = save / "universal"
    write_universal(open_source(str(save / "iter_0000005")), str(uroot / "iter_0000005"))
    (uroot / "latest_checkpointed_iteration.txt").write_text("5")
    out = _tool("to-hf", uroot, tmp_path / "hf", umask=0o022)
    assert out.returncode == 0, out.stderr
    assert f"reading {uroot / 'iter_0000005'} (iteration 5" in out.stdout
    _assert_modes(tmp_path / "hf", "0o644")


def _assert_modes(top, mode):
    modes = {str(p.relative_to(top)): oct(p.stat().st_mode & 0o777)
             for p in top.rglob("*") if p.is_file()}
    assert len(modes) >= 2 and set(modes.values()) == {mode}, modes


def test_merge_with_workers_equals_one_worker_and_a_failed_one_keeps_the_committed(tmp_path):
    src = tmp_path / "save" / "iter_0000005"
    write_datastates_checkpoint(str(src), global_tensors())
    one, many = tmp_path / "one", tmp_path / "many"
    write_universal(open_source(str(src)), str(one))  # what `merge` does with one worker
    run = _tool("merge", src, many, "--workers", "3")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["bytes"] > 0
    with UniversalCheckpoint(str(many)) as u:
        assert u.checksummed and len(set(u.weight_map.values())) >= 3  # files of 3 parts
        for name in u.names():
            u.verify(name)
    _same_universal(one, many)
    assert not [n for n in os.listdir(many) if n.startswith(("PART", "JOB"))]
    # A part that cannot be read fails the merge: one line, exit 2, nothing left behind, and the
    # checkpoint committed at the destination (asked to be overwritten) stays as it was.
    shard = src / "shard_r00001.bin"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    before = {p.name: p.read_bytes() for p in many.iterdir()}
    run = _tool("merge", src, many, "--workers", "2", "--overwrite")
    assert run.returncode == 2 and "error" in run.stderr.strip().splitlines()[-1], run.stderr
    assert {p.name: p.read_bytes() for p in many.iterdir()} == before
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
