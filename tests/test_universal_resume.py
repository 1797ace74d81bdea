"""Universal checkpoints end to end (gloo): save at TP2xPP2 with the distributed optimizer while
the background merge runs, then load the merged checkpoint at TP1/PP1/DP2 (distributed optimizer)
and TP2/PP1/DP1 (plain optimizer).

What each rank restored is dumped right after loading (tests/universal_probe.py saves it as
torch_dist before any step), converted back to universal, and compared bit for bit with the merged
checkpoint; the probe then trains one iteration, whose loss must match the uninterrupted run.
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from datastates import CheckpointReader
from datastates.megatron_adapter import open_source
from datastates.universal import UniversalCheckpoint, write_universal
from trainer_launch import (NO_DROPOUT, REPO, TINY_MODEL, Run, _kill_tree, assert_close,
                            convert_in_process, launch)

FOUR = ["--train-iters", "4", "--eval-interval", "0"]
PROBE = str(REPO / "tests" / "universal_probe.py")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("universal_tp2pp2")
    run = launch(4, TINY_MODEL + NO_DROPOUT + FOUR + [
        "--async-lazy-save", "--save-interval", "3", "--use-distributed-optimizer",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--universal-checkpoint-interval", "1", "--save", str(root)], timeout=400)
    assert run.returncode == 0, run.describe()
    return run, root


def _probe(nproc, args, timeout=300) -> Run:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", PROBE] + args
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        raise
    return Run(proc.returncode, out, err)


def test_background_merge_of_every_commit(saved):
    run, root = saved
    uroot = root / "universal"
    lines = [x for x in run.stdout.splitlines() if x.startswith(" universal merge iteration")]
    assert [int(x.split("|")[0].split()[-1]) for x in lines] == [3, 4], run.stdout[-3000:]
    assert all("throughput (GB/s)" in x for x in lines)
    assert (uroot / "latest_checkpointed_iteration.txt").read_text() == "4"
    records = [json.loads(x) for x in open(uroot / "universal_merges.jsonl")]
    assert [r["iteration"] for r in records] == [3, 4] and all(r["bytes"] > 0 for r in records)
    # Every universal tensor is the gathered original, bit for bit.
    reader = CheckpointReader(str(root / "iter_0000003"))
    with UniversalCheckpoint(str(uroot / "iter_0000003")) as u:
        assert u.manifest["source"]["layout"]["tp"] == 2 and u.manifest["iteration"] == 3
        keys = reader.tensor_keys(shards_only=True)
        assert len(keys) == len(u.names())
        for key in keys:
            name = key.replace("optimizer.state.param.", "optimizer.state.fp32_param.")
            assert torch.equal(u.read(name), reader.read(key)), key


@pytest.mark.parametrize("layout", ["tp1pp1dp2_distopt", "tp2pp1dp1_plain",
                                    "datastates_tp1pp1dp2_distopt"])
def test_load_at_another_layout_bit_exact_then_same_loss(saved, tmp_path, layout):
    """The merged universal checkpoint, or (datastates_*) the DataStates checkpoint it was merged
    from, whose distributed-optimizer state each DP rank reads straight into its own ranges."""
    run, root = saved
    merged = root / "universal" / "iter_0000003"
    if layout == "datastates_tp1pp1dp2_distopt":
        extra = ["--use-distributed-optimizer"]
        load = tmp_path / "root"
        shutil.copytree(root / "iter_0000003", load / "iter_0000003")
        (load / "latest_checkpointed_iteration.txt").write_text("3")
    elif layout == "tp1pp1dp2_distopt":
        extra = ["--use-distributed-optimizer"]
        load = tmp_path / "uroot"  # a universal root with its tracker, as --load usually is
        shutil.copytree(merged, load / "iter_0000003")
        (load / "latest_checkpointed_iteration.txt").write_text("3")
    else:
        extra = ["--tensor-model-parallel-size", "2"]
        load = merged  # or the universal directory itself
    dump = tmp_path / "dump"
    probe = _probe(2, TINY_MODEL + NO_DROPOUT + FOUR + extra + [
        "--load", str(load), "--save", str(dump)])
    assert probe.returncode == 0, probe.describe()
    kind = "format datastates" if layout.startswith("datastates") else "loaded universal"
    assert kind in probe.stdout and "optimizer restored" in probe.stdout, probe.stdout[-3000:]
    assert_close({4: probe.losses()[4]}, {4: run.losses()[4]})
    if layout == "tp2pp1dp1_plain":
        # The resume line's bytes: what the two TP ranks read out of the memory-mapped files,
        # every tensor this run needs once (a plain fp32 optimizer has no fp32 copies to read)
        # plus the few TP replicates (layer norms, row-parallel biases) both read; before,
        # /proc's rchar saw none of the mapped reads (61 KB of 17.5 MB).
        (nbytes,) = re.findall(r" checkpoint load \| iteration\s+3 \| bytes read: (\d+) \|",
                               probe.stdout)
        with UniversalCheckpoint(str(merged)) as u:
            total = sum(math.prod(u.info(n).shape) * u.info(n).dtype.itemsize for n in u.names()
                        if ".fp32_param." not in n)
        assert total <= int(nbytes) <= 1.05 * total, (nbytes, total)
    restored = write_universal(open_source(str(dump / "iter_0000003")), str(tmp_path / "u2"))
    with UniversalCheckpoint(str(merged)) as a, UniversalCheckpoint(restored.directory) as b:
        assert a.names() == b.names()
        for name in a.names():
            assert torch.equal(a.read(name), b.read(name)), name
        for field in ("iteration", "consumed_train_samples", "scheduler"):
            assert a.manifest[field] == b.manifest[field], field
        assert a.manifest["optimizer"]["step"] == b.manifest["optimizer"]["step"] == 3.0
        assert a.manifest["optimizer"]["param_groups"] == b.manifest["optimizer"]["param_groups"]


def _gpt2_logits(w: dict, cfg: dict, tokens: torch.Tensor) -> torch.Tensor:
    """A plain GPT-2 forward (Hugging Face's names and Conv1D layout), written from the paper."""
    F = torch.nn.functional
    b, s = tokens.shape
    heads, h = cfg["n_head"], cfg["n_embd"]
    ln = lambda x, p: F.layer_norm(x, (h,), w[p + ".weight"], w[p + ".bias"],  # noqa: E731
                                   cfg["layer_norm_epsilon"])
    x = w["transformer.wte.weight"][tokens] + w["transformer.wpe.weight"][torch.arange(s)]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        qkv = ln(x, p + "ln_1") @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (t.view(b, s, heads, h // heads).transpose(1, 2) for t in qkv.split(h, -1))
        att = (q @ k.transpose(-1, -2)) / (h // heads) ** 0.5
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + y @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        m = F.gelu(ln(x, p + "ln_2") @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = ln(x, "transformer.ln_f")
    return x @ w.get("lm_head.weight", w["transformer.wte.weight"]).t()


def test_hf_export_computes_what_megatron_computes(saved, tmp_path):
    """The exported GPT-2 weights, run through a plain GPT-2 forward and through transformers'
    GPT2LMHeadModel, give megatron's logits."""
    from safetensors.torch import load_file

    from datastates.megatron_adapter import export_hf

    run, root = saved
    merged = root / "universal" / "iter_0000003"
    cfg = export_hf(str(merged), str(tmp_path / "hf"))
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               LOGITS_OUT=str(tmp_path / "logits.pt"))
    out = subprocess.run([sys.executable, str(REPO / "tests" / "universal_hf_probe.py")] +
                         TINY_MODEL + NO_DROPOUT + FOUR + ["--load", str(merged)],
                         cwd=str(REPO), env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ref = torch.load(str(tmp_path / "logits.pt"), weights_only=True)
    ours = _gpt2_logits(weights, cfg, ref["tokens"])
    assert ours.shape == ref["logits"].shape
    torch.testing.assert_close(ours, ref["logits"], rtol=1e-4, atol=1e-4)
    # bos/eos inside the vocabulary (NullTokenizer --vocab-size 255: eod 255), eps from the run.
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["vocab_size"]) == (255, 255, 256)
    assert (cfg["layer_norm_epsilon"], cfg["torch_dtype"]) == (1e-5, "float32")
    from universal_hf_probe import transformers_logits  # transformers in a fresh interpreter

    hf = transformers_logits(tmp_path / "hf", ref["tokens"], tmp_path)
    assert hf["class"] == "GPT2LMHeadModel"
    assert not hf["missing_keys"] and not hf["unexpected_keys"], hf
    diff = (hf["logits"] - ref["logits"]).abs().max().item()
    print(f"gpt2: max |transformers - megatron| logits = {diff:.3g}")
    assert diff <= 1e-4, diff


def test_datastates_to_torch_dist_directly_resumes_bit_exact(saved, tmp_path):
    """`to-torch-dist` on a DataStates checkpoint (no universal merge): megatron's torch_dist
    layout, resumed at the same TP2xPP2 layout, gives iteration 4 exactly as the saving run."""
    from datastates.megatron_adapter import paths

    run, root = saved
    out_root = tmp_path / "torch_dist"
    conv = subprocess.run([sys.executable, "-m", "tools.convert_checkpoint", "to-torch-dist",
                           str(root / "iter_0000003"), str(out_root / "iter_0000003")],
                          cwd=str(REPO),
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert conv.returncode == 0, conv.stdout[-3000:] + conv.stderr[-3000:]
    assert paths.sharded_backend(str(out_root / "iter_0000003")) == "torch_dist"
    assert (out_root / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    resumed = launch(4, TINY_MODEL + NO_DROPOUT + FOUR + [
        "--use-distributed-optimizer", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--load", str(out_root)], timeout=400)
    assert resumed.returncode == 0, resumed.describe()
    assert "format torch_dist, iteration 3; optimizer restored, rng restored" in resumed.stdout
    assert resumed.losses() == {4: run.losses()[4]}
    # The refusal comes before the writer starts a process: in this one (no interpreter start).
    wrong = convert_in_process("to-torch-dist", out_root / "iter_0000003", tmp_path / "again")
    assert wrong.returncode == 2 and "expected a DataStates checkpoint" in wrong.stderr, \
        wrong.stderr
