"""Megatron-LM's non-persistent checkpoints (--non-persistent-save-interval): `global` ones are
saved by the run's format into a second root that keeps only its newest checkpoint; `local` ones
are DataStates versions that stay on each node's storage. Either is resumed from when it is at
least as new as --load's (~70 s: 4 launches, and 3 of two nodes).
"""
from __future__ import annotations

import json
import os
import shutil

from datastates import layout
from datastates.megatron_adapter import paths

from trainer_launch import TINY_MODEL, Node, _kill_tree, after, free_port, launch

NON_PERSISTENT = ["--non-persistent-ckpt-type", "global"]


def _complete(root: str):
    return paths.complete_iterations(root)


def test_lazy_non_persistent_checkpoint_is_resumed_after_a_crash(tmp_path):
    """--async-lazy-save on 2 ranks: persistent saves every 5 iterations, non-persistent every
    2; the job is killed once non-persistent iteration 6 is committed. The non-persistent root
    then holds its newest checkpoint (and the one before it only if the kill landed between a
    commit and its retention, the next one if it landed between a commit marker and its
    tracker), --load resumes from the tracker's (newer than --save's 5) and continues
    bit-exactly.

    Iteration 10's flush is held for a minute, so --save's newest stays 5 however late the
    kill lands: training is never held back by a commit, and on a loaded disk iteration 6's
    commit line once came after the 40th iteration."""
    save = str(tmp_path / "ckpt")
    flags = TINY_MODEL + ["--save", save, "--save-interval", "5",
                          "--non-persistent-save-interval", "2", "--async-lazy-save",
                          "--lazy-save-cache-mb", "8"] + NON_PERSISTENT
    committed = os.path.join(save, "non_persistent", "iter_0000006")

    def kill_after_commit(line, proc):
        if line.rstrip().endswith(f"committed: {committed}"):
            _kill_tree(proc)

    first = launch(2, flags + ["--train-iters", "100"], on_line=kill_after_commit,
                   extra_env={"DATASTATES_FAULT_DELAY_FLUSH": "60@10"})
    assert f"committed: {committed}" in first.stdout, first.describe()
    assert "final validation" not in first.stdout, f"the run was not killed: {first.describe()}"
    root = os.path.join(save, "non_persistent")
    newest = paths.tracked_iteration(root)
    assert newest is not None and newest >= 6 and newest % 2 == 0, first.describe()
    # Older non-persistent ones were removed (see above). A kill between a version's commit
    # marker and its tracker (seen under load) leaves that version committed too: the restart
    # resumes from the tracker's and sets it aside.
    complete = _complete(root)
    assert newest in complete and complete[-1] in (newest, newest + 2), (complete, newest)
    assert [it for it in complete if it < newest] in ([], [newest - 2]), (complete, newest)
    assert paths.tracked_iteration(save) == 5 and 5 in _complete(save)
    assert not [it for it in _complete(save) if it % 5], "non-persistent saves went to --save"

    resumed = launch(2, flags + ["--load", save, "--train-iters", "100",
                                 "--exit-interval", str(newest + 2)])
    assert resumed.returncode == 0, resumed.describe()
    assert (f"loading the non-persistent checkpoint of iteration {newest} from {root} "
            "(persistent: iteration 5)") in resumed.stdout
    printed_by_both = {it: v for it, v in after(resumed.losses(), newest).items()
                       if it in first.losses()}
    assert printed_by_both, (first.losses(), resumed.losses())
    assert printed_by_both == {it: first.losses()[it] for it in printed_by_both}


def test_torch_dist_non_persistent_root_keeps_its_newest_and_loses_to_a_newer_persistent(
        tmp_path):
    """torch_dist, 1 rank, --non-persistent-global-ckpt-dir: the second root keeps only its
    newest checkpoint, Megatron's `save-checkpoint-non-persistent` timer is printed, and --load
    prefers the persistent checkpoint when it is newer; with no persistent checkpoint the
    non-persistent one is loaded (the launch line of a job whose --load is still empty)."""
    save, np_root = str(tmp_path / "ckpt"), str(tmp_path / "np")
    flags = TINY_MODEL + NON_PERSISTENT + ["--non-persistent-global-ckpt-dir", np_root]
    first = launch(1, flags + ["--save", save, "--save-interval", "3",
                               "--non-persistent-save-interval", "2", "--train-iters", "5"])
    assert first.returncode == 0, first.describe()
    assert f"saved non-persistent checkpoint at iteration       4 to {np_root}" in first.stdout
    assert "save-checkpoint-non-persistent ..." in first.stdout
    assert _complete(np_root) == [4] and paths.tracked_iteration(np_root) == 4
    assert _complete(save) == [3, 5] and paths.tracked_iteration(save) == 5

    persistent = launch(1, flags + ["--load", save, "--train-iters", "5"])
    assert persistent.returncode == 0, persistent.describe()
    assert "is older than the persistent one (iteration 5)" in persistent.stdout
    assert f"loaded checkpoint {save}/iter_0000005" in persistent.stdout

    empty = launch(1, flags + ["--load", str(tmp_path / "nothing_yet"), "--train-iters", "5"])
    assert empty.returncode == 0, empty.describe()
    assert f"loaded checkpoint {np_root}/iter_0000004" in empty.stdout
    assert after(empty.losses(), 4) == after(first.losses(), 4)


def _two_nodes(args, logs, extra_env=None):
    port = free_port()
    logs.mkdir()
    return [Node(r, 2, 1, port, args, logs, extra_env) for r in (0, 1)]


def test_local_non_persistent_versions_stay_on_their_node_and_resume_on_every_node(tmp_path):
    """Two nodes (one rank each, DP2, distributed optimizer), --non-persistent-ckpt-type local
    every 2 iterations, persistent every 5; killed once node-local iteration 6 is committed.
    Each node's directory alone holds a loadable version (its rank's shards, replicas included,
    common.pt, metadata.json, a commit marker naming its rank) that never reached --save; both
    nodes resume from it bit-exactly. With one node's copy gone, --load's checkpoint is used."""
    save, local = tmp_path / "ckpt", tmp_path / "local"
    flags = TINY_MODEL + ["--use-distributed-optimizer", "--async-lazy-save",
                          "--lazy-save-cache-mb", "8", "--save", str(save), "--save-interval",
                          "5", "--non-persistent-save-interval", "2", "--non-persistent-ckpt-type",
                          "local", "--non-persistent-local-ckpt-dir", str(local / "node{node}"),
                          "--train-iters", "40"]
    # Held by fault points, however fast the run goes before the kill lands (on a loaded
    # machine both happened): the copy of iteration 10, so --save cannot move past 5; the commit
    # of node-local iteration 8, so neither node commits it (one node's commit thread could finish
    # it after the other node was killed, and its retention then drops 6: no version on every
    # node, and the resume rightly falls back to --save).
    first = _two_nodes(flags, tmp_path / "first", {"DATASTATES_FAULT_DELAY_COPY": "600@10",
                                                   "DATASTATES_FAULT_DELAY_COMMIT": "600@8"})
    first[0].wait_for_tracker(local / "node0", 6, timeout=240)
    for node in first:
        node.kill()
    runs = [n.result() for n in first]
    newest = paths.tracked_iteration(str(local / "node0"))
    assert newest is not None and newest >= 6, runs[0].describe()
    for rank in (0, 1):
        root = str(local / f"node{rank}")
        if paths.tracked_iteration(root) != newest:  # killed between the two nodes' commits
            newest = min(newest, paths.tracked_iteration(root))
        assert paths.complete_iterations(root)[-1:] == [paths.tracked_iteration(root)]
    for rank in (0, 1):
        directory = paths.checkpoint_dir(str(local / f"node{rank}"), newest)
        commit = json.loads(open(os.path.join(directory, layout.COMMIT_FILE)).read())
        assert commit["ranks"] == [rank] and commit["world_size"] == 2
        assert {"common.pt", "metadata.json", layout.rank_marker_file(rank)} <= set(
            os.listdir(directory))
        assert layout.rank_marker_file(1 - rank) not in os.listdir(directory)
    assert paths.tracked_iteration(str(save)) == 5
    assert [it for it in paths.complete_iterations(str(save)) if it % 5] == [], \
        "a node-local version reached --save"

    resumed = [n.result(timeout=240) for n in _two_nodes(
        flags + ["--load", str(save), "--exit-interval", str(newest + 1)], tmp_path / "second")]
    assert all(r.returncode == 0 for r in resumed), resumed[0].describe() + resumed[1].describe()
    assert (f"loading the non-persistent checkpoint of iteration {newest} from "
            f"{local / 'node0'} (persistent: iteration 5)") in resumed[0].stdout
    # The last rank prints the losses (node 1's).
    both = {it: v for it, v in after(resumed[1].losses(), newest).items()
            if it in runs[1].losses()}
    assert both and both == {it: runs[1].losses()[it] for it in both}

    # Node 1's storage is lost: the node-local version is no longer on every node.
    shutil.rmtree(local / "node1")
    fallback = [n.result(timeout=240) for n in _two_nodes(
        flags + ["--load", str(save), "--exit-interval", str(newest + 3)], tmp_path / "third")]
    assert all(r.returncode == 0 for r in fallback), fallback[0].describe()
    assert "rank(s) [1] do not hold the newest one on their node" in fallback[0].stdout
    assert f"loaded checkpoint {save}/iter_{newest + 1:07d}" in fallback[0].stdout
