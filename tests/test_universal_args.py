"""Flags of the background merge: checks and the resolved config (no process group)."""
import pytest

from megatron.training.arguments import ArgumentError, build_run_config, parse_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --mock-data --vocab-size 255")


def config(extra):
    return build_run_config(parse_args((BASE + " " + extra).split()), world_size=1)


@pytest.mark.parametrize("extra,message", [
    ("--save /tmp/x --async-lazy-save --universal-checkpoint-interval 0",
     "--universal-checkpoint-interval must be > 0, got 0"),
    ("--save /tmp/x --universal-checkpoint-interval 2", "it needs --async-lazy-save and --save"),
    ("--async-lazy-save --universal-checkpoint-interval 2", "it needs --async-lazy-save and --save"),
    ("--save /tmp/x --async-lazy-save --universal-save /tmp/u",
     "--universal-save needs --universal-checkpoint-interval N"),
    ("--save /tmp/x --async-lazy-save --keep-last-n-universal 2",
     "--keep-last-n-universal needs --universal-checkpoint-interval N"),
    ("--save /tmp/x --async-lazy-save --universal-checkpoint-interval 1 --keep-last-n-universal 0",
     "--keep-last-n-universal must be >= 1, got 0"),
])
def test_bad_merge_flags_get_a_clear_error(extra, message):
    with pytest.raises(ArgumentError) as err:
        config(extra)
    assert message in str(err.value)


def test_merge_flags_resolve_into_the_checkpoint_config():
    ckpt = config("--save /tmp/x --async-lazy-save --universal-checkpoint-interval 3 "
                  "--universal-save /tmp/u --keep-last-n-universal 2").checkpoint
    assert ckpt.universal_checkpoint_interval == 3 and ckpt.universal_save == "/tmp/u"
    assert ckpt.keep_last_n_universal == 2
    plain = config("--save /tmp/x --async-lazy-save").checkpoint
    assert plain.universal_checkpoint_interval is None and plain.keep_last_n_universal is None
