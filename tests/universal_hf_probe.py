"""Test helper (one process): load --load as pretrain_gpt.py does, run the model on fixed tokens
in eval mode, and torch.save the logits [batch, seq, vocab] to the path in $LOGITS_OUT.
`our_logits` runs it from a test."""
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


def main(argv) -> int:
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
