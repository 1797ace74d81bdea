"""A Llama-style model (rope, swiglu, RMSNorm, grouped-query attention, untied, no biases) trains,
checkpoints and resumes bit-exactly in every format, and reshards through the universal format.

Launches (about 70 s on 2 cores): one torch_dist reference run saving at 3 and 6; a resume of its
iteration 3 that saves in the torch format at 5, and a resume of that; fp16 with dynamic loss
scaling and --async-lazy-save, then a resume (the loss scale must continue, not restart); TP2 x PP2
with the distributed optimizer, lazy saves and the background merge, then the merged universal
checkpoint of iteration 3 loaded at TP1 x PP1 with the plain optimizer.
"""
import json
import zlib

import pytest
import torch

from megatron.training.checkpointing.contents import safe_torch_load

from trainer_launch import NO_DROPOUT, TINY_MODEL, after, assert_close, copy_checkpoints, launch

LLAMA = ["--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--group-query-attention", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
# rope needs no position table: drop --max-position-embeddings as a Llama launch line would.
_i = TINY_MODEL.index("--max-position-embeddings")
MODEL = TINY_MODEL[:_i] + TINY_MODEL[_i + 2:] + NO_DROPOUT + LLAMA
SIX = ["--train-iters", "6", "--eval-interval", "3", "--eval-iters", "1"]


def _scales(run):
    return [line.split(" loss scale: ")[1].split(" |")[0] for line in run.stdout.splitlines()
            if " loss scale: " in line]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 rank, fp32, torch_dist saves at 3 and 6."""
    root = tmp_path_factory.mktemp("llama_ref")
    run = launch(1, MODEL + SIX + ["--save", str(root), "--save-interval", "3"])
    assert run.returncode == 0, run.describe()
    return run, root


@pytest.fixture(scope="module")
def torch_dist_resume(reference, tmp_path_factory):
    """Resumes the reference's torch_dist checkpoint of iteration 3 and saves in the torch format
    at 5 (and 6), for the torch-format resume below."""
    _, root = reference
    tmp = tmp_path_factory.mktemp("llama_td_resume")
    run = launch(1, MODEL + SIX + ["--load", copy_checkpoints(root, [3], 3, tmp / "load"),
                                   "--ckpt-format", "torch", "--save", str(tmp / "torch"),
                                   "--save-interval", "5"])
    assert run.returncode == 0, run.describe()
    return run, tmp / "torch"


def test_torch_dist_resume_is_bit_exact(reference, torch_dist_resume):
    run, root = reference
    model = json.loads((root / "run_config.json").read_text())["model"]
    assert (model["position_embedding_type"], model["normalization"], model["swiglu"],
            model["num_query_groups"], model["add_bias_linear"], model["ffn_hidden_size"]) == (
        "rope", "RMSNorm", True, 2, False, 128)
    assert _scales(run) == ["1.0"] * 6
    resumed, _ = torch_dist_resume
    assert "optimizer restored, rng restored" in resumed.stdout
    assert resumed.losses() == after(run.losses(), 3)
    assert resumed.grad_norms() == after(run.grad_norms(), 3)
    assert resumed.validation() == after(run.validation(), 3)


def test_torch_format_resume_is_bit_exact(reference, torch_dist_resume, tmp_path):
    run, _ = reference
    _, torch_root = torch_dist_resume
    assert (torch_root / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    resumed = launch(1, MODEL + SIX + ["--load", copy_checkpoints(torch_root, [5], 5, tmp_path)])
    assert resumed.returncode == 0, resumed.describe()
    assert "format torch" in resumed.stdout
    assert resumed.losses() == after(run.losses(), 5)
    assert resumed.validation() == after(run.validation(), 5)


def test_fp16_lazy_save_resumes_losses_and_loss_scale(tmp_path):
    """fp16 with dynamic loss scaling (megatron-core's scaler: the scale doubles after every 2
    clean iterations here) and --async-lazy-save; the resumed run must continue the scale."""
    flags = MODEL + SIX + ["--fp16", "--initial-loss-scale", "256", "--loss-scale-window", "2",
                           "--async-lazy-save"]
    root = tmp_path / "fp16"
    run = launch(1, flags + ["--save", str(root), "--save-interval", "3"])
    assert run.returncode == 0, run.describe()
    assert _scales(run) == ["256.0", "512.0", "512.0", "1024.0", "1024.0", "2048.0"]
    resumed = launch(1, flags + ["--load", copy_checkpoints(root, [3], 3, tmp_path / "l"),
                                 "--save", str(tmp_path / "resumed")])
    assert resumed.returncode == 0, resumed.describe()
    assert "format datastates" in resumed.stdout
    assert _scales(resumed) == _scales(run)[3:]
    assert resumed.losses() == after(run.losses(), 3)
    assert resumed.grad_norms() == after(run.grad_norms(), 3)
    # Loaded without its optimizer (--finetune, also --no-load-optim, a release or pretrained
    # checkpoint), the fp32 main copies the optimizer steps are the loaded weights (Megatron-LM's
    # reload_model_params); they were the initial weights, which the first step then wrote over
    # the loaded ones. Saved as the run holds them (torch format: the main copies by name).
    out = tmp_path / "finetuned"
    converted = launch(1, flags[:-1] + ["--finetune", "--load", str(tmp_path / "l"),
                                   "--ckpt-convert-format", "torch", "--ckpt-convert-save",
                                   str(out)])
    assert converted.returncode == 0, converted.describe()
    saved = safe_torch_load(str(out / "torch" / "iter_0000000" / "mp_rank_00" /
                                "model_optim_rng.pt"))
    crc = lambda t: zlib.crc32(t.float().numpy().tobytes())  # noqa: E731
    weights = sorted(crc(t) for t in saved["model"].values()
                     if isinstance(t, torch.Tensor) and t.dtype == torch.float16)
    mains = sorted(crc(t) for group in saved["optimizer"]["fp32_from_fp16_params"] for t in group)
    assert len(weights) > 10 and mains == weights


def test_tp2_pp2_matches_one_process_and_reshards_to_tp1_pp1_through_universal(reference,
                                                                                tmp_path):
    """TP2 x PP2 splits the GQA qkv rows and both swiglu fc1 halves; its training matches the
    single process (the layout-independent initial weights include both halves), and the merged
    universal checkpoint loads at TP1 x PP1 with the next losses of the TP2 x PP2 run (weights,
    then Adam moments and step: iterations 5 and 6)."""
    ref, _ = reference
    root = tmp_path / "tp2pp2"
    run = launch(4, MODEL + SIX + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--use-distributed-optimizer", "--async-lazy-save", "--save", str(root),
        "--save-interval", "3", "--universal-checkpoint-interval", "1"], timeout=400)
    assert run.returncode == 0, run.describe()
    assert_close(run.losses(), ref.losses())
    assert_close(run.grad_norms(), ref.grad_norms(), rel=2e-3)  # printed with 3 decimals
    merged = root / "universal" / "iter_0000003"
    assert (merged / "manifest.json").is_file(), run.stdout[-3000:]
    resumed = launch(1, MODEL + SIX + ["--load", str(merged)])
    assert resumed.returncode == 0, resumed.describe()
    assert "loaded universal checkpoint" in resumed.stdout and "optimizer restored" in resumed.stdout
    assert_close(resumed.losses(), after(run.losses(), 3))
    assert_close(resumed.validation(), after(run.validation(), 3))
