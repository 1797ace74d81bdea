"""Universal checkpoints: checksums (every damage refused naming file and tensor by the reader,
to-hf and the trainer's --load; per-chunk verification of partial reads; checkpoints without
checksums still load with a warning), failed merges that leave nothing, file permissions."""
import json
import os
import shutil

import pytest
import torch

from datastates import CheckpointError
from datastates.megatron_adapter import export_hf, open_source
from datastates.universal import (MANIFEST_FILE, UniversalCheckpoint, add_checksums,
                                  unchecked_warning, write_universal)
from universal_fixtures import (flip_byte, reseal, source,  # noqa: F401 - a fixture
                                strip_checksums, tensor_span)

FC1 = "decoder.layers.mlp.linear_fc1.weight"  # [2, 32, 8] fp32: 2048 bytes


@pytest.fixture
def universal(source, tmp_path):
    d, tensors = source
    return write_universal(open_source(d), str(tmp_path / "u")).directory, tensors


def _refused(fn, *needles):
    with pytest.raises(CheckpointError) as err:
        fn()
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    return str(err.value)


def _read(udir, name, *box):
    with UniversalCheckpoint(udir) as u:
        return u.read(name, *box)


def test_a_flipped_exponent_byte_is_refused_by_the_reader_and_to_hf(universal, tmp_path):
    udir, tensors = universal
    path, offset, _ = tensor_span(udir, FC1)
    flat = tensors[FC1].flatten()
    element = next(i for i, v in enumerate(flat.tolist()) if 0.01 < abs(v) < 0.1)
    flip_byte(path, offset + 4 * element + 3)  # the high byte of a float32: sign and exponent
    damaged = torch.frombuffer(bytearray(open(path, "rb").read()[offset:offset + 2048]),
                               dtype=torch.float32)
    assert 1e30 < damaged[element].abs() < float("inf")  # a weight of ~0.02 became ~1e36
    msg = _refused(lambda: _read(udir, FC1), f"file {path}", repr(FC1), "checksum mismatch",
                   "expected crc32c 0x", "found 0x")
    assert "bytes [0, 2048) of the tensor" in msg
    # Only the damaged tensor is refused: the others read and verify.
    assert torch.equal(_read(udir, "decoder.final_layernorm.weight"),
                       tensors["decoder.final_layernorm.weight"])
    warnings = []
    _refused(lambda: export_hf(udir, str(tmp_path / "hf"), warn=warnings.append),
             f"file {path}", repr(FC1), "checksum mismatch")
    assert not warnings
    assert not os.path.exists(tmp_path / "hf") and not os.path.exists(tmp_path / "hf.tmp-hf")


def test_a_partial_read_verifies_only_the_chunks_it_touches(source, tmp_path):
    d, tensors = source
    # 256-byte chunks: FC1's layer 0 is chunks 0-3, layer 1 chunks 4-7.
    udir = write_universal(open_source(d), str(tmp_path / "u"), chunk_bytes=256).directory
    m = json.load(open(os.path.join(udir, MANIFEST_FILE)))
    assert m["checksum"] == {"algorithm": "crc32c", "chunk_bytes": 256}
    assert len(m["tensors"][FC1]["crc32c"]) == 8
    path, offset, _ = tensor_span(udir, FC1)
    flip_byte(path, offset + 1024 + 300)  # layer 1, chunk 5
    w = tensors[FC1]
    with UniversalCheckpoint(udir) as u:  # a PP stage holding layer 0 reads only chunks 0-3
        assert torch.equal(u.read(FC1, (0, 0, 0), (1, 32, 8)), w[:1])
        assert torch.equal(u.read(FC1, (1, 0, 0), (1, 8, 8)), w[1:, :8])  # chunk 4 only
        # a TP slice of the last dimension spans every row of the layer: chunks 4-7
        _refused(lambda: u.read(FC1, (1, 0, 4), (1, 32, 4)), "bytes [1280, 1536)", repr(FC1))
        _refused(lambda: u.verify(FC1), "bytes [1280, 1536)")


def test_truncated_missing_and_mismatched_files_are_refused_naming_file_and_tensor(universal):
    udir, tensors = universal
    path, offset, nbytes = tensor_span(udir, FC1)
    keep = dict(tensors)
    original = open(path, "rb").read()

    with open(path, "r+b") as f:  # cut in the middle of the tensor
        f.truncate(offset + nbytes // 2)
    _refused(lambda: _read(udir, FC1), f"file {path}", repr(FC1), "truncated",
             f"ends at byte {offset + nbytes}")
    with open(path, "r+b") as f:  # cut inside the header
        f.truncate(20)
    _refused(lambda: _read(udir, FC1), f"file {path}", "truncated")

    from safetensors.torch import save_file
    names = json.load(open(os.path.join(udir, MANIFEST_FILE)))["tensors"]
    whole = {n: keep.get(n.replace("fp32_param", "param"), None) for n in names}
    del whole[FC1]  # a file that lacks a tensor the manifest puts in it
    save_file({n: t for n, t in whole.items() if t is not None}, path)
    _refused(lambda: _read(udir, FC1), f"file {path}", repr(FC1), "does not hold it")
    save_file({FC1: keep[FC1].reshape(2, 8, 32)}, path)  # same bytes, another shape
    _refused(lambda: _read(udir, FC1), f"file {path}", repr(FC1), "F32[2, 8, 32]",
             "F32[2, 32, 8]")
    os.remove(path)  # the file the manifest names is gone
    _refused(lambda: _read(udir, FC1), f"file {path}", repr(FC1), "cannot open tensor file")
    open(path, "wb").write(original)
    assert torch.equal(_read(udir, FC1), keep[FC1])


def test_damaged_or_edited_manifest_and_checksum_table_are_refused(universal):
    udir, _ = universal
    manifest = os.path.join(udir, MANIFEST_FILE)
    original = open(manifest, "rb").read()
    text = original.decode()
    at = text.index('"consumed_train_samples": 40')
    open(manifest, "wb").write((text[:at] + '"consumed_train_samples": 48' +
                                text[at + 28:]).encode())
    _refused(lambda: UniversalCheckpoint(udir), f"file {manifest}",
             "does not match the checksum in UNIVERSAL_COMMIT.json")
    m = json.loads(original)
    m["tensors"][FC1]["crc32c"] = m["tensors"][FC1]["crc32c"][:0]
    json.dump(m, open(manifest, "w"))
    reseal(udir)  # a consistent forgery: the table itself is checked
    _refused(lambda: UniversalCheckpoint(udir), repr(FC1), "expected 1 crc32c values")
    del m["tensors"][FC1]["crc32c"]
    json.dump(m, open(manifest, "w"))
    reseal(udir)
    _refused(lambda: UniversalCheckpoint(udir), repr(FC1), "none for this tensor")


def test_a_checkpoint_without_checksums_loads_with_a_warning_and_can_get_them(universal,
                                                                              tmp_path):
    udir, tensors = universal
    strip_checksums(udir)
    with UniversalCheckpoint(udir) as u:
        assert not u.checksummed
        assert torch.equal(u.read(FC1), tensors[FC1])
    warnings = []
    cfg = export_hf(udir, str(tmp_path / "hf"), warn=warnings.append)
    assert warnings == [unchecked_warning(udir)] and cfg["n_layer"] == 2
    assert "upgrade-universal" in warnings[0] and "no checksums" in warnings[0]
    assert add_checksums(udir) == len(json.load(open(os.path.join(udir, MANIFEST_FILE)))
                                       ["tensors"])
    assert add_checksums(udir) == 0
    path, offset, _ = tensor_span(udir, FC1)
    flip_byte(path, offset + 5)
    with UniversalCheckpoint(udir) as u:
        assert u.checksummed
        _refused(lambda: u.read(FC1), repr(FC1), "checksum mismatch")


def test_failed_merge_leaves_nothing_and_files_respect_the_umask(source, tmp_path):
    d, tensors = source
    bad = str(tmp_path / "bad" / "iter_0000005")
    shutil.copytree(d, bad)
    index = json.load(open(os.path.join(bad, "index_r00000.json")))
    entry = max(index["tensors"], key=lambda t: t["nbytes"])
    flip_byte(os.path.join(bad, "shard_r00000.bin"), entry["offset"] + 3)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        write_universal(open_source(bad), str(tmp_path / "out" / "iter_0000005"))
    assert os.listdir(tmp_path / "out") == []  # no committed directory, no temporary
    assert sorted(os.listdir(tmp_path / "bad")) == ["iter_0000005"]  # no lock file left

    old = os.umask(0o022)
    try:
        u = write_universal(open_source(d), str(tmp_path / "u")).directory
        export_hf(u, str(tmp_path / "hf"))
        os.umask(0o077)
        private = write_universal(open_source(d), str(tmp_path / "p")).directory
    finally:
        os.umask(old)
    for directory, mode in ((u, 0o644), (str(tmp_path / "hf"), 0o644), (private, 0o600)):
        modes = {f: oct(os.stat(os.path.join(directory, f)).st_mode & 0o777)
                 for f in os.listdir(directory)}
        assert set(modes.values()) == {oct(mode)}, (directory, modes)
    assert "model.safetensors" in os.listdir(tmp_path / "hf")


def test_box_chunks_match_a_brute_force_count():
    import itertools
    import random

    from datastates.universal.tensor_files import box_chunks

    rng = random.Random(0)
    for _ in range(300):
        shape = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
        item, chunk = rng.choice([1, 2, 4]), rng.choice([1, 3, 8, 16, 64])
        off = [rng.randint(0, s - 1) for s in shape]
        box = [rng.randint(1, s - o) for s, o in zip(shape, off)]
        strides = [item * int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape))]
        want = set()
        for idx in itertools.product(*[range(o, o + b) for o, b in zip(off, box)]):
            first = sum(i * s for i, s in zip(idx, strides))
            want.update(b // chunk for b in range(first, first + item))
        assert box_chunks(shape, item, off, box, chunk) == sorted(want), (shape, off, box)


# ----------------------------------------------------------------- the trainer's --load
# One training launch writes iterations 1-2 (--async-lazy-save); they are merged here, in this
# process; one probe process tries --load on each damaged copy (megatron-core starts twice).

def _probe_cases(root):
    """name -> case of tests/faults_load_probe.py, each on a copy of the universal root."""
    cases = {}

    def case(name, damage, fallback=False):
        d = str(root / name)
        shutil.copytree(str(root / "universal"), d)
        damage(os.path.join(d, "iter_0000002"))
        cases[name] = {"name": name, "load": d, "fallback": fallback}

    def flip(it):
        name = "embedding.word_embeddings.weight"
        path, offset, nbytes = tensor_span(it, name)
        flip_byte(path, offset + nbytes // 2 + 3)

    case("flipped", flip)
    case("flipped_fallback", flip, fallback=True)
    case("without_checksums", strip_checksums)
    return cases


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    import subprocess
    import sys

    from trainer_launch import NO_DROPOUT, REPO, TINY_MODEL, launch

    args = TINY_MODEL + NO_DROPOUT + ["--eval-interval", "0", "--train-iters", "2"]
    root = tmp_path_factory.mktemp("trainer")
    run = launch(1, args + ["--async-lazy-save", "--save-interval", "1", "--save",
                            str(root / "save")])
    assert run.returncode == 0, run.describe()
    for it in (1, 2):
        write_universal(open_source(str(root / "save" / f"iter_{it:07d}")),
                        str(root / "universal" / f"iter_{it:07d}"))
    (root / "universal" / "latest_checkpointed_iteration.txt").write_text("2")
    cases = _probe_cases(root)
    spec = root / "cases.json"
    spec.write_text(json.dumps(list(cases.values())))
    out = subprocess.run([sys.executable, str(REPO / "tests" / "faults_load_probe.py"), str(spec),
                          "--"] + args, cwd=str(REPO), text=True, capture_output=True,
                         timeout=300,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    results, printed = {}, []
    for line in out.stdout.splitlines():  # what each case printed comes before its PROBE line
        if line.startswith("PROBE "):
            r = json.loads(line[6:])
            results[r["name"]] = dict(r, printed="\n".join(printed))
            printed = []
        else:
            printed.append(line)
    assert sorted(results) == sorted(cases), out.stdout[-3000:] + out.stderr[-3000:]
    return results, root


def test_load_refuses_a_flipped_byte_naming_file_and_tensor(probed):
    results, root = probed
    r = results["flipped"]
    assert not r["ok"] and r["error"].startswith("CheckpointError: "), r
    for needle in ("loading the universal checkpoint ", "failed on rank(s) [0]: ",
                   "checksum mismatch",
                   "flipped/iter_0000002/model-00001-of-00001.safetensors",
                   "tensor 'embedding.word_embeddings.weight'", "expected crc32c 0x",
                   "--ckpt-fallback-to-previous to resume from iteration 1"):
        assert needle in r["error"], (needle, r["error"])


def test_a_byte_damaged_where_one_rank_reads_is_one_line_naming_that_rank(probed, tmp_path):
    """At PP2 only rank 1 reads layers 2-3: it names the damage, every rank stops, one line (was
    rank 1's error and rank 0's "another rank found it damaged")."""
    from trainer_launch import NO_DROPOUT, TINY_MODEL, launch

    _, root = probed
    for i in (1, 2):  # checksummed per 4 KiB, so that the two stages read different chunks
        write_universal(open_source(str(root / "save" / f"iter_{i:07d}")),
                        str(tmp_path / "u" / f"iter_{i:07d}"), chunk_bytes=4096)
    (tmp_path / "u" / "latest_checkpointed_iteration.txt").write_text("2")
    it = str(tmp_path / "u" / "iter_0000002")
    name = "decoder.layers.self_attention.linear_qkv.weight"  # the 4 layers stacked
    path, offset, nbytes = tensor_span(it, name)
    flip_byte(path, offset + nbytes - 5)
    run = launch(2, TINY_MODEL + NO_DROPOUT + ["--eval-interval", "0", "--train-iters", "3",
                                               "--pipeline-model-parallel-size", "2",
                                               "--load", str(tmp_path / "u")])
    assert run.returncode != 0, run.describe()
    (line,) = [ln for ln in run.stderr.splitlines() if "pretrain_gpt.py: error:" in ln]
    for needle in (f"loading the universal checkpoint {it} failed on rank(s) [1]: ",
                   f"tensor '{name}'", "checksum mismatch",
                   "--ckpt-fallback-to-previous to resume from iteration 1"):
        assert needle in line, (needle, line)


def test_fallback_resumes_from_the_newest_intact_universal_checkpoint(probed):
    results, _ = probed
    r = results["flipped_fallback"]
    assert r["ok"] and r["iteration"] == 1, r
    assert "resuming from iteration 1 instead of 2" in r["printed"]
    assert "checksum mismatch" in r["printed"]


def test_load_of_a_checkpoint_without_checksums_warns(probed):
    results, root = probed
    r = results["without_checksums"]
    assert r["ok"] and r["iteration"] == 2, r
    assert ("WARNING: " + unchecked_warning(str(root / "without_checksums" / "iter_0000002"))
            in r["printed"]), r["printed"][-2000:]
