"""Multi-rank layouts simulated in one process: file-based commit and resharding reads."""
import pytest
import torch

from datastates import (CheckpointEngine, CheckpointError, CheckpointReader, CommitPolicy,
                        EngineConfig, TensorShard, is_committed, try_commit)

G = torch.arange(12 * 10, dtype=torch.float32).view(12, 10) * 0.5
E = torch.randn(6, 4, 3, generator=torch.Generator().manual_seed(2))


def rank_state(rank):
    # "w" is split by rows over 2 ranks, "e" by its middle dimension; "bias" is replicated.
    rows = slice(6 * rank, 6 * rank + 6)
    cols = slice(2 * rank, 2 * rank + 2)
    return {"w": TensorShard(G[rows].clone(), "w", G.shape, (6 * rank, 0)),
            "e": TensorShard(E[:, cols].clone(), "e", E.shape, (0, 2 * rank, 0)),
            "bias": torch.full((3,), 7.0), "rank": rank}


def save_two_ranks(d, policy=CommitPolicy.RANK0):
    engines = [CheckpointEngine(EngineConfig(rank=r, world_size=2, commit_policy=policy,
                                                    host_cache_bytes=1 << 20))
               for r in range(2)]
    try:
        h0 = engines[0].save(rank_state(0), d, step=3)
        rec0 = engines[0].wait_for_durable(h0)
        # Rank 0 is durable but rank 1 has not written: the version must not be committed.
        assert rec0[0].committed is False and not is_committed(d) and not try_commit(d, 2)
        with pytest.raises(CheckpointError, match="not committed"):
            CheckpointReader(d)
        h1 = engines[1].save(rank_state(1), d, step=3)
        engines[1].wait_for_durable(h1)
        if policy is CommitPolicy.RANK0:
            assert engines[0].wait_for_commit(h0, timeout=30)
    finally:
        for e in engines:
            e.close()


def test_rank0_commits_once_every_rank_marker_is_present(tmp_path):
    d = str(tmp_path / "v")
    save_two_ranks(d)
    assert is_committed(d)
    reader = CheckpointReader(d)
    assert reader.ranks() == [0, 1] and reader.tensor_keys() == ["bias", "e", "w"]
    meta = reader.tensor_meta("w")
    assert meta.global_shape == (12, 10) and meta.dtype == torch.float32
    assert sorted(meta.shards) == [(0, (0, 0), (6, 10)), (1, (6, 0), (6, 10))]


def test_manual_commit_policy_leaves_commit_to_caller(tmp_path):
    d = str(tmp_path / "v")
    save_two_ranks(d, CommitPolicy.MANUAL)
    assert not is_committed(d)
    assert try_commit(d, 2) and is_committed(d)


@pytest.mark.parametrize("offset,shape", [((0, 0), (12, 10)), ((4, 3), (4, 5)), ((5, 0), (2, 10)),
                                          ((6, 9), (6, 1)), ((11, 0), (1, 10)), ((3, 2), (0, 4))])
def test_read_any_box_across_rank_shards(tmp_path, offset, shape):
    d = str(tmp_path / "v")
    save_two_ranks(d)
    got = CheckpointReader(d).read("w", offset, shape)
    box = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    assert torch.equal(got, G[box])


def test_reshard_two_ranks_to_three(tmp_path):
    d = str(tmp_path / "v")
    save_two_ranks(d)
    reader = CheckpointReader(d)
    # A 3-rank layout splits dim 1 of "e" as 1/2/1 and dim 0 of "w" as 4/4/4.
    for r, (lo, n) in enumerate([(0, 1), (1, 2), (3, 1)]):
        assert torch.equal(reader.read("e", (0, lo, 0), (6, n, 3)), E[:, lo:lo + n])
        assert torch.equal(reader.read("w", (4 * r, 0), (4, 10)), G[4 * r:4 * r + 4])
    assert torch.equal(reader.read("bias"), torch.full((3,), 7.0))


def test_load_state_per_rank_returns_that_ranks_shards(tmp_path):
    d = str(tmp_path / "v")
    save_two_ranks(d)
    s1 = CheckpointReader(d).load_state(rank=1)
    assert s1["rank"] == 1 and isinstance(s1["w"], TensorShard)
    assert s1["w"].global_offset == (6, 0) and torch.equal(s1["w"].data, G[6:])
    assert torch.equal(s1["e"].data, E[:, 2:4])


def test_bad_requests_are_explained(tmp_path):
    d = str(tmp_path / "v")
    save_two_ranks(d)
    reader = CheckpointReader(d)
    with pytest.raises(CheckpointError, match="does not fit"):
        reader.read("w", (10, 0), (4, 10))
    with pytest.raises(CheckpointError, match="no tensor with this key"):
        reader.read("nope")
    with pytest.raises(CheckpointError, match="no such rank"):
        reader.load_state(rank=2)


def test_missing_shard_coverage_is_an_error(tmp_path):
    d = str(tmp_path / "v")
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20)) as eng:
        eng.save({"w": TensorShard(G[:6].clone(), "w", G.shape, (0, 0))}, d, step=1)
    reader = CheckpointReader(d)
    assert torch.equal(reader.read("w", (0, 0), (6, 10)), G[:6])
    with pytest.raises(CheckpointError, match="do not cover"):
        reader.read("w")


WORKER = """
import sys, torch
from datastates import CheckpointEngine, EngineConfig, TensorShard
rank, d = int(sys.argv[1]), sys.argv[2]
g = torch.arange(12 * 10, dtype=torch.float32).view(12, 10) * 0.5
state = {"w": TensorShard(g[6 * rank:6 * rank + 6].clone(), "w", g.shape, (6 * rank, 0)),
         "rank": rank}
with CheckpointEngine(EngineConfig(rank=rank, world_size=2, host_cache_bytes=1 << 20)) as eng:
    h = eng.save(state, d, step=9)
    eng.wait_for_durable(h)
    if rank == 0:
        assert eng.wait_for_commit(h, timeout=120), "rank 0 never saw rank 1's marker"
print("ok", rank)
"""


def test_two_processes_save_one_version_and_rank0_commits(tmp_path):
    import subprocess
    import sys
    d = str(tmp_path / "v")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), d], stdout=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs == ["ok 0\n", "ok 1\n"]
    assert is_committed(d)
    reader = CheckpointReader(d)
    assert torch.equal(reader.read("w", (3, 0), (6, 10)), G[3:9])
    assert reader.load_state(rank=1)["rank"] == 1


@pytest.mark.parametrize("refused", [False, True])
def test_direct_reads_equal_buffered_reads_and_still_verify(tmp_path, monkeypatch, refused):
    """O_DIRECT reads (the merge's and converters'), widened to pages into reused buffers, give
    the same boxes as buffered reads, into `out` too; where O_DIRECT is refused (at open, as
    some file systems do, or at read time) the same reader reads buffered; a damaged byte is
    still caught."""
    import errno
    import fcntl
    import os

    from datastates import fileio

    d = str(tmp_path / "v")
    save_two_ranks(d)
    if refused:
        real_open, real_preadv = fileio.open_confined, os.preadv

        def open_confined(path, **kw):
            if kw.get("flags", 0) & os.O_DIRECT and path.endswith("r00000.bin"):
                raise OSError(errno.EINVAL, "O_DIRECT refused", path)
            return real_open(path, **kw)

        def preadv(fd, bufs, offset):  # rank 1's file: O_DIRECT opens, its reads are refused
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise OSError(errno.EINVAL, "alignment refused")
            return real_preadv(fd, bufs, offset)

        monkeypatch.setattr(fileio, "open_confined", open_confined)
        monkeypatch.setattr(os, "preadv", preadv)
    plain, direct = CheckpointReader(d), CheckpointReader(d, direct=True)
    boxes = [("w", (0, 0), (12, 10)), ("w", (4, 3), (4, 5)), ("w", (6, 0), (6, 10)),
             ("e", (0, 1, 0), (6, 2, 3)), ("e", (0, 0, 0), (6, 4, 3)), ("bias", (0,), (3,))]
    for _ in range(3):  # later rounds take their buffers from the pool
        for key, off, shp in boxes:
            want = plain.read(key, off, shp)
            assert torch.equal(direct.read(key, off, shp), want), (key, off)
            out = torch.full(shp, -1.0)
            assert direct.read(key, off, shp, out=out) is out and torch.equal(out, want)
    s1 = direct.load_state(rank=1)
    assert torch.equal(s1["w"].data, G[6:]) and torch.equal(s1["bias"], torch.full((3,), 7.0))
    assert sorted(fd >= 0 for fd in direct._dfds.values()) == ([False, False] if refused
                                                               else [True, True])
    direct.close()
    with open(os.path.join(d, "shard_r00001.bin"), "r+b") as f:
        f.seek(8)
        f.write(bytes([f.read(1)[0] ^ 0x40]))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        CheckpointReader(d, direct=True).read("w")


def test_many_ranks_markers_are_read_concurrently_with_the_same_outcomes(tmp_path, monkeypatch):
    """Above 8 ranks `try_commit` lists the directory once and reads the markers concurrently
    (each is ~3 metadata round trips on a shared file system): a missing marker still means not
    yet, a corrupt one still raises naming its rank, and all valid commits."""
    import json
    import os
    import threading
    import time

    from datastates import layout

    world, d = 12, str(tmp_path / "v")
    engines = [CheckpointEngine(EngineConfig(rank=r, world_size=world, host_cache_bytes=1 << 20,
                                             commit_policy=CommitPolicy.MANUAL))
               for r in range(world)]
    try:
        for r, eng in enumerate(engines[:-1]):
            eng.wait_for_durable(eng.save({"x": torch.full((4,), float(r))}, d, step=5))
        assert not try_commit(d, world)  # rank 11 has not written
        engines[-1].wait_for_durable(engines[-1].save({"x": torch.zeros(4)}, d, step=5))
    finally:
        for eng in engines:
            eng.close()
    marker = os.path.join(d, layout.rank_marker_file(7))
    good = open(marker).read()
    doc = json.loads(good)
    with open(marker, "w") as f:
        json.dump(dict(doc, index_crc32=doc["index_crc32"] ^ 1), f)
    with pytest.raises(CheckpointError, match="index checksum") as err:
        try_commit(d, world)
    assert err.value.rank == 7 and not is_committed(d)
    with open(marker, "w") as f:
        f.write(good)
    active, most, lock = [0], [0], threading.Lock()
    read = layout._valid_rank_marker

    def counted(*args):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.02)  # a metadata round trip
        try:
            return read(*args)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(layout, "_valid_rank_marker", counted)
    assert try_commit(d, world) and is_committed(d)
    assert most[0] > 1  # read side by side, not one after the other
    assert CheckpointReader(d).ranks() == list(range(world))
