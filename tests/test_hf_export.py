"""`to-hf` for Llama-style models: the export loads in Hugging Face transformers with no missing or
unexpected keys and computes our model's logits (fp32, max abs difference <= 1e-4).

Two tiny real runs (1 process, 2 iterations, --async-lazy-save): rope + RMSNorm + swiglu with
grouped-query attention, untied embeddings and no biases (Llama proper), exported straight from
the DataStates checkpoint (the tool merges it to a scratch universal first); and the same with
multi-head attention, tied embeddings and biases (Llama's attention_bias/mlp_bias), exported from
the background merge's universal checkpoint. Our logits come from tests/universal_hf_probe.py
loading the same checkpoint. The GPT-2 export is checked in test_universal_resume.py.
"""
import json
from types import SimpleNamespace

import pytest
import torch

from trainer_launch import NO_DROPOUT, TINY_MODEL, convert_in_process, launch
from universal_hf_probe import our_logits, transformers_logits

ROPE = ["--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--rotary-base", "500000", "--norm-epsilon", "1e-6"]
VARIANTS = {
    # With Megatron-LM's Llama 3 recipe's zero-centered norms (--apply-layernorm-1p): each norm
    # scales by 1 + its weight, which the export hands to Hugging Face as 1 + weight.
    "gqa_untied_nobias": ROPE + ["--group-query-attention", "--num-query-groups", "2",
                                 "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                                 "--apply-layernorm-1p"],
    "mha_tied_bias": ROPE,
}
_i = TINY_MODEL.index("--max-position-embeddings")
BASE = TINY_MODEL[:_i] + TINY_MODEL[_i + 2:] + NO_DROPOUT + [
    "--num-layers", "2", "--train-iters", "2", "--eval-interval", "0"]


def _to_hf(src, dst):
    out = convert_in_process("to-hf", src, dst)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((dst / "config.json").read_text())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_llama_export_loads_in_transformers_and_gives_our_logits(variant, tmp_path):
    args = BASE + VARIANTS[variant]
    root = tmp_path / "run"
    run = launch(1, args + ["--async-lazy-save", "--save-interval", "2", "--save", str(root)] +
                 (["--universal-checkpoint-interval", "1"] if variant == "mha_tied_bias" else []))
    assert run.returncode == 0, run.describe()
    src = root / "universal" if variant == "mha_tied_bias" else root
    cfg = _to_hf(src, tmp_path / "hf")
    assert not (tmp_path / "hf.tmp-universal").exists()
    gqa = variant == "gqa_untied_nobias"
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["hidden_act"] == "silu"
    assert (cfg["num_key_value_heads"], cfg["tie_word_embeddings"], cfg["attention_bias"]) == \
        ((2, False, False) if gqa else (4, True, True))
    assert (cfg["rope_theta"], cfg["rms_norm_eps"], cfg["torch_dtype"]) == (5e5, 1e-6, "float32")
    # NullTokenizer --vocab-size 255: ids 0..254, eod 255, padded to 256 for the logits.
    assert (cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"]) == (256, 255, 255)
    assert (cfg["intermediate_size"], cfg["max_position_embeddings"]) == (128, 32)

    ref = our_logits(args, src, tmp_path)
    # transformers runs in a fresh interpreter as our model does: one run of this test on a
    # busy pytest worker (after other files) once gave logits 4.7e-3 away, never reproduced.
    hf = transformers_logits(tmp_path / "hf", ref["tokens"], tmp_path)
    assert hf["class"] == "LlamaForCausalLM"
    assert not hf["missing_keys"] and not hf["unexpected_keys"], hf
    assert not hf["mismatched_keys"], hf
    ours = hf["logits"]
    assert ours.shape == ref["logits"].shape == (2, 32, 256)
    diff = (ours - ref["logits"]).abs().max().item()
    print(f"{variant}: max |transformers - megatron| logits = {diff:.3g}")
    assert diff <= 1e-4, diff


class _Fake:
    """Just enough of a UniversalCheckpoint for the architecture checks."""

    def __init__(self, **model):
        self.directory = "/ckpt"
        self.manifest = {"model_config": dict(
            num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
            max_position_embeddings=32, vocab_size=256, **model)}

    def has(self, name):
        return False

    def info(self, name):
        return SimpleNamespace(shape=(256, 64), dtype=torch.float32)


@pytest.mark.parametrize("model,needles", [
    (dict(position_embedding_type="rope", rotary_percent=0.5, normalization="LayerNorm",
          swiglu=True), ["Llama model", "rotary_percent 0.5", "LayerNorm (Llama has RMSNorm only)"]),
    (dict(position_embedding_type="rope", normalization="RMSNorm"), ["a non-gated MLP"]),
    (dict(normalization="RMSNorm", swiglu=True),
     ["GPT-2 model", "RMSNorm (GPT-2 has LayerNorm)", "a SwiGLU MLP", "rotary models export as"]),
])
def test_shapes_hugging_face_cannot_express_are_refused_naming_the_part(model, needles):
    from datastates import CheckpointError
    from datastates.megatron_adapter.hf.exporter import _config_and_plan

    with pytest.raises(CheckpointError) as e:
        _config_and_plan(_Fake(**model))
    message = str(e.value)
    assert "\n" not in message and all(n in message for n in needles), message
