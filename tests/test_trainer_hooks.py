"""The checkpoint hook contract the training loop keeps (in-process, world size 1)."""

from megatron.training.arguments import build_run_config, parse_args
from megatron.training.checkpointing.manager import CheckpointManager

ARGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 4 --lr 1e-3 --mock-data "
        "--vocab-size 127 --log-interval 1 --eval-interval 0 --hidden-dropout 0 "
        "--attention-dropout 0 --exit-interval 3 --exit-duration-in-mins 600 "
        "--distributed-timeout-minutes 7")


class Recorder(CheckpointManager):
    """Records each hook with a checksum of the weights at that moment."""

    def __init__(self, config, model):
        super().__init__(config)
        self.model, self.calls = model, []

    def _weights(self):
        return sum(float(p.detach().double().sum()) for c in self.model for p in c.parameters())

    def before_optimizer_step(self):
        self.calls.append(("before_optimizer_step", self._weights()))

    def maybe_save(self, state, force=False):
        self.calls.append(("maybe_save", state.iteration, force, self._weights()))
        return force

    def after_iteration(self, iteration):
        self.calls.append(("after_iteration", iteration, self._weights()))

    def finalize(self):
        self.calls.append(("finalize",))


def test_hooks_run_in_order_and_before_the_weights_change():
    from megatron.training.initialize import destroy_distributed
    from megatron.training.training import setup, train

    config = build_run_config(parse_args(ARGS.split()), world_size=1)
    trainer = setup(config)
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        for group in (dist.group.WORLD, ps.get_data_parallel_group()):  # the training's groups
            backend = group._get_backend(torch.device("cpu"))
            assert backend.options._timeout == timedelta(minutes=7)
        recorder = Recorder(config, trainer.state.model)
        trainer.checkpoints = recorder
        assert train(trainer) == 3  # --exit-interval 3 (the duration, agreed on, is far off)
    finally:
        destroy_distributed()
    names = [c[0] for c in recorder.calls]
    assert names == ["before_optimizer_step", "maybe_save", "after_iteration"] * 3 + \
        ["maybe_save", "finalize"]
    # The forced save at the exit interval comes after the regular per-iteration call.
    assert recorder.calls[-2][1:3] == (3, True)
    weights_before = [c[1] for c in recorder.calls if c[0] == "before_optimizer_step"]
    weights_after = [c[2] for c in recorder.calls if c[0] == "after_iteration"]
    # The hook sees the weights of the previous iteration: nothing was updated yet ...
    assert weights_before[1:] == weights_after[:-1]
    # ... and the optimizer step that follows it does change them.
    assert all(b != a for b, a in zip(weights_before, weights_after))
