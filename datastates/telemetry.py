"""Per-save measurements, and the JSON-lines files they go to.

`JsonlAppender` appends JSON lines to a file from a background thread, so that the thread that
produces them (the training loop: one line per iteration and per committed checkpoint, in the
save root on a shared file system) never waits on that file system, which may be slow or hang.
Each file has one appender per process (`appender`), so its lines keep the order they were
appended in; `flush_all` writes what is queued (at exit too, bounded).
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, Deque, Dict, Optional


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


class JsonlAppender:
    """Appends one JSON line per record to `path` from a daemon thread: `append` serializes the
    record and returns at once. The thread opens the file for each batch of lines (so it follows
    the path if the file is moved or removed), creating its directory if needed. On an OSError
    it says so once through `warn` and drops every later line (telemetry never stops training).
    At most `max_queued` lines wait; more are dropped, said once."""

    def __init__(self, path: str, warn: Callable[[str], None] = print,
                 max_queued: int = 1 << 16):
        self.path = path
        self.warn = warn
        self.max_queued = max_queued
        self._lines: Deque[str] = deque()
        self._cv = threading.Condition()
        self._appended = 0  # lines taken by `append`
        self._written = 0  # lines written (or given up on, once off)
        self.off = False
        self._dropped = False
        self._thread = threading.Thread(target=self._run, name="datastates-telemetry",
                                        daemon=True)
        self._thread.start()

    def append(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        with self._cv:
            if self.off:
                return
            if len(self._lines) >= self.max_queued:
                if not self._dropped:
                    self._dropped = True
                    self.warn(f"WARNING: {self.path} is not keeping up (more than "
                              f"{self.max_queued} lines waiting): later lines are dropped "
                              "while it lags")
                return
            self._lines.append(line)
            self._appended += 1
            self._cv.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every line appended so far is written (or the file given up on); False if
        `timeout_s` passed first."""
        with self._cv:
            target = self._appended
            return self._cv.wait_for(lambda: self._written >= target, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._lines))
                lines = list(self._lines)
                self._lines.clear()
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                with open(self.path, "a") as f:
                    f.write("".join(lines))
            except OSError as err:  # e.g. the disk that just filled up
                with self._cv:
                    self.off = True
                    self._written = self._appended
                    self._lines.clear()
                    self._cv.notify_all()
                self.warn(f"WARNING: cannot append to {self.path} ({err}); checkpoint telemetry "
                          "is off for the rest of this run")
                return
            with self._cv:
                self._written += len(lines)
                self._cv.notify_all()


_APPENDERS: Dict[str, JsonlAppender] = {}
_APPENDERS_LOCK = threading.Lock()


def appender(path: str, warn: Callable[[str], None] = print) -> JsonlAppender:
    """This process's appender of `path` (made on first use, with `warn`)."""
    key = os.path.abspath(path)
    with _APPENDERS_LOCK:
        found = _APPENDERS.get(key)
        if found is None:
            if not _APPENDERS:
                atexit.register(flush_all, 10.0)
            found = _APPENDERS[key] = JsonlAppender(key, warn)
        return found


def flush_all(timeout_s: float) -> bool:
    """Write what every appender of this process holds, waiting at most `timeout_s` in all."""
    deadline = time.monotonic() + timeout_s
    with _APPENDERS_LOCK:
        pending = list(_APPENDERS.values())
    return all([a.flush(max(0.0, deadline - time.monotonic())) for a in pending])
