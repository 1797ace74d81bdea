"""Slurm examples without a Slurm: what tests/test_slurm_real.py cannot cover with its tiny CPU jobs.
The paper-sized launches (with srun stubbed: it records its arguments and replays a real trainer
log), layouts at other GPU counts, the job's refusals, submit_all.sh against a stub sbatch, the dry
run as documented, and that every flag the scripts pass is one pretrain_gpt.py's parser knows."""
import csv
import os
import stat
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM = os.path.join(ROOT, "examples", "slurm")
SCRIPTS = sorted(f for f in os.listdir(SLURM) if f.endswith((".sh", ".sbatch")))
MODELS = {"3B": 1, "7B": 2, "13B": 4, "30B": 8, "70B": 20}
VARIANTS = ("torch", "torch_dist", "torch_dist_async", "datastates_lazy")

# Records its arguments and prints a real log of the trainer for the variant it was given
# (tests/trainer_logs/: 3 iterations, a checkpoint after each, whatever --train-iters says).
FAKE_SRUN = r"""#!/usr/bin/env bash
printf '%s\0' "$@" >> "$STUB_DIR/srun_calls"
printf '\n' >> "$STUB_DIR/srun_calls"
log=torch_dist
case " $* " in
  *" --async-lazy-save "*) log=datastates_lazy ;;
  *" --async-save "*) log=torch_dist_async ;;
  *" --ckpt-format torch "*) log=torch ;;
esac
cat "$TRAINER_LOGS/$log.log"
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
            "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_SUBMIT_DIR": ROOT, "SLURM_CPUS_ON_NODE": "64",
            "TRAINER_LOGS": os.path.join(ROOT, "tests", "trainer_logs"), "LAZY_CACHE_MB": "12000"}


def _srun_calls(tmp_path):
    raw = (tmp_path / "srun_calls").read_bytes().decode()
    return [call.strip("\n").split("\0") for call in raw.split("\0\n") if call.strip("\n")]


def test_throughput_script_launches_every_variant_and_collects_a_csv(tmp_path):
    env = _stub_env(tmp_path, nodes=2)
    proc = subprocess.run(["bash", os.path.join(SLURM, "throughput.sbatch"), "7B"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = _srun_calls(tmp_path)
    assert len(calls) == 4
    entry = os.path.join(ROOT, "pretrain_gpt.py")
    for call in calls:
        assert call[:call.index(sys.executable)] == ["--nodes", "2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                                                     "--cpus-per-task=64"]
        launcher = call[call.index("torch.distributed.run") + 1:call.index(entry)]
        assert launcher == ["--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", "node001:29500", "--rdzv-id", launcher[-1]]
        flat = " ".join(call[call.index(entry) + 1:])
        # Llama-2 7B (tools/scale/architecture.py), sized for 40 GB with SP and selective recompute.
        assert flat.startswith("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 "
                               "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
                               "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
                               "--seq-length 2048 --max-position-embeddings 2048 "
                               "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 "
                               "--use-distributed-optimizer --sequence-parallel --recompute-granularity selective ")
        assert "--micro-batch-size 16 --global-batch-size 16 --train-iters 5" in flat and "--bf16" in flat
        assert "--mock-data --tokenizer-type NullTokenizer --vocab-size 31999" in flat
    variants = [" ".join(c[c.index("--save-interval") + 2:c.index("--log-interval")]) for c in calls]
    assert variants == ["--ckpt-format torch", "--ckpt-format torch_dist", "--ckpt-format torch_dist --async-save",
                        "--async-lazy-save --lazy-save-cache-mb 12000"]
    with open(tmp_path / "results" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["variant"] for r in rows] == list(VARIANTS)
    for row in rows:  # the figures of the replayed logs (tests/test_tools_runlog.py checks them exactly)
        assert (row["experiment"], row["model"], row["dp"], row["nodes"]) == ("throughput", "7B", "1", "2")
        assert row["rc"] == "0" and row["iterations_logged"] == "3" and row["checkpoints_saved"] == "3"
        assert float(row["mean_save_ms"]) > 0


def test_knobs_set_the_layout_and_gpus_per_node_follows_sbatch(tmp_path):
    # sbatch --gpus-per-node=8: 7B (TP4 x PP2) fits one node; the global batch follows DP, not the node count.
    env = {**_stub_env(tmp_path, nodes=1), "SLURM_GPUS_PER_NODE": "a100:8"}
    proc = subprocess.run(["bash", os.path.join(SLURM, "throughput.sbatch"), "7B"], env={**env, "ONLY_VARIANTS": "torch"},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (call,) = _srun_calls(tmp_path)
    flat = " ".join(call)
    assert "--nodes 1 " in flat and "--nnodes 1 --nproc-per-node 8 " in flat and "--global-batch-size 16 " in flat
    # The knobs replace the paper's values in place: 13B at TP2 x PP2 x DP2 on one node of 8 GPUs.
    knobs = {"TP": "2", "PP": "2", "MICRO_BATCH": "4", "GLOBAL_BATCH": "64", "SEQ_LENGTH": "1024",
             "ITERATIONS": "7", "SAVE_INTERVALS": "3", "PRECISION": "fp32", "ONLY_VARIANTS": "datastates_lazy",
             "SLURM_GPUS_PER_NODE": "8"}
    os.makedirs(tmp_path / "k")
    proc = subprocess.run(["bash", os.path.join(SLURM, "end_to_end.sbatch"), "13B", "2"],
                          env={**_stub_env(tmp_path / "k", nodes=1), **knobs}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (call,) = _srun_calls(tmp_path / "k")
    flat = " ".join(call)
    assert "--nnodes 1 --nproc-per-node 8 " in flat
    assert ("--seq-length 1024 --max-position-embeddings 1024 --tensor-model-parallel-size 2 "
            "--pipeline-model-parallel-size 2 --use-distributed-optimizer --sequence-parallel "
            "--recompute-granularity selective --micro-batch-size 4 "
            "--global-batch-size 64 --train-iters 7 --seed 1234") in flat
    # Sequence parallelism only where there is a TP group to split over (the trainer refuses TP=1).
    os.makedirs(tmp_path / "tp1")
    proc = subprocess.run(["bash", os.path.join(SLURM, "end_to_end.sbatch"), "3B", "4"],
                          env={**_stub_env(tmp_path / "tp1", nodes=1), **knobs, "TP": "1", "PP": "1"},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (call,) = _srun_calls(tmp_path / "tp1")
    flat = " ".join(call)
    assert "--sequence-parallel" not in flat and "--use-distributed-optimizer --recompute-granularity selective " in flat
    assert "--bf16" not in flat and "--save-interval 3 --async-lazy-save" in flat
    # A layout that splits a TP group over two nodes is refused with what to change.
    proc = subprocess.run(["bash", os.path.join(SLURM, "throughput.sbatch"), "3B", "3"],
                          env={**env, "GPUS_PER_NODE": "8"}, capture_output=True, text=True)
    assert proc.returncode == 2 and "whole TP groups" in proc.stderr, proc.stderr


def test_end_to_end_runs_both_intervals_and_scaling_checks_node_count(tmp_path):
    env = _stub_env(tmp_path, nodes=1)
    proc = subprocess.run(["bash", os.path.join(SLURM, "end_to_end.sbatch"), "3B"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "results" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["save_interval"], r["checkpoints_saved"]) for r in rows] == [("10", "3")] * 4 + [("1", "3")] * 4
    # 13B at DP=4 needs 16 nodes: the job refuses a wrong allocation before launching anything.
    os.makedirs(tmp_path / "x")
    proc = subprocess.run(["bash", os.path.join(SLURM, "dp_scaling.sbatch"), "13B", "4"],
                          env=_stub_env(tmp_path / "x", 8), capture_output=True, text=True)
    assert proc.returncode == 2 and "needs 16 nodes" in proc.stderr and "sbatch -N 16" in proc.stderr
    proc = subprocess.run(["bash", os.path.join(SLURM, "dp_scaling.sbatch"), "7B", "2"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "13B or 30B" in proc.stderr


FAKE_SBATCH = r"""#!/usr/bin/env bash
# Refuses the 30B jobs as a site would (e.g. over the QOS node limit); accepts the others.
printf '%s ' "$@" >> "$STUB_DIR/sbatch_calls"; echo >> "$STUB_DIR/sbatch_calls"
case " $* " in *" 30B"*) echo "sbatch: error: QOSMaxNodePerJobLimit" >&2; exit 1 ;; esac
echo "Submitted batch job $RANDOM"
"""


def test_submit_all_covers_the_paper_matrix_and_goes_on_after_a_refusal(tmp_path):
    env = {**os.environ, "ACCOUNT": "acct", "PARTITION": "gpu", "QOS": "normal", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", os.path.join(SLURM, "submit_all.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 * 5 + 2 * 5
    jobs = {tuple(l.split("/examples/slurm/")[1].split()): l for l in lines}
    assert "--nodes 20 --time=06:00:00 " in jobs[("end_to_end.sbatch", "70B")]  # 4.2 h projected, x1.25 + 5 min a run
    assert "--nodes 128 " in jobs[("dp_scaling.sbatch", "30B", "16")]
    for line in lines:
        assert " --gpus-per-node=4 --account acct --partition gpu --qos normal --nodes " in line, line
    # Eight GPUs per node: fewer nodes; TIME wins over the projection.
    proc = subprocess.run(["bash", os.path.join(SLURM, "submit_all.sh"), "--dry-run", "70B"],
                          env={**env, "GPUS_PER_NODE": "8", "TIME": "02:00:00"}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [l.split("--gpus-per-node=")[1].split()[0] for l in proc.stdout.splitlines()] == ["8", "8"]
    assert all("--nodes 10 --time=02:00:00 " in l for l in proc.stdout.splitlines()), proc.stdout
    # The limit covers the variants the jobs run: the in-memory level's alone is shorter.
    proc = subprocess.run(["bash", os.path.join(SLURM, "submit_all.sh"), "--dry-run", "70B"],
                          env={**env, "ONLY_VARIANTS": "datastates_memory"}, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert "--nodes 20 --time=01:30:00 " in proc.stdout.splitlines()[1], proc.stdout  # end_to_end
    # A refused submission is reported and the others still go.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    proc = subprocess.run(["bash", os.path.join(SLURM, "submit_all.sh")],
                          env={**env, "PATH": f"{bin_dir}:{env['PATH']}", "STUB_DIR": str(tmp_path)},
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert len((tmp_path / "sbatch_calls").read_text().splitlines()) == 20
    assert proc.stdout.count("Submitted batch job") == 13
    assert "7 submission(s) refused:" in proc.stderr and proc.stderr.count("QOSMaxNodePerJobLimit") == 14


def _launch_args(model, variant, dp=1, iters=5, interval=1, **knobs):
    proc = _build_args(model, variant, dp, iters, interval, **knobs)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.decode().split("\0")[:-1]


def _build_args(model, variant, dp, iters, interval, **knobs):
    script = (f'source "{SLURM}/common.sh"; build_args {model} {dp} {iters} {interval} {variant} /ckpt; '
              'printf "%s\\0" "${ARGS[@]}"')
    return subprocess.run(["bash", "-c", script], capture_output=True,
                          env={**os.environ, "REPO": ROOT, "PYTHON": sys.executable, **knobs})


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


def test_memory_variant_saves_in_memory_at_the_interval_and_to_save_every_tenth():
    """datastates_memory (named in ONLY_VARIANTS only): Megatron-LM's in-memory non-persistent
    flags, parsed by pretrain_gpt.py's parser; PERSISTENT_EVERY sets --save's share."""
    ckpt = _parse_with_world(_launch_args("7B", "datastates_memory", interval=2),
                             world_size=8).checkpoint
    assert ckpt.async_lazy_save and ckpt.non_persistent_ckpt_type == "in_memory"
    assert (ckpt.non_persistent_save_interval, ckpt.save_interval) == (2, 20)
    assert "--non-persistent-save-interval" not in _launch_args("7B", "datastates_lazy")
    argv = _launch_args("7B", "datastates_memory", interval=2, PERSISTENT_EVERY="5")
    assert argv[argv.index("--save-interval") + 1] == "10"
    proc = _build_args("7B", "datastates_memory", 1, 5, 2, PERSISTENT_EVERY="1")
    assert proc.returncode == 2 and b"PERSISTENT_EVERY must be an integer >= 2" in proc.stderr


def test_dry_run_as_documented_checks_each_launch_without_slurm(tmp_path):
    # The command of docs/SCALE.md, run from the repository root with no Slurm variable but the
    # node count; one variant keeps this to one megatron import.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "REPO"}
    env.update(DRY_RUN="1", SLURM_JOB_NUM_NODES="2", PYTHON=sys.executable, PYTHONWARNINGS="ignore",
               ONLY_VARIANTS="torch_dist", RESULTS_DIR=str(tmp_path / "results"))
    proc = subprocess.run(["bash", "examples/slurm/throughput.sbatch", "7B"], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("== dry run: throughput_7B_dp1_every1_torch_dist_dryrun") == 1
    assert "layer split per stage: [16, 16]  (TP=4, DP=1" in proc.stdout
    assert not (tmp_path / "results" / "results.csv").exists()
    proc = subprocess.run(["bash", "examples/slurm/throughput.sbatch", "7B"], cwd=ROOT, capture_output=True,
                          text=True, env={**env, "SLURM_JOB_NUM_NODES": "4"})
    assert proc.returncode == 2 and "needs 2 nodes" in proc.stderr, proc.stderr
    proc = subprocess.run(["bash", "examples/slurm/throughput.sbatch", "7B"], cwd=ROOT, capture_output=True,
                          text=True, env={**env, "ONLY_VARIANTS": "torch fast"})
    assert proc.returncode == 2 and "unknown variant 'fast'" in proc.stderr


@pytest.mark.parametrize("fails", [0, 3])
def test_train_restarts_a_failed_step_then_gives_the_memory_back(tmp_path, fails):
    """train.sbatch with srun stubbed: the training step fails `fails` times (every attempt of
    MAX_RESTARTS=2 when 3); each attempt is a new rendezvous (port and id) with the same
    --save/--load; after the last one every node runs tools/memory_level.py --remove once, and
    the job's status is the last attempt's."""
    env = _stub_env(tmp_path, nodes=2)
    stub = tmp_path / "bin" / "srun"
    stub.write_text(FAKE_SRUN.replace(
        'log=torch_dist\n', 'log=torch_dist\n'
        'if [[ " $* " == *" pretrain_gpt.py "* || " $* " == *"/pretrain_gpt.py "* ]]; then\n'
        '  n=$(cat "$STUB_DIR/attempts" 2>/dev/null || echo 0); echo $((n + 1)) > "$STUB_DIR/attempts"\n'
        '  [ "$n" -lt "$FAILS" ] && exit 1\n'
        'fi\n'
        '[[ " $* " == *" --remove "* ]] && exit 0\n'))
    proc = subprocess.run(["bash", os.path.join(SLURM, "train.sbatch"), "7B"], capture_output=True,
                          text=True, env={**env, "FAILS": str(fails), "MAX_RESTARTS": "2",
                                          "ITERATIONS": "20", "MASTER_PORT": "29600"})
    assert proc.returncode == (1 if fails else 0), proc.stdout + proc.stderr
    calls = _srun_calls(tmp_path)
    *trainings, cleanup = calls
    assert len(trainings) == (3 if fails else 1), calls
    ckpt = os.path.join(str(tmp_path / "ckpt"), "train_7B_dp1")
    for k, call in enumerate(trainings):
        launcher = call[call.index("torch.distributed.run") + 1:call.index(os.path.join(ROOT, "pretrain_gpt.py"))]
        assert launcher[launcher.index("--rdzv-endpoint") + 1] == f"node001:{29600 + k}"
        assert launcher[-1].endswith(f"_attempt{k + 1}")
        flat = " ".join(call)
        assert f"--save {ckpt} --save-interval 10 --non-persistent-save-interval 1 " in flat
        assert "--non-persistent-ckpt-type in_memory" in flat and f" --load {ckpt}" in flat
    assert cleanup == ["--nodes", "2", "--ntasks-per-node=1", sys.executable,
                       os.path.join(ROOT, "tools", "memory_level.py"), ckpt, "--remove"]
    if fails:
        assert "attempt 2 failed; restarting on the same nodes (1 restart(s) left)" in proc.stdout
        assert "attempt 3 failed; no restart left (MAX_RESTARTS=2)" in proc.stdout
