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
    ("--sequence-parallel", 1, "--sequence-parallel needs"),
    ("--train-iters 4 --lr-warmup-iters 4", 1, "--lr-warmup-iters must be >= 0 and smaller "
     "than the decay length (--lr-decay-iters, default --train-iters) 4, got 4"),
    ("--async-lazy-save --lazy-save-cache-mb 100000000", 1, "--lazy-save-cache-mb 100000000 on 1 "
     "rank(s) of this node needs 100000000 MiB of host memory, but"),
    ("--lazy-save-cache-mb 64", 1, "--lazy-save-cache-mb configure --async-lazy-save, which is "
     "not on"),
    ("--lazy-save-checksum none --ckpt-drain-timeout 5", 1,
     "--lazy-save-checksum, --ckpt-drain-timeout configure --async-lazy-save"),
    ("--async-lazy-save --async-save", 1, "two different asynchronous savers"),
    ("--async-lazy-save --ckpt-format torch", 1, "it needs --ckpt-format torch_dist"),
    ("--async-lazy-save --load /tmp/x", 1, "--async-lazy-save writes checkpoints under --save, "
     "which is not given"),
    ("--async-save --ckpt-format torch", 1, "--async-save needs --ckpt-format torch_dist"),
    ("--data-path /nonexistent/corpus", 1, "exactly one of --mock-data or --data-path"),
])
def test_contradictory_flags_get_a_clear_error(extra, world, message):
    with pytest.raises(ArgumentError) as err:
        config(extra, world)
    assert message in str(err.value)


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
