"""The one-pass copy + CRC-32C (datastates/_copycrc.c through datastates/copycrc.py): the bytes it
copies and the CRC it returns equal memmove's bytes and the `crc32c` package's value, for every
length, alignment and continuation value, with and without non-temporal stores; and the engine
that uses it writes chunks whose recorded checksums are those of the bytes in the shard file.

The library is compiled here from the repository's source with the flags setup.py uses, so these
tests check the C code whether or not `build_ext --inplace` was run in this checkout."""
import ctypes
import json
import os
import random
import shutil
import subprocess

import crc32c
import numpy as np
import pytest
import torch

from datastates import (Checksum, CheckpointEngine, CheckpointError, CheckpointReader,
                        EngineConfig, copycrc)
from datastates.layout import index_file, shard_file

SOURCE = os.path.join(os.path.dirname(copycrc.__file__), "_copycrc.c")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build datastates/_copycrc.c")
    out = str(tmp_path_factory.mktemp("copycrc") / "copycrc.so")
    subprocess.run([cc, "-O2", "-msse4.2", "-shared", "-fPIC", "-o", out, SOURCE], check=True)
    return copycrc.load(out)


@pytest.fixture
def fused(library, monkeypatch):
    """The engine's copies go through the library built here."""
    monkeypatch.setattr(copycrc, "_fn", library)
    monkeypatch.setattr(copycrc, "available", True)


def test_bytes_and_crc_match_memmove_and_crc32c(library):
    rng = random.Random(0)
    src = np.frombuffer(rng.randbytes(1 << 20), dtype=np.uint8)
    dst = np.zeros((1 << 20) + 128, dtype=np.uint8)
    # Lengths around the 3 x 4096-byte interleaved blocks and the 8-byte words, and random ones.
    lengths = [0, 1, 7, 8, 9, 4095, 4096, 12287, 12288, 12289, 3 * 12288 + 13, 100003, 1 << 19]
    lengths += [rng.randrange((1 << 20) - 64) for _ in range(40)]
    for n in lengths:
        for stream in (0, 1):
            s_off, d_off = rng.randrange(64), rng.randrange(64)
            init = rng.choice([0, rng.randrange(1 << 32)])
            dst[:] = 0xA5
            got = library(dst.ctypes.data + d_off, src.ctypes.data + s_off, n, init, stream)
            assert got == crc32c.crc32c(memoryview(src[s_off:s_off + n]), init), (n, stream)
            assert np.array_equal(dst[d_off:d_off + n], src[s_off:s_off + n]), (n, stream)
            # Not one byte outside the destination range.
            assert (dst[:d_off] == 0xA5).all() and (dst[d_off + n:] == 0xA5).all(), (n, stream)


def test_a_chunk_continued_over_calls_has_the_crc_of_the_whole(library):
    data = np.frombuffer(random.Random(1).randbytes(300_001), dtype=np.uint8)
    dst = np.zeros_like(data)
    crc, pos = 0, 0
    for step in (5, 12288, 70_000, 1, 100_000, 117_707):
        crc = library(dst.ctypes.data + pos, data.ctypes.data + pos, step, crc, step > 4096)
        pos += step
    assert pos == len(data)
    assert crc == crc32c.crc32c(memoryview(data))
    assert np.array_equal(dst, data)


def _index(directory):
    with open(os.path.join(directory, index_file(0)), "rb") as f:
        return json.load(f)


def test_engine_records_the_checksums_of_the_bytes_it_wrote(fused, tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(300_000, generator=g),            # streamed in several pieces
        "rows": torch.randn(513, 129, generator=g),          # not a multiple of a block
        "small": [torch.randn(17, generator=g) for _ in range(5)],  # packed into one block
        "bf16": torch.randn(1000, generator=g).to(torch.bfloat16),
        "strided": torch.randn(64, 64, generator=g).t(),    # not contiguous: writer's CRC
        "empty": torch.empty(0),
    }
    expect = {k: (v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v])
              for k, v in state.items()}
    d = str(tmp_path / "v")
    cfg = EngineConfig(host_cache_bytes=1 << 20, chunk_bytes=256 << 10)
    with CheckpointEngine(cfg) as eng:
        assert eng._copier.fused
        h = eng.save(state, d, step=3)
        eng.wait_for_snapshot()
        eng.wait_for_durable(h)
    index = _index(d)
    with open(os.path.join(d, shard_file(0)), "rb") as f:
        shard = f.read()
    chunks = 0
    for t in index["tensors"]:
        covered = 0
        for off, nbytes, crc in t["chunks"]:
            start = t["offset"] + off
            assert crc == crc32c.crc32c(shard[start:start + nbytes]), (t["key"], off)
            covered += nbytes
            chunks += 1
        assert covered == t["nbytes"], t["key"]
    assert chunks > len(index["tensors"]) - 1  # the big tensor has several chunks
    loaded = CheckpointReader(d).load_state()
    for k, v in expect.items():
        for a, b in zip(v if isinstance(v, list) else [v], loaded[k] if isinstance(v, list)
                        else [loaded[k]]):
            assert a.dtype == b.dtype and torch.equal(a, b), k


def test_a_flipped_byte_in_a_fused_chunk_is_refused(fused, tmp_path):
    d = str(tmp_path / "v")
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20)) as eng:
        eng.wait_for_durable(eng.save({"w": torch.arange(100_000, dtype=torch.float32)}, d, 1))
    path = os.path.join(d, shard_file(0))
    with open(path, "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CheckpointError, match="checksum|crc"):
        CheckpointReader(d).load_state()


def test_only_crc32c_engines_fuse(fused):
    from datastates.cache import HostCache
    from datastates.transfer import Copier
    cache = HostCache(1 << 16)
    assert Copier(cache, crc32c=True).fused
    assert not Copier(cache, crc32c=False).fused
    src = torch.arange(1000, dtype=torch.int32)
    assert Copier(cache, crc32c=True).issue(src, 0) == (crc32c.crc32c(src.numpy().tobytes()),
                                                         None)  # a CPU copy has landed
    assert Copier(cache, crc32c=False).issue(src, 4096) == (None, None)
    assert bytes(cache.memview(4096, src.nbytes)) == src.numpy().tobytes()
    # An engine checksumming with zlib's CRC-32 leaves the checksum to its writer.
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 16, checksum=Checksum.CRC32)) as eng:
        assert not eng._copier.fused


def test_build_script_builds_the_library_the_engine_loads(tmp_path):
    """scripts/build_copycrc.sh, run on a copy of the package, writes the _copycrc.so that
    copycrc.library_path() names, and copycrc.load accepts it."""
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(tmp_path / "scripts")
    shutil.copy(os.path.join(repo, "scripts", "build_copycrc.sh"), tmp_path / "scripts")
    shutil.copytree(os.path.dirname(copycrc.__file__), tmp_path / "datastates",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    subprocess.run(["bash", str(tmp_path / "scripts" / "build_copycrc.sh")], check=True)
    built = tmp_path / "datastates" / os.path.basename(copycrc.library_path())
    fn = copycrc.load(str(built))
    data = b"datastates" * 5000
    dst = ctypes.create_string_buffer(len(data))
    assert fn(ctypes.addressof(dst), data, len(data), 0, 1) == crc32c.crc32c(data)
    assert dst.raw == data


class _Landing:
    """What `InFlight` needs of a CUDA event: synchronize(), which records the order of the
    waits (or raises, as a failed device-to-host copy would)."""

    def __init__(self, name, log, error=None):
        self.name, self.log, self.error = name, log, error

    def synchronize(self):
        self.log.append(f"wait {self.name}")
        if self.error is not None:
            raise self.error


def test_in_flight_copies_land_in_issue_order_with_at_most_depth_outstanding():
    """The copy thread's window (`transfer.InFlight`): nothing is waited for until more than
    `depth` copies are outstanding; hand-overs run in issue order, an entry without events (a CPU
    copy, a group's end) only after every entry before it; a failed copy is reported and its
    block still handed on; `drain` empties it."""
    from datastates.transfer import InFlight

    log = []
    w = InFlight(depth=2)
    ev = {n: _Landing(n, log) for n in "abcd"}
    w.add([ev["a"]], lambda: log.append("land a"), log.append)
    w.add([ev["b"]], lambda: log.append("land b"), log.append)
    w.add([], lambda: log.append("group 1 done"), None)
    assert log == []  # two outstanding: nothing waited for yet
    w.add([ev["c"], ev["d"]], lambda: log.append("land cd"), log.append)
    assert log == ["wait a", "land a", "wait b", "land b", "group 1 done"]
    boom = RuntimeError("copy failed")
    w.add([_Landing("e", log, boom)], lambda: log.append("land e"),
          lambda err: log.append(f"failed {err}"))
    w.drain()
    assert log[5:] == ["wait c", "wait d", "land cd", "wait e", "failed copy failed", "land e"]
    w.add([], lambda: log.append("cpu copy"), None)
    assert log[-1] == "cpu copy"  # nothing pending: handed over at once
