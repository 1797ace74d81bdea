"""Bit-exact round trips of tensors and small objects through the engine."""
import argparse
import enum
import json
import os
import random

import numpy as np
import pytest
import torch

from datastates import (CheckpointEngine, CheckpointError, CheckpointReader, EngineConfig,
                        TensorShard, is_committed)


class Color(enum.Enum):
    RED = 1
    BLUE = "b"


def save_and_load(state, tmp_path, allow_pickle=False, **cfg):
    d = str(tmp_path / "v")
    cfg = {"host_cache_bytes": 1 << 20, **cfg}
    with CheckpointEngine(EngineConfig(allow_pickle=allow_pickle, **cfg)) as eng:
        h = eng.save(state, d, step=7)
        eng.wait_for_snapshot()
        records = eng.wait_for_durable(h)
    assert is_committed(d)
    assert [r.step for r in records] == [7]
    return CheckpointReader(d, allow_pickle=allow_pickle).load_state(), records[0], d


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8) if a.numel() else a,
                           b.contiguous().reshape(-1).view(torch.uint8) if b.numel() else b)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


def tensor_state():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 6, generator=g)
    return {
        "f32": torch.randn(33, 17, generator=g),
        "bf16": torch.randn(5, 9, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4, 3, generator=g).half(),
        "i64": torch.randint(-2**62, 2**62, (12,), generator=g, dtype=torch.int64),
        "bool": torch.rand(3, 5, generator=g) > 0.5,
        "zero_d": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(3.0).view(3, 1).expand(3, 4),
        "nested": {"list": [torch.ones(2), {"deep": torch.arange(6).view(2, 3)}]},
    }


def test_tensor_dtypes_and_layouts_round_trip_bit_exact(tmp_path):
    state = tensor_state()
    # NaN payloads and -0.0 must survive: compare bytes, not values.
    state["f32"][0, 0] = float("nan")
    state["f32"][0, 1] = -0.0
    loaded, rec, _ = save_and_load(state, tmp_path)
    assert_same(state, loaded)
    assert rec.bytes == sum(t.numel() * t.element_size() for t in
                            [state[k] for k in state if k != "nested"]) + 2 * 4 + 6 * 8


def test_small_objects_rng_states_and_param_groups_round_trip(tmp_path):
    random.seed(3)
    np.random.seed(3)
    state = {
        "scalars": [None, True, False, 0, -5, 2**70, 1.5, float("inf"), float("-inf"),
                    float("nan"), "text", b"\x00\xff"],
        "tuple": (1, (2, "x"), []),
        "int_keys": {0: {"step": 3}, 1: "a", (2, "t"): 4.0},
        "dtype": torch.bfloat16, "size": torch.Size([2, 3]),
        "np": np.arange(6, dtype=np.float32).reshape(2, 3), "np_scalar": np.float64(2.5),
        "enum": Color.BLUE,
        "args": argparse.Namespace(lr=0.1, layers=[1, 2]),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "torch_rng": torch.get_rng_state(),
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0,
                          "amsgrad": False, "params": [0, 1, 2], "maximize": False,
                          "foreach": None}],
    }
    loaded, _, d = save_and_load(state, tmp_path)
    assert_same(state, loaded)
    random.setstate(loaded["python_rng"])
    np.random.set_state(loaded["numpy_rng"])
    torch.set_rng_state(loaded["torch_rng"])
    r = (random.random(), np.random.rand(), torch.rand(1))
    random.setstate(state["python_rng"])
    np.random.set_state(state["numpy_rng"])
    torch.set_rng_state(state["torch_rng"])
    assert r == (random.random(), np.random.rand(), torch.rand(1))
    # The skeleton is plain JSON: nothing in it is pickled.
    with open(os.path.join(d, "index_r00000.json")) as f:
        assert "pickle" not in json.dumps(json.load(f)["objects"])


class Opaque:
    def __init__(self, v):
        self.v = v


def test_unsupported_type_is_refused_with_its_path(tmp_path):
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20)) as eng:
        with pytest.raises(CheckpointError, match=r"Opaque.*'a/b/1'.*allow_pickle"):
            eng.save({"a": {"b": [1, Opaque(2)]}}, str(tmp_path / "v"), step=1)


def test_pickle_needs_opt_in_on_both_sides(tmp_path):
    d = str(tmp_path / "v")
    with CheckpointEngine(EngineConfig(allow_pickle=True, host_cache_bytes=1 << 20)) as eng:
        eng.save({"o": Opaque(5)}, d, step=1)
    with pytest.raises(CheckpointError, match="allow_pickle"):
        CheckpointReader(d).load_state()
    assert CheckpointReader(d, allow_pickle=True).load_state()["o"].v == 5


def test_tensor_shard_leaves_come_back_as_tensor_shards(tmp_path):
    shard = TensorShard(torch.arange(12.0).view(3, 4), "w", (6, 4), (3, 0))
    loaded, _, _ = save_and_load({"w": shard, "plain": torch.ones(2)}, tmp_path)
    assert isinstance(loaded["w"], TensorShard)
    assert loaded["w"].key == "w" and loaded["w"].global_shape == (6, 4)
    assert loaded["w"].global_offset == (3, 0)
    assert torch.equal(loaded["w"].data, shard.data)


@pytest.mark.parametrize("threads", [1, 2])
def test_tensors_larger_than_cache_stream_in_chunks(tmp_path, threads):
    """Back-pressure: cache (64 KiB) smaller than the state and than its largest tensors,
    including a non-contiguous one whose single row exceeds a chunk."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(512, 1024, generator=g)           # 2 MiB, contiguous
    wide = torch.randn(3, 40000, generator=g).t()       # non-contiguous, 480 KB
    rows = torch.randn(4, 30000, generator=g)[:, ::2]   # non-contiguous, rows of 60 KB > chunk
    state = {"big": big, "wide": wide, "rows": rows, "small": torch.arange(5)}
    cache = 64 * 1024
    loaded, rec, d = save_and_load(state, tmp_path, host_cache_bytes=cache, chunk_bytes=16384,
                                   copy_threads=threads, writer_threads=threads)
    assert_same(state, loaded)
    assert 0 < rec.peak_cache_bytes <= cache
    with open(os.path.join(d, "index_r00000.json")) as f:
        entries = {t["key"]: t for t in json.load(f)["tensors"]}
    assert len(entries["big"]["chunks"]) >= 2 * 1024 * 1024 // cache
    reader = CheckpointReader(d)
    assert torch.equal(reader.read("big", (100, 7), (3, 500)), big[100:103, 7:507])
    assert torch.equal(reader.read("rows", (1, 100), (2, 3)), rows[1:3, 100:103])


def test_bad_config_is_explained():
    with pytest.raises(CheckpointError, match="0 <= rank < world_size.*rank=2, world_size=2"):
        EngineConfig(rank=2, world_size=2)
    with pytest.raises(CheckpointError, match="host_cache_bytes must be at least"):
        EngineConfig(host_cache_bytes=1000)


def test_checksum_none_is_recorded_and_reads_skip_verification(tmp_path):
    from datastates import Checksum
    state = {"x": torch.arange(100, dtype=torch.int32)}
    loaded, _, d = save_and_load(state, tmp_path, checksum=Checksum.NONE)
    assert torch.equal(loaded["x"], state["x"])
    with open(os.path.join(d, "index_r00000.json")) as f:
        assert json.load(f)["checksum"] == "none"


def test_default_checksum_is_crc32c_of_each_chunk_as_stored(tmp_path):
    import crc32c
    assert crc32c.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    state = {"w": torch.randn(300, 50), "b": torch.arange(1000, dtype=torch.int64)}
    _, _, d = save_and_load(state, tmp_path, chunk_bytes=16384)
    with open(os.path.join(d, "index_r00000.json")) as f:
        index = json.load(f)
    assert index["checksum"] == "crc32c"
    with open(os.path.join(d, "shard_r00000.bin"), "rb") as f:
        shard = f.read()
    chunks = 0
    for t in index["tensors"]:
        for off, n, crc in t["chunks"]:
            start = t["offset"] + off
            assert crc == crc32c.crc32c(shard[start:start + n]), (t["key"], off)
            chunks += 1
    assert chunks >= 5  # 60000 + 8000 bytes in 16 KiB chunks: several per tensor


def test_crc32c_checkpoint_without_the_package_says_what_to_install(tmp_path, monkeypatch):
    import sys
    state = {"x": torch.arange(10.0)}
    _, _, d = save_and_load(state, tmp_path)
    monkeypatch.setitem(sys.modules, "crc32c", None)  # import crc32c now raises ImportError
    with pytest.raises(CheckpointError, match=r"needs the 'crc32c' package \(pip install crc32c"):
        CheckpointReader(d)
    assert torch.equal(CheckpointReader(d, verify=False).load_state()["x"], state["x"])
    with pytest.raises(CheckpointError, match=r"needs the 'crc32c' package"):
        CheckpointEngine(EngineConfig())  # before any save starts, not in a writer thread


def test_unknown_checksum_in_index_names_the_known_ones(tmp_path):
    _, _, d = save_and_load({"x": torch.arange(10.0)}, tmp_path)
    path = os.path.join(d, "index_r00000.json")
    with open(path) as f:
        index = json.load(f)
    index["checksum"] = "md5"
    with open(path, "w") as f:
        json.dump(index, f)
    with pytest.raises(CheckpointError, match=r"unknown checksum algorithm 'md5': expected one of "
                                              r"\['crc32c', 'none', 'zlib-crc32'\]"):
        CheckpointReader(d, verify=False)  # the index checksum is skipped; the name is not


@pytest.mark.parametrize("mode", ["direct", "buffered", "mapped"])
def test_write_modes_round_trip_aligned_and_unaligned_pieces(tmp_path, mode):
    """O_DIRECT for page-aligned pieces, buffered fallback for row pieces of non-contiguous
    tensors, padding of last pieces must not clobber the next tensor; mapped: every piece
    copied straight into the shard file's pages, the host cache never used."""
    from datastates import WriteMode
    state = tensor_state()
    g = torch.Generator().manual_seed(4)
    state["big"] = torch.randn(300, 1000, generator=g)
    state["odd"] = torch.randn(1001, generator=g)
    state["rows"] = torch.randn(4, 30000, generator=g)[:, ::2]
    loaded, rec, d = save_and_load(state, tmp_path, host_cache_bytes=1 << 17, chunk_bytes=16384,
                                   write_mode=WriteMode(mode))
    assert_same(state, loaded)
    if mode == "mapped":
        assert rec.peak_cache_bytes == 0
    else:
        assert 0 < rec.peak_cache_bytes <= 1 << 17


def test_mapped_shard_on_a_full_tmpfs_fails_the_save_call_not_a_copy(tmp_path):
    """WriteMode.MAPPED reserves the shard's space before any copy: a tmpfs too small for it
    fails the save call with a CheckpointError naming the file (a copy into unreserved pages of
    a mapping would kill the process with SIGBUS); the engine stays usable."""
    from datastates import WriteMode
    from tmpfs import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "shm", "1m") as shm:
        with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 16,
                                           write_mode=WriteMode.MAPPED)) as eng:
            with pytest.raises(CheckpointError, match="cannot reserve .* bytes for the shard "
                                                      "file") as err:
                eng.save({"w": torch.zeros(1 << 19)}, str(shm / "v"), step=1)  # 2 MiB
            assert err.value.file == str(shm / "v" / "shard_r00000.bin")
            h = eng.save({"w": torch.ones(1 << 16)}, str(shm / "v2"), step=2)  # 256 KiB fits
            eng.wait_for_durable(h)
        loaded = CheckpointReader(str(shm / "v2")).load_state()
        assert torch.equal(loaded["w"], torch.ones(1 << 16))


def test_small_tensors_are_packed_into_few_writes(tmp_path):
    writes = []
    g = torch.Generator().manual_seed(5)
    state = {f"p{i}": torch.randn(i % 7, 3, generator=g) for i in range(300)}
    state["big"] = torch.randn(100000, generator=g)
    loaded, _, _ = save_and_load(state, tmp_path, host_cache_bytes=1 << 20,
                                 write_hook=lambda ev, info: ev == "write" and writes.append(ev))
    assert_same(state, loaded)
    assert 2 <= len(writes) <= 3  # 300 small tensors in one or two blocks, "big" alone


def test_mapped_slots_are_reused_only_once_no_version_links_them(tmp_path):
    """WriteMode.MAPPED with a slot directory: each save's shard is a hard link to a pooled
    file; a slot is written again only after the version using it was removed (as retention
    removes old versions), so every version still there reads back as saved; with no free slot
    and the pool full a save gets a file of its own; closing drops only the pool's links."""
    import shutil

    from datastates import WriteMode

    slots = tmp_path / "slots"
    (slots).mkdir()
    (slots / "r00000-9.bin").write_bytes(b"left by a killed process")
    cfg = EngineConfig(host_cache_bytes=1 << 16, write_mode=WriteMode.MAPPED,
                       mapped_slot_dir=str(slots), mapped_slots=2, chunk_bytes=1 << 16)
    states = {k: {"w": torch.full((50000,), float(k)), "b": torch.arange(k + 3)}
              for k in range(1, 7)}
    inodes = {}
    with CheckpointEngine(cfg) as eng:
        assert not (slots / "r00000-9.bin").exists()
        for k, state in states.items():
            d = tmp_path / f"v{k}"
            eng.wait_for_durable(eng.save(state, str(d), step=k))
            inodes[k] = os.stat(d / "shard_r00000.bin").st_ino
            for j in range(1, k + 1):  # every version still there holds its own bytes
                if (tmp_path / f"v{j}").exists():
                    assert_same(states[j], CheckpointReader(str(tmp_path / f"v{j}")).load_state())
            if k == 3:
                continue  # v1, v2 and v3 all kept once: v3 had no free slot (pool of 2)
            for old in range(1, k - 1):  # keep the two newest, as retention would
                shutil.rmtree(tmp_path / f"v{old}", ignore_errors=True)
        assert inodes[1] != inodes[2] and inodes[3] not in (inodes[1], inodes[2])
        assert inodes[5] == inodes[1] or inodes[5] == inodes[2]  # a freed slot came back
        assert len(list(slots.iterdir())) == 2
    assert list(slots.iterdir()) == []  # the pool's links are gone, the versions' stay
    assert_same(states[6], CheckpointReader(str(tmp_path / "v6")).load_state())


def test_mapped_copies_that_do_not_checksum_are_checksummed_by_every_writer(tmp_path,
                                                                           monkeypatch):
    """WriteMode.MAPPED where the copies land without a checksum (as a CUDA device-to-host copy
    does; here the copy thread's plain memmove, without `copycrc`): the writer threads checksum
    the pieces in the shard's pages, several of them at once (the in-memory level's
    --lazy-save-checksum-threads), and every chunk's CRC-32C is the one of the bytes stored."""
    import threading

    import crc32c

    from datastates import WriteMode, copycrc
    from datastates import engine as engine_module

    monkeypatch.setattr(copycrc, "available", False)
    by_thread = {}
    gate = threading.Barrier(3, timeout=10)

    def crc(buf):  # each writer waits for the others once: all three must be checksumming
        name = threading.current_thread().name
        if not name.startswith("datastates-write-"):
            return crc32c.crc32c(buf)  # the reader verifying them, on this thread
        if name not in by_thread:
            by_thread[name] = 0
            gate.wait()
        by_thread[name] += 1
        return crc32c.crc32c(buf)

    monkeypatch.setattr(engine_module.checksum, "function", lambda kind: crc)
    g = torch.Generator().manual_seed(6)
    state = {f"w{i}": torch.randn(40000, generator=g) for i in range(12)}  # 160 KB each
    state["small"] = torch.arange(7)
    loaded, rec, d = save_and_load(state, tmp_path, host_cache_bytes=1 << 16,
                                   chunk_bytes=1 << 16, write_mode=WriteMode.MAPPED,
                                   writer_threads=3)
    assert_same(state, loaded)
    assert rec.peak_cache_bytes == 0
    assert sorted(by_thread) == [f"datastates-write-{i}" for i in range(3)], by_thread
    with open(os.path.join(d, "index_r00000.json")) as f:
        entries = {t["key"]: t for t in json.load(f)["tensors"]}
    data = open(os.path.join(d, "shard_r00000.bin"), "rb").read()
    for key, e in entries.items():
        assert e["chunks"] == sorted(e["chunks"])
        for offset, nbytes, value in e["chunks"]:
            start = e["offset"] + offset
            assert value == crc32c.crc32c(data[start:start + nbytes]), key
    assert sum(len(e["chunks"]) for e in entries.values()) == sum(by_thread.values())


@pytest.mark.parametrize("cpus,ranks,threads", [
    (16, 1, 4),    # the lent H100/H200 machines: one rank
    (112, 8, 4),   # a DGX H100 node: 14 cores per GPU
    (32, 8, 2),    # 4 cores per rank: half of them
    (8, 8, 1), (4, 8, 1), (2, 1, 1),  # never below one
])
def test_checksum_threads_for_device_copies_keep_half_the_ranks_cores(cpus, ranks, threads):
    from datastates.checksum import threads_for_device_copies

    assert threads_for_device_copies(cpus, ranks) == threads
