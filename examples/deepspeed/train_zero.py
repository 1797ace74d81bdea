"""Train a small GPT-shaped MLP stack with DeepSpeed ZeRO and checkpoint it with DataStates.

DeepSpeed's own `DataStatesCheckpointEngine` (deepspeed 0.19.x) is turned on by the
``"datastates_ckpt"`` section of the DeepSpeed config and runs on our engine; nothing else in a
DeepSpeed script changes. CPU (gloo) or GPU (NCCL):

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed/train_zero.py \\
        --zero-stage 1 --steps 8 --save runs/ds --save-interval 4      # trains 1..8, saves 4, 8
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed/train_zero.py \\
        --zero-stage 1 --steps 12 --save runs/ds --load runs/ds        # resumes at 8, trains to 12

`--engine torch` uses DeepSpeed's default torch.save engine instead (the baseline of
benchmarks/deepspeed_engine_bench.py). Each step prints ``step N/ M | loss: <hex float> | step
time (ms): T | save stall (ms): S`` (the loss as float.hex, for bit-exact comparisons), and each
save ``saved tag <tag> in <ms> ms``.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch
import torch.nn as nn


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2))
    p.add_argument("--engine", choices=("datastates", "torch"), default="datastates")
    p.add_argument("--steps", type=int, default=8, help="train until this global step")
    p.add_argument("--save", default=None, help="checkpoint directory (DeepSpeed's save_dir)")
    p.add_argument("--save-interval", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--load", default=None, help="resume from DeepSpeed's `latest` tag here")
    p.add_argument("--load-tag", default=None, help="resume from this tag instead of `latest`")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="micro batch per rank")
    p.add_argument("--host-cache-gib", type=float, default=0.0625)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.up = nn.Linear(h, 4 * h)
        self.down = nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build_model(args) -> nn.Module:
    torch.manual_seed(args.seed)
    return nn.Sequential(*[Block(args.hidden) for _ in range(args.layers)],
                         nn.Linear(args.hidden, args.hidden))


def batch(args, step: int, rank: int):
    """The batch of a global step on a rank: the same on every run, so a resume is bit-exact."""
    g = torch.Generator().manual_seed(args.seed * 1000003 + step * 101 + rank)
    x = torch.randn(args.batch, args.hidden, generator=g)
    return x, torch.tanh(x.flip(-1))


def ds_config(args) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        # torch's Adam: DeepSpeed's FusedAdam would be JIT-compiled on a CPU machine.
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3,
                                                      "warmup_max_lr": 1e-3}},
        "zero_optimization": {"stage": args.zero_stage},
        "steps_per_print": 10 ** 9,
    }
    if args.engine == "datastates":
        cfg["datastates_ckpt"] = {"host_cache_size": args.host_cache_gib, "parser_threads": 1}
    return cfg


def main(argv=None) -> int:
    args = parse_args(argv)
    import deepspeed  # after argparse: --help works without it
    # ZeRO's calls into torch 2.13, not something a user of this script can change.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated",
                            category=FutureWarning)

    model = build_model(args)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args))
    rank = engine.global_rank
    if args.load:
        path, _ = engine.load_checkpoint(args.load, tag=args.load_tag)
        if rank == 0:
            print(f"no checkpoint to resume from in {args.load}" if path is None else
                  f"resumed from {path} at step {engine.global_steps}", flush=True)
    engine_impl = engine.checkpoint_engine
    t_start = time.perf_counter()
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        t0 = time.perf_counter()
        x, y = batch(args, step, rank)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        stall0 = _blocked(engine_impl)
        engine.step()
        stall = _blocked(engine_impl) - stall0
        save_ms = 0.0
        if args.save and args.save_interval and step % args.save_interval == 0:
            t_save = time.perf_counter()
            engine.save_checkpoint(args.save)
            save_ms = (time.perf_counter() - t_save) * 1e3
            if rank == 0:
                print(f"saved tag global_step{step} in {save_ms:.1f} ms", flush=True)
        if rank == 0:
            print(f"step {step}/ {args.steps} | loss: {loss.item().hex()} | step time (ms): "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} | save stall (ms): "
                  f"{stall * 1e3 + save_ms:.1f}", flush=True)
    t_train = time.perf_counter() - t_start
    # Wait until every save is durable and its tag committed, as DeepSpeed's class does in its
    # commit(). (engine.destroy() would too, but deepspeed 0.19.8's DataStatesCheckpointEngine then
    # fails in its __del__, printing an ignored AttributeError; at exit our engine drains anyway.)
    inner = getattr(engine_impl, "ckpt_engine", None)
    if inner is not None:
        inner.wait(persist=True)
    if rank == 0:
        print(f"done | train time (s): {t_train:.3f} | end-to-end incl. drain (s): "
              f"{time.perf_counter() - t_start:.3f}", flush=True)
    return 0


def _blocked(ckpt_engine) -> float:
    """Seconds our engine held optimizer steps back for snapshots (0 for DeepSpeed's own)."""
    inner = getattr(ckpt_engine, "ckpt_engine", None)
    return float(getattr(inner, "blocked_s", 0.0))


if __name__ == "__main__":
    sys.exit(main())
