"""Save/resume: bit-identical `lm loss` continuation, resume at another layout, SIGTERM, bad loads.

One uninterrupted run per scenario saves every 3 iterations; the resumed run loads a copy of its
iteration-3 checkpoint, so the reference and the checkpoint come from a single launch.
"""
import hashlib
import json
import re

import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.checkpointing.checkpoint_args import apply_checkpoint_args
from trainer_launch import (NO_DROPOUT, TINY_MODEL, after, assert_close, copy_checkpoints,
                            launch, send_sigterm_to_tree)

SIX = ["--train-iters", "6", "--eval-interval", "3", "--eval-iters", "1"]


@pytest.fixture(scope="module")
def dropout_run(tmp_path_factory):
    """Single process, dropout on (so RNG restore matters), torch_dist sync saves at 3 and 6.
    Its --load names a directory that does not exist yet (see `_never_saved`)."""
    root = tmp_path_factory.mktemp("ckpt_dropout")
    run = launch(1, TINY_MODEL + SIX + ["--save", str(root), "--save-interval", "3",
                                        "--load", str(_never_saved(root))])
    assert run.returncode == 0, run.describe()
    return run, root


def _never_saved(root):
    return root.with_name(root.name + "_never_saved")


def test_torch_dist_layout_and_bit_exact_resume(dropout_run, tmp_path):
    run, root = dropout_run
    assert open(root / "latest_checkpointed_iteration.txt").read().strip() == "6"
    assert (root / "iter_0000003" / "metadata.json").is_file()
    saved = json.loads((root / "run_config.json").read_text())
    assert saved["model"]["num_layers"] == 4 and saved["checkpoint"]["ckpt_format"] == "torch_dist"
    load = copy_checkpoints(root, [3], 3, tmp_path / "load")
    resumed = launch(1, TINY_MODEL + SIX + ["--load", load])
    assert resumed.returncode == 0, resumed.describe()
    assert "optimizer restored, rng restored" in resumed.stdout
    assert resumed.losses() == after(run.losses(), 3)
    assert resumed.validation() == after(run.validation(), 3)


def test_torch_format_exit_interval_then_bit_exact_resume(dropout_run, tmp_path):
    run, _ = dropout_run
    root = tmp_path / "torch"
    first = launch(1, TINY_MODEL + SIX + ["--ckpt-format", "torch", "--save", str(root),
                                          "--save-interval", "100", "--exit-interval", "3"])
    assert first.returncode == 0, first.describe()
    assert sorted(first.losses()) == [1, 2, 3]
    assert (root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    assert open(root / "latest_checkpointed_iteration.txt").read().strip() == "3"
    # --use-checkpoint-args reads the torch format's model too (a file of one (TP, PP) rank).
    args = parse_args(_without_model_flags(TINY_MODEL) + ["--train-iters", "6",
                                                          "--use-checkpoint-args",
                                                          "--load", str(root)])
    (line,) = apply_checkpoint_args(args)
    assert f"model flags from {root / 'iter_0000003'}: --num-layers 4 --hidden-size 64 " in line
    assert (args.num_layers, args.seq_length, args.max_position_embeddings) == (4, 32, 32)
    resumed = launch(1, TINY_MODEL + SIX + ["--ckpt-format", "torch", "--load", str(root)])
    assert resumed.returncode == 0, resumed.describe()
    assert resumed.losses() == after(run.losses(), 3)


def test_other_model_shape_is_refused_clearly(dropout_run, tmp_path):
    """Every rank finds the same mistake: agreed on, one line (was one per rank)."""
    _, root = dropout_run
    shape = [a if a != "64" else "32" for a in TINY_MODEL]  # --hidden-size 32
    run = launch(2, shape + SIX + ["--load", str(root)])
    assert run.returncode != 0, run.describe()
    (line,) = [ln for ln in run.stderr.splitlines() if "pretrain_gpt.py: error:" in ln]
    assert f"loading {root / 'iter_0000006'} failed on rank(s) [0, 1]: " in line, line
    assert "another model shape" in line and "hidden_size: checkpoint 64, this run 32" in line
    assert 'pretrain_gpt.py", line' not in run.stderr  # no traceback of ours (torchrun prints one)


@pytest.fixture(scope="module")
def distopt_async_run(tmp_path_factory):
    """DP2 with the distributed optimizer and --async-save; no dropout (compared across layouts)."""
    root = tmp_path_factory.mktemp("ckpt_distopt")
    run = launch(2, TINY_MODEL + NO_DROPOUT + SIX + [
        "--use-distributed-optimizer", "--async-save", "--save", str(root), "--save-interval", "3"])
    assert run.returncode == 0, run.describe()
    assert open(root / "latest_checkpointed_iteration.txt").read().strip() == "6"
    return run, root


def test_distributed_optimizer_async_save_resumes_bit_exact(distopt_async_run, tmp_path):
    run, root = distopt_async_run
    load = copy_checkpoints(root, [3], 3, tmp_path / "load")
    resumed = launch(2, TINY_MODEL + NO_DROPOUT + SIX + ["--use-distributed-optimizer",
                                                         "--load", load])
    assert resumed.returncode == 0, resumed.describe()
    assert resumed.losses() == after(run.losses(), 3)


def test_resume_at_another_layout_restores_weights_and_optimizer(distopt_async_run, tmp_path):
    run, root = distopt_async_run
    load = copy_checkpoints(root, [3], 3, tmp_path / "load")
    resumed = launch(2, TINY_MODEL + NO_DROPOUT + SIX + [
        "--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--load", load])
    assert resumed.returncode == 0, resumed.describe()
    assert "optimizer restored" in resumed.stdout and "are not restored" in resumed.stdout
    # Iteration 4's loss proves the weights; 5 and 6 prove Adam moments and step were resharded.
    assert_close(resumed.losses(), after(run.losses(), 3))


def _digests(directory):
    return {p.relative_to(directory): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


MODEL_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
               "--max-position-embeddings")


def _without_model_flags(argv):
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in MODEL_FLAGS:
            skip = True
        else:
            out.append(item)
    return out


def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(dropout_run, tmp_path):
    """Megatron-LM's --use-checkpoint-args: a launch that gives no model flags and no
    vocabulary (the tokenizer is the checkpoint's too, as in Megatron-LM 0.16), and an
    architecture flag the checkpoint overrides (--swiglu), resumes the dropout run's iteration 3
    (--ckpt-step) and prints its losses, bit for bit. Without a checkpoint in --load, the flags
    that are missing are named."""
    run, root = dropout_run
    no_vocab = _without_model_flags(TINY_MODEL)
    del no_vocab[no_vocab.index("--vocab-size"):no_vocab.index("--vocab-size") + 2]
    argv = no_vocab + SIX + ["--use-checkpoint-args", "--load", str(root), "--ckpt-step", "3",
                             "--swiglu"]
    resumed = launch(1, argv)
    assert resumed.returncode == 0, resumed.describe()
    line = next(ln for ln in resumed.stdout.splitlines() if "--use-checkpoint-args" in ln)
    for part in (f"model flags from {root / 'iter_0000003'}: ", "--num-layers 4 ",
                 "--seq-length 32 ", "--ffn-hidden-size 256 ", "--hidden-dropout 0.1 ",
                 "--tokenizer-type NullTokenizer --vocab-size 255"):
        assert part in line, line
    assert "--swiglu" not in line
    assert resumed.losses() == after(run.losses(), 3)
    empty = launch(1, argv[:argv.index("--load") + 1] + [str(tmp_path)] + ["--swiglu"])
    assert empty.returncode == 2 and "the following arguments are required: --num-layers, " \
        "--hidden-size, --num-attention-heads, --seq-length (--use-checkpoint-args found no " \
        "checkpoint that gives them)" in empty.stderr, empty.describe()
    assert f"--use-checkpoint-args: no checkpoint in {tmp_path} to take the model flags from" \
        in empty.stdout


def test_pretrained_checkpoint_starts_a_fine_tuning_that_restarts_from_its_own(dropout_run,
                                                                              tmp_path):
    """Megatron-LM's --pretrained-checkpoint, one launch line run twice: the first launch
    (--load empty) fine-tunes from iteration 3 of the dropout run (--ckpt-step goes to the
    pretrained checkpoint while --load has no tracker; the model from it, --use-checkpoint-args)
    and exits at 2; the second resumes the fine-tuning's own iteration 2, not the pretrained
    weights. Together they print, bit for bit, what --finetune --load <that checkpoint> prints.
    With neither holding a checkpoint the error says so."""
    _, root = dropout_run
    ft = tmp_path / "ft"
    line = _without_model_flags(TINY_MODEL) + [
        "--train-iters", "4", "--use-checkpoint-args", "--pretrained-checkpoint", str(root),
        "--load", str(ft), "--save", str(ft), "--save-interval", "2"]
    first = launch(1, line + ["--ckpt-step", "3", "--exit-interval", "2"])
    assert first.returncode == 0, first.describe()
    assert f"--ckpt-step 3: --load {ft} has no latest_checkpointed_iteration.txt: fine-tuning " \
           f"from iteration 3 of --pretrained-checkpoint {root}" in first.stdout
    assert f"loaded checkpoint {root / 'iter_0000003'} (format torch_dist, iteration 3; " \
           "optimizer not restored, rng not restored)" in first.stdout
    assert f"model flags from {root / 'iter_0000003'}: --num-layers 4" in first.stdout
    restarted = launch(1, line)
    assert restarted.returncode == 0, restarted.describe()
    assert f"loaded checkpoint {ft / 'iter_0000002'} (format torch_dist, iteration 2; " \
           "optimizer restored, rng restored)" in restarted.stdout
    assert f"model flags from {ft / 'iter_0000002'}: " in restarted.stdout
    reference = launch(1, TINY_MODEL + ["--train-iters", "4", "--finetune", "--load", str(root),
                                        "--ckpt-step", "3"])
    assert reference.returncode == 0, reference.describe()
    assert sorted(reference.losses()) == [1, 2, 3, 4]
    assert {**first.losses(), **restarted.losses()} == reference.losses()
    empty = launch(1, TINY_MODEL + ["--train-iters", "4", "--load", str(tmp_path / "none"),
                                    "--pretrained-checkpoint", str(tmp_path / "neither")])
    assert empty.returncode == 2, empty.describe()
    assert f"--pretrained-checkpoint directory {tmp_path / 'neither'} does not exist: no " \
           "checkpoint to load, and --load holds no checkpoint to resume either" \
        in empty.stderr, empty.describe()


def test_ckpt_convert_format_saves_the_loaded_checkpoint_in_another_format(dropout_run,
                                                                          tmp_path):
    """Megatron-LM's --ckpt-convert-format: iteration 3 of the dropout run (torch_dist) saved as
    <--ckpt-convert-save>/torch/, no iteration trained; a resume from the converted checkpoint
    prints the dropout run's losses after 3 bit for bit (optimizer and RNG converted too)."""
    run, root = dropout_run
    out = tmp_path / "converted"
    converted = launch(1, TINY_MODEL + SIX + ["--load", str(root), "--ckpt-step", "3",
                                              "--ckpt-convert-format", "torch",
                                              "--ckpt-convert-save", str(out)])
    assert converted.returncode == 0, converted.describe()
    assert converted.losses() == {}
    assert f"> converted checkpoint: torch_dist -> torch. (iter_0000003 of {root} saved under " \
           f"{out / 'torch'})" in converted.stdout
    assert (out / "torch" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    assert (out / "torch" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    resumed = launch(1, TINY_MODEL + SIX + ["--ckpt-format", "torch", "--load", str(out / "torch")])
    assert resumed.returncode == 0, resumed.describe()
    assert "optimizer restored, rng restored" in resumed.stdout
    assert resumed.losses() == after(run.losses(), 3)
    missing = launch(1, TINY_MODEL + SIX + ["--load", str(tmp_path / "none"),
                                            "--ckpt-convert-format", "torch",
                                            "--ckpt-convert-save", str(out)])
    assert missing.returncode == 2 and f"--load directory {tmp_path / 'none'} does not exist: " \
        "no checkpoint to load: nothing to convert (--ckpt-convert-format)" in missing.stderr, \
        missing.describe()


def test_lenient_dist_ckpt_strictness_loads_the_tensors_both_models_have(dropout_run,
                                                                          tmp_path):
    """Megatron-LM's --dist-ckpt-strictness log_all: the dropout run's tied-embeddings model
    loaded into one with its own output layer (refused by default, with the way out named).
    Both loads, converted to the torch format (--ckpt-convert-format) to read what they hold:
    every tensor of the tied model is the untied one's, bit for bit; the output layer the
    checkpoint lacks keeps its initial value and is named. Without --finetune it is refused:
    that tensor's optimizer state is not in the checkpoint."""
    from megatron.training.checkpointing.contents import safe_torch_load

    _, root = dropout_run
    untie = ["--untie-embeddings-and-output-weights"]
    convert = ["--load", str(root), "--ckpt-convert-format", "torch", "--ckpt-convert-save"]
    refused = launch(1, TINY_MODEL + SIX + untie + ["--load", str(root), "--finetune"])
    assert refused.returncode == 2 and "untie_embeddings_and_output_weights: checkpoint False, " \
        "this run True); pass the same model flags or another --load (or, to load the tensors " \
        "both models have, --dist-ckpt-strictness log_all with --finetune)" in refused.stderr, \
        refused.describe()
    tied = launch(1, TINY_MODEL + SIX + ["--finetune"] + convert + [str(tmp_path / "tied")])
    lenient = ["--dist-ckpt-strictness", "log_all"]
    untied = launch(1, TINY_MODEL + SIX + untie + lenient + ["--finetune"] + convert
                    + [str(tmp_path / "untied")])
    for run in (tied, untied):
        assert run.returncode == 0, run.describe()
    assert "--dist-ckpt-strictness log_all: the checkpoint lacks 1 tensor(s) of this model, " \
           "which keep their initial values (unexpected): output_layer.weight" in untied.stdout
    assert "(missing)" not in untied.stdout  # the optimizer and RNG states were not asked for
    files = [safe_torch_load(str(tmp_path / name / "torch" / "iter_0000000" / "mp_rank_00" /
                                 "model_optim_rng.pt"))["model"] for name in ("tied", "untied")]
    assert sorted(files[1]) == sorted(list(files[0]) + ["output_layer.weight"])
    for key, tensor in files[0].items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, files[1][key]), key
    no_finetune = launch(1, TINY_MODEL + SIX + untie + lenient + ["--load", str(root)])
    assert no_finetune.returncode == 2 and "the checkpoint lacks 3 tensor(s) of this model " \
        "(optimizer.state.exp_avg.output_layer.weight, optimizer.state.exp_avg_sq.output_layer." \
        "weight, output_layer.weight), whose optimizer state it cannot restore; add --finetune " \
        "(or --no-load-optim)" in no_finetune.stderr, no_finetune.describe()


def test_ckpt_step_rolls_back_and_sets_the_newer_checkpoint_aside(dropout_run, tmp_path):
    """--ckpt-step 3 with --save = --load whose tracker names 6: the run resumes from 3 and
    prints the first run's losses, its save of 6 is a new checkpoint (not skipped for the other
    run's, which the tracker would have named again), and that one is kept byte for byte in
    superseded-by-iter_0000003-*/. A step that is not a complete checkpoint is refused."""
    run, root = dropout_run
    load = tmp_path / "load"
    copy_checkpoints(root, [3, 6], 6, load)
    theirs = _digests(load / "iter_0000006")
    rolled = launch(1, TINY_MODEL + SIX + ["--load", str(load), "--save", str(load),
                                           "--save-interval", "3", "--ckpt-step", "3"])
    assert rolled.returncode == 0, rolled.describe()
    assert f"loaded checkpoint {load / 'iter_0000003'} (format torch_dist, iteration 3;" \
        in rolled.stdout
    assert rolled.losses() == after(run.losses(), 3)
    (aside,) = load.glob("superseded-by-iter_0000003-*")
    assert f"set aside iteration(s) 6 of {load}: newer than iteration 3, which this run starts " \
           f"from (another run's states of those iterations); moved whole to {aside}" \
        in rolled.stdout
    assert "skipping the save" not in rolled.stdout
    assert _digests(aside / "iter_0000006") == theirs
    assert sorted(p.name for p in load.glob("iter_*")) == ["iter_0000003", "iter_0000006"]
    assert (load / "iter_0000006" / "metadata.json").is_file()
    assert (load / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    from datastates import CheckpointError
    from megatron.training.checkpointing.loading import _complete_step

    with pytest.raises(CheckpointError) as missing:
        _complete_step(str(load), 4)
    assert f"--ckpt-step 4: {load / 'iter_0000004'} is missing; the complete checkpoints " \
           f"under {load} are at iterations [3, 6]" in str(missing.value)


def test_sigterm_saves_then_exits_zero(tmp_path):
    root = tmp_path / "sigterm"
    sent = []

    def on_line(line, proc):
        if not sent and " iteration        2/" in line:
            send_sigterm_to_tree(proc)
            sent.append(True)

    run = launch(1, TINY_MODEL + NO_DROPOUT + ["--train-iters", "500", "--eval-interval", "0",
                                               "--exit-signal-handler", "--save", str(root)],
                 on_line=on_line)
    assert sent and run.returncode == 0, run.describe()
    stopped = max(run.losses())
    assert 2 <= stopped < 500
    assert "exiting on SIGTERM" in run.stdout
    assert open(root / "latest_checkpointed_iteration.txt").read().strip() == str(stopped)
    assert (root / f"iter_{stopped:07d}" / "metadata.json").is_file()


def test_exit_signal_sigusr1_saves_then_exits_zero(tmp_path):
    """Megatron-LM's --exit-signal SIGUSR1 (what Slurm's --signal=USR1@SECONDS sends before the
    time limit): the signal saves the iteration it ends and exits 0, as SIGTERM does."""
    import os
    import signal

    root = tmp_path / "usr1"
    sent = []

    def on_line(line, proc):
        if not sent and " iteration        2/" in line:
            os.kill(proc.pid, signal.SIGUSR1)
            sent.append(True)

    run = launch(1, TINY_MODEL + NO_DROPOUT + ["--train-iters", "500", "--eval-interval", "0",
                                               "--exit-signal-handler", "--exit-signal",
                                               "SIGUSR1", "--save", str(root)], on_line=on_line)
    assert sent and run.returncode == 0, run.describe()
    stopped = max(run.losses())
    assert 2 <= stopped < 500 and "exiting on SIGUSR1" in run.stdout
    assert open(root / "latest_checkpointed_iteration.txt").read().strip() == str(stopped)


def test_exit_duration_stops_validation_saves_and_exits_zero(tmp_path):
    """--exit-duration-in-mins (Megatron-LM's), 2 ranks with --async-lazy-save: a limit already
    past when the first iteration ends (start-up alone takes longer) cuts that iteration's
    validation short after its first batch, then every rank exits there together after a forced
    save (--save-interval would not save 1), committed before the process ends."""
    root = tmp_path / "timed"
    run = launch(2, TINY_MODEL + NO_DROPOUT + [
        "--train-iters", "50", "--eval-interval", "1", "--eval-iters", "3",
        "--exit-duration-in-mins", "0.0001", "--async-lazy-save", "--save-interval", "100",
        "--save", str(root)])
    assert run.returncode == 0, run.describe()
    assert sorted(run.losses()) == [1]
    assert "validation stopped after 1 of 3 iterations: --exit-duration-in-mins 0.0001 is " \
           "reached" in run.stdout
    assert run.validation() == {}
    assert re.search(r"exiting program after \d+\.\d\d minutes at iteration 1 "
                     r"\(--exit-duration-in-mins 0\.0001\)", run.stdout), run.stdout[-3000:]
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (root / "iter_0000001" / "COMMIT.json").is_file()


def test_entry_point_reports_bad_layout_and_missing_load_in_one_line(dropout_run):
    contradictory = launch(2, TINY_MODEL + SIX + ["--tensor-model-parallel-size", "2",
                                                  "--pipeline-model-parallel-size", "2"])
    assert contradictory.returncode != 0
    # Once (rank 0), and no traceback from our code (torchrun adds its own failure summary).
    assert contradictory.stderr.count(
        "pretrain_gpt.py: error: world size 2 is not divisible by TP*PP = 2*2 = 4") == 1
    assert "megatron/training/" not in contradictory.stderr
    # As Megatron-LM: a --load directory that does not exist yet is a warning, and the run starts
    # from scratch (so a launch line with --save D --load D works the first time). The dropout
    # run's --load is one.
    missing, root = dropout_run
    assert missing.returncode == 0, missing.describe()
    assert f"WARNING: --load directory {_never_saved(root)} does not exist: no checkpoint to " \
           "load, starting from scratch" in missing.stdout
    assert sorted(missing.losses()) == list(range(1, 7))
    # Megatron-LM's --exit-on-missing-checkpoint: an error instead (exit 2, not Megatron-LM's 0;
    # torchrun's 1), found by every rank, agreed on: one line.
    refused = launch(2, TINY_MODEL + SIX + ["--load", str(_never_saved(root)),
                                            "--exit-on-missing-checkpoint"])
    assert refused.returncode == 1, refused.describe()
    assert refused.stderr.count("pretrain_gpt.py: error: CheckpointError: ") == 1, \
        refused.describe()
    assert "failed on rank(s) [0, 1]: " in refused.stderr
    assert f"--load directory {_never_saved(root)} does not exist: no checkpoint to load; not " \
           "starting from scratch (--exit-on-missing-checkpoint)" in refused.stderr


def test_resume_with_another_schedule_follows_megatron_lms_rule(dropout_run):
    """Resuming with another --train-iters changes the decay length: refused by default with what
    differs and the two flags, in one line for the two ranks that find it (agreed on);
    --override-opt_param-scheduler follows this run's flags, --use-checkpoint-opt_param-scheduler
    the checkpoint's, each saying so. (From the dropout run's iteration 6; these runs save
    nothing.)"""
    _, root = dropout_run
    longer = TINY_MODEL + ["--train-iters", "7", "--load", str(root), "--eval-interval", "0"]
    refused = launch(2, longer)
    assert refused.returncode == 1, refused.describe()  # torchrun's, for ranks that exited with 2
    errors = [ln for ln in refused.stderr.splitlines() if ln.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1, refused.describe()
    for needle in ("another learning-rate schedule", "decay samples (--lr-decay-iters, default "
                   "--train-iters, x global batch; or --lr-decay-samples, default "
                   "--train-samples): checkpoint 48, this run 56", "--override-opt_param-scheduler",
                   "--use-checkpoint-opt_param-scheduler"):
        assert needle in errors[0], (needle, errors[0])
    for flag, says in (("--override-opt_param-scheduler", "following this run's flags"),
                       ("--use-checkpoint-opt_param-scheduler", "following the checkpoint's")):
        run = launch(1, longer + [flag])
        assert run.returncode == 0, run.describe()
        assert says in run.stdout and sorted(run.losses()) == [7], run.stdout[-2000:]


def test_end_of_training_validation_and_summary(tmp_path):
    """As Megatron-LM, the last iteration is validated even when it is not a multiple of
    --eval-interval; one summary line says what the run did (iterations, time, tokens/s,
    checkpoints, time blocked by checkpointing, newest complete checkpoint)."""
    root = tmp_path / "ckpt"
    run = launch(1, TINY_MODEL + NO_DROPOUT + ["--train-iters", "5", "--eval-interval", "2",
                                               "--eval-iters", "1", "--save", str(root),
                                               "--save-interval", "2", "--async-lazy-save"])
    assert run.returncode == 0, run.describe()
    assert sorted(run.validation()) == [2, 4, 5], run.stdout[-2000:]
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(" training summary |")]
    assert len(lines) == 1, run.stdout[-2000:]
    m = re.fullmatch(r" training summary \| iterations: 0 -> 5 \| time \(s\): [0-9.]+ \| "
                     r"tokens/s: [0-9.]+ \| checkpoints: 3 \(complete: 3\) \| blocked by "
                     r"checkpointing \(s\): [0-9.]+ \| newest complete checkpoint: (\S+)", lines[0])
    assert m and m.group(1) == str(root / "iter_0000005"), lines[0]
