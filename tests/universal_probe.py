"""Test helper (torchrun entry): load --load exactly as pretrain_gpt.py does, then save that state
at once, without training, as a synchronous torch_dist checkpoint under --save.

Comparing that checkpoint with the one loaded shows what every rank really restored. Then it
trains on to --train-iters, printing the usual log lines (the loss right after resuming).
"""
import sys


def main(argv) -> int:
    from megatron.training.arguments import build_run_config, parse_args
    from megatron.training.initialize import destroy_distributed
    from megatron.training.training import setup, train

    trainer = setup(build_run_config(parse_args(argv)))
    trainer.checkpoints.maybe_save(trainer.state, force=True)
    train(trainer)  # finalizes the checkpoint manager on the way out
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
