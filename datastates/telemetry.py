"""Per-save measurements."""
from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from typing import Optional


@dataclass(frozen=True)
class SaveRecord:
    """What one save cost on this rank. Times in seconds, measured from the `save` call."""

    step: int
    directory: str
    rank: int
    bytes: int
    """Tensor bytes written by this rank."""
    num_tensors: int
    blocked_s: float
    """Time the caller spent inside save(), wait_for_snapshot() and wait_for_durable() while this
    save was pending."""
    copy_s: float
    """From the save call until the last tensor was in the host cache (snapshot complete)."""
    flush_s: float
    """From the first byte written until shard + index fsync'd and the rank marker written."""
    durable_s: float
    """From the save call until this rank's marker was written."""
    gbps: float
    """bytes / durable_s / 1e9."""
    peak_cache_bytes: int
    """Largest host-cache occupancy while this save was in flight."""
    committed: bool
    """Whether the version's commit marker existed when this record was made."""
    local_durable_s: Optional[float] = None
    """With EngineConfig.local_dir: from the save call until the node-local copy was durable."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))


_lock = threading.Lock()


def append_record(path: Optional[str], record: SaveRecord) -> None:
    if not path:
        return
    with _lock, open(path, "a") as f:
        f.write(record.to_json() + "\n")
