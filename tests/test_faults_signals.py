"""Signals and exit with --async-lazy-save: SIGTERM during a flush, normal exit with a save in
flight, and a hung writer that is reported (not waited on forever).

The flush of one step is held by DATASTATES_FAULT_DELAY_FLUSH (datastates/faults.py), so each
scenario happens on every run, not only when the timing is unlucky.
"""
import json
import re

import psutil
import pytest

from crash_harness import stream_launch, verify_committed
from trainer_launch import NO_DROPOUT, TINY_MODEL, send_sigterm_to_tree

LAZY = ["--eval-interval", "0", "--async-lazy-save", "--save-interval", "1"]


def _errors(run):
    return [line for line in run.lines if line.startswith("pretrain_gpt.py: error:")]


def _tracked(root):
    return int(open(root / "latest_checkpointed_iteration.txt").read())


def test_sigterm_during_flush_commits_then_exits_zero(tmp_path):
    root = tmp_path / "ckpt"
    sent = []

    def on_line(line, proc):
        if not sent and line.startswith("DATASTATES_FAULT phase=flush step=2"):
            send_sigterm_to_tree(proc)  # the flush of iteration 2 is still in progress
            sent.append(True)

    run = stream_launch(1, TINY_MODEL + NO_DROPOUT + LAZY + [
        "--train-iters", "200", "--exit-signal-handler", "--save", str(root)],
        {"DATASTATES_FAULT_DELAY_FLUSH": "3@2"}, on_line=on_line)
    assert sent and run.returncode == 0, run.tail()
    assert any("exiting on SIGTERM" in line for line in run.lines)
    stopped = max(run.losses())
    assert 2 <= stopped < 200
    # The held flush and every later save, up to the iteration it stopped at, were committed.
    assert _tracked(root) == stopped
    for it in range(2, stopped + 1):
        assert (root / f"iter_{it:07d}" / "COMMIT.json").is_file(), it
    assert verify_committed(str(root)) == []


def test_normal_exit_completes_the_save_in_flight(tmp_path):
    root = tmp_path / "ckpt"
    run = stream_launch(1, TINY_MODEL + NO_DROPOUT + LAZY + ["--train-iters", "3", "--save",
                                                             str(root)],
                        {"DATASTATES_FAULT_DELAY_FLUSH": "3@3"})  # the last save still flushes
    assert run.returncode == 0, run.tail()
    # The fault line proves the exit really found the save in flight.
    assert any(line.startswith("DATASTATES_FAULT phase=flush step=3") for line in run.lines)
    assert _tracked(root) == 3
    events = [json.loads(x) for x in open(root / "datastates_checkpoints.jsonl")]
    assert [r["iteration"] for r in events if r["event"] == "checkpoint"] == [1, 2, 3]
    assert verify_committed(str(root)) == []


def test_hung_writer_is_reported_within_the_drain_timeout(tmp_path):
    root = tmp_path / "ckpt"
    run = stream_launch(1, TINY_MODEL + NO_DROPOUT + LAZY + [
        "--train-iters", "4", "--save", str(root), "--ckpt-drain-timeout", "5"],
        {"DATASTATES_FAULT_DELAY_FLUSH": "3600@2"}, timeout=180)  # a writer that never returns
    assert run.returncode == 2, run.tail()
    errors = _errors(run)
    assert len(errors) == 1, run.tail()
    for needle in ("timed out after 5 s", "save of step 2 is stuck", "hung", "rank 0",
                   "iter_0000002/shard_r00000.bin", "newest complete: iteration 1"):
        assert needle in errors[0], (needle, errors[0])
    assert _tracked(root) == 1
    assert not (root / "iter_0000002" / "COMMIT.json").exists()
    assert not (root / "iter_0000002" / "done_r00000.json").exists()
    assert verify_committed(str(root)) == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_hung_torch_dist_writer_is_reported_within_the_drain_timeout(tmp_path, mode):
    """The stock torch_dist save, rank 1's writer held for an hour at iteration 2. In megatron's
    execute_sync (sync) rank 0 would wait in its barrier until the training group's timeout (10
    minutes) and rank 1 for ever: a reference launch of the fault matrix once sat 240 s without a
    line after its last iteration (2026-12-07, under the suite's load; a forked writer process
    that cannot finish is the likely cause). With --async-save the writer is megatron's forked
    process, joined without a bound by its blocking finalize (the next save's, rank 1) while
    rank 0 waits in its all-reduce. Either wait is bounded by --ckpt-drain-timeout: every rank
    stops with one line naming rank 1 (with --async-save: the writer process killed, no orphan
    left); iteration 1 stays the newest complete checkpoint."""
    root = tmp_path / "ckpt"
    flags = ["--async-save"] if mode == "async" else []
    run = stream_launch(2, TINY_MODEL + NO_DROPOUT + flags + [
        "--eval-interval", "0", "--save-interval", "1", "--train-iters", "4", "--save",
        str(root), "--ckpt-drain-timeout", "5"],
        {"DATASTATES_FAULT_DELAY_FLUSH": "3600@2:1"}, timeout=180)
    assert run.returncode == 1, run.tail()  # torchrun's, for a rank that exited with 2
    errors = _errors(run)
    assert len(errors) == 1, run.tail()
    killed = ("it had started no writer process" if mode == "sync" else
              "megatron's --async-save writer process did not finish")
    for needle in ("saving iteration 2 failed on rank(s) [1]", "timed out after 5 s",
                   "--ckpt-drain-timeout", killed,
                   "the newest complete checkpoint is iteration 1"):
        assert needle in errors[0], (needle, errors[0])
    assert _tracked(root) == 1 and (root / "iter_0000001" / "metadata.json").is_file()
    assert not (root / "iter_0000002" / "metadata.json").exists()  # torch_dist's commit marker
    if mode == "async":
        pids = [int(p) for p in re.search(r"its processes \[([\d, ]+)\] were killed",
                                          errors[0]).group(1).split(",")]
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() !=
                       psutil.STATUS_ZOMBIE for p in pids), pids
