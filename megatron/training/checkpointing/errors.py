"""The trainer's checkpoint error type, on its own so every checkpoint module can raise it."""
from __future__ import annotations

from typing import List, Optional

import torch

import datastates


class CheckpointError(datastates.CheckpointError):
    """A checkpoint the trainer cannot save or load: `datastates.CheckpointError` (one error type
    for every checkpoint failure), naming this process's rank by default and the path; `ranks`
    when every rank raises it after an agreement (printed once)."""

    def __init__(self, message: str, path: Optional[str] = None, rank: Optional[int] = None,
                 ranks: Optional[List[int]] = None):
        if rank is None and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        super().__init__(message, rank=rank, file=path, ranks=ranks)
        self.path = path
