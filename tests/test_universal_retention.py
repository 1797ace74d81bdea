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


def test_save_retain_interval_keeps_its_multiples_besides_the_newest(tmp_path):
    """Megatron-LM's --save-retain-interval: multiples of it stay; of the others only the newest
    (alone: the one the tracker names), or the newest --keep-last-n-checkpoints of them."""
    from megatron.training.checkpointing.retention import apply_retention

    root = tmp_path / "save"
    for it in range(1, 11):
        (root / f"iter_{it:07d}").mkdir(parents=True)
    done = apply_retention(str(root), None, 9, in_flight=[10], retain_every=4)
    assert done.removed == [1, 2, 3, 5, 6, 7]
    assert sorted(os.listdir(root)) == [f"iter_{it:07d}" for it in (4, 8, 9, 10)]
    for it in (11, 12, 13):
        (root / f"iter_{it:07d}").mkdir()
    done = apply_retention(str(root), 2, 13, retain_every=4)  # with --keep-last-n-checkpoints 2
    assert done.removed == [9, 10]
    assert sorted(os.listdir(root)) == [f"iter_{it:07d}" for it in (4, 8, 11, 12, 13)]


def test_a_save_at_a_retained_iteration_is_never_deferred(tmp_path, one_rank_group):
    """While the persistent level is busy (latest wins), saves due at 2 and 6 are deferred; those
    at 4 and 8 (--save-retain-interval 4) are made at their iteration."""
    from megatron.training.arguments import build_run_config, parse_args
    from megatron.training.checkpointing.contents import TrainState
    from megatron.training.checkpointing.manager import CheckpointManager

    class Busy(CheckpointManager):
        def __init__(self, config):
            super().__init__(config)
            self.saved = []

        def _persistent_busy(self):
            return True

        def _times_reported_at_commit(self, root):
            return True

        def _save(self, state, root):
            self.saved.append(state.iteration)

    config = build_run_config(parse_args(
        "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 8 --mock-data --vocab-size 127 "
        f"--save {tmp_path / 'ckpt'} --save-interval 2 --save-retain-interval 4".split()),
        world_size=1)
    manager = Busy(config)
    state = TrainState(model=[], optimizer=None, scheduler=None)
    for it in range(1, 9):
        state.iteration = it
        manager.maybe_save(state)
    assert manager.saved == [4, 8] and manager.saves_deferred == 2


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
