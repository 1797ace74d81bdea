"""Rank-aware printing and Megatron-LM's log-line format (parsed by scripts and tests)."""
from __future__ import annotations

import math
import sys
from typing import Dict, Optional, TextIO, Tuple

import torch.distributed as dist


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def say(message: str, stream: Optional[TextIO] = None) -> None:
    """`message` and its newline in one write to `stream` (stdout by default), flushed: ranks
    that share a stdout or stderr (torchrun's ranks on one node) never split each other's lines.
    `print` writes the newline on its own, and with `python -u` or PYTHONUNBUFFERED each write
    reaches the pipe by itself: another rank's line then landed inside a timer report, where no
    log parser finds it."""
    stream = stream or sys.stdout
    stream.write(message + "\n")
    stream.flush()


def print_rank_0(message: str) -> None:
    if _rank() == 0:
        say(message)


def print_rank_last(message: str) -> None:
    """Megatron prints training lines from the last rank: it holds the loss under PP."""
    if _last_rank():
        say(message)


def training_log_line(iteration: int, train_iters: int, consumed_samples: int,
                      elapsed_ms: float, lr: float, global_batch_size: int,
                      lm_loss: Optional[float],
                      grad_norm, skipped: int, nans: int, loss_scale: float = 1.0,
                      throughput: Optional[float] = None,
                      decoupled_lr: Optional[float] = None,
                      skipped_samples: int = 0) -> str:
    """Megatron-LM's iteration line. `throughput` (TFLOP/s per rank, `--log-throughput`) goes
    where Megatron puts it, right after the iteration time, with its wording ("per GPU");
    `loss_scale` is the optimizer's (1.0 unless fp16 or --loss-scale), printed, as Megatron-LM
    does, between the losses and the grad norm; `decoupled_lr`, with --decoupled-lr, the
    embeddings' and output layer's learning rate, after the learning rate as there;
    `skipped_samples` (--decrease-batch-size-if-needed, --iterations-to-skip), after the consumed
    ones where any."""
    line = f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    if skipped_samples > 0:
        line += f" skipped samples: {skipped_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    if throughput is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    line += f" learning rate: {lr:.6E} |"
    if decoupled_lr is not None:
        line += f" decoupled learning rate: {decoupled_lr:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    if lm_loss is not None:  # None: every iteration of the window was skipped (Megatron-LM)
        line += f" lm loss: {lm_loss:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nans:3d} |"
    return line


def validation_lines(iteration: int, lm_loss: float, prefix: str = "validation") -> str:
    ppl = math.exp(min(20.0, lm_loss))
    body = (f" {prefix} loss at iteration {iteration} | lm loss value: {lm_loss:.6E} |"
            f" lm loss PPL: {ppl:.6E} | ")
    rule = "-" * (len(body) + 1)
    return f"{rule}\n{body}\n{rule}"


def min_max_time_lines(times_ms: Dict[str, Tuple[float, float]]) -> str:
    """Megatron's timers report: `(min, max) time across ranks (ms):` and one line per timer."""
    lines = ["(min, max) time across ranks (ms):"]
    for name, (low, high) in times_ms.items():
        lines.append(f"    {(name + ' ').ljust(48, '.')}: ({low:.2f}, {high:.2f})")
    return "\n".join(lines)


def flush_all() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
