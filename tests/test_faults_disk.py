"""A --save directory on a tiny tmpfs that fills up mid-run (a real ENOSPC, no mocks).

--ckpt-failure-policy stop: exit status 2 with one clear error; continue: one warning, training
runs to the end, no further saves. Either way the checkpoints completed before the failure stay
loadable, and no partial one carries a commit marker or is named by the tracker.
Skipped where mounting is not permitted (CI and sessions run as root, see docs/TESTING.md).
"""
import errno
import os
import re

import pytest

from crash_harness import verify_committed
from tmpfs import mounted_tmpfs
from trainer_launch import NO_DROPOUT, TINY_MODEL, launch

TRAIN = ["--train-iters", "8", "--eval-interval", "0", "--async-lazy-save", "--save-interval", "1"]
# A checkpoint of TINY_MODEL is ~2.6 MB: two fit in 6 MiB, the third does not.
SIZE = "6m"


@pytest.fixture
def small_fs(tmp_path):
    with mounted_tmpfs(tmp_path / "tmpfs", SIZE) as mnt:
        yield mnt


def _iter_dirs(root):
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("iter_"))


def _check_nothing_partial_is_complete(root):
    tracked = int(open(root / "latest_checkpointed_iteration.txt").read())
    assert tracked >= 1
    assert verify_committed(str(root)) == []  # every committed dir reads back, all checksums
    committed = [it for it in _iter_dirs(root)
                 if (root / f"iter_{it:07d}" / "COMMIT.json").exists()]
    assert committed and max(committed) == tracked, (committed, tracked)
    return tracked


def test_full_disk_stop_policy_exits_with_a_clear_error(small_fs):
    root = small_fs / "ckpt"
    run = launch(1, TINY_MODEL + NO_DROPOUT + TRAIN + ["--save", str(root)])
    assert run.returncode == 2, run.describe()
    errors = [line for line in run.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1, run.describe()
    tracked = _check_nothing_partial_is_complete(root)
    for needle in ("No space left on device", "failed on rank(s) [0]",
                   f"newest complete: iteration {tracked}", "not marked complete",
                   "--ckpt-failure-policy continue"):
        assert needle in errors[0], (needle, errors[0])
    assert max(run.losses()) < 8  # it stopped


def test_full_disk_continue_policy_trains_to_the_end_without_saving(small_fs):
    root = small_fs / "ckpt"
    run = launch(1, TINY_MODEL + NO_DROPOUT + TRAIN + ["--save", str(root),
                                                       "--ckpt-failure-policy", "continue"])
    assert run.returncode == 0, run.describe()
    assert sorted(run.losses()) == list(range(1, 9))
    warnings = [line for line in run.stdout.splitlines()
                if "Continuing WITHOUT checkpointing" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], run.describe()
    tracked = _check_nothing_partial_is_complete(root)
    # No saves after the failure was agreed on: the last iterations have no directory at all.
    assert 8 not in _iter_dirs(root) and tracked < 8
    # The summary counts what was started and what became complete, as on disk.
    (summary,) = [ln for ln in run.stdout.splitlines() if ln.startswith(" training summary |")]
    m = re.search(r"checkpoints: (\d+) \(complete: (\d+)\) \|.*"
                  r"newest complete checkpoint: (\S+)$", summary)
    committed = [it for it in _iter_dirs(root)
                 if (root / f"iter_{it:07d}" / "COMMIT.json").exists()]
    assert m and int(m.group(2)) == len(committed) < int(m.group(1)), summary
    assert m.group(3) == str(root / f"iter_{tracked:07d}"), summary


def _fill(mnt):
    """Fill the filesystem at `mnt` to its last block."""
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as err:
        assert err.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_common_pt_on_a_full_disk_is_an_enospc_oserror_naming_the_file(tmp_path, one_rank_group):
    """Stock torch.save reports a full disk as "[enforce fail at inline_container.cc] unexpected
    pos"; our common.pt writer must say ENOSPC and name the file, and leave no partial file."""
    import torch

    from datastates.megatron_adapter import DurableCommonSaveStrategy

    with mounted_tmpfs(tmp_path / "fs", "1m") as mnt:
        ckpt = mnt / "iter_0000001"
        ckpt.mkdir()
        _fill(mnt)
        with pytest.raises(OSError) as info:
            DurableCommonSaveStrategy("torch", 1).save_common({"w": torch.ones(4096)}, ckpt)
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == str(ckpt / "common.pt")
        assert os.listdir(ckpt) == []  # neither common.pt nor the temporary file


def test_durable_common_save_writes_torch_save_bytes_and_restores_the_registry(tmp_path,
                                                                                one_rank_group):
    import torch
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction, default_strategies)

    from datastates.megatron_adapter import DurableCommonSaveStrategy, durable_common_save

    table = default_strategies[StrategyAction.SAVE_COMMON.value]
    stock = table[("torch", 1)]
    assert not isinstance(stock, DurableCommonSaveStrategy)
    with durable_common_save():
        ours = table[("torch", 1)]
        assert isinstance(ours, DurableCommonSaveStrategy)
        ours.save_common({"iteration": 7, "w": torch.arange(5.0)}, tmp_path)
    assert table[("torch", 1)] is stock
    loaded = torch.load(tmp_path / "common.pt", weights_only=True)
    assert loaded["iteration"] == 7 and torch.equal(loaded["w"], torch.arange(5.0))


def _run_config(save):
    from megatron.training.arguments import build_run_config, parse_args

    return build_run_config(parse_args(TINY_MODEL + ["--train-iters", "4", "--save", str(save)]),
                            world_size=1)


def test_tracker_moves_on_a_full_disk_through_its_spare(tmp_path, one_rank_group):
    """After a commit marker is written the disk may fill up (the next save's shards): the
    tracker must still move, so it is rewritten in blocks allocated beforehand; a plain atomic
    write (temp file + rename) gets ENOSPC in the same state."""
    from datastates.fileio import atomic_write, make_spare, spare_path
    from datastates.megatron_adapter.paths import TRACKER_FILENAME
    from datastates.megatron_adapter.paths import write_tracker as write

    def write_tracker(root, iteration, config):  # what every format does once a save is complete
        write(root, iteration, config.to_json())

    with mounted_tmpfs(tmp_path / "fs", "1m") as mnt:
        root = mnt / "ckpt"
        root.mkdir()
        config = _run_config(root)
        tracker = root / TRACKER_FILENAME
        assert make_spare(str(tracker))  # what start-up does (paths.prepare_root), before any save
        write_tracker(str(root), 1, config)
        assert tracker.read_text() == "1" and os.path.isfile(spare_path(str(tracker)))
        run_config = os.stat(root / "run_config.json").st_ino
        _fill(mnt)
        with pytest.raises(OSError) as info:
            atomic_write(str(root / "other.txt"), b"2")
        assert info.value.errno == errno.ENOSPC
        write_tracker(str(root), 2, config)
        assert tracker.read_text() == "2"
        assert os.stat(root / "run_config.json").st_ino == run_config  # unchanged: not rewritten
        # The rename freed the old tracker's block and the new spare took it: the tracker keeps
        # moving on a disk that stays full.
        assert os.path.isfile(spare_path(str(tracker)))
        write_tracker(str(root), 3, config)
        assert tracker.read_text() == "3"
        # Without a spare (lost, or never made) the update is a plain atomic write: on the full
        # disk it fails naming the tracker and leaves the tracker as it was, with no stray files.
        os.unlink(spare_path(str(tracker)))
        _fill(mnt)
        with pytest.raises(OSError) as info:
            write_tracker(str(root), 4, config)
        assert info.value.errno == errno.ENOSPC and info.value.filename == str(tracker)
        assert tracker.read_text() == "3"
        assert sorted(os.listdir(root)) == ["latest_checkpointed_iteration.txt", "run_config.json"]
        os.unlink(mnt / "filler")
        write_tracker(str(root), 4, config)  # room again: a new spare comes with the update
        assert tracker.read_text() == "4" and os.path.isfile(spare_path(str(tracker)))


def test_commit_marker_written_but_tracker_not_is_reported_as_such(tmp_path):
    """A tracker that cannot be replaced (here: a directory in its place) fails the save after
    COMMIT.json: the error must say the checkpoint is complete and what the tracker names,
    not that the checkpoint is incomplete."""
    root = tmp_path / "ckpt"
    (root / "latest_checkpointed_iteration.txt").mkdir(parents=True)
    run = launch(1, TINY_MODEL + NO_DROPOUT + TRAIN + ["--save", str(root)])
    assert run.returncode == 2, run.describe()
    errors = [line for line in run.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1, run.describe()
    assert (root / "iter_0000001" / "COMMIT.json").is_file()
    for needle in ("save of iteration 1 failed on rank(s) [0]", "Is a directory",
                   "this one is complete (", "has its commit marker) but "
                   "latest_checkpointed_iteration.txt could not be moved to it: it still names "
                   "no iteration"):
        assert needle in errors[0], (needle, errors[0])
    assert "not marked complete" not in errors[0]


def test_commit_marker_goes_into_space_set_aside_at_save_time(tmp_path):
    """The trainer sets aside room for COMMIT.json when a save starts; once every rank is
    durable, the marker is written into it even if a later save has filled the disk since.
    Without that room the same commit fails with ENOSPC and the version stays uncommitted."""
    import torch

    from datastates import CheckpointEngine, CommitPolicy, EngineConfig, is_committed, try_commit
    from datastates.fileio import make_spare, spare_path
    from datastates.layout import COMMIT_FILE

    with mounted_tmpfs(tmp_path / "fs", "2m") as mnt:
        state = {"w": torch.arange(4096.0)}
        with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20,
                                           commit_policy=CommitPolicy.MANUAL)) as eng:
            for name in ("with_room", "without_room"):
                (mnt / name).mkdir()
                if name == "with_room":
                    assert make_spare(str(mnt / name / COMMIT_FILE), 64 * 1024)
                eng.wait_for_durable(eng.save(state, str(mnt / name), step=1))
        _fill(mnt)
        with pytest.raises(OSError) as info:
            try_commit(str(mnt / "without_room"), 1)
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == str(mnt / "without_room" / COMMIT_FILE)
        assert not is_committed(str(mnt / "without_room"))
        assert try_commit(str(mnt / "with_room"), 1) and is_committed(str(mnt / "with_room"))
        assert not os.path.exists(spare_path(str(mnt / "with_room" / COMMIT_FILE)))


def test_spare_takes_its_blocks_at_once_or_leaves_nothing(tmp_path):
    """`make_spare` allocates without writing data or fsyncing (it runs in every save call): the
    blocks must be taken when it returns True, so a disk filled right after cannot take them, and
    on a full disk it returns False leaving no file behind."""
    from datastates.fileio import make_spare, spare_path

    with mounted_tmpfs(tmp_path / "fs", "1m") as mnt:
        taken = str(mnt / "COMMIT.json")
        assert make_spare(taken, 64 * 1024)
        assert os.stat(spare_path(taken)).st_blocks * 512 >= 64 * 1024
        _fill(mnt)
        fd = os.open(spare_path(taken), os.O_WRONLY)  # its blocks are still writable
        try:
            assert os.pwrite(fd, b"x" * 64 * 1024, 0) == 64 * 1024
        finally:
            os.close(fd)
        assert not make_spare(str(mnt / "other"), 64 * 1024)
        assert not os.path.exists(spare_path(str(mnt / "other")))
