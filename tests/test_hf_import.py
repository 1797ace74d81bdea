"""`from-hf`: a Hugging Face model made with transformers (tiny random config, save_pretrained, no
download) becomes a universal checkpoint that our model loads with transformers' logits, that
`to-hf` turns back into the same tensors bit for bit, and that pretrain_gpt.py resumes at TP=2.

Models: a Llama with grouped-query attention and untied embeddings saved in several shards; a
GPT-2 with tied embeddings, biases and a vocabulary (250) the trainer pads (to 256); a Llama with
biases and tied embeddings for the round trip. Bad input: architectures we do not convert, a
missing shard, pickled weights, and a conversion that fails half-way (nothing committed).
"""
import glob
import json
import os
import re
import shutil

import pytest
import torch

from trainer_launch import assert_close, launch
from universal_hf_probe import our_logits, transformers_logits

from tools.convert_checkpoint import main as convert

TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
         "--lr", "1e-3", "--mock-data", "--log-interval", "1", "--eval-interval", "0"]


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
               tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-6)
    return LlamaForCausalLM(LlamaConfig(**dict(cfg, **kw)))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=250, n_embd=64, n_layer=2, n_head=4,
                                      n_positions=32, activation_function="gelu",
                                      layer_norm_epsilon=1e-5, bos_token_id=249,
                                      eos_token_id=249))


MODELS = {"llama_gqa_untied": lambda: _llama(),
          "gpt2_tied_padded_vocab": _gpt2,
          "llama_bias_tied": lambda: _llama(attention_bias=True, mlp_bias=True,
                                            tie_word_embeddings=True, num_key_value_heads=4)}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {}
    for name, make in MODELS.items():
        model = make()
        with torch.no_grad():  # transformers zeroes biases and sets norms to 1: make them count
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        # the GQA Llama in 60 KB shards (9 files), the others in one file
        model.save_pretrained(str(root / name),
                              max_shard_size="60KB" if name == "llama_gqa_untied" else "1GB")
        out[name] = root / name
    return out


def _from_hf(src, dst, capsys):
    assert convert(["from-hf", str(src), str(dst)]) == 0
    printed = capsys.readouterr().out
    flags = re.search(r"pretrain_gpt\.py (.*) --load", printed).group(1).split()
    return printed, flags


def _tensors(directory):
    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(os.path.join(str(directory), "*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_from_hf_then_to_hf_is_bit_exact(name, hf_dirs, tmp_path, capsys):
    src = hf_dirs[name]
    assert name != "llama_gqa_untied" or len(glob.glob(str(src / "*.safetensors"))) > 2
    _from_hf(src, tmp_path / "u", capsys)
    files = sorted(os.listdir(tmp_path / "u"))
    assert "UNIVERSAL_COMMIT.json" in files and not glob.glob(str(tmp_path / "u.tmp-*"))
    assert all(os.stat(tmp_path / "u" / f).st_mode & 0o777 == 0o644 for f in files)
    manifest = json.loads((tmp_path / "u" / "manifest.json").read_text())
    assert (manifest["iteration"], manifest["optimizer"], manifest["release"]) == (0, None, True)
    assert manifest["checksum"]["algorithm"] == "crc32c"
    assert convert(["to-hf", str(tmp_path / "u"), str(tmp_path / "back")]) == 0
    original, back = _tensors(src), _tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for k, t in original.items():
        assert t.dtype == back[k].dtype and torch.equal(t, back[k]), k
    before = json.loads((src / "config.json").read_text())
    after = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in ("architectures", "vocab_size", "hidden_size", "n_embd", "num_key_value_heads",
                "intermediate_size", "rms_norm_eps", "layer_norm_epsilon", "tie_word_embeddings",
                "attention_bias", "max_position_embeddings", "n_positions"):
        assert before.get(key) == after.get(key), key


@pytest.mark.parametrize("name", ["gpt2_tied_padded_vocab", "llama_gqa_untied"])
def test_our_model_gives_transformers_logits_and_trains_at_tp2(name, hf_dirs, tmp_path, capsys):
    printed, flags = _from_hf(hf_dirs[name], tmp_path / "u", capsys)
    ref = our_logits(flags + TRAIN, tmp_path / "u", tmp_path)
    # Both models run in fresh interpreters (see test_hf_export).
    theirs = transformers_logits(hf_dirs[name], ref["tokens"], tmp_path)["logits"]
    vocab = theirs.shape[-1]
    assert ref["logits"].shape == (2, 32, 256) and vocab == (250 if "gpt2" in name else 256)
    diff = (theirs - ref["logits"][..., :vocab]).abs().max().item()
    print(f"{name}: max |transformers - megatron| logits = {diff:.3g}")
    assert diff <= 1e-4, diff
    if "gpt2" in name:
        return
    # Iteration 1's loss is computed with the loaded weights: TP=2 (q/k/v groups and the
    # vocabulary split over 2 ranks) computes what TP=1 does on the same batch.
    runs = [launch(n, flags + TRAIN + ["--tensor-model-parallel-size", str(n),
                                       "--load", str(tmp_path / "u")]) for n in (1, 2)]
    for run in runs:
        assert run.returncode == 0, run.describe()
        assert "is a release checkpoint" in run.stdout and "training from iteration 0 to 1" in \
            run.stdout, run.describe()
    assert_close(runs[1].losses(), runs[0].losses())
    wrong = launch(1, [f for f in flags if f != "--untie-embeddings-and-output-weights"] + TRAIN
                   + ["--load", str(tmp_path / "u")])
    assert wrong.returncode != 0 and "checkpoint was saved for another model shape " \
        "(untie_embeddings_and_output_weights: checkpoint True, this run False)" in \
        wrong.stderr + wrong.stdout, wrong.describe()


def _error(argv, capsys):
    """The error a failing conversion ends with: one line, after any progress lines."""
    assert convert(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("convert_checkpoint.py: error: "), lines
    assert not any(line.startswith("convert_checkpoint.py") for line in lines[:-1]), lines
    return lines[-1]


@pytest.mark.parametrize("config,needle", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "MistralForCausalLM"),
    ({"architectures": ["BertModel"], "model_type": "bert"}, "BertModel"),
])
def test_unsupported_architecture_gets_one_line(config, needle, tmp_path, capsys):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    err = _error(["from-hf", str(src), str(tmp_path / "u")], capsys)
    assert needle in err and "LlamaForCausalLM and GPT2LMHeadModel" in err, err
    assert not (tmp_path / "u").exists()


@pytest.mark.parametrize("name,change,needles", [
    ("llama_gqa_untied", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}},
     ["cannot convert this Hugging Face LlamaForCausalLM", "rope scaling 'llama3'"]),
    ("gpt2_tied_padded_vocab", {"activation_function": "gelu_new"},
     ["activation_function 'gelu_new'", "--allow-approximate-gelu"]),
    ("llama_gqa_untied", {"hidden_size": None}, ["needs positive integer vocab_size, "
                                                  "hidden_size", "found hidden_size=None"]),
])
def test_parts_megatron_cannot_express_get_one_line(name, change, needles, hf_dirs, tmp_path,
                                                    capsys):
    src = tmp_path / "hf"
    src.mkdir()
    config = json.loads((hf_dirs[name] / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, **change)))
    err = _error(["from-hf", str(src), str(tmp_path / "u")], capsys)
    assert all(n in err for n in needles), err


def test_missing_shard_and_pickled_weights_are_refused(hf_dirs, tmp_path, capsys):
    src = tmp_path / "hf"
    shutil.copytree(hf_dirs["llama_gqa_untied"], src)
    os.remove(src / "model-00003-of-00009.safetensors")
    err = _error(["from-hf", str(src), str(tmp_path / "u")], capsys)
    assert "names 9 shard files and 1 of them are missing (model-00003-of-00009" in err, err
    for f in glob.glob(str(src / "model*")):
        os.remove(f)
    (src / "pytorch_model.bin").write_bytes(b"not read")
    err = _error(["from-hf", str(src), str(tmp_path / "u")], capsys)
    assert "found pytorch_model.bin" in err and "safetensors only" in err, err
    assert not (tmp_path / "u").exists()


def test_a_hub_cache_snapshot_converts_and_links_out_of_it_are_refused(hf_dirs, tmp_path,
                                                                      capsys):
    """The Hugging Face hub cache keeps a revision's files as links to ../../blobs/: reads
    follow them inside the model's cache directory and nowhere else."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for f in os.listdir(hf_dirs["gpt2_tied_padded_vocab"]):
        shutil.copyfile(hf_dirs["gpt2_tied_padded_vocab"] / f, repo / "blobs" / ("blob-" + f))
        os.symlink(os.path.join("..", "..", "blobs", "blob-" + f), snap / f)
    _from_hf(snap, tmp_path / "u", capsys)
    assert torch.equal(_tensors(tmp_path / "u")["embedding.word_embeddings.weight"],
                       _tensors(hf_dirs["gpt2_tied_padded_vocab"])["transformer.wte.weight"])
    outside = tmp_path / "elsewhere.safetensors"
    os.rename(os.path.realpath(snap / "model.safetensors"), outside)
    os.remove(snap / "model.safetensors")
    os.symlink(outside, snap / "model.safetensors")
    err = _error(["from-hf", str(snap), str(tmp_path / "u2")], capsys)
    assert "resolves through a symlink" in err and "not inside" in err, err


def test_gpt2_saved_as_its_base_model_with_mask_buffers_converts_the_same(hf_dirs, tmp_path,
                                                                         capsys):
    """The original GPT-2 files name tensors without ``transformer.`` (saved from GPT2Model) and
    hold each layer's causal-mask buffer ``h.<i>.attn.bias``: the same weights result."""
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    src.mkdir()
    shutil.copyfile(hf_dirs["gpt2_tied_padded_vocab"] / "config.json", src / "config.json")
    tensors = {k[len("transformer."):]: v
               for k, v in _tensors(hf_dirs["gpt2_tied_padded_vocab"]).items()}
    tensors.update({f"h.{i}.attn.bias": torch.ones(1, 1, 32, 32).tril() for i in range(2)})
    save_file(tensors, str(src / "model.safetensors"))
    _from_hf(src, tmp_path / "base", capsys)
    _from_hf(hf_dirs["gpt2_tied_padded_vocab"], tmp_path / "full", capsys)
    base, full = _tensors(tmp_path / "base"), _tensors(tmp_path / "full")
    assert sorted(base) == sorted(full) and all(torch.equal(base[k], full[k]) for k in full)


def test_a_conversion_that_fails_half_way_commits_nothing(hf_dirs, tmp_path, capsys):
    src = tmp_path / "hf"
    shutil.copytree(hf_dirs["llama_gqa_untied"], src)
    last = sorted(glob.glob(str(src / "model-*.safetensors")))[-1]
    with open(last, "r+b") as f:  # the header stays intact: found only when its data is read
        f.truncate(os.path.getsize(last) - 100)
    err = _error(["from-hf", str(src), str(tmp_path / "u")], capsys)
    assert "truncated" in err, err
    assert not (tmp_path / "u").exists() and not glob.glob(str(tmp_path / "u.tmp-*"))
