"""--async-lazy-save end to end: real gloo runs of pretrain_gpt.py saving every iteration.

Each fixture is one launch that saves every iteration; resumed runs load a copy of one of its
checkpoints, so the reference losses and the checkpoint come from the same launch.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from trainer_launch import NO_DROPOUT, REPO, TINY_MODEL, after, copy_checkpoints, launch

SIX = ["--train-iters", "6", "--eval-interval", "0"]
LAZY = ["--async-lazy-save", "--save-interval", "1"]
# With Megatron-LM's --decoupled-lr the embeddings' and output layer's parameter group has its
# own schedule: a resume must give each group its own (megatron-core 0.16.1 gave the default group
# the decoupled one's, see mcore_fixes.optimizer_config_overrides).
DISTOPT = ["--use-distributed-optimizer", "--decoupled-lr", "3e-3", "--decoupled-min-lr", "2e-4"]


def _checkpoint_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith(" checkpoint iteration")]


def _check_committed_run(run, root, iterations, kept=None):
    assert run.returncode == 0, run.describe()
    assert open(root / "latest_checkpointed_iteration.txt").read().strip() == str(iterations[-1])
    for it in kept or iterations:
        d = root / f"iter_{it:07d}"
        assert (d / "COMMIT.json").is_file(), sorted(os.listdir(d))
        assert json.loads((d / "metadata.json").read_text())["sharded_backend"] == "datastates"
        assert json.loads((d / "index_r00000.json").read_text())["checksum"] == "crc32c"
        assert not [f for f in os.listdir(d) if f.endswith(".spare")]  # room set aside is gone
    lines = _checkpoint_lines(run.stdout)
    assert [int(line.split("|")[0].split()[-1]) for line in lines] == iterations, lines
    events = [json.loads(x) for x in open(root / "datastates_checkpoints.jsonl")]
    records = [r for r in events if r["event"] == "checkpoint"]
    assert [r["iteration"] for r in records] == iterations
    assert [r["iteration"] for r in events if r["event"] == "iteration"] == iterations
    assert all(r["bytes"] > 0 and r["durable_s"] > 0 for r in records)


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory):
    """4 ranks, TP2 x PP2 with the distributed optimizer; a checkpoint every iteration."""
    root = tmp_path_factory.mktemp("lazy_tp2pp2")
    run = launch(4, TINY_MODEL + NO_DROPOUT + SIX + LAZY + DISTOPT + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--save", str(root)], timeout=400)
    _check_committed_run(run, root, [1, 2, 3, 4, 5, 6])
    return run, root


def test_tp2pp2_resume_bit_exact(tp2pp2, tmp_path):
    """Resumed by a launch that names neither the model nor the layout: Megatron-LM's
    --use-checkpoint-args --use-mp-args-from-checkpoint-args take both from the checkpoint."""
    run, root = tp2pp2
    load = copy_checkpoints(root, [3], 3, tmp_path / "load")
    sizes = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
             "--max-position-embeddings")
    unnamed = [x for i, x in enumerate(TINY_MODEL)
               if x not in sizes and (i == 0 or TINY_MODEL[i - 1] not in sizes)]
    resumed = launch(4, unnamed + NO_DROPOUT + SIX + DISTOPT + [
        "--use-checkpoint-args", "--use-mp-args-from-checkpoint-args", "--load", load],
        timeout=400)
    assert resumed.returncode == 0, resumed.describe()
    assert "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" in resumed.stdout
    assert "optimizer restored" in resumed.stdout
    assert resumed.losses() == after(run.losses(), 3)


# Resharding TP2xPP2 onto TP1xPP1xDP2 (every tensor bit for bit, each DP rank reading its own
# ranges of the distributed optimizer's state): tests/test_universal_resume.py, whose
# `datastates_tp1pp1dp2_distopt` case loads the DataStates checkpoint itself.


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    """2 ranks, DP2 with the distributed optimizer, dropout on (RNG restore matters), keep 4."""
    root = tmp_path_factory.mktemp("lazy_dp2")
    run = launch(2, TINY_MODEL + SIX + LAZY + DISTOPT + [
        "--save", str(root), "--keep-last-n-checkpoints", "4"])
    _check_committed_run(run, root, [1, 2, 3, 4, 5, 6], kept=[3, 4, 5, 6])
    return run, root


def _model_pieces(directory):
    """{(key, global offset): CRC-32C of each chunk} of the model's tensors in a DataStates
    version (every rank's index); the optimizer's are left out (their sharding follows the
    gradient buckets)."""
    out = {}
    for index in directory.glob("index_r*.json"):
        for t in json.loads(index.read_text())["tensors"]:
            if not t["key"].startswith("optimizer."):
                out[t["key"], tuple(t["global_offset"])] = [c[2] for c in t["chunks"]]
    return out


def test_dp2_overlapped_grad_reduce_and_param_gather_save_what_each_step_made(dp2, tmp_path):
    """Megatron-LM's Llama launch lines carry --overlap-grad-reduce --overlap-param-gather. Then
    the optimizer step leaves the all-gather of the updated parameters to the next forward pass,
    which the lazy copy overlaps: each save gathers them first, as Megatron-LM's saves do. The
    losses and every model tensor of every checkpoint are dp2's (one bucket, as dp2's, so the
    numbers are the same to the bit). Without the gather, the pieces a rank wrote of another
    rank's shard were the previous iteration's: a resume hid it, since its first forward gathers
    every rank's fresh shard, but a conversion or a model-only load would not."""
    run, root = dp2
    other = tmp_path / "overlap"
    overlapped = launch(2, TINY_MODEL + SIX + LAZY + DISTOPT + [
        "--save", str(other), "--keep-last-n-checkpoints", "4", "--overlap-grad-reduce",
        "--overlap-param-gather"])
    _check_committed_run(overlapped, other, [1, 2, 3, 4, 5, 6], kept=[3, 4, 5, 6])
    assert overlapped.losses() == run.losses()
    for it in (3, 4, 5, 6):
        theirs = _model_pieces(root / f"iter_{it:07d}")
        assert theirs and _model_pieces(other / f"iter_{it:07d}") == theirs, it


def test_dp2_retention_keeps_newest_four(dp2):
    _, root = dp2
    kept = sorted(p.name for p in root.iterdir() if p.name.startswith("iter_"))
    assert kept == [f"iter_{i:07d}" for i in (3, 4, 5, 6)]
    assert not [p for p in root.iterdir() if p.name.startswith(".deleting-")]


def test_dp2_replicated_shards_written_once(dp2):
    """DP replicas of each model shard are written by exactly one rank, spread over both: the
    saved boxes of every model tensor add up to its global size (no box saved twice)."""
    import math

    from datastates import CheckpointReader

    reader = CheckpointReader(str(dp2[1] / "iter_0000006"))
    writers = set()
    for key in reader.tensor_keys(shards_only=True):
        if key.startswith("optimizer."):
            continue
        meta = reader.tensor_meta(key)
        assert sum(math.prod(shape) for _, _, shape in meta.shards) == \
            math.prod(meta.global_shape), (key, meta.shards)
        writers.update(rank for rank, _, _ in meta.shards)
    assert writers == {0, 1}


def test_dp2_host_cache_holds_each_rank_checkpoint(dp2):
    """The default host cache is sized from a bound of one rank's checkpoint that counts the
    distributed optimizer's state for this rank's shard only, and every model weight (a rank
    writes them all without --ckpt-fully-parallel-save): it holds what each rank saved, even had
    one rank written every weight."""
    import math
    import re

    from datastates import CheckpointReader

    run, root = dp2
    found = re.search(r"DataStates host cache: (\d+) MiB per rank \(a checkpoint of rank 0 holds "
                      r"at most (\d+) MiB", run.stdout)
    params = int(re.search(r"> GPT model: (\d+) parameters", run.stdout).group(1))  # fp32
    assert found, run.stdout[-2000:]
    cache_mb, bound_mb = int(found.group(1)), int(found.group(2))
    reader = CheckpointReader(str(root / "iter_0000006"))
    saved, optimizer = {0: 0, 1: 0}, {0: 0, 1: 0}
    for key in reader.tensor_keys(shards_only=True):
        meta = reader.tensor_meta(key)
        for rank, _, shape in meta.shards:
            nbytes = math.prod(shape) * meta.dtype.itemsize
            saved[rank] += nbytes
            if key.startswith("optimizer."):
                optimizer[rank] += nbytes
    assert max(saved.values()) <= bound_mb * 2**20, (saved, bound_mb)
    assert max(optimizer.values()) + 4 * params <= bound_mb * 2**20, (optimizer, params, bound_mb)
    assert cache_mb == max(16, bound_mb)  # a few MiB: well within this machine's free memory


def test_dp2_resume_bit_exact_and_incomplete_never_loaded(dp2, tmp_path):
    """The tracker names 3 (a rollback by hand); 4 is torn (no commit marker, shard truncated,
    as after a crash mid-flush) and 5 is complete: --load resumes from 3, rewrites 4, and saves
    5 anew after setting the other run's 5 aside whole (it would otherwise be skipped, and the
    tracker moved to it); with merges on, the other run's universal merge of 5 is set aside too."""
    run, root = dp2
    load = copy_checkpoints(root, [3, 4, 5], 3, tmp_path / "load")
    torn = tmp_path / "load" / "iter_0000004"
    os.remove(torn / "COMMIT.json")
    with open(torn / "shard_r00001.bin", "r+b") as f:
        f.truncate(100)
    theirs = {p.name: p.read_bytes() for p in (tmp_path / "load" / "iter_0000005").iterdir()}
    # The other run's universal merge of 5, which a later --load of the universal root would take.
    from datastates.megatron_adapter import open_source
    from datastates.universal import write_universal

    uroot = tmp_path / "load" / "universal"
    write_universal(open_source(str(tmp_path / "load" / "iter_0000005")),
                    str(uroot / "iter_0000005"))
    (uroot / "latest_checkpointed_iteration.txt").write_text("5")
    # --use-checkpoint-args reads a universal checkpoint's model from its manifest.
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing.checkpoint_args import apply_checkpoint_args

    args = parse_args(["--micro-batch-size", "2", "--train-iters", "6", "--mock-data",
                       "--use-checkpoint-args", "--load", str(uroot)])
    (line,) = apply_checkpoint_args(args)
    assert f"model flags from {uroot / 'iter_0000005'}: --num-layers 4 --hidden-size 64 " in line
    resumed = launch(2, TINY_MODEL + SIX + DISTOPT + LAZY + [
        "--load", load, "--save", load, "--universal-checkpoint-interval", "100"])
    assert resumed.returncode == 0, resumed.describe()
    assert "iteration 3;" in resumed.stdout
    assert resumed.losses() == after(run.losses(), 3)
    # The torn version was rewritten and committed by the resumed run.
    assert (torn / "COMMIT.json").is_file()
    (aside,) = (tmp_path / "load").glob("superseded-by-iter_0000003-*")
    assert f"set aside iteration(s) 5 of {load}: newer than iteration 3" in resumed.stdout
    assert {p.name: p.read_bytes() for p in (aside / "iter_0000005").iterdir()} == theirs
    assert (tmp_path / "load" / "iter_0000005" / "COMMIT.json").is_file()
    assert (tmp_path / "load" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    (uaside,) = uroot.glob("superseded-by-iter_0000003-*")
    assert [p.name for p in uaside.iterdir()] == ["iter_0000005"]
    assert not list(uroot.glob("iter_*"))
    assert not (uroot / "latest_checkpointed_iteration.txt").exists()
    assert f"set aside iteration(s) 5 of {uroot}: newer than iteration 3" in resumed.stdout


def test_tracker_naming_an_uncommitted_checkpoint_is_refused(dp2, tmp_path):
    _, root = dp2
    load = copy_checkpoints(root, [5], 5, tmp_path / "load")
    os.remove(tmp_path / "load" / "iter_0000005" / "COMMIT.json")
    resumed = launch(2, TINY_MODEL + SIX + DISTOPT + ["--load", load])
    assert resumed.returncode != 0
    # torchrun prints its own traceback for a failed worker; ours is one line, agreed on.
    errors = [line for line in (resumed.stdout + resumed.stderr).splitlines()
              if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and "not committed" in errors[0] and "iter_0000005" in errors[0], \
        resumed.describe()


def test_a_shard_damaged_where_one_rank_reads_stops_every_rank_in_one_line(dp2, tmp_path):
    """A flipped byte in rank 1's range of the distributed optimizer's state: only rank 1 reads
    it, every rank stops before anything is applied, one line naming rank 1, the file and the
    tensor (was rank 1's error, and rank 0 waiting for it in the next collective)."""
    _, root = dp2
    load = copy_checkpoints(root, [5], 5, tmp_path / "load")
    version = tmp_path / "load" / "iter_0000005"
    index = json.loads((version / "index_r00001.json").read_text())
    t = next(t for t in index["tensors"] if t["key"].startswith("optimizer.") and t["nbytes"] > 64)
    with open(version / t["file"], "r+b") as f:
        f.seek(t["offset"] + t["nbytes"] // 2)
        byte = f.read(1)[0]
        f.seek(t["offset"] + t["nbytes"] // 2)
        f.write(bytes([byte ^ 0x40]))
    resumed = launch(2, TINY_MODEL + SIX + DISTOPT + ["--load", load])
    assert resumed.returncode != 0
    errors = [line for line in (resumed.stdout + resumed.stderr).splitlines()
              if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1, resumed.describe()
    for needle in (f"loading {version} failed on rank(s) [1]: ", "checksum mismatch",
                   f"file {version / t['file']}", f"tensor '{t['key']}'"):
        assert needle in errors[0], (needle, errors[0])


def test_rampup_batch_size_saves_where_the_batch_grows_and_resumes_on_the_ramp(tmp_path):
    """Megatron-LM's --rampup-batch-size 2 2 12 to a batch of 8 over 48 samples: batches 2, 2,
    4, 6, then 8 (8 iterations); a lazy save where the batch grows (iterations 2, 3, 4, as
    Megatron-LM saves there) besides the end's. A resume from iteration 3 (on the ramp) prints
    iterations 4-8 bit for bit: batch, samples and learning rate go on where they were.
    (tests/test_megatron_lm_interop.py resumes a ramp Megatron-LM saved, against its own
    losses.)"""
    i = TINY_MODEL.index("--lr-warmup-iters")
    flags = TINY_MODEL[:i] + TINY_MODEL[i + 2:] + [
        "--train-samples", "48", "--lr-warmup-samples", "4", "--rampup-batch-size", "2", "2",
        "12"]
    root = tmp_path / "ramp"
    run = launch(1, flags + ["--async-lazy-save", "--save", str(root), "--save-interval", "100"])
    assert run.returncode == 0, run.describe()
    batches = [int(x) for x in re.findall(r"global batch size:\s+(\d+) \|", run.stdout)]
    assert batches == [2, 2, 4, 6, 8, 8, 8, 8], batches
    for it, (old, new) in ((2, (2, 4)), (3, (4, 6)), (4, (6, 8))):
        assert f"saving a checkpoint at iteration {it}: the global batch size grows from {old} " \
               f"to {new} (--rampup-batch-size, as Megatron-LM saves)" in run.stdout
    assert sorted(p.name for p in root.glob("iter_*")) == [
        "iter_0000002", "iter_0000003", "iter_0000004", "iter_0000008"]
    load = copy_checkpoints(root, [3], 3, tmp_path / "load")
    resumed = launch(1, flags + ["--load", load])
    assert resumed.returncode == 0, resumed.describe()
    assert " consumed samples:           14 |" in resumed.stdout  # iteration 4: 8 + 6
    assert resumed.losses() == after(run.losses(), 3)


def test_decrease_batch_size_if_needed_trains_the_batch_that_divides_and_counts_the_rest(
        tmp_path):
    """Megatron-LM's --decrease-batch-size-if-needed: --global-batch-size 5 in micro-batches of
    2 runs batches of 4 (one line says so), prints Megatron-LM's `skipped samples` field, and
    trains exactly as a run with --global-batch-size 4 (a constant learning rate: the schedule
    counts in the nominal batch, as in Megatron-LM, so no warm-up either). Saved at 2 with the
    samples skipped so far and resumed on 2 ranks (DP2: still batches of 4), iterations 3 and 4
    are bit for bit the same, and the count goes on."""
    i = TINY_MODEL.index("--lr-warmup-iters")
    assert TINY_MODEL[i + 2:i + 6] == ["--min-lr", "1e-4", "--lr-decay-style", "cosine"]
    flags = TINY_MODEL[:i] + TINY_MODEL[i + 2:i + 5] + ["constant"] + TINY_MODEL[i + 6:] + \
        NO_DROPOUT + ["--train-iters", "4", "--eval-interval", "0"]
    root = tmp_path / "ckpt"
    run = launch(1, flags + ["--global-batch-size", "5", "--decrease-batch-size-if-needed",
                             "--async-lazy-save", "--save", str(root), "--save-interval", "2"])
    assert run.returncode == 0, run.describe()
    assert "decreasing the global batch size from 5 to 4 to keep it divisible by " \
           "--micro-batch-size 2 * data-parallel size 1 (--decrease-batch-size-if-needed): 1 " \
           "sample(s) per iteration are skipped" in run.stdout, run.describe()
    assert re.findall(r"consumed samples:\s+(\d+) \| skipped samples:\s+(\d+) \|", run.stdout) \
        == [("4", "1"), ("8", "2"), ("12", "3"), ("16", "4")], run.stdout
    assert re.findall(r"global batch size:\s+(\d+) \|", run.stdout) == ["4"] * 4
    reference = launch(1, flags + ["--global-batch-size", "4"])
    assert reference.returncode == 0, reference.describe()
    assert "skipped samples" not in reference.stdout
    assert run.losses() == reference.losses() and len(run.losses()) == 4
    load = copy_checkpoints(root, [2], 2, tmp_path / "load")
    resumed = launch(2, flags + ["--global-batch-size", "5", "--decrease-batch-size-if-needed",
                                 "--load", load])
    assert resumed.returncode == 0, resumed.describe()
    assert " consumed samples:           12 | skipped samples:            3 |" in resumed.stdout
    assert resumed.losses() == after(run.losses(), 2)
    # (Without the flag the same launch is refused at start: tests/test_trainer_units.py.)


def test_iterations_to_skip_reads_past_a_batch_on_the_restart_before_it(tmp_path):
    """Megatron-LM's --iterations-to-skip 2 5, on the restart from the checkpoint of iteration 2
    (as after a loss spike at 3): iteration 3's batch is read past (one line), 4 trains on the
    samples after it with the schedule where 3 would have started (no step for 3), and the
    samples are counted as consumed and skipped; the last iteration, 6, skipped too, is still
    saved at the end (the data position moved), although 5 was saved just before. The count is
    saved and goes on after a resume, bit for bit. Megatron-LM's count: N skips the iteration
    after N are done."""
    flags = TINY_MODEL + NO_DROPOUT + ["--train-iters", "6", "--eval-interval", "0"]
    root = tmp_path / "ckpt"
    run = launch(1, flags + ["--async-lazy-save", "--save", str(root), "--save-interval", "2"])
    assert run.returncode == 0, run.describe()
    skip = tmp_path / "skip"
    skipped = launch(1, flags + ["--iterations-to-skip", "2", "5", "--load",
                                 copy_checkpoints(root, [2], 2, tmp_path / "load"),
                                 "--async-lazy-save", "--save", str(skip), "--save-interval",
                                 "1"])
    assert skipped.returncode == 0, skipped.describe()
    assert "skipping iteration 3 (--iterations-to-skip 2): its 8 samples are counted as " \
           "consumed and skipped" in skipped.stdout, skipped.describe()
    assert "skipping iteration 6 (--iterations-to-skip 5)" in skipped.stdout
    assert sorted(skipped.losses()) == [4, 5]
    assert re.findall(r"consumed samples:\s+(\d+) \| skipped samples:\s+(\d+) \|",
                      skipped.stdout) == [("32", "8"), ("40", "8")]
    lr = re.compile(r" iteration\s+(\d+)/.*? learning rate: (\S+) \|")
    assert dict(lr.findall(skipped.stdout))["4"] == dict(lr.findall(run.stdout))["3"]
    assert skipped.losses()[4] != run.losses()[4]
    assert (skip / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    resumed = launch(1, flags + ["--load", copy_checkpoints(skip, [4], 4, tmp_path / "load4")])
    assert resumed.returncode == 0, resumed.describe()
    assert " consumed samples:           40 | skipped samples:            8 |" in resumed.stdout
    assert resumed.losses()[5] == skipped.losses()[5] and sorted(resumed.losses()) == [5, 6]


def test_log_progress_records_jobs_saves_and_deletions_in_megatron_lms_format(tmp_path):
    """Megatron-LM's --log-progress across two jobs into one --save: a lazy-save job (saves at
    2 and 4, keeping one) and a synchronous torch_dist job resuming it to 6. progress.txt holds
    Megatron-LM's lines: each job's start, an asynchronous save's call and its completion (after
    it), the deletion retention made, the synchronous save with the job's and the cumulative
    throughput, FLOPs and tokens in Megatron-LM's field order."""
    root = tmp_path / "progress"
    flags = TINY_MODEL + NO_DROPOUT + ["--log-progress", "--save", str(root), "--save-interval",
                                       "2", "--eval-interval", "0", "--train-iters", "6"]
    first = launch(1, flags + ["--exit-interval", "4", "--async-lazy-save",
                               "--keep-last-n-checkpoints", "1"])
    assert first.returncode == 0, first.describe()
    second = launch(1, flags + ["--load", str(root)])
    assert second.returncode == 0, second.describe()
    lines = [line.split("\t") for line in (root / "progress.txt").read_text().splitlines()]
    assert all(len(f) >= 4 and f[1].startswith("Job ID: ") and f[2] == "# GPUs: 1"
               for f in lines), lines
    events = [f[3] + (" " + f[4] if len(f) > 4 else "") for f in lines]
    assert events.count("Starting job") == 2 and events[0] == "Starting job"
    second_job = events.index("Starting job", 1)
    for it in (2, 4):  # the lazy job: each save's call, then (from the commit) its completion
        call = events.index(f"Saving async checkpoint Iteration: {it}")
        assert call < events.index(f"Saved async checkpoint Iteration: {it}") < second_job
    assert "Deleted checkpoint Iteration: 2" in events[:second_job]
    assert events[second_job + 1:] == ["Saved checkpoint Iteration: 6"], events
    saved = lines[-1]
    assert [x.split(": ")[0] for x in saved[4:]] == [
        "Iteration", "Job throughput", "Cumulative throughput", "Floating-point operations",
        "Tokens (in billions)"]
    assert saved[5].endswith(" TFLOP/s/GPU") and float(saved[7].split(": ")[1]) > 0
    assert saved[8] == f"Tokens (in billions): {6 * 8 * 32 / 1e9:.2f}"


def test_stock_dist_checkpointing_load_matches_torch_dist(tmp_path):
    """One process: the same training saved with torch_dist and with --async-lazy-save; stock
    megatron-core load (after `import datastates`) gives bit-identical tensors. The copy of the
    lazy save of iteration 3 is held back 2 s (the engine's copy fault point), so it is still
    running when iteration 4's optimizer step would start: the checkpoint matches only if the
    trainer waits for the snapshot before that step. Saved with zlib crc32 chunk checksums
    (--lazy-save-checksum crc32): the load verifies them too."""
    lazy_root, dist_root = tmp_path / "lazy", tmp_path / "dist"
    args = TINY_MODEL + NO_DROPOUT + ["--train-iters", "5", "--eval-interval", "0"]
    lazy = launch(1, args + LAZY + ["--save", str(lazy_root), "--lazy-save-checksum", "crc32"],
                  extra_env={"DATASTATES_FAULT_DELAY_COPY": "2@3"})
    ref = launch(1, args + ["--save", str(dist_root), "--save-interval", "3"])
    assert lazy.returncode == 0 and ref.returncode == 0, lazy.describe() + ref.describe()
    assert "DATASTATES_FAULT phase=copy step=3" in lazy.stderr
    assert lazy.losses() == ref.losses()
    index = json.loads((lazy_root / "iter_0000003" / "index_r00000.json").read_text())
    assert index["checksum"] == "zlib-crc32"
    check = subprocess.run(
        [sys.executable, str(REPO / "tests" / "stock_load.py"), str(dist_root / "iter_0000003"),
         str(lazy_root / "iter_0000003")], cwd=str(REPO), capture_output=True, text=True,
        env=dict(os.environ, PYTHONWARNINGS="ignore"), timeout=300)
    assert check.returncode == 0 and "MATCH" in check.stdout, check.stdout + check.stderr
    assert int(check.stdout.split("MATCH")[1].split()[0]) > 20  # model and optimizer tensors


IMPORT_ORDERS = ("import datastates.megatron_adapter.save.strategies",
                 "import datastates.megatron_adapter.save.payload",
                 "import datastates.megatron_adapter",
                 "import datastates; import megatron.core",
                 "import megatron.core; import datastates")


def test_load_strategy_registered_in_any_import_order():
    """Whichever of megatron-core and our adapter is imported first, stock load finds our backend
    (importing the adapter first used to fail with a circular import). Each order in its own
    process that has imported neither (forked once torch is imported: tests/import_orders.py)."""
    code = ("\nfrom megatron.core.dist_checkpointing.strategies.base import "
            "default_strategies as d\nprint(sorted(d['load_sharded']))")
    run = subprocess.run([sys.executable, str(REPO / "tests" / "import_orders.py")]
                         + [imports + code for imports in IMPORT_ORDERS], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout)
    assert len(results) == len(IMPORT_ORDERS), results
    for imports in IMPORT_ORDERS:
        status, out = results[imports + code]
        assert status == 0, (imports, out[-2000:])
        assert "('datastates', 1)" in out, (imports, out)


def test_leftovers_of_an_unfinished_save_are_set_aside_not_mixed(tmp_path):
    """An iteration directory holding an earlier, unfinished save's files is moved out of the
    ``iter_*`` namespace (and removed) before the new save writes, with one line naming it;
    megatron-core's "Overwriting old incomplete / corrupted checkpoint..." (printed for any
    non-empty directory, ours holds the commit marker's room) never appears."""
    root = tmp_path / "ckpt"
    (root / "iter_0000002").mkdir(parents=True)
    (root / "iter_0000002" / "shard_r00000.bin").write_bytes(b"left over")
    (root / "iter_0000002" / "stale_extra_file").write_bytes(b"x")
    run = launch(1, TINY_MODEL + NO_DROPOUT + ["--train-iters", "2", "--save", str(root),
                                               "--save-interval", "1", "--async-lazy-save"])
    assert run.returncode == 0, run.describe()
    text = run.stdout + run.stderr
    assert "Overwriting old incomplete" not in text, text[-3000:]
    lines = [ln for ln in text.splitlines() if "moved the leftovers of an earlier" in ln]
    assert len(lines) == 1 and "iteration 2" in lines[0] and ".incomplete-iter_0000002" in \
        lines[0], lines
    assert not (root / "iter_0000002" / "stale_extra_file").exists()  # nothing mixed in
    assert (root / "iter_0000002" / "shard_r00000.bin").read_bytes() != b"left over"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
