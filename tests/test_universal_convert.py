"""tools/convert_checkpoint.py: bit-exact round trips universal <-> torch_dist, inspect, errors."""
import json
import os
import subprocess
import sys

import torch

from datastates.megatron_adapter import TorchDistSource, open_source
from datastates.universal import UniversalCheckpoint, decode_value, write_universal
from universal_fixtures import global_tensors, write_datastates_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "convert_checkpoint.py")


def _tool(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, TOOL, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


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
    out = _tool("merge", tmp_path / "save", tmp_path / "u1", "--max-file-size-mb", "1")
    assert out.returncode == 0, out.stderr
    assert "merge [" in out.stderr and json.loads(out.stdout.splitlines()[-1])["iteration"] == 5
    # universal -> torch_dist -> universal
    out = _tool("to-torch-dist", tmp_path / "u1", tmp_path / "td" / "iter_0000005")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "td" / "latest_checkpointed_iteration.txt").read_text() == "5"
    # The progress ends at 100% once the files are written (it stopped at ~70% before).
    last = [ln for ln in out.stderr.splitlines() if ln.startswith("to-torch-dist [")][-1]
    assert "100.0%" in last and "torch_dist files written" in last, out.stderr[-1500:]
    out = _tool("from-torch-dist", tmp_path / "td", tmp_path / "u2")
    assert out.returncode == 0, out.stderr
    _same_universal(tmp_path / "u1", tmp_path / "u2")
    # torch_dist -> universal -> torch_dist: same keys, tensors and common state as the first
    out = _tool("to-torch-dist", tmp_path / "u2", tmp_path / "td2" / "iter_0000005")
    assert out.returncode == 0, out.stderr
    first, second = (TorchDistSource(str(tmp_path / d / "iter_0000005")) for d in ("td", "td2"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first.read(k), second.read(k)) for k in first.keys())
    assert first.objects() == second.objects()
    assert repr(first.common()) == repr(second.common())
    original = decode_value(json.load(open(tmp_path / "u1" / "manifest.json"))["megatron_common"])
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
