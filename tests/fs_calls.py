"""Which file-system calls a thread makes under a directory, seen through Python's audit events
(`sys.addaudithook`): each `open`, `os.mkdir`, `os.remove`, `os.rename`, `os.listdir`... a
call made by our code or by a library it calls. The hook is installed once per process (audit
hooks cannot be removed) and records only inside `recording(...)`. No `stat` or `fsync` event
exists; a file created, removed or listed always shows."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator, List, Optional, Tuple

_EVENTS = {"open", "os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.listdir",
           "os.scandir", "os.truncate", "os.link", "os.symlink", "shutil.rmtree", "os.chmod",
           "os.utime", "os.posix_spawn"}
_active: Optional["Recorder"] = None
_installed = False


class Recorder:
    def __init__(self, roots: Tuple[str, ...], thread: threading.Thread):
        self.roots = tuple(os.path.abspath(r) for r in roots)
        self.thread = thread
        self.calls: List[Tuple[str, str]] = []  # (event, path) by `thread` under a root
        self.paused = False

    def under(self, path: str) -> bool:
        return any(path == r or path.startswith(r + os.sep) for r in self.roots)


def _path(args) -> Optional[str]:
    p = args[0] if args else None
    if isinstance(p, bytes):
        p = p.decode(errors="replace")
    return os.path.abspath(p) if isinstance(p, str) else None


def _hook(event: str, args) -> None:
    rec = _active
    if rec is None or rec.paused or event not in _EVENTS or \
            threading.current_thread() is not rec.thread:
        return
    path = _path(args)
    if path is not None and rec.under(path):
        rec.calls.append((event, path))


@contextlib.contextmanager
def recording(*roots: str) -> Iterator[Recorder]:
    """Record the calling thread's file-system calls under any of `roots` while the block
    runs."""
    global _active, _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    rec = Recorder(roots, threading.current_thread())
    _active = rec
    try:
        yield rec
    finally:
        _active = None


@contextlib.contextmanager
def paused(rec: Recorder) -> Iterator[None]:
    """Not recorded while the block runs (e.g. what the test itself does between save calls)."""
    rec.paused = True
    try:
        yield
    finally:
        rec.paused = False
