"""NVIDIA Megatron-LM checkpoints (issue 19): ours resuming theirs, and theirs resuming ours.

The fixtures under tests/fixtures/megatron_lm/ were written by Megatron-LM's own training loop at
tag core_v0.16.1 (tests/megatron_lm_fixtures.py says how); each records the `lm loss` Megatron-LM
printed for the iteration after its checkpoint, which our resume must print exactly.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil

import pytest
import torch

from trainer_launch import REPO, launch

FIXTURES = REPO / "tests" / "fixtures" / "megatron_lm"
#: A training log line (ours and Megatron-LM's share the format): consumed samples, lm loss.
_MLM_LINE = r" iteration\s+{}/\s*\d+ \| consumed samples:\s+(\d+) \|.*? lm loss: (\S+) \|"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "fixture.json").is_file())


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name / "fixture.json").read_text())


def _copy(name: str, dest) -> str:
    shutil.copytree(FIXTURES / name, dest, ignore=shutil.ignore_patterns("fixture.json"))
    return str(dest)


def test_fixtures_are_megatron_lm_checkpoints():
    assert len(NAMES) >= 4, NAMES
    kinds = {(_fixture(n)["distrib_optim_sharding_type"], "--swiglu" in _fixture(n)["trainer_flags"])
             for n in NAMES}
    assert {k for k, _ in kinds} == {None, "dp_reshardable", "fully_reshardable"}
    assert {llama for _, llama in kinds} == {False, True}


@pytest.mark.parametrize("name", NAMES)
def test_resume_megatron_lm_checkpoint_prints_its_next_loss(name, tmp_path):
    fixture = _fixture(name)
    load = _copy(name, tmp_path / "load")
    run = launch(1, fixture["trainer_flags"] + ["--load", load])
    assert run.returncode == 0, run.describe()
    assert "written by Megatron-LM" in run.stdout, run.stdout[-2000:]
    assert "optimizer restored, rng restored" in run.stdout, run.stdout[-2000:]
    losses = run.losses()
    # Megatron-LM printed these for the same iterations in the uninterrupted run (from the
    # second one on, they follow the learning rates of each parameter group the resume restored:
    # gpt2_distopt_decoupled_lr's decoupled group is unmarked in Megatron-LM's checkpoint).
    later = fixture.get("later_losses", {str(fixture["next_iteration"]): fixture["lm_loss"]})
    assert {str(it): loss for it, loss in losses.items()} == later, fixture["log_line"]
    assert losses[fixture["next_iteration"]] == fixture["lm_loss"]
    consumed = re.search(r" consumed samples:\s+(\d+) \|", fixture["log_line"]).group(1)
    assert re.search(_MLM_LINE.format(fixture["next_iteration"]), run.stdout).group(1) == consumed


def test_release_tracker_loads_weights_as_iteration_zero(tmp_path):
    fixture = _fixture("gpt2_adam")
    root = tmp_path / "load"
    _copy("gpt2_adam", root)
    os.rename(root / f"iter_{fixture['saved_iteration']:07d}", root / "release")
    (root / "latest_checkpointed_iteration.txt").write_text("release\n")
    flags = list(fixture["trainer_flags"])
    flags[flags.index("--train-iters") + 1] = "2"
    run = launch(1, flags + ["--load", str(root)])
    assert run.returncode == 0, run.describe()
    assert f"{root / 'release'} (format torch_dist, written by Megatron-LM, iteration 0; " \
           "optimizer not restored, rng not restored)" in run.stdout, run.stdout[-2000:]
    assert sorted(run.losses()) == [1, 2]


# ----------------------------------------------------------------------------- bad input

def _common(name: str = "gpt2_distopt_dp_reshardable") -> dict:
    from datastates.megatron_adapter import paths

    fixture = _fixture(name)
    return paths.saved_common(str(FIXTURES / name / f"iter_{fixture['saved_iteration']:07d}"))


def test_megatron_lm_args_give_the_model_and_layout():
    from megatron.training.checkpointing import upstream_compat

    saved = json.loads(upstream_compat.saved_config_from_args(_common("llama_adam"), "x"))
    assert saved["model"]["num_layers"] == 2 and saved["model"]["hidden_size"] == 32
    assert saved["model"]["position_embedding_type"] == "rope"
    assert saved["model"]["normalization"] == "RMSNorm" and saved["model"]["swiglu"] is True
    assert saved["model"]["num_query_groups"] == 2 and saved["model"]["add_bias_linear"] is False
    assert saved["parallel"]["tensor_model_parallel_size"] == 1
    assert saved["checkpoint"] == {"save_optim": True, "save_rng": True}


def test_dp_reshardable_at_another_tp_names_the_conversion():
    from megatron.training.checkpointing.contents import CheckpointError
    from megatron.training.checkpointing.loading import _megatron_lm_optimizer_metadata

    common = _common()
    layout = {"tp": 1, "pp": 1, "vpp": None, "dp": 1}
    assert _megatron_lm_optimizer_metadata(common, layout, dict(layout, dp=2), "x")[
        "distrib_optim_sharding_type"] == "dp_reshardable"  # DP may change
    with pytest.raises(CheckpointError) as err:
        _megatron_lm_optimizer_metadata(common, layout, dict(layout, tp=2), "x")
    text = str(err.value)
    assert "dp_reshardable" in text and "TP=1, PP=1" in text and "TP=2, PP=1" in text
    assert "--dist-ckpt-optim-fully-reshardable" in text and "--no-load-optim" in text


@pytest.mark.parametrize("change, field", [
    (lambda c: c.update(checkpoint_version=4.0), "checkpoint_version"),
    (lambda c: c.update(moe_router_state={}), "moe_router_state"),
    (lambda c: setattr(c["args"], "num_experts", 8), "num_experts=8"),
    (lambda c: delattr(c["args"], "hidden_size"), "'hidden_size'"),
    (lambda c: c["content_metadata"].update(distrib_optim_sharding_type="fsdp_dtensor"),
     "distrib_optim_sharding_type='fsdp_dtensor'"),
    (lambda c: c["content_metadata"].update(new_flag=True), "'new_flag'"),
])
def test_fields_we_do_not_read_are_refused_by_name(change, field):
    from megatron.training.checkpointing import upstream_compat
    from megatron.training.checkpointing.contents import CheckpointError

    common = _common()
    common["args"] = argparse.Namespace(**vars(common["args"]))
    change(common)
    with pytest.raises(CheckpointError, match=field.replace("(", r"\(")):
        upstream_compat.saved_config_from_args(common, "x")


def test_args_holding_another_class_are_refused_not_unpickled(tmp_path):
    import pathlib

    from datastates.megatron_adapter import paths
    from datastates.safe_load import UnsafePickleError

    iter_dir = tmp_path / "iter_0000001"
    iter_dir.mkdir()
    torch.save({"args": argparse.Namespace(num_layers=2, tokenizer=pathlib.PurePosixPath("/")),
                "checkpoint_version": 3.0}, iter_dir / "common.pt")
    with pytest.raises(UnsafePickleError, match="pathlib.PurePosixPath"):
        paths.saved_common(str(iter_dir))


# ------------------------------------------------------------------ Megatron-LM loading ours

@pytest.fixture(scope="module")
def megatron_lm_tree(tmp_path_factory) -> str:
    """Megatron-LM's source at core_v0.16.1: $MEGATRON_LM_TREE, else extracted from the mirror."""
    from megatron_lm_fixtures import MIRROR, extract_tree

    tree = os.environ.get("MEGATRON_LM_TREE")
    if tree:
        return tree
    if not os.path.isdir(MIRROR):
        pytest.skip(f"no Megatron-LM source: set MEGATRON_LM_TREE or provide the mirror {MIRROR}")
    return extract_tree(str(tmp_path_factory.mktemp("megatron_lm")))


@pytest.mark.parametrize("fmt", ["torch_dist", "datastates"])
def test_megatron_lm_resumes_our_checkpoint(megatron_lm_tree, tmp_path, fmt):
    """Megatron-LM's own load_checkpoint, without extra flags, on a checkpoint our trainer saved
    (torch_dist, or --async-lazy-save with `import datastates` in Megatron-LM's process):
    its next iteration prints our uninterrupted run's loss (weights, distributed-optimizer state,
    scheduler, iteration and consumed samples restored), its RNG state loads without complaint,
    and nothing it reads is missing. Dropout is off: on CPU Megatron-LM's resume of its *own*
    checkpoint is not bit-exact with dropout (gpt2_adam: 4.814372E+00 against the 4.809053E+00 it
    printed uninterrupted), because its torch DataLoader draws a base seed from the default
    generator when its iterator is made (after the RNG restore on resume), and on CPU that is
    dropout's generator too (on a GPU dropout draws from the CUDA one)."""
    import re

    from megatron_lm_fixtures import DISTOPT, TINY, UPSTREAM_CPU_FLAGS, run_upstream
    from trainer_launch import NO_DROPOUT, copy_checkpoints

    flags = TINY + DISTOPT + NO_DROPOUT
    lazy = ["--async-lazy-save"] if fmt == "datastates" else []
    ours = launch(1, flags + lazy + ["--save", str(tmp_path / "ours"), "--save-interval", "3"])
    assert ours.returncode == 0, ours.describe()
    load = copy_checkpoints(tmp_path / "ours", [3], 3, tmp_path / "load")
    theirs = run_upstream(megatron_lm_tree, "pretrain", UPSTREAM_CPU_FLAGS + flags
                          + ["--load", str(load)],
                          imports=["datastates"] if fmt == "datastates" else [])
    assert theirs.returncode == 0, theirs.describe()[-4000:]
    out = theirs.stdout
    assert "successfully loaded checkpoint from" in out and "at iteration 3" in out, out[-3000:]
    for complaint in ("could not find arguments", "RNG state will be ignored", "not found in "
                      "checkpoint args", "Unable to load"):
        assert complaint not in out, out[-3000:]
    from datastates.megatron_adapter import paths
    from megatron.training.flops import num_floating_point_operations, shape_of
    from megatron.training.arguments import build_run_config, parse_args

    common = paths.saved_common(os.path.join(load, "iter_0000003"))
    per_iteration = num_floating_point_operations(shape_of(build_run_config(parse_args(
        flags)).model), 4)
    assert common["num_floating_point_operations_so_far"] == pytest.approx(3 * per_iteration)
    match = re.search(_MLM_LINE.format(4), out)
    assert match, out[-3000:]
    assert match.group(1) == "16"  # consumed samples restored from our args: 3 x 4, then 4 more
    assert match.group(2) == ours.losses()[4]


def test_our_common_state_carries_what_megatron_lm_reads():
    """Every args field Megatron-LM core_v0.16.1's load_checkpoint and check_checkpoint_args
    read, and its other keys, in the common state every format of ours saves."""
    from megatron_lm_fixtures import DISTOPT, TINY

    from megatron.training.arguments import build_run_config, parse_args
    from megatron.training.checkpointing.contents import CHECKPOINT_VERSION, TrainState, common_state

    config = build_run_config(parse_args(TINY + DISTOPT))
    state = TrainState(model=[], optimizer=None, scheduler=None, iteration=3,
                       consumed_train_samples=12, consumed_valid_samples=0,
                       floating_point_operations_so_far=1.5e6)
    common = common_state(state, config)
    assert common["checkpoint_version"] == CHECKPOINT_VERSION and common["iteration"] == 3
    assert common["num_floating_point_operations_so_far"] == 1.5e6
    expected = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                "add_position_embedding": True, "max_position_embeddings": 16,
                "make_vocab_size_divisible_by": 128, "padded_vocab_size": 128,
                "tokenizer_type": "NullTokenizer", "data_parallel_random_init": False,
                "global_batch_size": 4, "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
                "world_size": 1, "data_parallel_size": 1, "no_save_rng": False,
                "no_save_optim": False, "consumed_train_samples": 12,
                "skipped_train_samples": 0, "consumed_valid_samples": 0,
                "use_distributed_optimizer": True, "ckpt_format": "torch_dist"}
    args = common["args"]
    assert {k: getattr(args, k, "MISSING") for k in expected} == expected
    # Plain values only: every format (and the universal one) stores them without pickles.
    assert all(v is None or isinstance(v, (bool, int, float, str)) for v in vars(args).values())
