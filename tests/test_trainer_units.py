"""Unit tests without a process group: argument checks, config JSON, log format, CPU policy."""
import json
import re

import pytest

from megatron.training.arguments import ArgumentError, build_run_config, parse_args
from megatron.training.mcore_fixes import batch_p2p_comm_for
from megatron.training.log import training_log_line, validation_lines

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --mock-data --vocab-size 255")


def config(extra="", world_size=1):
    return build_run_config(parse_args((BASE + " " + extra).split()), world_size=world_size)


@pytest.mark.parametrize("extra,world,message", [
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 2,
     "world size 2 is not divisible by TP*PP"),
    ("--pipeline-model-parallel-size 3", 3, "--num-layers 4 is not divisible by"),
    ("--tensor-model-parallel-size 3", 3, "--num-attention-heads 4 is not divisible"),
    ("--global-batch-size 6", 4, "--global-batch-size 6 is not divisible by --micro-batch-size 2"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3", 2,
     "not divisible by --num-layers-per-virtual-pipeline-stage 3"),
    ("--train-iters 4 --lr-warmup-iters 4", 1, "--lr-warmup-iters must be >= 0 and smaller "
     "than the decay length (--lr-decay-iters, default --train-iters) 4, got 4"),
    ("--async-lazy-save --lazy-save-cache-mb 100000000", 1, "--lazy-save-cache-mb 100000000 on 1 "
     "rank(s) of this node needs 100000000 MiB of host memory, but"),
    ("--lazy-save-cache-mb 64", 1, "--lazy-save-cache-mb configure --async-lazy-save, which is "
     "not on"),
    ("--lazy-save-checksum none --ckpt-drain-timeout 5", 1,
     "--lazy-save-checksum configure --async-lazy-save"),
    ("--async-lazy-save --async-save", 1, "two different asynchronous savers"),
    ("--async-lazy-save --ckpt-format torch", 1, "it needs --ckpt-format torch_dist"),
    ("--async-lazy-save --load /tmp/x", 1, "--async-lazy-save writes checkpoints under --save, "
     "which is not given"),
    ("--async-save --ckpt-format torch", 1, "--async-save needs --ckpt-format torch_dist"),
    ("--manual-gc --manual-gc-interval -1", 1, "--manual-gc-interval must be >= 0, got -1"),
    ("--ckpt-step 3", 1, "--ckpt-step names an iteration under --load, which is not given"),
    ("--load /tmp/x --ckpt-step -1", 1, "--ckpt-step must be >= 0, got -1"),
    ("--overlap-grad-reduce --overlap-param-gather", 1,
     "--overlap-param-gather needs --use-distributed-optimizer"),
    ("--use-distributed-optimizer --overlap-param-gather", 1,
     "--overlap-param-gather needs --overlap-grad-reduce, as in Megatron-LM"),
    ("--overlap-grad-reduce --ddp-bucket-size 0", 1, "--ddp-bucket-size must be > 0 elements"),
    ("--distributed-timeout-minutes 0", 1, "--distributed-timeout-minutes must be > 0, got 0"),
    ("--save /tmp/x --save-interval 2 --save-retain-interval 3", 1, "--save-retain-interval 3 "
     "must be a multiple of a fixed --save-interval, as in Megatron-LM (so each retained "
     "iteration is saved), got --save-interval 2"),
    ("--save /tmp/x --save-interval 2 --save-retain-interval 0", 1,
     "--save-retain-interval must be >= 1, got 0"),
    ("--exit-duration-in-mins -5", 1,
     "--exit-duration-in-mins must be >= 0 minutes (0: no limit), got -5.0"),
    ("--data-path /nonexistent/corpus", 1, "give exactly one of --mock-data, --data-path PREFIX "
     "[PREFIX ...], or --train-data-path (with --valid-data-path, --test-data-path: each split "
     "its own); got --mock-data, --data-path"),
    ("--train-data-path /x --valid-data-path /y", 1, "; got --mock-data, --train-data-path, "
     "--valid-data-path"),
    ("--lazy-save-local-keep 3", 1, "--lazy-save-local-keep configure --async-lazy-save"),
    ("--async-lazy-save --lazy-save-local-keep 3", 1,
     "--lazy-save-local-keep counts copies under --lazy-save-local-dir, which is not given"),
    ("--async-lazy-save --lazy-save-local-dir /tmp/x --lazy-save-local-keep 0", 1,
     "--lazy-save-local-keep must be >= 1, got 0"),
    ("--lazy-save-checksum-threads 2", 1, "--lazy-save-checksum-threads configure "
     "--async-lazy-save"),
    ("--save /tmp/x --async-lazy-save --lazy-save-checksum-threads 2", 1,
     "--lazy-save-checksum-threads checksums the in-memory checkpoints, but "
     "--non-persistent-ckpt-type in_memory is not given: add it, or drop the flag"),
    ("--save /tmp/x --async-lazy-save --non-persistent-ckpt-type local "
     "--non-persistent-local-ckpt-dir /nvme --lazy-save-checksum-threads 2", 1,
     "in_memory is not given (found local)"),
    ("--save /tmp/x --async-lazy-save --non-persistent-ckpt-type in_memory "
     "--lazy-save-checksum-threads 0", 1, "--lazy-save-checksum-threads must be >= 1, got 0"),
    ("--use-dist-ckpt --ckpt-format torch", 1,
     "--use-dist-ckpt means --ckpt-format torch_dist, but --ckpt-format torch was given"),
    ("--ckpt-fully-parallel-save --no-ckpt-fully-parallel-save", 1, "contradict each other"),
    ("--ckpt-fully-parallel-load", 1, "--ckpt-fully-parallel-load needs CUDA"),
    ("--non-persistent-save-interval 5 --non-persistent-ckpt-type local "
     "--non-persistent-local-ckpt-dir /nvme", 1,
     "--non-persistent-ckpt-type local keeps DataStates versions on each node's storage: add "
     "--async-lazy-save"),
    ("--async-lazy-save --non-persistent-ckpt-type local", 1,
     "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR"),
    ("--async-lazy-save --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir /n{nod}",
     1, "--non-persistent-local-ckpt-dir '/n{nod}': unknown or malformed placeholder"),
    ("--non-persistent-local-ckpt-dir /nvme", 1,
     "--non-persistent-local-ckpt-dir needs --non-persistent-ckpt-type local"),
    ("--non-persistent-ckpt-type in_memory", 1, "--non-persistent-ckpt-type in_memory keeps "
     "DataStates versions in each node's shared memory: add --async-lazy-save"),
    ("--non-persistent-save-interval 5", 1,
     "--non-persistent-save-interval needs --non-persistent-ckpt-type global, local or in_memory"),
    ("--non-persistent-save-interval 0 --non-persistent-ckpt-type global", 1,
     "--non-persistent-save-interval must be >= 1, got 0"),
    ("--non-persistent-global-ckpt-dir /np", 1,
     "--non-persistent-global-ckpt-dir needs --non-persistent-ckpt-type global"),
    ("--keep-last-n-non-persistent 2", 1, "--keep-last-n-non-persistent counts the checkpoints "
     "of --non-persistent-ckpt-type global, local or in_memory, which is not given"),
    ("--non-persistent-ckpt-type global --keep-last-n-non-persistent 0", 1,
     "--keep-last-n-non-persistent must be >= 1, got 0"),
    ("--save /ckpt --non-persistent-ckpt-type global --non-persistent-global-ckpt-dir /ckpt/",
     1, "--non-persistent-global-ckpt-dir must differ from --save (/ckpt)"),
    ("--replication --non-persistent-ckpt-type global", 1,
     "--replication requires the value of --replication-jump"),
    ("--replication --replication-jump 8 --non-persistent-ckpt-type global", 1,
     "--replication requires --non-persistent-ckpt-type local (as in Megatron-LM), got global"),
    ("--async-lazy-save --replication --replication-jump 8 --replication-factor 2 "
     "--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir /nvme", 1,
     "--replication (Megatron-LM's copies of local non-persistent checkpoints on peer ranks) is "
     "not supported: drop --replication, --replication-jump and --replication-factor. With "
     "--async-lazy-save, --lazy-save-peer-replica keeps"),
    ("--ckpt-convert-format torch --load /ckpt", 1,
     "--ckpt-convert-format and --ckpt-convert-save go together"),
    ("--ckpt-convert-format torch --ckpt-convert-save /out", 1,
     "--ckpt-convert-format converts the checkpoint it loads: add --load DIR"),
    ("--load /ckpt --ckpt-convert-update-legacy-dist-opt-format", 1,
     "format of before February 2024, which is not read here"),
    ("--dist-ckpt-save-pre-mcore-014", 1, "--dist-ckpt-save-pre-mcore-014 writes the format of "
     "megatron-core before 0.14, which this trainer does not write"),
    ("--use-persistent-ckpt-worker", 1,
     "--use-persistent-ckpt-worker is the writer of --async-save, which is not given"),
    ("--dataloader-type cyclic", 1, "--dataloader-type cyclic (Megatron-LM's random sampler, "
     "reshuffled every epoch) is not supported: the trainer reads each split once, in order"),
    ("--global-batch-size 6", 2, "--global-batch-size 6 is not divisible by --micro-batch-size "
     "2 * data-parallel size 2 (--decrease-batch-size-if-needed runs each iteration with 4 "
     "samples instead)"),
    ("--global-batch-size 3 --decrease-batch-size-if-needed", 2, "--global-batch-size 3 is below "
     "one micro-batch per data-parallel rank (--micro-batch-size 2 * data-parallel size 2 = 4): "
     "--decrease-batch-size-if-needed can only decrease it"),
])
def test_contradictory_flags_get_a_clear_error(extra, world, message):
    with pytest.raises(ArgumentError) as err:
        config(extra, world)
    assert message in str(err.value)


@pytest.mark.parametrize("ramp,world,message", [
    ("3 2 16", 1, "--global-batch-size 8 must be START plus a whole number of INCREMENTs"),
    ("2 4 16", 1, "--global-batch-size 8 must be START plus a whole number of INCREMENTs"),
    ("2 2 16", 2, "START and INCREMENT must be multiples of 4 (micro-batch size 2 * "
     "data-parallel size 2), so that every batch of the ramp is whole micro-batches"),
    ("0 2 16", 1, "--rampup-batch-size needs START > 0, INCREMENT > 0 and SAMPLES >= 0"),
])
def test_rampup_batch_size_is_checked_and_sets_the_iterations(ramp, world, message):
    sample_based = BASE.replace("--train-iters 4", "--train-samples 64")
    with pytest.raises(ArgumentError) as err:
        build_run_config(parse_args(f"{sample_based} --rampup-batch-size {ramp}".split()),
                         world_size=world)
    assert message in str(err.value)
    with pytest.raises(ArgumentError, match="it needs --train-samples"):
        config("--rampup-batch-size 2 2 16")
    # Megatron-LM's count: batches 2, 2, 2, 4, 4, 6 through the ramp (20 samples), then 44 // 8.
    ramped = build_run_config(parse_args(f"{sample_based} --rampup-batch-size 2 2 16".split()))
    assert (ramped.training.train_iters, ramped.training.rampup_batch_size) == (11, (2, 2, 16))


def test_exit_signal_names_a_catchable_signal(capsys):
    assert config("--exit-signal-handler --exit-signal SIGUSR1").training.exit_signal == "SIGUSR1"
    config("--exit-signal SIGUSR1")
    assert "--exit-signal SIGUSR1 takes effect with --exit-signal-handler only" in \
        capsys.readouterr().out
    with pytest.raises(ArgumentError, match="invalid choice: 'SIGKILL'"):  # cannot be caught
        config("--exit-signal-handler --exit-signal SIGKILL")


def test_sequence_parallel_without_tp_is_disabled_with_megatron_lms_warning(capsys):
    assert not config("--sequence-parallel").parallel.sequence_parallel
    assert "WARNING: Disabling sequence parallelism because tensor model parallelism is " \
        "disabled" in capsys.readouterr().out


def test_exit_duration_zero_means_no_limit_as_in_megatron_lm():
    assert config("--exit-duration-in-mins 0").training.exit_duration_in_mins is None
    assert config("--exit-duration-in-mins 230").training.exit_duration_in_mins == 230


def test_non_persistent_roots_follow_megatron_lm():
    ckpt = config("--save /s --load /l --non-persistent-save-interval 2 "
                  "--non-persistent-ckpt-type global").checkpoint
    assert ckpt.non_persistent_save_root() == "/s/non_persistent"
    assert ckpt.non_persistent_root(ckpt.load) == "/l/non_persistent"
    given = config("--save /s --non-persistent-ckpt-type global "
                   "--non-persistent-global-ckpt-dir /np").checkpoint
    assert given.non_persistent_root(None) == given.non_persistent_root("/l") == "/np"
    assert given.non_persistent_save_root() is None  # no interval: loads only, as Megatron-LM
    assert config("--save /s --non-persistent-save-interval 3 --non-persistent-ckpt-type global"
                  ).checkpoint.non_persistent_save_root() == "/s/non_persistent"
    assert config("--save /s").checkpoint.non_persistent_root("/s") is None
    assert given.keep_last_n_non_persistent == 1  # Megatron-LM's: its newest only
    assert config("--save /s --non-persistent-ckpt-type global --keep-last-n-non-persistent 3"
                  ).checkpoint.keep_last_n_non_persistent == 3
    local = config("--save /s --async-lazy-save --non-persistent-save-interval 3 "
                   "--non-persistent-ckpt-type local --non-persistent-local-ckpt-dir /nvme/{node} "
                   "--non-persistent-local-ckpt-algo atomic").checkpoint
    assert local.non_persistent_save_root() == local.non_persistent_root("/l") == "/nvme/{node}"
    memory = config("--save /s --load /l --async-lazy-save --non-persistent-save-interval 1 "
                    "--non-persistent-ckpt-type in_memory").checkpoint
    # One shared-memory root per --save (loading: per --load), never another root's.
    saving, loading = memory.non_persistent_save_root(), memory.non_persistent_root("/l")
    assert saving.startswith("/dev/shm/datastates-") and saving.endswith("/in_memory/node{node}")
    assert loading != saving and loading == config(
        "--save /l --async-lazy-save --non-persistent-save-interval 1 "
        "--non-persistent-ckpt-type in_memory").checkpoint.non_persistent_save_root()
    assert memory.non_persistent_node_local and local.non_persistent_node_local


def test_megatron_checkpoint_flags_map_onto_ours(capsys):
    cfg = config("--use-dist-ckpt --ckpt-fully-parallel-save --dist-ckpt-format zarr")
    assert cfg.checkpoint.ckpt_format.value == "torch_dist"
    assert cfg.checkpoint.ckpt_fully_parallel_save and not cfg.checkpoint.ckpt_fully_parallel_load
    out = capsys.readouterr().out
    assert "WARNING: --use-dist-ckpt is deprecated" in out
    assert "WARNING: --ckpt-fully-parallel-save is deprecated and has no effect" in out
    assert "WARNING: --dist-ckpt-format is deprecated and has no effect (as in Megatron-LM): " \
           "--ckpt-format selects the format (torch_dist here)" in out
    assert config("--dataloader-type single") == config("")
    assert not config("--no-ckpt-fully-parallel-save").checkpoint.ckpt_fully_parallel_save
    # Megatron-LM's no-ops here: the format of --load is always detected, the model is mcore's.
    assert config("--auto-detect-ckpt-format --use-mcore-models") == config("")
    assert config("--dist-ckpt-optim-fully-reshardable "
                  "--distrib-optim-fully-reshardable-mem-efficient") == config("")
    capsys.readouterr()
    assert config("--async-save --use-persistent-ckpt-worker") == config("--async-save")
    assert "--use-persistent-ckpt-worker: the --async-save writer is forked at each save call " \
        "instead" in capsys.readouterr().out
    local = config("--async-lazy-save --save /s --lazy-save-local-dir /nvme/{node}").checkpoint
    assert local.lazy_save_local_dir == "/nvme/{node}" and local.lazy_save_local_keep == 2
    constant = config("--async-lazy-save --save /s --ckpt-assume-constant-structure").checkpoint
    assert constant.ckpt_assume_constant_structure and not local.ckpt_assume_constant_structure
    from datastates.megatron_adapter import StructurePolicy
    from megatron.training.checkpointing.lazy import lazy_save_config

    assert lazy_save_config(config("--async-lazy-save --save /s --lazy-save-cache-mb 16 "
                                   "--ckpt-assume-constant-structure")
                            ).structure_policy is StructurePolicy.ASSUME_CONSTANT
    worker = config("--async-lazy-save --save /s --lazy-save-cache-mb 16")
    on_thread = config("--async-lazy-save --save /s --lazy-save-cache-mb 16 "
                       "--lazy-save-on-training-thread")
    assert lazy_save_config(worker).offload_steady_saves
    assert not lazy_save_config(on_thread).offload_steady_saves


def test_local_dir_placeholders():
    from datastates.megatron_adapter import expand_local_dir
    from datastates import CheckpointError

    env = {"GROUP_RANK": "3", "LOCAL_RANK": "1"}
    assert expand_local_dir("/nvme/n{node}/r{rank}/l{local_rank}", 13, env) == "/nvme/n3/r13/l1"
    assert expand_local_dir("/nvme/{node}", 0, {"SLURM_NODEID": "7"}) == "/nvme/7"
    with pytest.raises(CheckpointError, match=r"unknown or malformed placeholder.*\{rank\}"):
        expand_local_dir("/nvme/{nodes}", 0, env)


def test_unknown_flag_is_named():
    with pytest.raises(ArgumentError, match="--no-such-flag"):
        parse_args((BASE + " --no-such-flag 3").split())


def test_config_resolves_layout_vocab_and_microbatches():
    cfg = config("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                 "--num-layers-per-virtual-pipeline-stage 1", world_size=8)
    assert cfg.parallel.data_parallel_size == 2
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    assert cfg.model.vocab_size == 256 and cfg.model.padded_vocab_size == 256
    assert cfg.training.num_microbatches(cfg.parallel.data_parallel_size) == 2
    saved = json.loads(cfg.to_json())
    assert saved["checkpoint"]["ckpt_format"] == "torch_dist"
    assert saved["model"]["ffn_hidden_size"] == 256


def test_vpp_with_two_stages_on_gloo_uses_unbatched_p2p():
    assert batch_p2p_comm_for(2, 2, "gloo") is False
    assert batch_p2p_comm_for(2, None, "gloo") is True
    assert batch_p2p_comm_for(4, 2, "gloo") is True
    assert batch_p2p_comm_for(2, 2, "nccl") is True


def test_log_lines_follow_megatron_format():
    line = training_log_line(7, 100, 56, 123.45, 3e-4, 8, 5.123456789, 1.5, 0, 0)
    assert re.search(r" iteration\s+7/\s+100 \|", line)
    assert "elapsed time per iteration (ms): 123.5 |" in line
    assert "learning rate: 3.000000E-04 |" in line
    assert "lm loss: 5.123457E+00 |" in line
    assert "grad norm: 1.500 |" in line
    assert "lm loss value: 2.000000E+00 |" in validation_lines(3, 2.0)
    # With --decoupled-lr, Megatron-LM prints that group's rate right after the learning rate.
    line = training_log_line(7, 100, 56, 123.45, 3e-4, 8, 5.1, 1.5, 0, 0, decoupled_lr=5e-3)
    assert "| learning rate: 3.000000E-04 | decoupled learning rate: 5.000000E-03 | global " \
        "batch size:     8 |" in line


def test_log_window_averages_stepped_iterations_and_drops_an_all_skipped_loss():
    """Megatron-LM's training_log: the printed loss is the mean over the window's iterations
    whose step was taken; a window of skipped (fp16 overflow) steps prints no `lm loss`."""
    from megatron.training.training import LogWindow

    window = LogWindow()
    window.add(6.0, stepped=False)
    window.add(5.0, stepped=True)
    window.add(4.0, stepped=True)
    assert window.take() == (4.5, 1)
    window.add(3.0, stepped=False)
    assert window.take() == (None, 1)
    assert window.take() == (None, 0)
    line = training_log_line(2, 10, 16, 1.0, 1e-3, 8, None, None, 1, 0, loss_scale=2.0 ** 31)
    assert "lm loss" not in line and "number of skipped iterations:   1 |" in line


def test_uneven_pipeline_split():
    from megatron.training.arguments import ArgumentError, build_run_config, parse_args

    def cfg(flags, world):
        return build_run_config(parse_args(flags.split()), world_size=world)

    base = ("--num-layers 60 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 1 --global-batch-size 8 --train-iters 1 --mock-data "
            "--vocab-size 255 --pipeline-model-parallel-size 8 ")
    c = cfg(base + "--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 6", 8)
    assert c.parallel.stage_layers(60) == [6, 8, 8, 8, 8, 8, 8, 6]
    with pytest.raises(ArgumentError, match="not divisible by --pipeline-model-parallel-size 8"):
        cfg(base, 8)
    with pytest.raises(ArgumentError, match="must split evenly over the other 7"):
        cfg(base + "--decoder-first-pipeline-num-layers 5", 8)


def test_host_cache_is_sized_from_the_checkpoint_unless_given(capsys, monkeypatch):
    import torch

    from megatron.training.checkpointing import lazy as lazy_checkpointing
    from megatron.training.checkpointing.lazy import (AUTO_CACHE_MIN_MB, checkpoint_bytes_bound,
                                                      size_host_cache)

    fp32 = [torch.nn.Linear(1000, 1000)]  # 1001000 parameters: 12 bytes each with Adam
    assert checkpoint_bytes_bound(fp32) == 1001000 * 12
    bf16 = [torch.nn.Linear(1000, 1000).to(torch.bfloat16)]  # + fp32 main copy: 14 bytes each
    assert checkpoint_bytes_bound(bf16) == 1001000 * 14
    lazy = config("--async-lazy-save --save /s")
    monkeypatch.setattr(lazy_checkpointing, "host_cache_budget_mb", lambda: (20000, 1, 22222))
    sized = size_host_cache(lazy, fp32).checkpoint.lazy_save_cache_mb
    assert sized == AUTO_CACHE_MIN_MB  # 11.5 MiB of checkpoint: the smallest default cache
    assert "DataStates host cache: 16 MiB per rank (a checkpoint of rank 0 holds at most 12 MiB" \
        in capsys.readouterr().out
    big = [torch.nn.Linear(12000, 12000, device="meta")]  # ~1.6 GiB of checkpoint: all of it
    assert size_host_cache(lazy, big).checkpoint.lazy_save_cache_mb == 1649
    assert "WARNING" not in capsys.readouterr().out
    # Half of this rank's share of free memory at most; below the checkpoint, the log warns.
    monkeypatch.setattr(lazy_checkpointing, "host_cache_budget_mb", lambda: (2000, 1, 2222))
    assert size_host_cache(lazy, big).checkpoint.lazy_save_cache_mb == 1000
    assert "WARNING: the DataStates host cache (1000 MiB) may not hold a whole checkpoint of " \
        "rank 0 (1649 MiB at most)" in capsys.readouterr().out
    given = config("--async-lazy-save --save /s --lazy-save-cache-mb 64")
    assert size_host_cache(given, big) is given  # an explicit size is kept
    off = config()
    assert size_host_cache(off, big) is off and off.checkpoint.lazy_save_cache_mb is None


def test_sequence_parallel_on_a_gpu_without_fused_norms_is_one_line(monkeypatch):
    import importlib.util

    from megatron.training import cpu_compat

    sp = "--tensor-model-parallel-size 2 --sequence-parallel"
    assert config(sp, world_size=2).parallel.sequence_parallel  # CPU: cpu_compat's norms
    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("transformer_engine", "apex")
                        else real(name, *a))
    with pytest.raises(ArgumentError, match="--sequence-parallel on a GPU needs "
                                            "transformer-engine or apex"):
        config(sp, world_size=2)
    with pytest.raises(ArgumentError, match="--apply-layernorm-1p on a GPU needs "
                                            "transformer-engine or apex"):
        config("--apply-layernorm-1p")


def test_manual_gc_collects_at_the_same_points_on_every_rank(monkeypatch):
    """Megatron-LM's --manual-gc flags: automatic collection off while training, a collection
    every --manual-gc-interval iterations, a full one before each validation and a young one
    after it (unless --no-manual-gc-eval); automatic collection back on at the end. Without
    --manual-gc nothing is touched."""
    from megatron.training import training

    calls = []

    class Recorder:
        def disable(self):
            calls.append("disable")

        def enable(self):
            calls.append("enable")

        def collect(self, generation=2):
            calls.append(f"collect{generation}")

    monkeypatch.setattr(training, "gc", Recorder())
    monkeypatch.setattr(training, "evaluate", lambda trainer, **kw: calls.append("evaluate"))
    t = config("--manual-gc --manual-gc-interval 3").training
    assert (t.manual_gc, t.manual_gc_interval, t.manual_gc_eval) == (True, 3, True)
    policy = training._ManualGC(t)
    policy.start()
    for it in range(1, 7):
        policy.after_iteration(it)
    policy.validate(None)
    policy.stop()
    assert calls == ["disable", "collect2", "collect2", "collect2", "collect2", "evaluate",
                     "collect0", "enable"]
    calls.clear()
    quiet = training._ManualGC(config("--manual-gc --no-manual-gc-eval").training)
    quiet.start()
    quiet.after_iteration(3)
    quiet.validate(None)
    assert calls == ["disable", "collect2", "evaluate"]
    calls.clear()
    off = training._ManualGC(config("--manual-gc-interval 3").training)
    off.start()
    off.after_iteration(3)
    off.validate(None)
    off.stop()
    assert calls == ["evaluate"]


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_centered_norms_scale_by_one_plus_their_weight(normalization):
    """--apply-layernorm-1p without apex/TE (cpu_compat's torch norms): the weight starts at 0
    and the norm scales by 1 + weight, as megatron-core's fused norms and TE's do."""
    import torch
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.training.cpu_compat import apply_cpu_patches
    from megatron.training.model import transformer_config

    apply_cpu_patches()
    c = config(f"--apply-layernorm-1p --normalization {normalization}")
    norm = WrappedTorchNorm(transformer_config(c.model, c.parallel, "gloo"), 64, eps=1e-5)
    assert torch.equal(norm.weight.detach(), torch.zeros(64))
    x = torch.randn(3, 64)
    plain = getattr(torch.nn, normalization)(64, eps=1e-5)
    assert torch.allclose(norm(x), plain(x))
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 64))
        plain.weight.copy_(norm.weight + 1)
    assert torch.allclose(norm(x), plain(x))


def test_an_exit_after_an_error_shuts_the_process_groups_down_within_its_bound(tmp_path,
                                                                                 monkeypatch):
    """pretrain_gpt.py's error exits shut the process groups down as a normal end does (left to
    the interpreter's teardown, gloo's threads once aborted a rank: status -6, not 2), and a
    shut-down that hangs (a peer gone) or fails holds the exit up at most the bound, silently."""
    import threading
    import time

    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.training import initialize

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel()
    assert initialize.shutdown_after_error() is True
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    assert initialize.shutdown_after_error() is True  # nothing up: nothing to do

    release = threading.Event()
    monkeypatch.setattr(initialize, "destroy_distributed", lambda: release.wait(60))
    started = time.monotonic()
    assert initialize.shutdown_after_error(wait_s=0.5) is False
    assert time.monotonic() - started < 30  # a bound, not a timing: the hang lasts 60 s
    release.set()

    def fails():
        raise RuntimeError("connection reset by peer")

    monkeypatch.setattr(initialize, "destroy_distributed", fails)
    assert initialize.shutdown_after_error() is True
