"""Megatron-LM's `global` non-persistent checkpoints (--non-persistent-save-interval,
--non-persistent-ckpt-type global): saved by the run's format into a second root that keeps only
its newest checkpoint, and resumed from when it is at least as new as --load's (~35 s, 4 launches).
"""
from __future__ import annotations

import os

from datastates.megatron_adapter import paths

from trainer_launch import TINY_MODEL, _kill_tree, after, launch

NON_PERSISTENT = ["--non-persistent-ckpt-type", "global"]


def _complete(root: str):
    return paths.complete_iterations(root)


def test_lazy_non_persistent_checkpoint_is_resumed_after_a_crash(tmp_path):
    """--async-lazy-save on 2 ranks: persistent saves every 5 iterations, non-persistent every
    2; the job is killed once non-persistent iteration 6 is committed. The non-persistent root
    then holds exactly its newest checkpoint, --load resumes from it (newer than --save's 5)
    and continues bit-exactly."""
    save = str(tmp_path / "ckpt")
    flags = TINY_MODEL + ["--save", save, "--save-interval", "5",
                          "--non-persistent-save-interval", "2", "--async-lazy-save",
                          "--lazy-save-cache-mb", "8"] + NON_PERSISTENT
    committed = os.path.join(save, "non_persistent", "iter_0000006")

    def kill_after_commit(line, proc):
        if line.rstrip().endswith(f"committed: {committed}"):
            _kill_tree(proc)

    first = launch(2, flags + ["--train-iters", "40"], on_line=kill_after_commit)
    assert f"committed: {committed}" in first.stdout, first.describe()
    assert "iteration       40/" not in first.stdout, "the run was not killed"
    root = os.path.join(save, "non_persistent")
    newest = paths.tracked_iteration(root)
    assert newest is not None and newest >= 6 and newest % 2 == 0, first.describe()
    assert _complete(root) == [newest]  # older non-persistent ones were removed
    assert paths.tracked_iteration(save) == 5 and 5 in _complete(save)
    assert not [it for it in _complete(save) if it % 5], "non-persistent saves went to --save"

    resumed = launch(2, flags + ["--load", save, "--train-iters", "40",
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
