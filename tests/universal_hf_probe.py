"""Test helper (one process): load --load as pretrain_gpt.py does, run the model on fixed tokens
in eval mode, and torch.save the logits [batch, seq, vocab] to the path in $LOGITS_OUT."""
import os
import sys


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
