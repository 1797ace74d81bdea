"""The save worker (`offload.SaveWorker`, `LazyCheckpointer.save_built`): a steady save's dict,
plan check, payload and engine call run off the training thread, during the next
forward/backward, and are joined before the next optimizer step; what they say is said on the
training thread; a structure change is handed back to it; a failure is raised at the join. One
process on a one-rank gloo group, no trainer (tests/test_in_memory_level.py runs the trainer on 2
ranks through it: a kill and a bit-exact resume, a failed commit, the collectives per iteration)."""
import importlib
import re
import threading
import time

import pytest
import torch

from megatron.core.dist_checkpointing import ShardedTensor

WAIT_S = 60.0  # a bound for a thread to get somewhere, never a timing assertion


def _tensor(key, step, rows=8):
    data = torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8) + 1000 * step
    return ShardedTensor(key, data, data.dtype, (rows, 8), (rows, 8), (0, 0), (1, 1))


def _state(step, second=False):
    out = {"w": _tensor("w", step), "iteration": step}
    if second:  # another structure: one more tensor
        out["v"] = _tensor("v", step, rows=4)
    return out


class _Run:
    """A LazyCheckpointer with an in-memory level under tmp_path, the thread each save's dict was
    built on, and each log line with whether the training (main) thread said it."""

    def __init__(self, tmp_path, offload=True):
        from datastates.megatron_adapter import LazyCheckpointer, LazySaveConfig

        self.memory = str(tmp_path / "memory")
        self.built_on = {}
        self.lines = []
        self.ckpt = LazyCheckpointer(
            LazySaveConfig(root=str(tmp_path / "save"), cache_bytes=1 << 20,
                           non_persistent_root=self.memory, non_persistent_node_local=True,
                           non_persistent_in_memory=True, offload_steady_saves=offload),
            log=lambda m: self.lines.append((threading.current_thread() is
                                             threading.main_thread(), m)))

    def build(self, step, second=False, gate=None, fail=None):
        def fn():
            self.built_on[step] = threading.current_thread().name
            if gate is not None:
                assert gate.wait(WAIT_S), "the test never opened the gate"
            if fail is not None:
                raise fail
            return _state(step, second), ()
        return fn

    def iteration(self, step, **build):
        """save, then (the next forward/backward) the step's hook, then the poll."""
        self.ckpt.save_built(step, self.build(step, **build), root=self.memory)
        self.ckpt.poll(step)
        self.ckpt.before_optimizer_step()


def _loads(root, step, second=False):
    from megatron.core.dist_checkpointing import load

    importlib.import_module("datastates")  # registers our load strategy
    want = _state(step, second)
    empty = {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v.data))
             for k, v in want.items() if k != "iteration"}
    loaded = load(empty, f"{root}/iter_{step:07d}")
    return all(torch.equal(loaded[k], want[k].data) for k in empty)


def test_a_steady_in_memory_save_runs_on_the_worker_until_the_step(one_rank_megatron, tmp_path,
                                                                    monkeypatch):
    """The first two saves are made in their call (the first makes the plan, the second finds it
    unchanged on every rank); from the third on, the call returns while the dict is not even
    built, the poll after it is queued behind it, and the step's hook waits for it; from then on
    the training thread issues no control-plane collective (the versions' agreements too are
    the worker's). The commit lines said by the worker's jobs reach the log on the training
    thread. Every version loads."""
    from datastates import control_plane
    from datastates.megatron_adapter.paths import tracked_iteration

    collectives = []  # (thread name, collective)
    for name in ("all_gather_ints", "all_reduce", "barrier"):
        def counted(*args, _real=getattr(control_plane, name), _name=name, **kwargs):
            collectives.append((threading.current_thread().name, _name))
            return _real(*args, **kwargs)

        monkeypatch.setattr(control_plane, name, counted)
    run = _Run(tmp_path)
    main = threading.current_thread().name
    for step in (1, 2):
        run.iteration(step)
        assert run.built_on[step] == main
    assert (main, "all_gather_ints") in collectives  # the agreements so far
    steady = len(collectives)
    gate = threading.Event()
    run.ckpt.save_built(3, run.build(3, gate=gate), root=run.memory)  # returns: not built yet
    run.ckpt.poll(3)  # queued behind the save
    time.sleep(0.3)  # the forward/backward: the worker's copies of 3 have not started yet
    gate.set()
    run.ckpt.before_optimizer_step()
    assert run.built_on[3].startswith("datastates-save"), run.built_on
    run.iteration(4)
    assert run.built_on[4].startswith("datastates-save"), run.built_on
    later = collectives[steady:]  # (one read: the worker may be adding version 4's agreement)
    assert later and all(thread.startswith("datastates-save") for thread, _ in later), later
    run.ckpt.finish()
    assert tracked_iteration(run.memory) == 4
    assert _loads(run.memory, 4)
    said = [m for _, m in run.lines if m.startswith(" checkpoint iteration")]
    assert [int(m.split()[2]) for m in said] == [1, 2, 3, 4], run.lines
    assert all(on_main for on_main, _ in run.lines), run.lines
    # Each line says when the copies could start, counted from the save call: version 3's
    # after the worker's build, held past the 0.3 s above.
    starts = [float(re.search(r"\| copy start \(ms\): ([\d.]+) \|", m).group(1)) for m in said]
    assert starts[2] >= 300.0, said


def test_a_structure_change_is_saved_by_the_training_thread(one_rank_megatron, tmp_path,
                                                            monkeypatch):
    """An offloaded save whose structure changed (its plan check, on the worker, says so) is
    handed back: megatron's call, with its collectives on the training thread's groups, is made
    at the join, on the training thread, and that version commits with the new structure. The
    next save is made in its call (the plan is new); the one after runs on the worker again."""
    from megatron.core import dist_checkpointing

    from datastates.megatron_adapter.paths import tracked_iteration

    megatron_on = []
    real = dist_checkpointing.save

    def save(*args, **kwargs):
        megatron_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(dist_checkpointing, "save", save)
    run = _Run(tmp_path)
    main = threading.current_thread().name
    for step in (1, 2):
        run.iteration(step)
    assert megatron_on == [main]  # the first save only
    run.iteration(3, second=True)
    assert run.built_on[3].startswith("datastates-save"), run.built_on
    assert megatron_on == [main, main]
    run.iteration(4, second=True)
    assert run.built_on[4] == main
    run.iteration(5, second=True)
    assert run.built_on[5].startswith("datastates-save"), run.built_on
    run.ckpt.finish()
    assert megatron_on == [main, main]
    assert tracked_iteration(run.memory) == 5
    assert _loads(run.memory, 5, second=True)


def test_a_failure_on_the_worker_is_raised_before_the_step_once(one_rank_megatron, tmp_path):
    """What an offloaded job raises is raised by the step's hook (the poll queued behind it does
    not run), once: the versions before it stay committed and the run can still finish."""
    from datastates.megatron_adapter.paths import tracked_iteration

    run = _Run(tmp_path)
    for step in (1, 2):
        run.iteration(step)
    run.ckpt.save_built(3, run.build(3, fail=RuntimeError("the dict could not be built")),
                        root=run.memory)
    run.ckpt.poll(3)
    with pytest.raises(RuntimeError, match="the dict could not be built"):
        run.ckpt.before_optimizer_step()
    run.ckpt.finish()
    assert tracked_iteration(run.memory) == 2
    assert _loads(run.memory, 2)


def test_a_collective_on_the_training_thread_waits_for_the_worker(one_rank_megatron, tmp_path):
    """Another control-plane collective on the training thread while a job is in flight (e.g.
    --save-interval auto's agreement right after the save call) first joins the job: their
    collectives would otherwise interleave, in a different order on each rank (a hang)."""
    from datastates import control_plane

    run = _Run(tmp_path)
    for step in (1, 2):
        run.iteration(step)
    gate = threading.Event()
    run.ckpt.save_built(3, run.build(3, gate=gate), root=run.memory)
    opener = threading.Timer(0.5, gate.set)
    opener.start()
    control_plane.all_reduce([1])
    assert gate.is_set() and run.built_on[3].startswith("datastates-save"), run.built_on
    # Joined: what the job said (the commit of version 2, settled in its plan check) is out.
    assert any(m.startswith(" checkpoint iteration        2") for _, m in run.lines), run.lines
    run.ckpt.poll(3)
    run.ckpt.before_optimizer_step()
    run.ckpt.finish()


def test_steady_saves_into_save_run_on_the_worker_too(one_rank_megatron, tmp_path):
    """--save's lane (here without an in-memory level's saves): from its third save on, the dict
    and the save are made by the worker, committed at a later poll, and every version loads."""
    from datastates.megatron_adapter.paths import tracked_iteration

    run = _Run(tmp_path)
    save = run.ckpt.config.root
    main = threading.current_thread().name
    for step in (1, 2, 3, 4):
        run.ckpt.save_built(step, run.build(step), root=save)
        run.ckpt.poll(step)
        run.ckpt.before_optimizer_step()
    assert run.built_on[1] == run.built_on[2] == main
    assert all(run.built_on[s].startswith("datastates-save") for s in (3, 4)), run.built_on
    run.ckpt.finish()
    assert tracked_iteration(save) == 4
    assert _loads(save, 4)


def test_on_the_training_thread_every_save_is_made_in_its_call(one_rank_megatron, tmp_path):
    """`offload_steady_saves=False` (--lazy-save-on-training-thread): steady saves too are built
    and made on the training thread, and every version still commits and loads."""
    from datastates.megatron_adapter.paths import tracked_iteration

    run = _Run(tmp_path, offload=False)
    for step in (1, 2, 3, 4):
        run.iteration(step)
    run.ckpt.finish()
    main = threading.current_thread().name
    assert all(run.built_on[s] == main for s in (1, 2, 3, 4)), run.built_on
    assert tracked_iteration(run.memory) == 4 and _loads(run.memory, 4)


def test_in_memory_versions_are_checksummed_by_the_threads_set_for_them(one_rank_megatron,
                                                                          tmp_path, monkeypatch):
    """LazySaveConfig.checksum_threads (--lazy-save-checksum-threads): the in-memory level's
    engine has that many writer threads, at the training threads' priority (a version commits
    once checksummed, and the level's next save waits for that commit), while --save's engine
    keeps one writer, lowered. With copies that do not checksum as they copy (as a device's
    copies; here without `copycrc`), the writers checksum every version, which commits and
    loads. By default on CPU: one writer, and nothing said about it."""
    from datastates import copycrc
    from datastates.megatron_adapter import LazyCheckpointer, LazySaveConfig
    from datastates.megatron_adapter.paths import tracked_iteration

    default = _Run(tmp_path / "default")
    assert default.ckpt.node_lane.engine.cfg.writer_threads == 1
    assert not any("checksum" in line for _, line in default.lines)
    default.ckpt.finish()
    monkeypatch.setattr(copycrc, "available", False)
    memory, committed = str(tmp_path / "memory"), []
    ckpt = LazyCheckpointer(LazySaveConfig(
        root=str(tmp_path / "save"), cache_bytes=1 << 20, non_persistent_root=memory,
        non_persistent_node_local=True, non_persistent_in_memory=True, checksum_threads=3),
        log=lambda _m: None, on_record=lambda r: committed.append(r["iteration"]))
    node, persistent = ckpt.node_lane.engine, ckpt.persistent.engine
    assert (node.cfg.writer_threads, node.cfg.background_nice) == (3, 0)
    assert (persistent.cfg.writer_threads, persistent.cfg.background_nice) == (1, 5)
    assert sum(t.name.startswith("datastates-write") for t in node._threads) == 3
    assert not node._copier.fused
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), root=memory)
        ckpt.before_optimizer_step()
        ckpt.poll(step)
    ckpt.finish()
    assert committed == [1, 2, 3]
    assert tracked_iteration(memory) == 3 and _loads(memory, 3)
    with pytest.raises(ValueError, match="checksum_threads must be >= 1, found 0"):
        LazySaveConfig(root="x", checksum_threads=0)
