"""The commit of a lazy save (`LazyCheckpointer`): metadata.json, the commit marker and the tracker
are written by the commit thread, off the training loop; a commit in flight never blocks `poll` or
the next save, versions still commit in order, and a failed commit is raised as the agreed
`CheckpointError`. One process on a one-rank gloo group, no trainer."""
import errno
import importlib
import json
import os
import threading
import time

import pytest
import torch

from megatron.core.dist_checkpointing import ShardedTensor

WAIT_S = 60.0  # a bound for background work to reach a state, never a timing assertion


def _state(step):
    data = torch.arange(64, dtype=torch.float32).reshape(8, 8) + 1000 * step
    return {"w": ShardedTensor("w", data, data.dtype, (8, 8), (8, 8), (0, 0), (1, 1)),
            "iteration": step}


def _checkpointer(root):
    from datastates.megatron_adapter import LazyCheckpointer, LazySaveConfig

    return LazyCheckpointer(LazySaveConfig(root=str(root), cache_bytes=1 << 20),
                            log=lambda _msg: None)


def _save(ckpt, step):
    ckpt.save(step, _state(step))
    ckpt.before_optimizer_step()
    ckpt.poll(step)


def _poll_until(ckpt, step, done):
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "background work did not get there"
        ckpt.poll(step)
        time.sleep(0.01)


def _tracked(root):
    from datastates.megatron_adapter.paths import tracked_iteration

    return tracked_iteration(str(root))


def _loads(root, step):
    from megatron.core.dist_checkpointing import load

    importlib.import_module("datastates")  # registers our load strategy
    empty = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 8))}
    loaded = load(empty, str(root / f"iter_{step:07d}"))
    return torch.equal(loaded["w"], _state(step)["w"].data)


def _hook_tracker(monkeypatch, action):
    """`action(root)` runs first when the tracker is about to move to iteration 2."""
    from datastates.megatron_adapter.save import checkpointer

    real = checkpointer.write_tracker

    def hooked(root, iteration, *a, **k):
        if iteration == 2:
            action(root)
        return real(root, iteration, *a, **k)

    monkeypatch.setattr(checkpointer, "write_tracker", hooked)


def _first_committed(tmp_path):
    """A checkpointer whose iteration 1 is committed and settled."""
    root = tmp_path / "ckpt"
    ckpt = _checkpointer(root)
    _save(ckpt, 1)
    _poll_until(ckpt, 1, lambda: _tracked(root) == 1 and ckpt.publishing is None)
    return root, ckpt


def test_commit_files_are_written_by_the_commit_thread(tmp_path, one_rank_megatron, monkeypatch):
    from datastates.megatron_adapter.save import checkpointer, strategies

    threads = []
    for owner, name in ((checkpointer, "write_tracker"), (checkpointer, "try_commit"),
                        (strategies, "write_metadata")):
        real = getattr(owner, name)

        def traced(*a, _real=real, _name=name, **k):
            threads.append((_name, threading.current_thread().name))
            return _real(*a, **k)

        monkeypatch.setattr(owner, name, traced)
    root = tmp_path / "ckpt"
    ckpt = _checkpointer(root)
    for step in (1, 2, 3):
        _save(ckpt, step)
    ckpt.finish()
    assert sorted({n for n, _ in threads}) == ["try_commit", "write_metadata", "write_tracker"]
    assert all(t.startswith("datastates-commit") for _, t in threads), threads
    assert _tracked(root) == 3
    for step in (1, 2, 3):
        version = root / f"iter_{step:07d}"
        meta = json.loads((version / "metadata.json").read_text())
        assert meta["sharded_backend"] == "datastates", meta  # what megatron's finalize writes
        assert (version / "COMMIT.json").is_file() and _loads(root, step)


def test_steady_saves_make_no_file_system_call_on_the_training_thread(tmp_path, one_rank_megatron):
    """Once a save has planned (the first makes its directory in the call: megatron's save lists
    it), the save calls, the waits before the step and the polls that commit them make no
    file-system call under the root on the training thread: rank 0's version directory and
    spares are made by its files thread, the shard file by the engine's writers, the commit and
    retention (keep 2) by the commit thread. On a shared file system each would be a metadata
    round trip."""
    from fs_calls import paused, recording

    from datastates.megatron_adapter import LazyCheckpointer, LazySaveConfig
    from megatron.training.checkpointing.retention import apply_retention

    root = tmp_path / "ckpt"
    ckpt = LazyCheckpointer(LazySaveConfig(root=str(root), cache_bytes=1 << 20),
                            log=lambda _msg: None,
                            after_commit=lambda it, r: apply_retention(r, 2, it))

    def committed(step):
        with paused(rec):  # the test's own look at the tracker
            return _tracked(root) == step and ckpt.publishing is None

    _save(ckpt, 1)
    with recording(str(root)) as rec:
        for step in range(2, 7):
            _save(ckpt, step)
            _poll_until(ckpt, step, lambda: committed(step))
    assert rec.calls == []
    ckpt.finish()
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000005", "iter_0000006"]
    assert _loads(root, 5) and _loads(root, 6)


def test_a_commit_in_flight_blocks_neither_poll_nor_the_next_save(tmp_path, one_rank_megatron,
                                                                  monkeypatch):
    entered, release = threading.Event(), threading.Event()
    _hook_tracker(monkeypatch, lambda _root: (entered.set(), release.wait(WAIT_S)))
    root, ckpt = _first_committed(tmp_path)
    _save(ckpt, 2)
    _poll_until(ckpt, 2, entered.is_set)  # the commit thread is inside step 2's tracker write
    try:
        ckpt.poll(2)  # returns: the training thread does not wait for the commit thread
        assert _tracked(root) == 1 and ckpt.in_flight(2)
        _save(ckpt, 3)  # the next save starts meanwhile
        assert _tracked(root) == 1 and (root / "iter_0000002" / "COMMIT.json").is_file()
        assert not (root / "iter_0000003" / "COMMIT.json").exists()
    finally:
        release.set()
    ckpt.finish()
    assert _tracked(root) == 3
    assert all(_loads(root, step) for step in (1, 2, 3))


def test_a_failed_commit_is_raised_and_the_tracker_stays(tmp_path, one_rank_megatron, monkeypatch):
    from datastates.errors import CheckpointError

    def full_disk(root):
        raise OSError(errno.ENOSPC, "No space left on device", str(root))

    _hook_tracker(monkeypatch, full_disk)
    root, ckpt = _first_committed(tmp_path)
    with pytest.raises(CheckpointError) as err:
        _save(ckpt, 2)
        _poll_until(ckpt, 2, lambda: False)  # the agreed failure ends the loop
    assert "iteration 2" in str(err.value) and "No space left" in str(err.value)
    assert _tracked(root) == 1 and _loads(root, 1)


def _durable_unpolled(ckpt, steps, state=_state):
    """Saves of `steps`, each followed by the step's hook but no poll, until each is durable
    here: a lane that fell behind (a slow fsync, a loaded machine)."""
    for step in steps:
        ckpt.save(step, state(step))
        ckpt.before_optimizer_step()
    lane = ckpt.persistent
    for p in lane.pending:  # what the checkpointer's own blocking wait records (`_wait_durable`)
        for record in lane.engine.wait_for_durable(p.handle, timeout=WAIT_S):
            ckpt.durable[os.path.normpath(record.directory)] = record
        for written in p.files:  # common.pt
            written.result(timeout=WAIT_S)


def _commit_thread_idle(ckpt):
    ckpt.persistent.publisher.submit(lambda: None).result(timeout=WAIT_S)


def test_a_lane_that_fell_behind_commits_every_durable_version_at_the_next_poll(
        tmp_path, one_rank_megatron):
    """One poll starts one commit of every version durable everywhere, written in order by the
    commit thread; the next poll settles them, logging each in order. (With one version per
    commit, a lane saving every iteration stayed as far behind as its slowest moment put it.)"""
    from datastates.megatron_adapter import LazyCheckpointer, LazySaveConfig

    root, lines = tmp_path / "ckpt", []
    ckpt = LazyCheckpointer(LazySaveConfig(root=str(root), cache_bytes=1 << 20), log=lines.append)
    _durable_unpolled(ckpt, (1, 2, 3, 4))
    ckpt.poll(4)
    assert not ckpt.persistent.pending
    _commit_thread_idle(ckpt)
    assert _tracked(root) == 4
    assert all((root / f"iter_{s:07d}" / "COMMIT.json").is_file() for s in (1, 2, 3, 4))
    ckpt.poll(4)
    assert ckpt.publishing is None and not ckpt.busy()
    said = [int(m.split()[2]) for m in lines if m.startswith(" checkpoint iteration")]
    assert said == [1, 2, 3, 4], lines
    ckpt.finish()
    assert all(_loads(root, step) for step in (1, 2, 3, 4))


def test_settling_several_keeps_the_local_copies_of_the_ones_after_each(tmp_path, monkeypatch,
                                                                        one_rank_megatron):
    """With node-local copies (--lazy-save-local-dir, newest 2 kept): 1-4 committed at once while
    5 and 6 are still in flight. Pruning after each of 1-4 must keep the copies of those after
    it in the same commit: a crash between two of them would otherwise leave the tracker naming
    a version whose local copy is gone (the suite's lost-node test saw iteration 3's removed
    while settling 2). After the commit every committed copy beyond the newest two is gone."""
    from datastates import flush
    from datastates.megatron_adapter import LazyCheckpointer, LazySaveConfig
    from datastates.megatron_adapter.levels.local_tier import local_iterations

    # 5 and 6 stay in flight (written, not yet fsync'd and marked) until the commit of 1-4 is
    # settled: on a loaded machine they used to become durable in between, and 5 was settled too.
    release, fail_point = threading.Event(), flush.fail_point

    def hold_5_and_6(step_name, step, *args, **kwargs):
        if step_name == "write" and step in (5, 6):
            assert release.wait(WAIT_S), "5 and 6 were not released"
        return fail_point(step_name, step, *args, **kwargs)

    monkeypatch.setattr(flush, "fail_point", hold_5_and_6)
    root, local = tmp_path / "ckpt", tmp_path / "local"
    ckpt = LazyCheckpointer(LazySaveConfig(root=str(root), cache_bytes=1 << 20,
                                           local_dir=str(local)), log=lambda _msg: None)
    try:
        _settle_one_to_four_while_five_and_six_are_in_flight(ckpt, local, local_iterations)
    finally:
        release.set()
    ckpt.finish()


def _settle_one_to_four_while_five_and_six_are_in_flight(ckpt, local, local_iterations):
    _durable_unpolled(ckpt, (1, 2, 3, 4))
    for step in (5, 6):  # in flight: not yet known durable here
        ckpt.save(step, _state(step))
        ckpt.before_optimizer_step()
    seen = []
    real = ckpt._prune_local

    def prune(committed, *a, **k):
        real(committed, *a, **k)
        seen.append((committed, local_iterations(str(local))))

    ckpt._prune_local = prune
    ckpt.poll(6)  # one commit of 1-4
    _commit_thread_idle(ckpt)
    ckpt.poll(6)  # settled: each of 1-4 after another
    assert [c for c, _ in seen] == [1, 2, 3, 4]
    for committed, left in seen:
        assert all(later in left for later in range(committed, 5)), seen
    left = seen[-1][1]  # 1-3 gone, as after a commit of 4 alone; 5's copy (in flight) untouched
    assert [it for it in left if it <= 4] == [4] and 5 in left, seen


def test_a_run_from_an_older_iteration_drops_the_newer_local_copies(tmp_path,
                                                                    one_rank_megatron):
    """A run that starts from iteration 3 where the node-local copies of 3 and 4 are (4: the run
    rolled back from): 4's copy goes before the first save, so `local_keep` counts this run's
    copies, not that one."""
    from datastates.megatron_adapter import LazyCheckpointer, LazySaveConfig
    from datastates.megatron_adapter.levels.local_tier import local_iterations

    root, local = tmp_path / "ckpt", tmp_path / "local"
    config = LazySaveConfig(root=str(root), cache_bytes=1 << 20, local_dir=str(local))
    ckpt = LazyCheckpointer(config, log=lambda _msg: None)
    for step in (1, 2, 3, 4):
        ckpt.save(step, _state(step))
        ckpt.before_optimizer_step()
    ckpt.finish()
    assert local_iterations(str(local)) == [3, 4]
    again = LazyCheckpointer(config, log=lambda _msg: None)
    assert again.drop_local_copies_newer(3) == [4]
    assert local_iterations(str(local)) == [3]
    again.finish()


def test_a_failed_commit_of_several_names_the_first_and_settles_those_before(
        tmp_path, one_rank_megatron, monkeypatch):
    """Iterations 2, 3 and 4 are committed together; 3's tracker write fails: 2 is committed and
    logged, 4 is not committed, the tracker stays at 2, and the agreed error names 3."""
    from datastates.errors import CheckpointError
    from datastates.megatron_adapter import LazyCheckpointer, LazySaveConfig
    from datastates.megatron_adapter.save import checkpointer

    real = checkpointer.write_tracker

    def full_at_3(root, iteration, *a, **k):
        if iteration == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(root))
        return real(root, iteration, *a, **k)

    monkeypatch.setattr(checkpointer, "write_tracker", full_at_3)
    root, lines = tmp_path / "ckpt", []
    ckpt = LazyCheckpointer(LazySaveConfig(root=str(root), cache_bytes=1 << 20), log=lines.append)
    _durable_unpolled(ckpt, (2, 3, 4))
    with pytest.raises(CheckpointError) as err:
        ckpt.poll(4)  # one commit of 2, 3 and 4
        _commit_thread_idle(ckpt)
        ckpt.poll(4)  # the agreed failure
    assert "iteration 3" in str(err.value) and "No space left" in str(err.value)
    assert "it still names iteration 2" in str(err.value)
    said = [int(m.split()[2]) for m in lines if m.startswith(" checkpoint iteration")]
    assert said == [2], lines
    assert _tracked(root) == 2 and not (root / "iter_0000004" / "COMMIT.json").exists()
    assert _loads(root, 2)


def _several_worker(rank, store, root, out):
    """One of two gloo ranks: `_durable_unpolled` of 1-4 (each rank its own tensor), a tracker
    that cannot move to 3 (rank 0's commit thread), two polls."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from datastates.errors import CheckpointError
    from datastates.megatron_adapter import LazyCheckpointer, LazySaveConfig
    from datastates.megatron_adapter.save import checkpointer

    def own(step):  # this rank's tensor, a key of its own
        data = torch.arange(64, dtype=torch.float32).reshape(8, 8) + 1000 * step + rank
        return {f"w{rank}": ShardedTensor(f"w{rank}", data, data.dtype, (8, 8), (8, 8), (0, 0),
                                          (1, 1)), "iteration": step}

    real = checkpointer.write_tracker

    def full_at_3(root, iteration, *a, **k):
        if iteration == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(root))
        return real(root, iteration, *a, **k)

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel()
    checkpointer.write_tracker = full_at_3
    try:
        lines, seen = [], []
        ckpt = LazyCheckpointer(LazySaveConfig(root=root, cache_bytes=1 << 20), log=lines.append)
        _durable_unpolled(ckpt, (1, 2, 3, 4), own)
        try:
            ckpt.poll(4)  # one commit of all four, on rank 0's commit thread
            seen.append(len(ckpt.persistent.pending))
            if rank == 0:
                _commit_thread_idle(ckpt)
            dist.barrier()
            ckpt.poll(4)  # the agreed failure
        except CheckpointError as err:
            seen.append(str(err).split("] ", 1)[1])
        seen.append([int(m.split()[2]) for m in lines if m.startswith(" checkpoint iteration")])
        try:
            ckpt.finish()
        except CheckpointError:
            pass
        torch.save(seen, f"{out}.{rank}")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_two_ranks_commit_several_and_agree_on_the_first_that_failed(tmp_path):
    """Two gloo ranks, four versions durable on both before a poll: one commit covers them all;
    rank 0's tracker cannot move to 3, and both ranks raise the same error naming iteration 3,
    after 1 and 2 settled (rank 0 logs them); 4 is never committed; neither rank hangs."""
    from trainer_launch import spawn_ranks

    root = tmp_path / "ckpt"
    spawn_ranks(_several_worker, 2, (str(tmp_path / "store"), str(root), str(tmp_path / "seen")))
    seen = [torch.load(f"{tmp_path / 'seen'}.{r}", weights_only=True) for r in (0, 1)]
    assert seen[0][0] == seen[1][0] == 0  # none left waiting after the first poll
    assert seen[0][1] == seen[1][1], seen  # the same agreed error
    assert "iteration 3 failed on rank(s) [0]" in seen[0][1] and "No space left" in seen[0][1]
    assert "it still names iteration 2" in seen[0][1]
    assert seen[0][2] == [1, 2] and seen[1][2] == []  # rank 0 logs what committed
    assert _tracked(root) == 2 and not (root / "iter_0000004" / "COMMIT.json").exists()


def test_a_refused_version_among_several_commits_those_before_it_first(tmp_path,
                                                                        one_rank_megatron):
    """Iterations 2, 3 and 4 wait durable; 3's replicas disagree (agreed on every rank): 2 is
    committed and settled before the refusal is raised, 3 is never committed, 4 still waits."""
    from datastates.megatron_adapter import LazyCheckpointer, LazySaveConfig
    from datastates.megatron_adapter.save.replica_check import ReplicaMismatch

    root = tmp_path / "ckpt"
    ckpt = LazyCheckpointer(LazySaveConfig(root=str(root), cache_bytes=1 << 20),
                            log=lambda _msg: None)
    _durable_unpolled(ckpt, (2, 3, 4))
    refused = []

    def verify(p):
        if p.iteration == 3:
            refused.append(_tracked(root))
            raise ReplicaMismatch("replicas of iteration 3 differ", rank=0, ranks=[0])

    for p in ckpt.persistent.pending:
        p.replica_check = object()
    ckpt._verify_replicas = verify
    with pytest.raises(ReplicaMismatch):
        ckpt.poll(4)
    assert refused == [None]  # nothing committed when it was found
    assert _tracked(root) == 2 and ckpt.publishing is None
    assert not (root / "iter_0000003" / "COMMIT.json").exists()
    assert [p.iteration for p in ckpt.persistent.pending] == [4]


def test_a_finalize_function_megatron_adds_in_future_still_runs_on_the_training_thread(
        tmp_path, one_rank_megatron, monkeypatch):
    """The commit thread writes metadata.json in place of megatron's only finalize function; if
    megatron's request ever holds another one, every finalize function runs as megatron would run
    it, on the training thread, and the commit thread does not write metadata.json again."""
    from megatron.core import dist_checkpointing

    from datastates.megatron_adapter.save import strategies

    ran, rewritten = [], []
    real_save = dist_checkpointing.save

    def save_with_extra(*a, **k):
        request = real_save(*a, **k)
        request.finalize_fns.append(lambda: ran.append(threading.current_thread().name))
        return request

    monkeypatch.setattr(dist_checkpointing, "save", save_with_extra)
    monkeypatch.setattr(strategies, "write_metadata", lambda *a: rewritten.append(a))
    root = tmp_path / "ckpt"
    ckpt = _checkpointer(root)
    for step in (1, 2):
        _save(ckpt, step)
    ckpt.finish()
    assert ran == [threading.main_thread().name] * 2 and rewritten == []
    meta = json.loads((root / "iter_0000002" / "metadata.json").read_text())
    assert meta["sharded_backend"] == "datastates" and _tracked(root) == 2 and _loads(root, 2)


def test_an_error_after_the_last_commit_is_agreed_on_at_finish(tmp_path, one_rank_megatron):
    """What follows the final commit (retention, here) has no later save to be agreed on with:
    `finish` agrees on it once more and raises it, naming the last committed iteration, instead
    of ending the run as if nothing had failed."""
    from datastates.errors import CheckpointError

    root, ckpt = _first_committed(tmp_path)

    def retention_fails(iteration, _root):
        if iteration == 2:
            raise RuntimeError("retention could not remove iteration 1")

    ckpt.after_commit = retention_fails
    _save(ckpt, 2)
    with pytest.raises(CheckpointError) as err:
        ckpt.finish()
    assert "iteration 2" in str(err.value) and "retention could not remove" in str(err.value)
    assert _tracked(root) == 2 and _loads(root, 2)


def test_a_failed_save_names_a_newer_version_complete_on_another_level(tmp_path):
    """A --save version failing after the in-memory level committed a newer one: the agreed
    error says so (a restart on these nodes resumes from it), not only that --save has none."""
    from datastates.megatron_adapter.save.checkpointer import _Pending, _state_of

    def pending(root, iteration, node_local):
        return _Pending(iteration, str(root), node_local, str(root / f"iter_{iteration:07d}"),
                        None, None, 0.0, 0.0, 0.0)

    save, memory = tmp_path / "save", tmp_path / "memory"
    save.mkdir()
    failed = pending(save, 3, False)
    alone = _state_of(failed, str(save))
    assert alone.startswith("no earlier checkpoint was completed")
    told = _state_of(failed, str(save), pending(memory, 2, True))
    assert told.startswith(alone) and told.endswith(
        f"; iteration 2 is complete on another level, in {memory / 'iter_0000002'}, which a "
        "restart on these nodes takes")
    # Not when that version is of the same level, or older than --save's newest.
    assert _state_of(failed, str(save), pending(save, 2, False)) == alone
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    assert "another level" not in _state_of(failed, str(save), pending(memory, 2, True))


@pytest.mark.parametrize("attributed", [True, False])
def test_a_failure_raised_by_the_next_save_call_stays_with_its_own_save(tmp_path, one_rank_megatron,
                                                                        monkeypatch, attributed):
    """The engine raises a save's background failure at its next call, which may be the next
    save call. It is that earlier save's failure: the run stops naming it. It used to go with
    the save being made, the earlier one then waited for a durability that never came, and the
    final drain ended with it neither committed nor failed (exit status 0, found under load by
    test_cluster_path's deleted node-local directory). Without the attribution (`attributed`
    False), the final drain still fails that save: one the engine is done with that is not
    durable gets a failure of its own."""
    from datastates import faults, flush
    from datastates.errors import CheckpointError
    from datastates.megatron_adapter.save.checkpointer import LazyCheckpointer

    if not attributed:
        monkeypatch.setattr(LazyCheckpointer, "_owner", lambda self, err, besides=None: None)
    # The write fails only once the snapshot wait has returned: a failure there would be raised
    # by that wait instead, a path the `attributed` False variant does not test (under load the
    # writer's failure could come between the last copy and the waiting thread's wake-up).
    snapshot_returned = threading.Event()

    def fail_after_the_snapshot(step_name, step, *args, **kwargs):
        if step_name == "write" and step == 2:
            assert snapshot_returned.wait(WAIT_S), "the snapshot wait did not return"
        return fail_point(step_name, step, *args, **kwargs)

    fail_point = flush.fail_point
    monkeypatch.setattr(flush, "fail_point", fail_after_the_snapshot)
    root, ckpt = _first_committed(tmp_path)
    monkeypatch.setenv("DATASTATES_FAULT_FAIL_WRITE", "error@2")
    faults.reload_from_env()
    try:
        ckpt.save(2, _state(2))
        ckpt.before_optimizer_step()
        snapshot_returned.set()
        engine = ckpt.persistent.engine
        deadline = time.monotonic() + WAIT_S
        while not any(s.error is not None for s in engine._saves):  # failed, not yet raised
            assert time.monotonic() < deadline, "the injected failure did not happen"
            time.sleep(0.01)
        ckpt.save(3, _state(3))  # the engine raises save 2's failure in this call
        ckpt.before_optimizer_step()
        with pytest.raises(CheckpointError) as err:
            ckpt.poll(3)
            ckpt.finish()
    finally:
        monkeypatch.delenv("DATASTATES_FAULT_FAIL_WRITE")
        faults.reload_from_env()
    assert "DataStates save of iteration 2 failed" in str(err.value), err.value
    assert ("injected failure of step 'write'" if attributed else
            "ended on this rank without becoming durable") in str(err.value), err.value
    assert _tracked(root) == 1
