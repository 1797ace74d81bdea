"""Test helper (one process): load --load as pretrain_gpt.py does, run the model on fixed tokens
in eval mode, and torch.save the logits [batch, seq, vocab] to the path in $LOGITS_OUT.
`our_logits` runs it from a test. With `--transformers HF_DIR TOKENS`, load HF_DIR with
transformers' AutoModelForCausalLM instead and save its logits on the saved tokens, with the
loading info (`transformers_logits` runs it): both sides of an export's check in a fresh
interpreter, whatever the test process imported or patched before."""
import os
import subprocess
import sys
from pathlib import Path


def our_logits(args, load, tmp_path) -> dict:
    """{"tokens", "logits"} of our model built from pretrain_gpt.py flags `args`, loaded from
    `load` (runs this file in a subprocess)."""
    import torch

    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               LOGITS_OUT=str(tmp_path / "logits.pt"))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve())] + list(args) +
                         ["--load", str(load)], cwd=str(repo), env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return torch.load(str(tmp_path / "logits.pt"), weights_only=True)


def transformers_logits(hf_dir, tokens, tmp_path) -> dict:
    """{"logits", "class", "missing_keys", "unexpected_keys", "mismatched_keys"} of the Hugging
    Face model in `hf_dir` on `tokens` (runs this file in a subprocess)."""
    import torch

    torch.save(tokens, str(tmp_path / "tokens.pt"))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--transformers",
                          str(hf_dir), str(tmp_path / "tokens.pt")],
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                                  LOGITS_OUT=str(tmp_path / "hf_logits.pt")),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return torch.load(str(tmp_path / "hf_logits.pt"), weights_only=True)


def _transformers_main(hf_dir: str, tokens: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    with torch.no_grad():
        logits = model.eval()(torch.load(tokens, weights_only=True)).logits
    torch.save({"logits": logits.float(), "class": type(model).__name__,
                **{k: sorted(map(str, info[k])) for k in
                   ("missing_keys", "unexpected_keys", "mismatched_keys")}},
               os.environ["LOGITS_OUT"])
    return 0


def main(argv) -> int:
    if argv[:1] == ["--transformers"]:
        return _transformers_main(argv[1], argv[2])
    import torch

    from megatron.training.arguments import build_run_config, parse_args
    from megatron.training.initialize import destroy_distributed
    from megatron.training.model import unwrap
    from megatron.training.training import setup

    config = build_run_config(parse_args(argv))
    trainer = setup(config)
    model = unwrap(trainer.state.model[0])
    model.eval()
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.model.vocab_size, (2, config.model.seq_length), generator=g)
    positions = torch.arange(config.model.seq_length).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    torch.save({"tokens": tokens, "logits": logits.float()}, os.environ["LOGITS_OUT"])
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
