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
