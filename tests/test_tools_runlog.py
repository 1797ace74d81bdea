"""tools/runlog.py and tools/slurm_results.py on the trainer's real output.

The logs in tests/trainer_logs/ are pretrain_gpt.py's stdout, unedited but for the --save
directory (a temporary one, renamed `/checkpoints/...`): the tiny model of tests/trainer_launch.py
on 2 gloo ranks, 3 iterations, `--save-interval 1`, one file per format (`torch`, `torch_dist`,
`torch_dist --async-save`, `--async-lazy-save`, and `--async-lazy-save --lazy-save-local-dir`);
`datastates_memory.log`: 4 iterations of `--async-lazy-save --save-interval 2
--non-persistent-ckpt-type in_memory --non-persistent-save-interval 1`. The two `*_timers.log`
come from the trainer of branch `tensorboard` (commit b416b93), which adds Megatron's `(min, max) time across ranks (ms):` report after every
save call. Regenerate them when the trainer's log lines change.
"""
import csv
import os
import subprocess
import sys

import pytest

from tools.runlog import csv_row, parse_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGS = os.path.join(ROOT, "tests", "trainer_logs")


def _figures(name):
    with open(os.path.join(LOGS, name), encoding="utf-8") as f:
        return parse_log(f)


# What each log prints, read off the files by eye: per-save blocking time (ms), whole-run blocked (s).
STOCK = {
    "torch.log": ([20.3, 14.2, 13.4], 0.048),
    "torch_dist.log": ([3242.1, 599.3, 174.3], 4.016),
    "torch_dist_async.log": ([258.4, 2284.5, 195.2], 3.085),
    # the timers line (slowest rank) stands for the save it follows
    "torch_dist_async_timers.log": ([1053.94, 1828.74, 102.44], 3.160),
}


@pytest.mark.parametrize("name", sorted(STOCK))
def test_stock_formats_give_one_save_time_per_checkpoint(name):
    fig = _figures(name)
    saves, blocked = STOCK[name]
    assert sorted(fig.iteration_ms) == [1, 2, 3] and fig.train_iters == 3
    assert sorted(set(fig.saved_iterations)) == [1, 2, 3] and not fig.commits
    assert fig.stall_ms() == pytest.approx(saves)
    assert fig.blocked_s == pytest.approx(blocked)
    assert fig.newest_checkpoint.endswith("/iter_0000003")


LAZY = {  # iteration -> (bytes, stall ms, durable s), and local durable s where the log has it
    "datastates_lazy.log": {1: (2662400, 21.4, 0.049), 2: (2662400, 25.9, 0.022), 3: (2662400, 16.5, 0.015)},
    "datastates_lazy_local.log": {1: (2662400, 37.5, 0.084), 2: (2662400, 24.4, 0.056),
                                  3: (2662400, 32.3, 0.027)},
    "datastates_lazy_timers.log": {1: (2662400, 77.7, 0.163), 2: (2662400, 38.8, 0.032),
                                   3: (2662400, 24.4, 0.019)},
}


@pytest.mark.parametrize("name", sorted(LAZY))
def test_lazy_saves_are_read_from_their_committed_lines(name):
    fig = _figures(name)
    assert sorted(set(fig.saved_iterations)) == [1, 2, 3]
    got = {c.iteration: (int(c.fields["bytes"]), c.fields["stall (ms)"], c.fields["durable (s)"])
           for c in fig.commits}
    assert got == LAZY[name]
    # The save-checkpoint timer covers the save call only; the committed line's stall also holds
    # the wait before the next optimizer step, so it is the figure per checkpoint.
    assert fig.stall_ms() == [s for _, s, _ in LAZY[name].values()]
    if name == "datastates_lazy_local.log":
        assert [c.fields["local durable (s)"] for c in fig.commits] == [0.048, 0.013, 0.017]
    row = csv_row(fig, variant="datastates_lazy")
    assert row["checkpoints_saved"] == 3 and row["checkpoint_bytes"] == 2662400
    stalls = [s for _, s, _ in LAZY[name].values()]
    assert float(row["mean_save_ms"]) == pytest.approx(sum(stalls) / 3, abs=1e-3)
    assert float(row["max_save_ms"]) == max(stalls)
    assert float(row["throughput_gbps"]) == pytest.approx(2662400 / (sum(stalls) / 3) / 1e6, abs=1e-3)
    assert float(row["mean_durable_s"]) == pytest.approx(sum(d for *_, d in LAZY[name].values()) / 3, abs=1e-3)


def test_levels_are_told_apart_by_their_directories():
    """The in-memory level (`datastates_memory.log`: every iteration into /dev/shm, --save every
    2, 4 iterations; both levels commit iteration 4): the persistent columns hold --save's lines
    alone, the others every level's."""
    fig = _figures("datastates_memory.log")
    assert [c.directory.rsplit("/", 1)[-1] for c in fig.commits] == [
        "iter_0000001", "iter_0000003", "iter_0000002", "iter_0000004", "iter_0000004"]
    assert [p["stall (ms)"] for p in fig.persistent()] == [16.2, 4.7]
    row = csv_row(fig, variant="datastates_memory")
    assert row["persistent_checkpoints"] == 2
    assert float(row["persistent_mean_save_ms"]) == pytest.approx((16.2 + 4.7) / 2, abs=1e-3)
    assert float(row["persistent_mean_durable_s"]) == pytest.approx((0.012 + 0.013) / 2, abs=1e-3)
    assert row["checkpoints_saved"] == 4  # iterations saved, on any level
    # Every level's lines, both of iteration 4 included.
    assert fig.stall_ms() == [6.5, 4.9, 16.2, 4.7, 0.0]
    assert float(row["mean_save_ms"]) == pytest.approx((6.5 + 4.9 + 16.2 + 4.7) / 5, abs=1e-3)
    # A run of one level: its lines are --save's.
    one = csv_row(_figures("datastates_lazy.log"))
    assert one["persistent_checkpoints"] == 3 and one["persistent_mean_save_ms"] == one["mean_save_ms"]


def test_megatron_lm_lines_and_the_launch_wrapper_line():
    # Upstream Megatron-LM's save line and timers report (their format, for logs of runs made with
    # Megatron-LM itself) and the line examples/slurm/common.sh writes after each launch.
    lines = ["  successfully saved checkpoint from iteration       2 to /x [ t 1/4, p 1/2 ]",
             "    save-checkpoint ...............: (10.00, 20.00)",
             "[run] tag=t rc=1 wall_seconds=12.250"]
    fig = parse_log(lines)
    assert fig.saved_iterations == [2] and fig.save_ms == [20.0]
    assert (fig.rc, fig.wall_seconds) == (1, 12.25)


def test_slurm_results_appends_rows_with_bytes_measured_on_disk(tmp_path):
    ckpt = tmp_path / "iter_0000003"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "a.distcp").write_bytes(b"x" * 1000)
    (ckpt / "sub" / "b").write_bytes(b"y" * 24)
    with open(os.path.join(LOGS, "torch_dist.log"), encoding="utf-8") as f:
        text = f.read().replace("/checkpoints/torch_dist/iter_0000003", str(ckpt))
    log = tmp_path / "run.log"
    log.write_text(text + "[run] tag=t rc=0 wall_seconds=30.500\n")
    out = tmp_path / "out" / "results.csv"
    for variant in ("torch_dist", "datastates_lazy"):
        src = str(log) if variant == "torch_dist" else os.path.join(LOGS, "datastates_lazy.log")
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "slurm_results.py"), "--csv", str(out),
                               "--log", src, "--experiment", "throughput", "--model", "tiny", "--dp", "2",
                               "--nodes", "2", "--variant", variant, "--iterations", "3", "--save-interval", "1"],
                              capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
        assert proc.returncode == 0, proc.stderr
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["variant"] for r in rows] == ["torch_dist", "datastates_lazy"]
    stock, lazy = rows
    assert (stock["rc"], stock["wall_seconds"], stock["checkpoints_saved"]) == ("0", "30.500", "3")
    assert stock["checkpoint_bytes"] == "1024" and stock["mean_durable_s"] == ""
    assert float(stock["mean_save_ms"]) == pytest.approx((3242.1 + 599.3 + 174.3) / 3, abs=1e-3)
    # the lazy log names a directory that is gone: its own bytes figure is used
    assert lazy["checkpoint_bytes"] == "2662400" and lazy["checkpoints_saved"] == "3"
    # A results.csv of another version's columns is refused by name, and left as it was.
    old = tmp_path / "old.csv"
    old.write_text("experiment,model,log\nthroughput,7B,x.log\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "slurm_results.py"), "--csv", str(old),
                           "--log", str(log), "--experiment", "throughput", "--model", "tiny", "--dp", "2",
                           "--nodes", "2", "--variant", "torch_dist", "--iterations", "3", "--save-interval", "1"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2 and "its columns are not this version's" in proc.stderr, proc.stderr
    assert old.read_text() == "experiment,model,log\nthroughput,7B,x.log\n"
