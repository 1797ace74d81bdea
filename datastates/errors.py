"""The one exception type the engine raises."""
from __future__ import annotations

from typing import List, Optional


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed or loaded.

    Carries the rank, file and tensor involved (any may be None when not applicable) so that a
    failure in a background thread can be traced to its source after it is re-raised in the
    caller's thread; `ranks` names the failing ranks of a failure every rank agreed on.
    """

    def __init__(self, message: str, *, rank: Optional[int] = None, file: Optional[str] = None,
                 tensor: Optional[str] = None, ranks: Optional[List[int]] = None):
        self.rank = rank
        self.file = file
        self.tensor = tensor
        #: Set when every rank agreed on this failure and raises the same error (the failing
        #: ranks, in order): an entry point then prints it once, on rank 0.
        self.ranks = None if ranks is None else list(ranks)
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

    @property
    def agreed(self) -> bool:
        """Every rank raises this same error (see `control_plane.agree`)."""
        return self.ranks is not None
