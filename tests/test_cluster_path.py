"""The path our users run on GPU clusters, checked on CPU: NCCL's rules for collectives, the
node-local tier, two nodes on one machine, and a lazy save that overlaps the next step."""
import json
import os
import subprocess
import sys

from trainer_launch import NO_DROPOUT, REPO, TINY_MODEL, launch

LAZY = ["--async-lazy-save", "--save-interval", "1"]
NCCL_LIKE = str(REPO / "tests" / "nccl_like.py")


def _checked_counts(stdout):
    return [int(line.split("checked=")[1]) for line in stdout.splitlines()
            if line.startswith("NCCL-LIKE")]


def test_checkpoint_collectives_run_where_nccl_would_accept_them(tmp_path):
    """Collectives on non-gloo groups refuse CPU tensors (tests/nccl_like.py): a lazy save with
    commit, then a verified resume (--ckpt-fallback-to-previous) that saves as torch_dist."""
    lazy, dist_root = tmp_path / "lazy", tmp_path / "dist"
    args = TINY_MODEL + NO_DROPOUT + ["--eval-interval", "0", "--use-distributed-optimizer"]
    first = launch(2, args + LAZY + ["--train-iters", "4", "--exit-interval", "3",
                                      "--save", str(lazy)],
                   entry=NCCL_LIKE)
    assert first.returncode == 0, first.describe()
    assert (lazy / "iter_0000003" / "COMMIT.json").is_file()
    counts = _checked_counts(first.stdout)
    assert len(counts) == 2 and min(counts) > 0, first.stdout[-2000:]
    resumed = launch(2, args + ["--train-iters", "4", "--load", str(lazy), "--save",
                                str(dist_root), "--save-interval", "1",
                                "--ckpt-fallback-to-previous"], entry=NCCL_LIKE)
    assert resumed.returncode == 0, resumed.describe()
    assert " iteration        4/" in resumed.stdout
    assert (dist_root / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert min(_checked_counts(resumed.stdout)) > 0
