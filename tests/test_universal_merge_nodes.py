"""One merge on two nodes (merge/nodes.py): node 0's and node 1's mergers in one process here, the
trainer on two torchrun agents below. Every part is written by its
node and the manifest is committed last by node 0; a worker killed on either node commits
nothing, keeps the previous universal checkpoint, and leaves no directory behind."""
import os
import signal
import time

import torch

import fs_calls
from datastates.megatron_adapter import BackgroundMerger, MergerConfig, open_source
from datastates.megatron_adapter.merge.nodes import job_tmp
from datastates.universal import UniversalCheckpoint, is_committed, write_universal
from test_universal_merge_workers import _alive, _universal_name, _wait_for
from universal_fixtures import source  # noqa: F401


def _mergers(root, lines, run_id="r1", **kw):
    return [BackgroundMerger(MergerConfig(root=root, workers=1, nodes=2, node=n, run_id=run_id,
                                          idle_io=False, max_file_bytes=4096, **kw),
                             log=lambda m, n=n: lines.append(f"node{n}:{m}"))
            for n in (0, 1)]


def _commit(mergers, iteration, directory):
    for m in mergers:  # node 0's merger hears of the commit first, as in the trainer
        m.on_commit(iteration, directory)


def _until(mergers, cond, what, timeout=60.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"still waiting for {what}"
        for m in mergers:
            m.poll()
        time.sleep(0.05)


def _log_has(root, name, text):
    path = os.path.join(root, "merge_logs", f"{name}.log")
    return os.path.exists(path) and text in open(path).read()


def _same_tensors(directory, tensors):
    with UniversalCheckpoint(directory) as u:
        assert u.checksummed
        for key, t in tensors.items():
            assert torch.equal(u.read(_universal_name(key)), t), key


def test_a_worker_killed_on_node_0_commits_nothing_and_node_1_never_recreates(source, tmp_path,
                                                                             monkeypatch):
    """(A worker killed on node 1: the two-agent test below.)"""
    d, tensors = source
    root = str(tmp_path / "universal")
    previous = os.path.join(root, "iter_0000004")  # committed before, must stay
    write_universal(open_source(d), previous, max_file_bytes=4096)
    # Every part pauses after its first file, long enough to be stopped or killed there. Node
    # 1's worker is stopped (SIGSTOP) until node 0's worker is killed and node 0 has removed
    # the merge's directory: it then resumes into a directory that is gone (and must not
    # recreate it), however slowly each process reached its pause.
    monkeypatch.setenv("DATASTATES_FAULT_DELAY_MERGE", "5")
    lines = []
    mergers = _mergers(root, lines)
    coord, follower = mergers
    _commit(mergers, 5, d)
    _until(mergers, lambda: _log_has(root, "node-1-worker-0", "DATASTATES_FAULT"),
           "node 1's worker to write its first file")
    follower.workers[0].proc.send_signal(signal.SIGSTOP)
    _until(mergers, lambda: _log_has(root, "worker-0", "DATASTATES_FAULT"),
           "node 0's worker to write its first file")
    tmp = job_tmp(os.path.join(root, "iter_0000005"), "r1")
    assert os.path.isdir(tmp)
    coord.workers[0].proc.send_signal(signal.SIGKILL)
    try:
        _until(mergers, lambda: coord.running is None and not os.path.exists(tmp),
               "node 0 to give up the merge")
    finally:
        follower.workers[0].proc.send_signal(signal.SIGCONT)
    _until(mergers, lambda: follower.running is None, "node 1 to give up the merge")
    failed = [l for l in lines if "FAILED" in l]
    assert failed and failed[0].startswith("node0:") and "exited" in failed[0], lines
    assert any(l.startswith("node1:") and "No such file" in l for l in failed), lines
    assert not coord.results
    assert not os.path.exists(os.path.join(root, "iter_0000005")) and not os.path.exists(tmp)
    assert is_committed(previous)
    _same_tensors(previous, tensors)
    # The next merge starts the dead worker again and commits, with both nodes' parts. The
    # mergers' own reads and writes under the root (announcement, parts watched, announcements
    # looked for) are their files threads': the polling (training) thread makes none but a
    # restarted worker's log file.
    monkeypatch.delenv("DATASTATES_FAULT_DELAY_MERGE")
    with fs_calls.recording(root) as calls:
        _commit(mergers, 6, d)
        _until(mergers, lambda: coord.running is None, "the next merge", timeout=120)
    logs = os.path.join(root, "merge_logs")
    assert [c for c in calls.calls if not c[1].startswith(logs + os.sep) and c[1] != logs] == []
    assert calls.calls, "no file-system call seen at all: is the recording broken?"
    out = os.path.join(root, "iter_0000006")
    assert is_committed(out) and follower.parts_written == 1, lines
    assert coord.worker_starts == 2 and follower.worker_starts == 1
    assert not [n for n in os.listdir(out) if n.startswith(("PART", "JOB", "FAILED"))]
    _same_tensors(out, tensors)
    # Node 0 says it is done at exit; node 1 serves until then, then stops its workers.
    pids = [w.proc.pid for m in mergers for w in m.workers]
    coord.wait()
    follower.wait()
    assert not coord.workers and not follower.workers
    _wait_for(lambda: not any(_alive(pid) for pid in pids), "the workers to exit", timeout=10)


# -- the trainer on two torchrun agents acting as two nodes ---------------------------------------

def _merge_worker_of(node):
    import psutil

    for p in psutil.Process(node.proc.pid).children(recursive=True):
        if "datastates.megatron_adapter.merge.worker" in " ".join(p.cmdline()):
            return p
    raise AssertionError("no merge worker under node 1's agent")


def _args(save, iters):
    from trainer_launch import NO_DROPOUT, TINY_MODEL

    return TINY_MODEL + NO_DROPOUT + [
        "--eval-interval", "0", "--use-distributed-optimizer", "--train-iters", str(iters),
        "--save-interval", "2", "--async-lazy-save", "--save", str(save),
        "--universal-checkpoint-interval", "1", "--universal-merge-workers", "1"]


def test_two_agents_merge_in_parallel_and_a_killed_worker_on_node_1_commits_nothing(tmp_path):
    from trainer_launch import Node, free_port

    save = tmp_path / "save"
    args = _args(save, 4)
    port, logs = free_port(), tmp_path / "logs"
    logs.mkdir()
    # Node 1's worker pauses in its part of iteration 4's merge, after its first file.
    nodes = [Node(r, 2, 1, port, args, logs,
                  extra_env={"DATASTATES_FAULT_DELAY_MERGE": "120@4"} if r else None)
             for r in (0, 1)]
    try:
        root = save / "universal"
        log = root / "merge_logs" / "node-1-worker-0.log"
        deadline = time.time() + 150
        while not (log.exists() and "phase=merge step=4" in log.read_text()):
            assert time.time() < deadline and nodes[0].proc.poll() is None, \
                nodes[0].result().describe() + nodes[1].result().describe()
            time.sleep(0.2)
        _merge_worker_of(nodes[1]).kill()
        runs = [n.result(timeout=120) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert all(r.returncode == 0 for r in runs), runs[0].describe() + runs[1].describe()
    out = runs[0].stdout
    assert "universal merge iteration        2 | bytes" in out, out
    assert "universal merge iteration        4 | FAILED" in out and "node 1:" in out, out
    assert "node 1: parts of 1 worker(s) durable" in runs[1].stdout, runs[1].stdout
    # Iteration 2: both nodes' parts, committed, the same tensors as a merge in one process.
    merged = root / "iter_0000002"
    assert is_committed(str(merged)) and not (root / "iter_0000004").exists()
    assert not [n for n in os.listdir(root) if ".tmp-" in n], os.listdir(root)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    offline = str(tmp_path / "offline")
    write_universal(open_source(str(save / "iter_0000002")), offline)
    with UniversalCheckpoint(str(merged)) as u, UniversalCheckpoint(offline) as v:
        assert len(set(u.weight_map.values())) == 2  # one file per part
        assert sorted(u.weight_map) == sorted(v.weight_map)
        for name in v.weight_map:
            assert torch.equal(u.read(name), v.read(name)), name


def test_a_node_that_does_not_see_the_universal_root_leaves_the_merge_to_node_0(tmp_path):
    """Node 1's --universal-save is its own directory (as a node-local path would be): it would
    never find node 0's announcements, so node 0 merges alone, and says why."""
    from trainer_launch import Node, free_port

    save, elsewhere = tmp_path / "save", tmp_path / "node1_universal"
    port = free_port()
    nodes = [Node(r, 2, 1, port, _args(save, 2) + (["--universal-save", str(elsewhere)] if r
                                                   else []), tmp_path)
             for r in (0, 1)]
    runs = [n.result(timeout=150) for n in nodes]
    assert all(r.returncode == 0 for r in runs), runs[0].describe() + runs[1].describe()
    assert "universal merges run on node 0 only" in runs[0].stdout, runs[0].stdout
    assert "universal merge iteration        2 | bytes" in runs[0].stdout, runs[0].stdout
    root = save / "universal"
    assert is_committed(str(root / "iter_0000002")) and not elsewhere.exists()
    with UniversalCheckpoint(str(root / "iter_0000002")) as u:
        assert len(set(u.weight_map.values())) == 1  # one part: node 0's one worker
