"""Slurm examples: syntax, the launch they perform (with srun stubbed), results.csv, and that every
flag they pass is one pretrain_gpt.py's parser knows."""
import csv
import os
import stat
import subprocess
import sys

import pytest

from tools.runlog import parse_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM = os.path.join(ROOT, "examples", "slurm")
SCRIPTS = sorted(f for f in os.listdir(SLURM) if f.endswith((".sh", ".sbatch")))
MODELS = {"3B": 1, "7B": 2, "13B": 4, "30B": 8, "70B": 20}
VARIANTS = ("torch", "torch_dist", "torch_dist_async", "datastates_lazy")

FAKE_SRUN = r"""#!/usr/bin/env bash
# Records its arguments and prints what pretrain_gpt.py would log.
printf '%s\0' "$@" >> "$STUB_DIR/srun_calls"
printf '\n' >> "$STUB_DIR/srun_calls"
iters=0; interval=0; prev=""
for a in "$@"; do
  [ "$prev" = "--train-iters" ] && iters=$a
  [ "$prev" = "--save-interval" ] && interval=$a
  prev=$a
done
for i in $(seq 1 "$iters"); do
  echo " [2026-01-01 00:00:00] iteration $i/ $iters | consumed samples: $((16 * i)) | elapsed time per iteration (ms): $((1000 + 10 * i)).0 | learning rate: 1.000000E-04 | lm loss: 1.050000E+01 | grad norm: 1.000 |"
  if [ $((i % interval)) -eq 0 ]; then
    echo "  successfully saved checkpoint from iteration $i to /ckpt [ t 1/4, p 1/2 ]"
    echo "    save-checkpoint ................................: (250.00, 300.00)"
  fi
done
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse_with_bash_n(script):
    proc = subprocess.run(["bash", "-n", os.path.join(SLURM, script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _stub_env(tmp_path, nodes):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"srun": FAKE_SRUN,
                       "scontrol": "#!/usr/bin/env bash\nprintf 'node%03d\\n' 1 2 3\n"}.items():
        path = bin_dir / name
        path.write_text(body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_DIR": str(tmp_path),
            "REPO": ROOT, "PYTHON": sys.executable, "RESULTS_DIR": str(tmp_path / "results"),
            "CKPT_ROOT": str(tmp_path / "ckpt"), "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_ID": "42",
            "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_SUBMIT_DIR": ROOT}


def _srun_calls(tmp_path):
    raw = (tmp_path / "srun_calls").read_bytes().decode()
    return [call.strip("\n").split("\0")[:-1] for call in raw.split("\0\n") if call.strip("\n")]


def test_throughput_script_launches_every_variant_and_collects_a_csv(tmp_path):
    env = _stub_env(tmp_path, nodes=2)
    proc = subprocess.run(["bash", os.path.join(SLURM, "throughput.sbatch"), "7B"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = _srun_calls(tmp_path)
    assert len(calls) == 4
    for call in calls:
        launcher = call[call.index("torch.distributed.run") + 1:call.index(os.path.join(ROOT, "pretrain_gpt.py"))]
        assert launcher == ["--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", "node001:29500", "--rdzv-id", launcher[-1]]
        args = call[call.index(os.path.join(ROOT, "pretrain_gpt.py")) + 1:]
        flat = " ".join(args)
        assert "--num-layers 32 --hidden-size 4096 --num-attention-heads 32" in flat
        assert "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2" in flat
        assert "--micro-batch-size 16 --global-batch-size 16 --train-iters 5" in flat
        assert "--seq-length 2048" in flat and "--save-interval 1" in flat
    variants = [" ".join(c[c.index("--save-interval") + 2:c.index("--log-interval")]) for c in calls]
    assert variants == ["--ckpt-format torch", "--ckpt-format torch_dist", "--ckpt-format torch_dist --async-save",
                        "--async-lazy-save"]
    with open(tmp_path / "results" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["variant"] for r in rows] == list(VARIANTS)
    for row in rows:
        assert (row["experiment"], row["model"], row["dp"], row["nodes"]) == ("throughput", "7B", "1", "2")
        assert row["rc"] == "0" and row["iterations_logged"] == "5" and row["checkpoints_saved"] == "5"
        assert float(row["mean_iteration_ms"]) == pytest.approx(1030.0)
        assert float(row["mean_iteration_ms_after_first"]) == pytest.approx(1035.0)
        assert float(row["max_save_ms"]) == pytest.approx(300.0)


def test_end_to_end_runs_both_intervals_and_scaling_checks_node_count(tmp_path):
    env = _stub_env(tmp_path, nodes=1)
    proc = subprocess.run(["bash", os.path.join(SLURM, "end_to_end.sbatch"), "3B"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "results" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["save_interval"], r["checkpoints_saved"]) for r in rows] == [("10", "5")] * 4 + [("1", "50")] * 4
    # 13B at DP=4 needs 16 nodes: the job refuses a wrong allocation before launching anything.
    os.makedirs(tmp_path / "x")
    proc = subprocess.run(["bash", os.path.join(SLURM, "dp_scaling.sbatch"), "13B", "4"],
                          env=_stub_env(tmp_path / "x", 8), capture_output=True, text=True)
    assert proc.returncode == 2 and "needs 16 nodes" in proc.stderr
    proc = subprocess.run(["bash", os.path.join(SLURM, "dp_scaling.sbatch"), "7B", "2"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "13B or 30B" in proc.stderr


def test_submit_all_covers_the_paper_matrix():
    proc = subprocess.run(["bash", os.path.join(SLURM, "submit_all.sh"), "--dry-run"],
                          env={**os.environ, "ACCOUNT": "acct", "PARTITION": "gpu"}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    jobs = [(l.split()[-2].rsplit("/", 1)[-1], l.split()[-1] if "dp_scaling" not in l else tuple(l.split()[-2:]),
             l.split()[l.split().index("--nodes") + 1]) for l in lines]
    assert len(lines) == 2 * 5 + 2 * 5
    assert ("throughput.sbatch", "70B", "20") in jobs and ("end_to_end.sbatch", "30B", "8") in jobs
    assert any(l.endswith("dp_scaling.sbatch 30B 16") and "--nodes 128" in l for l in lines)


def _launch_args(model, variant, dp=1, iters=5, interval=1):
    script = (f'source "{SLURM}/common.sh"; build_args {model} {dp} {iters} {interval} {variant} /ckpt; '
              'printf "%s\\0" "${ARGS[@]}"')
    proc = subprocess.run(["bash", "-c", script], capture_output=True, env={**os.environ, "REPO": ROOT})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.decode().split("\0")[:-1]


def test_runlog_parses_megatron_lines_and_our_checkpoint_lines():
    lines = [" iteration        1/      50 | consumed samples: 16 | elapsed time per iteration (ms): 5000.5 | lm loss",
             " iteration        2/      50 | elapsed time per iteration (ms): 4000.0 |",
             "  successfully saved checkpoint from iteration       2 to /x [ t 1/4, p 1/2 ]",
             "[rank0] checkpoint iteration 2: blocking time (ms): 12.5 | bytes: 100",
             "    save-checkpoint ...............: (10.00, 20.00)",
             "saved checkpoint at iteration       4 to /tmp/ck in 53.5 ms (format torch_dist, async)",
             " validation loss at iteration 4 | lm loss value: 5.376557E+00 |",
             "[run] tag=t rc=1 wall_seconds=12.250"]
    fig = parse_log(lines)
    assert fig.iteration_ms == {1: 5000.5, 2: 4000.0} and fig.train_iters == 50
    assert fig.saved_iterations == [2, 4] and fig.save_ms == [12.5, 20.0, 53.5]
    assert (fig.rc, fig.wall_seconds) == (1, 12.25)
    # Our trainer prints Megatron's timers report after its own save line: one save, one time
    # (the slowest rank's), not two.
    ours = ["saved checkpoint at iteration       2 to /tmp/ck in 40.0 ms (format torch_dist)",
            "(min, max) time across ranks (ms):",
            "    save-checkpoint ................................: (38.00, 41.50)",
            " iteration        3/      50 | elapsed time per iteration (ms): 100.0 |",
            "(min, max) time across ranks (ms):",
            "    save-checkpoint ................................: (8.00, 9.50)"]
    fig = parse_log(ours)
    assert fig.saved_iterations == [2] and fig.save_ms == [41.5, 9.5]



def _parse_with_world(argv, world_size):
    """pretrain_gpt.py's own parser and checks, at the world size the Slurm job would have."""
    try:
        from megatron.training.arguments import build_run_config, parse_args
    except ImportError as error:
        pytest.skip(f"megatron.training.arguments not available yet (trainer branch): {error}")
    return build_run_config(parse_args(argv), world_size=world_size)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_flags_exist_in_pretrain_gpt_parser(model, variant):
    argv = _launch_args(model, variant)
    config = _parse_with_world(argv, world_size=4 * MODELS[model])
    assert config.parallel.pipeline_model_parallel_size == MODELS[model]
    assert sum(config.parallel.stage_layers(config.model.num_layers)) == config.model.num_layers
    assert config.parallel.data_parallel_size == 1 and config.model.seq_length == 2048


def test_dry_run_mode_checks_each_launch_without_srun(tmp_path):
    # One variant keeps this to one megatron import; the others differ only in checkpoint flags.
    env = {**_stub_env(tmp_path, nodes=2), "DRY_RUN": "1", "PYTHONWARNINGS": "ignore", "ONLY_VARIANTS": "torch_dist"}
    env["PATH"] = env["PATH"].split(":", 1)[1]  # no srun stub: a dry run must not need it
    proc = subprocess.run(["bash", os.path.join(SLURM, "throughput.sbatch"), "7B"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("== dry run: throughput_7B_dp1_every1_") == 1
    assert "layer split per stage: [16, 16]  (TP=4, DP=1" in proc.stdout
    assert not (tmp_path / "results" / "results.csv").exists()
    env["ONLY_VARIANTS"] = "torch fast"
    proc = subprocess.run(["bash", os.path.join(SLURM, "throughput.sbatch"), "7B"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown variant 'fast'" in proc.stderr
