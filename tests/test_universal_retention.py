"""Retention that knows about merges: a checkpoint a merge or a converter reads is kept until it
is done, --keep-last-n-universal after each merge (one process, no training)."""
import os
from types import SimpleNamespace

import pytest

from datastates import CheckpointError
from datastates.fileio import claim_for_removal, hold_for_reading, lock_path
from datastates.megatron_adapter import export_hf, open_source
from datastates.universal import write_universal
from universal_fixtures import source  # noqa: F401 - a fixture


def test_retention_keeps_what_a_merge_reads(tmp_path):
    from megatron.training.checkpointing.retention import apply_retention

    root = tmp_path / "save"
    for it in (1, 2, 3, 4):
        (root / f"iter_{it:07d}").mkdir(parents=True)
    with hold_for_reading(str(root / "iter_0000001")):  # a merge (or converter) reads 1
        done = apply_retention(str(root), 1, 4, in_flight=[2])  # a merge of 2 waits
        assert done.removed == [3] and done.kept_in_use == [1]
        assert os.path.exists(lock_path(str(root / "iter_0000001")))
    done = apply_retention(str(root), 1, 4)
    assert done.removed == [1, 2] and sorted(os.listdir(root)) == ["iter_0000004"]
    with pytest.raises(CheckpointError, match="removed"):  # a reader that came too late
        with hold_for_reading(str(root / "iter_0000002")):
            pass
    assert sorted(os.listdir(root)) == ["iter_0000004"]


def test_universal_retention_after_each_merge(tmp_path):
    from megatron.training.checkpointing.lazy import LazyCheckpointManager

    uroot = tmp_path / "universal"
    for it in (3, 6, 9):
        (uroot / f"iter_{it:07d}").mkdir(parents=True)
    (uroot / "iter_0000012.tmp-123").mkdir()  # the merge running now
    (uroot / "latest_checkpointed_iteration.txt").write_text("9")
    merger = SimpleNamespace(results=[{}], config=SimpleNamespace(root=str(uroot)),
                             iterations_in_use=lambda: [4])
    manager = object.__new__(LazyCheckpointManager)  # only what retention reads
    manager.checkpointer = SimpleNamespace(universal=merger)
    manager.ckpt = SimpleNamespace(keep_last_n_universal=2)
    manager._merges_retained = 0
    manager._universal_retention()
    assert sorted(os.listdir(uroot)) == ["iter_0000006", "iter_0000009", "iter_0000012.tmp-123",
                                         "latest_checkpointed_iteration.txt"]
    (uroot / "iter_0000003").mkdir()
    manager._universal_retention()  # no new merge since: nothing to do
    assert (uroot / "iter_0000003").exists()
    assert manager._in_use() == [4]


def test_merges_and_converters_hold_what_they_read(source, tmp_path):
    d, _ = source
    reading, free_meanwhile = [d], []

    def progress(done, total, name):  # retention's view, in the middle of the work
        with claim_for_removal(reading[-1]) as free:
            free_meanwhile.append((reading[-1], free))

    u = write_universal(open_source(d), str(tmp_path / "u"), progress=progress).directory
    reading.append(u)
    export_hf(u, str(tmp_path / "hf"), progress=progress)
    assert {r for r, _ in free_meanwhile} == {d, u}
    assert not any(free for _, free in free_meanwhile)
    for directory in (d, u):  # released: retention may take them now
        with claim_for_removal(directory) as free:
            assert free
        assert not os.path.exists(lock_path(directory))
