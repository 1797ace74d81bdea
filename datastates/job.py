"""What one save is: its handle for the caller and the state its threads share."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .errors import CheckpointError
from .state import TensorEntry
from .telemetry import SaveRecord


@dataclass(eq=False)
class SaveHandle:
    """Identifies one `save` call; pass it to `wait_for_durable` / `wait_for_commit`."""

    id: int
    step: int
    directory: str


@dataclass(eq=False)
class SaveJob:
    """Bookkeeping of one save; fields change under the engine's lock."""

    handle: SaveHandle
    entries: List[TensorEntry]
    skeleton: Any
    shard_path: str
    fd: int
    dfd: int  # O_DIRECT descriptor of the same file, or -1
    file_offsets: List[int]
    total_bytes: int
    t_start: float
    ready_events: Dict[Any, Any] = field(default_factory=dict)
    chunks: List[List[List[int]]] = field(default_factory=list)  # per entry: [off, nbytes, crc]
    entries_copied: int = 0
    inflight: int = 0  # pieces handed to writers and not yet processed
    bytes_written: int = 0
    t_copied: Optional[float] = None
    t_first_write: Optional[float] = None
    blocked_s: float = 0.0
    peak_cache: int = 0
    error: Optional[CheckpointError] = None
    finalizing: bool = False
    done: bool = False
    record: Optional[SaveRecord] = None
    reported: bool = False

    @property
    def copied(self) -> bool:
        return self.entries_copied == len(self.entries) or self.error is not None
