"""The CUDA device of a checkpoint thread.

The CUDA runtime keeps the current device per host thread, and a new thread's is device 0,
whatever the thread that started it had set (`torch.cuda.set_device(local_rank)` in the
trainer). The engine's copy threads and the adapter's save worker issue CUDA calls for one rank's
tensors. A call there that names no device (the current stream, an event, an allocation with
``device="cuda"``) goes to GPU 0 instead of the rank's, and its first use opens a context on
GPU 0 from every rank of the node (hundreds of MiB each). PyTorch's own pin-memory thread sets
the device of the process that started it for the same reason; these threads do the same:
`creator_device()` on the thread that creates them, `use_device()` first thing on each.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["creator_device", "use_device"]


def creator_device() -> Optional[int]:
    """The caller's current CUDA device when this process has initialized CUDA; else None, and
    no CUDA call is made (a CPU run, or a process that has not used the GPU: creating a
    checkpoint engine must not open a context)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def use_device(device: Optional[int]) -> None:
    """Make `device` (from `creator_device`) the calling thread's current CUDA device; None:
    nothing."""
    if device is not None:
        torch.cuda.set_device(device)
