"""Reading a checkpoint never runs code: a planted pickle payload at every read path.

The payload's `__reduce__` is `os.mkdir(MARKER)`: if anything unpickles it with code execution the
marker directory appears. Every entry point must refuse it with one line naming the file and the
offending global (`posix.mkdir`), and the marker must stay absent. The one opt-in
(--allow-unsafe-pickle) is tested to be what makes a legacy pickle load.

Three tiny training runs (one per format, world size 1, ~5 s each) make real checkpoints; the
trainer's --load cases run in one probe process (tests/faults_load_probe.py).
"""
import base64
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import zlib

import pytest
import torch

from trainer_launch import NO_DROPOUT, REPO, TINY_MODEL, convert_in_process, launch
from universal_fixtures import reseal

ARGS = TINY_MODEL + NO_DROPOUT + ["--eval-interval", "0", "--train-iters", "2",
                                  "--use-distributed-optimizer"]
ITER = "iter_0000002"


class Payload:
    """Creates `marker` (a directory) when unpickled with code execution."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, extra in (("datastates", ["--async-lazy-save"]), ("torch_dist", []),
                        ("torch", ["--ckpt-format", "torch"])):
        r = launch(1, ARGS + extra + ["--save", str(root / name), "--save-interval", "2"],
                   timeout=180)
        assert r.returncode == 0, r.describe()
        out[name] = root / name
    from datastates.megatron_adapter import open_source
    from datastates.universal import write_universal

    src = open_source(str(out["datastates"] / ITER))
    try:
        write_universal(src, str(root / "universal"))
    finally:
        src.close()
    out["universal"] = root / "universal"
    return out


def _copy_root(src, dst):
    """A --load root with only the one checkpoint and the tracker."""
    os.makedirs(dst)
    shutil.copytree(src / ITER, dst / ITER)
    shutil.copy(src / "latest_checkpointed_iteration.txt", dst)
    return dst


# ----------------------------------------------------------------- planting payloads

def plant_common(iter_dir, marker):
    torch.save({"run_config": Payload(marker), "iteration": 2}, iter_dir / "common.pt")


def plant_dcp_metadata(iter_dir, marker):
    (iter_dir / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


def _read_metadata_trusted(iter_dir):
    """Our own test-written checkpoint: read its DCP metadata with the restricted reader."""
    from datastates.safe_load import read_dcp_metadata

    return read_dcp_metadata(str(iter_dir))


def plant_dcp_object(iter_dir, marker, fqn_part="_extra_state"):
    """Replace the bytes of the first saved object whose key contains `fqn_part` with a pickled
    payload, shifting the offsets of what follows it in the same .distcp file."""
    md = _read_metadata_trusted(iter_dir)
    index, info = next((i, s) for i, s in sorted(md.storage_data.items(), key=lambda x: x[0].fqn)
                       if fqn_part in i.fqn)
    path = iter_dir / info.relative_path
    raw = path.read_bytes()
    new = _torch_bytes(Payload(marker))
    path.write_bytes(raw[:info.offset] + new + raw[info.offset + info.length:])
    delta = len(new) - info.length
    for other in md.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += delta
    info.length = len(new)
    md.storage_meta = None
    (iter_dir / ".metadata").write_bytes(pickle.dumps(md))
    return index.fqn


def plant_index_pickle(iter_dir, marker):
    """A DataStates index whose rng_state object is the engine's opt-in pickle tag (rank marker's
    crc fixed, as a forger would)."""
    index_path = iter_dir / "index_r00000.json"
    doc = json.loads(index_path.read_text())
    tagged = {"__t__": "pickle", "b64": base64.b64encode(pickle.dumps(Payload(marker))).decode()}

    def walk(node):
        if isinstance(node, dict) and node.get("__t__") == "dict":
            for item in node["items"]:
                if isinstance(item[0], str) and item[0].startswith("rng_state"):
                    item[1] = tagged
                    return True
                if walk(item[1]):
                    return True
        return False

    assert walk(doc["objects"])
    raw = json.dumps(doc).encode()
    index_path.write_bytes(raw)
    marker_path = iter_dir / "done_r00000.json"
    m = json.loads(marker_path.read_text())
    m["index_crc32"] = zlib.crc32(raw)
    marker_path.write_text(json.dumps(m))


def plant_universal_object(u_dir, value):
    """A format-1 universal manifest whose first object is `value` as a torch_b64 pickle (its
    checksum recorded in the commit marker: only the pickle checks stop it)."""
    path = u_dir / "manifest.json"
    m = json.loads(path.read_text())
    key = sorted(m["objects"])[0]
    m["objects"][key] = {"torch_b64": base64.b64encode(_torch_bytes(value)).decode()}
    m["format_version"] = 1
    path.write_text(json.dumps(m))
    reseal(str(u_dir))
    return key


def plant_universal_extra_state(u_dir, pickled: bytes):
    """A universal manifest whose first module extra state is `pickled` in a uint8 tensor: how
    Transformer Engine saves its FP8 metadata, and what its set_extra_state before 2.18 hands to
    pickle.loads. Stored in format 2's typed encoding (no pickle in the manifest itself)."""
    from datastates.universal.objects import encode_object

    path = u_dir / "manifest.json"
    m = json.loads(path.read_text())
    key = sorted(k for k in m["objects"] if k.split("/")[0].endswith("._extra_state"))[0]
    m["objects"][key] = encode_object(torch.frombuffer(bytearray(pickled), dtype=torch.uint8))
    path.write_text(json.dumps(m))
    reseal(str(u_dir))
    return key


def _tool(*args):
    """In this process (every refusal comes before a worker is started); a payload that ran would
    leave its marker all the same."""
    return convert_in_process(*args)


def _refused(out, marker, *needles):
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    for needle in needles + ("--allow-unsafe-pickle",):
        assert needle in lines[0], (needle, lines[0])
    assert not os.path.exists(marker), "the payload ran"


# ----------------------------------------------------------------- tools

def test_converters_and_inspect_refuse_planted_pickles(runs, tmp_path):
    m = tmp_path / "MARKER"
    td = _copy_root(runs["torch_dist"], tmp_path / "td_common")
    plant_common(td / ITER, m)
    _refused(_tool("from-torch-dist", td, tmp_path / "o1"), m, "common.pt", "posix.mkdir")
    _refused(_tool("inspect", td), m, "common.pt", "posix.mkdir")
    assert not (tmp_path / "o1").exists()

    td = _copy_root(runs["torch_dist"], tmp_path / "td_meta")
    plant_dcp_metadata(td / ITER, m)
    _refused(_tool("from-torch-dist", td, tmp_path / "o2"), m, ".metadata", "posix.mkdir")
    _refused(_tool("inspect", td), m, ".metadata", "posix.mkdir")

    td = _copy_root(runs["torch_dist"], tmp_path / "td_obj")
    fqn = plant_dcp_object(td / ITER, m)
    _refused(_tool("from-torch-dist", td, tmp_path / "o3"), m, ".distcp", fqn, "posix.mkdir")

    ds = _copy_root(runs["datastates"], tmp_path / "ds_common")
    plant_common(ds / ITER, m)
    _refused(_tool("merge", ds, tmp_path / "o4"), m, "common.pt", "posix.mkdir")

    ds = _copy_root(runs["datastates"], tmp_path / "ds_index")
    plant_index_pickle(ds / ITER, m)
    _refused(_tool("merge", ds, tmp_path / "o5"), m, "pickled object")

    u = tmp_path / "u"
    shutil.copytree(runs["universal"], u)
    key = plant_universal_object(u, Payload(m))
    for cmd in (("to-torch-dist", u, tmp_path / "o6" / ITER), ("to-hf", u, tmp_path / "o7"),
                ("inspect", u), ("upgrade-universal", u)):
        _refused(_tool(*cmd), m, "manifest.json", key, "posix.mkdir",
                 f"convert_checkpoint.py upgrade-universal {u} --allow-unsafe-pickle")


def test_upgrade_universal_rewrites_legacy_pickles(runs, tmp_path):
    """A format-1 object that weights_only can read is upgraded without the opt-in; one that
    names code only with it (and the opt-in then really unpickles it)."""
    from datastates.safe_load import UnsafePickleError
    from datastates.universal import UniversalCheckpoint, upgrade_universal

    u = tmp_path / "u"
    shutil.copytree(runs["universal"], u)
    value = (1, torch.arange(3, dtype=torch.bfloat16), {"a": [2.5]})
    key = plant_universal_object(u, value)
    with UniversalCheckpoint(str(u)) as ck:
        got = ck.object(key)
    assert got[0] == 1 and torch.equal(got[1], value[1]) and got[2] == {"a": [2.5]}
    assert upgrade_universal(str(u)) == 1
    m = json.loads((u / "manifest.json").read_text())
    assert m["format_version"] == 2 and "torch_b64" not in json.dumps(m)
    assert json.loads((u / "UNIVERSAL_COMMIT.json").read_text())["format_version"] == 2
    with UniversalCheckpoint(str(u)) as ck:
        again = ck.object(key)
    assert again[0] == 1 and torch.equal(again[1], value[1]) and again[2] == {"a": [2.5]}
    assert upgrade_universal(str(u)) == 0

    marker = tmp_path / "OPTED_IN"
    key = plant_universal_object(u, Payload(marker))
    before = (u / "manifest.json").read_bytes()
    with pytest.raises(UnsafePickleError, match="posix.mkdir"):
        upgrade_universal(str(u))
    assert (u / "manifest.json").read_bytes() == before and not marker.exists()
    # The opt-in really is plain pickle: the "payload" runs (and returns None).
    assert upgrade_universal(str(u), allow_unsafe_pickle=True) == 1
    assert marker.is_dir()
    with UniversalCheckpoint(str(u)) as ck:
        assert ck.object(key) is None


# ----------------------------------------------------------------- trainer --load

def test_trainer_load_refuses_planted_pickles_in_every_format(runs, tmp_path):
    cases, markers = [], {}

    def case(name, load, **extra):
        markers[name] = tmp_path / f"M_{name}"
        cases.append(dict(name=name, load=str(load), **extra))
        return markers[name]

    for name, plant in (("td_common", plant_common), ("td_metadata", plant_dcp_metadata),
                        ("td_object", plant_dcp_object)):
        d = _copy_root(runs["torch_dist"], tmp_path / name)
        plant(d / ITER, case(name, d))
    d = _copy_root(runs["torch"], tmp_path / "torch_model")
    torch.save({"run_config": Payload(case("torch_model", d)), "iteration": 2},
               d / ITER / "mp_rank_00" / "model_optim_rng.pt")
    d = _copy_root(runs["torch"], tmp_path / "torch_distopt")
    torch.save({"0": Payload(case("torch_distopt", d))}, d / ITER / "mp_rank_00" / "distrib_optim.pt")
    d = _copy_root(runs["datastates"], tmp_path / "ds_index")
    plant_index_pickle(d / ITER, case("ds_index", d))
    for name, optin in (("universal", False), ("universal_optin", True)):
        u = tmp_path / name
        shutil.copytree(runs["universal"], u)
        plant_universal_object(u, Payload(case(name, u, allow_unsafe_pickle=optin)))
    u = tmp_path / "universal_legacy_safe"
    shutil.copytree(runs["universal"], u)
    plant_universal_object(u, None)  # what format 1 wrote for a CPU model's _extra_state
    cases.append(dict(name="universal_legacy_safe", load=str(u)))
    # Module extra state as Transformer Engine writes it: a pickle in a uint8 tensor. One that
    # imports a callable is refused before any module's set_extra_state sees it; one that imports
    # nothing (an empty dict) cannot run code and loads; the opt-in loads the first.
    for name, optin in (("te_extra_state", False), ("te_extra_state_optin", True)):
        u = tmp_path / name
        shutil.copytree(runs["universal"], u)
        plant_universal_extra_state(
            u, pickle.dumps(Payload(case(name, u, allow_unsafe_pickle=optin))))
    u = tmp_path / "te_extra_state_inert"
    shutil.copytree(runs["universal"], u)
    plant_universal_extra_state(u, pickle.dumps({}))
    cases.append(dict(name="te_extra_state_inert", load=str(u)))

    cases_path = tmp_path / "cases.json"
    cases_path.write_text(json.dumps(cases))
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(REPO / "tests" / "faults_load_probe.py"),
                          str(cases_path), "--"] + ARGS, capture_output=True, text=True,
                         env=env, cwd=str(REPO), timeout=300)
    results = {r["name"]: r for r in (json.loads(ln[len("PROBE "):])
                                      for ln in out.stdout.splitlines() if ln.startswith("PROBE "))}
    assert len(results) == len(cases), out.stdout[-3000:] + out.stderr[-3000:]

    expect = {"td_common": ["common.pt", "posix.mkdir"],
              "td_metadata": [".metadata", "posix.mkdir"],
              "td_object": [".distcp", "_extra_state", "posix.mkdir"],
              "torch_model": ["model_optim_rng.pt", "posix.mkdir"],
              "torch_distopt": ["distrib_optim.pt", "posix.mkdir"],
              "ds_index": ["pickled object", "index_r00000.json"],
              "universal": ["manifest.json", "_extra_state", "posix.mkdir", "upgrade-universal"],
              "te_extra_state": ["linear_fc1._extra_state", "set_extra_state", "posix.mkdir",
                                 "Transformer Engine 2.18"]}
    for name, needles in expect.items():
        r = results[name]
        assert not r["ok"] and r["error"] and not r["error"].startswith("UNEXPECTED"), r
        assert "\n" not in r["error"], r["error"]
        for needle in needles + ["--allow-unsafe-pickle"]:
            assert needle in r["error"], (name, needle, r["error"])
        assert not markers[name].exists(), f"{name}: the payload ran"
    assert results["universal_legacy_safe"]["ok"], results["universal_legacy_safe"]
    assert results["te_extra_state_inert"]["ok"], results["te_extra_state_inert"]
    # With the opt-in the planted state reaches the module (the local spec's linear layers keep
    # no extra state and ignore it; Transformer Engine's would unpickle it).
    assert results["te_extra_state_optin"]["ok"], results["te_extra_state_optin"]
    # The explicit opt-in, and only it, unpickles the legacy object with code execution.
    assert results["universal_optin"]["ok"] and markers["universal_optin"].is_dir()


# ----------------------------------------------------------------- background merge

def test_background_merge_refuses_a_planted_pickle(runs, tmp_path):
    from datastates.megatron_adapter import BackgroundMerger, MergerConfig

    marker = tmp_path / "MARKER"
    ds = _copy_root(runs["datastates"], tmp_path / "ds")
    plant_common(ds / ITER, marker)
    logs = []
    merger = BackgroundMerger(MergerConfig(root=str(tmp_path / "universal"), idle_io=False),
                              log=logs.append)
    merger.on_commit(2, str(ds / ITER))
    merger.wait()
    assert not merger.results and not marker.exists()
    assert any("FAILED" in ln and "common.pt" in ln and "posix.mkdir" in ln for ln in logs), logs
    assert not (tmp_path / "universal" / ITER).exists()


# ----------------------------------------------------------------- DCP metadata paths

@pytest.mark.parametrize("rel", ["../outside.distcp", "/etc/passwd", "sub/../../x.distcp"])
def test_dcp_metadata_storage_paths_stay_inside(runs, tmp_path, rel):
    from datastates import CheckpointError
    from datastates.safe_load import read_dcp_metadata

    d = tmp_path / "td"
    shutil.copytree(runs["torch_dist"] / ITER, d)
    md = _read_metadata_trusted(d)
    next(iter(md.storage_data.values())).relative_path = rel
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"names storage file .*expected a file name inside|"
                                              r"outside the checkpoint directory"):
        read_dcp_metadata(str(d))


def test_dcp_metadata_symlink_outside_is_refused(runs, tmp_path):
    from datastates import CheckpointError
    from datastates.safe_load import read_dcp_metadata

    d = tmp_path / "td"
    shutil.copytree(runs["torch_dist"] / ITER, d)
    secret = tmp_path / "secret.distcp"
    os.rename(d / "__0_0.distcp", secret)
    os.symlink(secret, d / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        read_dcp_metadata(str(d))


# ----------------------------------------------------------------- module extra state (unit)

def test_pickle_imports_lists_what_a_stream_would_import_without_running_it(tmp_path):
    from datastates.safe_load import pickle_imports

    marker = tmp_path / "M"
    assert pickle_imports(pickle.dumps({})) == []
    assert pickle_imports(pickle.dumps({"a": [1, 2.5, "x", (True, None)]})) == []
    for protocol in (0, 2, 4, 5):  # GLOBAL/INST in the old protocols, STACK_GLOBAL from 4
        assert pickle_imports(pickle.dumps(Payload(marker), protocol=protocol)) == ["posix.mkdir"]
    te_like = {"scale_fwd": torch.ones(3), "extra_fp8_variables": {"num_gemms": 1}}
    assert "torch._utils._rebuild_tensor_v2" in pickle_imports(pickle.dumps(te_like))
    with pytest.raises(ValueError, match="not a readable pickle stream"):
        pickle_imports(b"\x80\x04not a pickle")
    assert not marker.exists()


def test_extra_state_check_refuses_what_set_extra_state_would_unpickle(monkeypatch, tmp_path):
    from datastates.safe_load import UnsafePickleError
    from megatron.training.checkpointing import contents as cc

    def as_tensor(raw):
        return torch.tensor(list(raw), dtype=torch.uint8)

    planted = as_tensor(pickle.dumps(Payload(tmp_path / "M")))
    fine = {"a.weight": torch.ones(2), "a._extra_state": None, "b._extra_state": as_tensor(b""),
            "c._extra_state": as_tensor(pickle.dumps({})), "d.bias_extra": planted}
    cc.check_extra_states(fine, allow_unsafe_pickle=False)
    for value, needle in ((planted, "imports posix.mkdir"),
                          (io.BytesIO(_torch_bytes({"x": 1})), "a torch.save buffer"),
                          (as_tensor(b"\x80\x04junk"), "not a readable pickle stream")):
        with pytest.raises(UnsafePickleError) as err:
            cc.check_extra_states({**fine, "layer.fc1._extra_state": value},
                                  allow_unsafe_pickle=False, path="/ckpt/iter_0000002")
        assert "layer.fc1._extra_state" in str(err.value) and needle in str(err.value)
        assert "--allow-unsafe-pickle" in str(err.value) and "/ckpt/iter_0000002" in str(err.value)
        cc.check_extra_states({"layer.fc1._extra_state": value}, allow_unsafe_pickle=True)
    # A Transformer Engine that checks these pickles itself (2.18+) decides on its own, and our
    # flag is its opt-in while the model loads; the environment is restored afterwards.
    monkeypatch.setattr(cc, "_te_guards_extra_state", lambda: True)
    cc.check_extra_states({"layer.fc1._extra_state": planted}, allow_unsafe_pickle=False)
    monkeypatch.delenv(cc.TE_UNSAFE_PICKLE_ENV, raising=False)
    with cc._te_pickle_opt_in(True):
        assert os.environ[cc.TE_UNSAFE_PICKLE_ENV] == "1"
    assert cc.TE_UNSAFE_PICKLE_ENV not in os.environ
    with cc._te_pickle_opt_in(False):
        assert cc.TE_UNSAFE_PICKLE_ENV not in os.environ
    assert not (tmp_path / "M").exists()
