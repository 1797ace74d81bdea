"""The one exception type the engine raises."""
from __future__ import annotations

from typing import Optional


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed or loaded.

    Carries the rank, file and tensor involved (any may be None when not applicable) so that a
    failure in a background thread can be traced to its source after it is re-raised in the
    caller's thread.
    """

    def __init__(self, message: str, *, rank: Optional[int] = None, file: Optional[str] = None,
                 tensor: Optional[str] = None):
        self.rank = rank
        self.file = file
        self.tensor = tensor
        self.reason = message  # without the [rank, file, tensor] prefix, for wrapping
        where = []
        if rank is not None:
            where.append(f"rank {rank}")
        if file is not None:
            where.append(f"file {file}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        prefix = f"[{', '.join(where)}] " if where else ""
        super().__init__(prefix + message)
