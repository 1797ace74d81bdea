"""Failures: unwritable directory, full disk, failing writes, corrupt files, SIGKILL mid-flush."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

from datastates import (Checksum, CheckpointEngine, CheckpointError, CheckpointReader,
                        EngineConfig, is_committed, try_commit)
from tmpfs import mounted_tmpfs


def state(n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(n, generator=g), "b": torch.randn(n, 4, generator=g),
            "c": torch.arange(n)}


def save(d, st, **cfg):
    with CheckpointEngine(EngineConfig(**{"host_cache_bytes": 1 << 20, **cfg})) as eng:
        eng.wait_for_durable(eng.save(st, d, step=1))


def markers(d):
    return sorted(f for f in os.listdir(d) if f.startswith("done_") or f == "COMMIT.json")


def test_unwritable_directory_fails_the_save_naming_the_file(tmp_path):
    """The shard file is made by a writer thread (a slow metadata server never holds the
    caller): the failure to make it fails that save, raised at the next call, and the engine
    goes on saving elsewhere."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20)) as eng:
        handle = eng.save(state(), str(blocker / "v"), step=1)
        with pytest.raises(CheckpointError, match=r"rank 0, file .*file/v/shard_r00000\.bin\] "
                           r"cannot create the shard file: .*Not a directory"):
            eng.wait_for_durable(handle)
        good = str(tmp_path / "good")
        eng.wait_for_durable(eng.save(state(), good, step=2))
        assert is_committed(good)


@pytest.mark.parametrize("empty", [False, True])
def test_save_call_makes_no_file_system_call(tmp_path, empty):
    """`save` neither creates nor opens anything under the version directory on the caller's
    thread, overwriting a version included (its markers are withdrawn by a writer too); a save
    without tensors is written by a writer as well."""
    from fs_calls import recording

    d = str(tmp_path / "v")
    st = {"step": 1} if empty else state()
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20)) as eng:
        eng.wait_for_durable(eng.save(st, d, step=1))
        with recording(str(tmp_path)) as rec:
            handle = eng.save(st, d, step=2)  # the same directory: an overwrite
        assert rec.calls == []
        eng.wait_for_durable(handle)
    assert is_committed(d)
    loaded = CheckpointReader(d).load_state()
    assert loaded.keys() == st.keys()
    assert all(torch.equal(loaded[k], v) if isinstance(v, torch.Tensor) else loaded[k] == v
               for k, v in st.items())


def test_write_fault_mid_way_leaves_no_marker_and_engine_recovers(tmp_path):
    calls = []

    def hook(event, info):
        if event == "write":
            calls.append(info["tensor"])
            if len(calls) == 3:
                raise OSError(5, "injected I/O error")

    d = str(tmp_path / "bad")
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 16, chunk_bytes=8192,
                                       write_hook=hook)) as eng:
        eng.save(state(), d, step=1)
        with pytest.raises(CheckpointError) as err:
            eng.wait_for_durable()
        assert err.value.rank == 0 and err.value.file.endswith("shard_r00000.bin")
        assert err.value.tensor == calls[2] and "injected I/O error" in str(err.value)
        assert markers(d) == [] and not try_commit(d, 1)
        # The engine keeps working for the next save once the error was reported.
        good = str(tmp_path / "good")
        calls.append("skip")
        eng.wait_for_durable(eng.save(state(seed=1), good, step=2))
    assert torch.equal(CheckpointReader(good).load_state()["b"], state(seed=1)["b"])
    with pytest.raises(CheckpointError, match="not committed"):
        CheckpointReader(d)


def test_fsync_fault_leaves_no_marker(tmp_path):
    def hook(event, info):
        if event == "fsync":
            raise OSError(28, "No space left on device")

    d = str(tmp_path / "v")
    with pytest.raises(CheckpointError, match="No space"):
        save(d, state(), write_hook=hook)
    assert markers(d) == []


def test_full_tmpfs_fails_cleanly(tmp_path):
    with mounted_tmpfs(tmp_path / "tiny", "1m") as mnt:
        d = str(mnt / "v")
        with pytest.raises(CheckpointError) as err:
            save(d, state(n=1 << 17), host_cache_bytes=1 << 18)  # 3.5 MB into 1 MB
        assert "No space left" in str(err.value) or "Errno 28" in str(err.value)
        assert err.value.file.endswith("shard_r00000.bin") and err.value.tensor in "abc"
        assert markers(d) == [] and not is_committed(d)


def corrupt_setup(tmp_path, **cfg):
    d = str(tmp_path / "v")
    save(d, state(), chunk_bytes=8192, host_cache_bytes=1 << 16, **cfg)
    with open(os.path.join(d, "index_r00000.json")) as f:
        index = json.load(f)
    return d, {t["key"]: t for t in index["tensors"]}


# zlib-crc32: what versions before crc32c wrote; their checkpoints must keep verifying.
@pytest.mark.parametrize("kind", [Checksum.CRC32C, Checksum.CRC32])
def test_flipped_byte_is_detected_naming_file_and_tensor(tmp_path, kind):
    d, entries = corrupt_setup(tmp_path, checksum=kind)
    shard = os.path.join(d, "shard_r00000.bin")
    pos = entries["b"]["offset"] + 20000
    with open(shard, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x10]))
    reader = CheckpointReader(d)
    assert torch.equal(reader.read("a"), state()["a"])  # other tensors still load
    assert torch.equal(reader.read("b", (0, 0), (100, 4)), state()["b"][:100])  # other chunks too
    with pytest.raises(CheckpointError, match=r"file .*shard_r00000\.bin, tensor 'b'.*checksum"):
        reader.load_state()


def test_truncated_shard_is_detected_naming_file_and_tensor(tmp_path):
    d, entries = corrupt_setup(tmp_path)
    os.truncate(os.path.join(d, "shard_r00000.bin"), entries["c"]["offset"] + 100)
    reader = CheckpointReader(d)
    assert torch.equal(reader.read("b"), state()["b"])
    with pytest.raises(CheckpointError, match=r"shard_r00000\.bin, tensor 'c'.*truncated"):
        reader.read("c")


def rewrite_index(d, edit):
    path = os.path.join(d, "index_r00000.json")
    with open(path) as f:
        index = json.load(f)
    edit(index)
    raw = json.dumps(index).encode()
    with open(path, "wb") as f:
        f.write(raw)
    marker_path = os.path.join(d, "done_r00000.json")
    with open(marker_path) as f:
        marker = json.load(f)
    marker["index_crc32"] = zlib.crc32(raw)  # a consistent forgery, not just corruption
    with open(marker_path, "w") as f:
        json.dump(marker, f)


@pytest.mark.parametrize("name", ["../evil.bin", "/etc/passwd", "sub/x.bin", ".."])
def test_path_traversal_in_index_is_refused(tmp_path, name):
    d, _ = corrupt_setup(tmp_path)

    def edit(index):
        index["tensors"][0]["file"] = name
    rewrite_index(d, edit)
    with pytest.raises(CheckpointError, match="plain file name|outside"):
        CheckpointReader(d)


def test_edited_index_without_matching_marker_is_refused(tmp_path):
    d, _ = corrupt_setup(tmp_path)
    path = os.path.join(d, "index_r00000.json")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace('"shape":[4096,4]', '"shape":[4096,2]'))
    with pytest.raises(CheckpointError, match="index does not match"):
        CheckpointReader(d)


def test_uncommitted_directory_is_refused_unless_asked(tmp_path):
    d, _ = corrupt_setup(tmp_path)
    os.unlink(os.path.join(d, "COMMIT.json"))
    with pytest.raises(CheckpointError, match="not committed"):
        CheckpointReader(d)
    assert torch.equal(CheckpointReader(d, allow_uncommitted=True).read("c"), state()["c"])


CHILD = textwrap.dedent("""
    import sys, time, torch
    from datastates import CheckpointEngine, EngineConfig
    root = sys.argv[1]
    flushing = []
    def hook(event, info):
        if event == "write" and flushing:
            print("FLUSHING", flush=True)
            time.sleep(600)  # held mid-flush until the parent kills us
    g = torch.Generator().manual_seed(0)
    st = {"w": torch.randn(512, 256, generator=g)}
    eng = CheckpointEngine(EngineConfig(host_cache_bytes=1 << 16, chunk_bytes=8192,
                                        write_hook=hook))
    eng.wait_for_durable(eng.save(st, root + "/v1", step=1))
    st["w"].add_(1)
    flushing.append(1)
    eng.save(st, root + "/v2", step=2)
    time.sleep(120)
""")


def test_sigkill_during_flush_keeps_previous_version(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "FLUSHING"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    g = torch.Generator().manual_seed(0)
    assert torch.equal(CheckpointReader(str(tmp_path / "v1")).read("w"),
                       torch.randn(512, 256, generator=g))
    v2 = str(tmp_path / "v2")
    assert os.path.exists(os.path.join(v2, "shard_r00000.bin"))
    assert markers(v2) == [] and not is_committed(v2) and not try_commit(v2, 1)
    with pytest.raises(CheckpointError, match="not committed"):
        CheckpointReader(v2)


def test_latest_committed_skips_partial_versions(tmp_path):
    from datastates import latest_committed, step_dir
    root = str(tmp_path)
    assert latest_committed(root) is None
    for step in (5, 40):
        save(step_dir(root, step), state(n=64))
    os.makedirs(step_dir(root, 100))  # a save that never finished
    with open(os.path.join(step_dir(root, 100), "shard_r00000.bin"), "wb") as f:
        f.write(b"partial")
    assert latest_committed(root) == (40, step_dir(root, 40))
    assert step_dir(root, 40).endswith("step_000000040")


def test_level3_local_copy_then_migration_and_local_restore(tmp_path):
    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    d = os.path.join(shared, "step_000000003")
    st = state(n=50000)
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 18, local_dir=local)) as eng:
        (rec,) = eng.wait_for_durable(eng.save(st, d, step=3))
    assert rec.committed and 0 < rec.local_durable_s <= rec.durable_s
    assert is_committed(d)
    local_copy = os.path.join(local, "step_000000003")
    for name in ("shard_r00000.bin", "index_r00000.json", "done_r00000.json"):
        with open(os.path.join(local_copy, name), "rb") as a:
            with open(os.path.join(d, name), "rb") as b:
                assert a.read() == b.read()
    # Damage the shared copy: a reader told about the local copy still loads, others fail.
    with open(os.path.join(d, "shard_r00000.bin"), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    reader = CheckpointReader(d, local_dir=local)
    assert reader.source(0) == local_copy
    assert torch.equal(reader.load_state()["a"], st["a"])
    assert CheckpointReader(d).source(0) == d
    with pytest.raises(CheckpointError, match="checksum"):
        CheckpointReader(d).load_state()
    # A stale local copy (another save's index) is ignored.
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 18)) as eng:
        eng.wait_for_durable(eng.save(state(n=64, seed=9), d, step=3))
    assert CheckpointReader(d, local_dir=local).source(0) == d


def test_level3_damaged_local_copy_falls_back_to_the_version_directory(tmp_path):
    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    d = os.path.join(shared, "step_000000004")
    st = state(n=50000)
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 18, local_dir=local)) as eng:
        eng.wait_for_durable(eng.save(st, d, step=4))
    local_copy = os.path.join(local, "step_000000004")
    intact = CheckpointReader(d, local_dir=local)
    assert torch.equal(intact.load_state()["a"], st["a"])
    assert set(intact.read_stats()) == {"local"} and intact.fallbacks == {}
    assert intact.read_stats()["local"][0] >= st["a"].numel() * st["a"].element_size()
    with open(os.path.join(local_copy, "shard_r00000.bin"), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    reader = CheckpointReader(d, local_dir=local)
    assert reader.source(0) == local_copy  # its marker and index still match
    loaded = reader.load_state()
    assert all(torch.equal(loaded[k], st[k]) for k in st)
    assert reader.source(0) == d and "checksum mismatch" in reader.fallbacks[0]
    assert local_copy in reader.fallbacks[0] and reader.read_stats()["shared"][0] > 0
    os.truncate(os.path.join(local_copy, "shard_r00000.bin"), 10)  # truncated: same fallback
    reader = CheckpointReader(d, local_dir=local)
    assert torch.equal(reader.load_state()["b"], st["b"]) and "truncated" in reader.fallbacks[0]


def test_level3_migration_to_a_full_filesystem_fails_without_shared_marker(tmp_path):
    with mounted_tmpfs(tmp_path / "tiny", "1m") as mnt:
        local, d = str(tmp_path / "local"), str(mnt / "step_000000001")
        with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 18, local_dir=local)) as eng:
            eng.save(state(n=1 << 17), d, step=1)
            with pytest.raises(CheckpointError, match="migration.*No space|Errno 28"):
                eng.wait_for_durable()
        assert markers(d) == [] and not is_committed(d)
        assert markers(os.path.join(local, "step_000000001")) == ["done_r00000.json"]


def test_level3_migrates_across_filesystems(tmp_path):
    with mounted_tmpfs(tmp_path / "node_local", "16m") as mnt:
        d = str(tmp_path / "shared" / "step_000000002")
        st = state(n=50000)
        with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 18, local_dir=str(mnt))) as eng:
            eng.wait_for_durable(eng.save(st, d, step=2))
        reader = CheckpointReader(d)
        assert reader.source(0) == d and torch.equal(reader.load_state()["b"], st["b"])
