"""The Slurm examples on a real Slurm: scripts/local_slurm.sh starts Debian's slurm-wlm on this
machine (two slurmd acting as two nodes with 4 fake GPUs each), every example is submitted with
sbatch at the tiny CPU configuration, and what the jobs leave behind is checked: committed
checkpoints of every variant and results.csv rows with real figures parsed from the trainer's log.

Each job asks for `--gpus-per-node=1`, so the scripts take one rank per node from Slurm's own
setting (two torchrun agents on two nodes, DP=2, gloo). About 3 minutes on 2 cores.
"""
import csv
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM = os.path.join(ROOT, "examples", "slurm")
LOCAL_SLURM = os.path.join(ROOT, "scripts", "local_slurm.sh")
JOB_TIMEOUT_S = 420


def _why_not():
    if shutil.which("sbatch") and shutil.which("slurmctld") and shutil.which("munged"):
        return None if os.geteuid() == 0 else "a local Slurm runs its daemons as root; not root here"
    if os.geteuid() != 0:
        return "slurm-wlm is not installed and installing it needs root"
    if not shutil.which("apt-get"):
        return "slurm-wlm is not installed and there is no apt-get to install it"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


@pytest.fixture(scope="module")
def cluster():
    # Under /tmp, not pytest's tmp_path: munged runs as the munge user and must reach its socket.
    directory = tempfile.mkdtemp(prefix="local_slurm.")
    proc = subprocess.run(["bash", LOCAL_SLURM, "start", directory, "4"], capture_output=True, text=True,
                          timeout=300)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"export SLURM_CONF={directory}/slurm.conf" in proc.stdout
        yield {**os.environ, "SLURM_CONF": os.path.join(directory, "slurm.conf")}
    finally:
        subprocess.run(["bash", LOCAL_SLURM, "stop", directory], capture_output=True, timeout=120)
        shutil.rmtree(directory, ignore_errors=True)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _submit(env, script, args, nodes, **knobs):
    out = os.path.join(env["RESULTS_DIR"], f"{script}-%j.out")
    proc = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", "--gpus-per-node=1", "--output", out,
                           os.path.join(SLURM, script), *args],
                          env={**env, **knobs}, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _wait(env, job_ids):
    """JobState and ExitCode of each job once none is pending or running."""
    deadline = time.time() + JOB_TIMEOUT_S
    states = {}
    while time.time() < deadline:
        for job in job_ids:
            out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True,
                                 text=True).stdout
            fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
            states[job] = (fields.get("JobState"), fields.get("ExitCode"))
        if all(s not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", None) for s, _ in states.values()):
            return states
        time.sleep(2)
    subprocess.run(["scancel", *job_ids], env=env)
    pytest.fail(f"jobs still running after {JOB_TIMEOUT_S} s: {states}")


def _job_output(env, script):
    paths = [os.path.join(env["RESULTS_DIR"], f) for f in os.listdir(env["RESULTS_DIR"]) if f.startswith(script)]
    return "\n".join(open(p, encoding="utf-8", errors="replace").read() for p in paths)


def test_every_example_runs_on_a_real_slurm_and_records_real_figures(cluster, tmp_path):
    from datastates.megatron_adapter import paths

    env = {**cluster, "REPO": ROOT, "PYTHON": sys.executable, "PYTHONWARNINGS": "ignore",
           "RESULTS_DIR": str(tmp_path / "results"), "CKPT_ROOT": str(tmp_path / "ckpt"), "KEEP_CHECKPOINTS": "1",
           "MASTER_PORT": str(_free_port())}  # the jobs run one after another: one port serves them all
    os.makedirs(env["RESULTS_DIR"])
    t0 = time.time()
    jobs = {
        # the lazy cache sized by the dry run; the other two variants are the same scripts with
        # other trainer flags (torch_dist's sync save runs in the trainer's own tests)
        _submit(env, "throughput.sbatch", ["tiny", "2"], nodes=2,
                ONLY_VARIANTS="torch datastates_lazy"): "throughput.sbatch",
        # beyond the paper: an in-memory version every 2 iterations, --save every 20 (here: the
        # end of training only)
        _submit(env, "end_to_end.sbatch", ["tiny"], nodes=1, ITERATIONS="4", SAVE_INTERVALS="2",
                ONLY_VARIANTS="datastates_memory", LAZY_CACHE_MB="64"): "end_to_end.sbatch",
        _submit(env, "dp_scaling.sbatch", ["tiny", "2"], nodes=2, ONLY_VARIANTS="torch_dist_async"): "dp_scaling.sbatch",
    }
    states = _wait(env, list(jobs))
    elapsed = time.time() - t0
    for job, script in jobs.items():
        assert states[job] == ("COMPLETED", "0:0"), (script, states[job], _job_output(env, script)[-3000:])

    with open(tmp_path / "results" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    got = sorted((r["experiment"], r["variant"], r["dp"], r["nodes"], r["save_interval"]) for r in rows)
    assert got == sorted([("throughput", v, "2", "2", "1") for v in ("torch", "datastates_lazy")]
                         + [("end_to_end", "datastates_memory", "1", "1", "2"),
                            ("dp_scaling", "torch_dist_async", "2", "2", "1")]), got
    for row in rows:
        what = (row["experiment"], row["variant"])
        iterations, interval = int(row["iterations"]), int(row["save_interval"])
        assert row["rc"] == "0" and int(row["iterations_logged"]) == iterations, (what, row)
        assert int(row["checkpoints_saved"]) == iterations // interval, (what, row)
        assert float(row["mean_save_ms"]) > 0 and float(row["max_save_ms"]) >= float(row["mean_save_ms"]), (what, row)
        assert int(row["checkpoint_bytes"]) > 0 and float(row["throughput_gbps"]) > 0, (what, row)
        assert float(row["blocked_by_checkpointing_s"]) > 0, (what, row)
        lazy = row["variant"] in ("datastates_lazy", "datastates_memory")
        if lazy:
            assert float(row["mean_durable_s"]) > 0, row
            # --save's own: every iteration saved, or (in memory) the end of training only
            assert row["persistent_checkpoints"] == ("1" if row["variant"] == "datastates_memory"
                                                     else row["checkpoints_saved"]), row
        with open(row["log"], encoding="utf-8") as f:
            log = f.read()
        # The knobs reach the trainer (no paper settings followed by overrides), and the ranks of
        # both nodes met in one job.
        assert log.count(" args: --num-layers 4 --hidden-size 64 ") == 1, log[:2000]
        dp = int(row["dp"])
        assert f"(TP 1, PP 1, DP {dp}), backend gloo" in log, log[-3000:]
        if lazy:
            assert "--lazy-save-cache-mb 64" in log, log[:2000]

        # Every checkpoint of the run is complete on disk (kept with KEEP_CHECKPOINTS=1).
        root = log.split("--save ", 1)[1].split()[0]
        saved = list(range(interval, iterations + 1, interval))
        if row["variant"] == "datastates_memory":  # in memory, then given back at the end
            assert re.search(r"committed: /\S+/in_memory/node0/iter_0000002\n", log), log[-3000:]
            assert "in-memory checkpoints: removed iteration(s) [4] from " in log, log[-3000:]
            saved = [iterations]  # --save: the end of training only
        if row["variant"] == "torch":  # no metadata.json: one file per model-parallel rank
            assert [os.path.isfile(os.path.join(paths.checkpoint_dir(root, it), "mp_rank_00", "model_optim_rng.pt"))
                    for it in saved] == [True] * len(saved), (what, os.listdir(root))
        else:
            assert paths.complete_iterations(root) == saved, (what, root)
        assert paths.read_tracker(root) == iterations
    # The throughput job sized the lazy cache from its dry run (tiny: one 64 MiB step).
    assert "lazy cache per rank: 64 MiB (the largest rank's checkpoint" in _job_output(env, "throughput.sbatch")
    print(f"3 jobs, 6 runs on a local Slurm: {elapsed:.0f} s")


def test_train_restarts_a_crashed_step_on_the_same_nodes_from_memory(cluster, tmp_path):
    """examples/slurm/train.sbatch on two nodes: a rank is SIGKILLed in the first attempt, after
    --save's iteration 20; the script starts the step again on the same nodes, which resumes from
    the in-memory level (newer than --save's) and prints the killed attempt's losses bit for
    bit; after the clean end no shared memory of the run is left on either node."""
    import psutil

    from datastates.megatron_adapter import paths

    env = {**cluster, "REPO": ROOT, "PYTHON": sys.executable, "PYTHONWARNINGS": "ignore",
           "RESULTS_DIR": str(tmp_path / "results"), "CKPT_ROOT": str(tmp_path / "ckpt"),
           "MASTER_PORT": str(_free_port()), "LAZY_CACHE_MB": "64"}
    os.makedirs(env["RESULTS_DIR"])
    job = _submit(env, "train.sbatch", ["tiny", "2"], nodes=2, ITERATIONS="100", SAVE_EVERY="10",
                  MAX_RESTARTS="1")
    ckpt = str(tmp_path / "ckpt" / "train_tiny_dp2")
    first_log = tmp_path / "results" / f"train_tiny_dp2_{job}_attempt1.log"
    step = re.compile(r" iteration\s+(\d+)/\s*100 \|")
    deadline, killed_after = time.time() + JOB_TIMEOUT_S, None
    while killed_after is None and time.time() < deadline:
        printed = [int(m) for m in step.findall(first_log.read_text())] if first_log.exists() else []
        if printed and printed[-1] >= 33 and (paths.tracked_iteration(ckpt) or 0) >= 20:
            ranks = [p for p in psutil.process_iter(["cmdline"])
                     if "pretrain_gpt.py" in " ".join(p.info["cmdline"] or [])
                     and ckpt in (p.info["cmdline"] or []) and "torch.distributed.run" not in
                     " ".join(p.info["cmdline"])]
            assert len(ranks) == 2, [p.info["cmdline"] for p in ranks]
            ranks[-1].kill()
            killed_after = printed[-1]
        time.sleep(0.2)
    assert killed_after is not None, "the first attempt never reached iteration 33 with --save's 20"
    states = _wait(env, [job])
    out = _job_output(env, "train.sbatch")
    assert states[job] == ("COMPLETED", "0:0"), (states[job], out[-3000:])
    assert "attempt 1 failed; restarting on the same nodes (1 restart(s) left)" in out, out[-3000:]
    first = first_log.read_text()
    second = (tmp_path / "results" / f"train_tiny_dp2_{job}_attempt2.log").read_text()
    loaded = re.search(r"loading the in-memory checkpoint of iteration (\d+) from (\S+) "
                       r"\(persistent: iteration (\d+)\)", second)
    assert loaded, second[-3000:]
    newest, persistent = int(loaded.group(1)), int(loaded.group(3))
    assert persistent >= 20 and newest > persistent and newest >= killed_after - 5, \
        (newest, persistent, killed_after)
    # The losses both attempts printed (the first printed past its newest in-memory version).
    losses = [{int(m.group(1)): m.group(2) for m in re.finditer(
        r" iteration\s+(\d+)/\s*100 \|.*? lm loss: (\S+) \|", log)} for log in (first, second)]
    both = sorted(set(losses[0]) & set(losses[1]))
    assert all(losses[0][i] == losses[1][i] for i in both), (newest, losses[0], losses[1])
    assert both or max(losses[0]) <= newest, (newest, losses[0], losses[1])
    assert sorted(losses[1]) == list(range(newest + 1, 101))
    assert "in-memory checkpoints: removed iteration(s)" in second, second[-3000:]
    assert paths.read_tracker(ckpt) == 100
    # The clean end gave the memory back; the script's check on each node finds nothing.
    assert out.count(f"no shared memory held for --save {ckpt}") == 2, out[-3000:]
    print(f"killed a rank after iteration {killed_after}; the restart resumed from memory's "
          f"iteration {newest} (--save's: {persistent})")
