"""DeepSpeed's checkpoint-engine call shape on our engine (no DeepSpeed import at module load).

DeepSpeed (0.19.x) ships `DataStatesCheckpointEngine`, enabled by a ``"datastates_ckpt": {...}``
section of its config. That class does ``from datastates import CheckpointEngine`` and calls:

    engine = CheckpointEngine(deepspeed_config, rank)   # builds a `DeepSpeedCheckpointEngine`
    engine.save(state_dict, path)                       # once per file of a tag, per rank
    engine.load(path, map_location)
    engine.wait(persist=True)                           # its commit() and cleanup()

What DeepSpeed's engine interface gives us, and what it does not (read in deepspeed 0.19.8):
- `save` gets one torch.save-style nested dict per file, `<save_dir>/<tag>/<name>.pt`, from every
  rank that writes that file. Nothing marks the end of a tag; we take it to be over at the next
  optimizer step, at a save into another tag, or at `wait`.
- Nothing is called between `save_checkpoint` and the next optimizer step: DeepSpeed's class does
  not return its commit info from `get_commit_info()`, so `engine.step()` skips its commit. The
  wait point the lazy copy needs is ours: a global `torch.optim` step pre-hook (every DeepSpeed
  optimizer, ZeRO's inner one included, is a `torch.optim.Optimizer`) waits for the snapshot
  before any optimizer mutates the saved tensors.
- For the same reason DeepSpeed never writes `<save_dir>/latest` with this engine. We write it,
  atomically, when a tag is committed on every rank (so `save_latest=False` is not honoured).

What a tag is on disk and how it is read: `deepspeed_tags.py`. This module is when things happen:
files saved lazily, tags sealed at the wait point, markers and commits written as files become
durable, failures kept to their tag. A tag that is committed is never rewritten.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import layout
from .config import EngineConfig
from .deepspeed_tags import (TAG_MARKERS, advance_latest, decode_objects, encode_objects,
                             newer_committed_tags, newest_committed_tag, read_file, safe_globals,
                             supersede_tags, tag_is_committed, tag_marker, try_commit_tag)
from .engine import CheckpointEngine, SaveHandle
from .errors import CheckpointError
from .fileio import atomic_write, fsync_dir
from .safe_load import torch_load

logger = logging.getLogger(__name__)

SECTION = "datastates_ckpt"
GiB = 1 << 30
#: Tags this rank has marked that wait for other ranks' markers, retried at each step (a tag
#: another rank failed never commits; the last rank to mark a tag commits it itself).
MARKED_RETRIED = 4
#: How long a rank other than 0 waits, in its first save after a rollback, for rank 0 to set aside
#: the other run's committed tag it is saving into (rank 0 does it in its own first save call of
#: the same `save_checkpoint`, with no collective in between).
SET_ASIDE_WAIT_S = 120.0
#: Keys of the section we read, and those of the reference implementation we accept and ignore.
KNOWN_KEYS = ("host_cache_size", "parser_threads", "allow_pickle")
IGNORED_KEYS = ("fast_cache_init", "pin_host_cache")

@dataclass(frozen=True)
class DeepSpeedSection:
    """The ``datastates_ckpt`` section of a DeepSpeed config."""

    host_cache_bytes: int = 256 * (1 << 20)
    parser_threads: int = 1
    allow_pickle: bool = False

    @classmethod
    def parse(cls, ds_config: Any) -> "DeepSpeedSection":
        if hasattr(ds_config, "datastates_config"):  # DeepSpeed's DeepSpeedConfig
            section = getattr(ds_config.datastates_config, "config", None)
        elif isinstance(ds_config, Mapping):  # a DeepSpeed config dict, or the section itself
            section = ds_config.get(SECTION, ds_config)
        else:
            raise CheckpointError(
                f"CheckpointEngine: expected an EngineConfig, or DeepSpeed's config (its "
                f"DeepSpeedConfig or a dict with a {SECTION!r} section) and a rank, found "
                f"{type(ds_config).__module__}.{type(ds_config).__qualname__}")
        section = {} if section in (None, True) else section
        if not isinstance(section, Mapping):
            raise CheckpointError(f"DeepSpeed config: {SECTION!r} must be an object, found "
                                  f"{section!r}")
        unknown = sorted(set(section) - set(KNOWN_KEYS) - set(IGNORED_KEYS))
        if unknown:
            raise CheckpointError(f"DeepSpeed config: unknown key(s) {unknown} in {SECTION!r}; "
                                  f"expected some of {list(KNOWN_KEYS)}")
        out: Dict[str, Any] = {}
        if "host_cache_size" in section:
            gib = section["host_cache_size"]
            if isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib <= 0:
                raise CheckpointError(f"DeepSpeed config: {SECTION}.host_cache_size is the host "
                                      f"cache in GiB, a number > 0; found {gib!r}")
            out["host_cache_bytes"] = max(int(gib * GiB), 1 << 20)
        if "parser_threads" in section:
            n = section["parser_threads"]
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise CheckpointError(f"DeepSpeed config: {SECTION}.parser_threads must be an "
                                      f"integer >= 1, found {n!r}")
            out["parser_threads"] = n
        if "allow_pickle" in section:
            out["allow_pickle"] = bool(section["allow_pickle"])
        return cls(**out)


@dataclass
class _Tag:
    directory: str
    files: Dict[str, SaveHandle] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    sealed: bool = False
    marked: bool = False
    failed: bool = False


# ------------------------------------------------------------------ the wait point
_live: "weakref.WeakSet[DeepSpeedCheckpointEngine]" = weakref.WeakSet()
_hook = None


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    for engine in list(_live):
        engine.before_optimizer_step()


def _register(engine: "DeepSpeedCheckpointEngine") -> None:
    global _hook
    _live.add(engine)
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_before_optimizer_step)


class DeepSpeedCheckpointEngine:
    """What `CheckpointEngine(deepspeed_config, rank)` builds: DeepSpeed's call shape (one file per
    `save`, `load`, `wait(persist)`, `commit(tag)`) on a lazy `CheckpointEngine`. `save` returns
    before any tensor is copied; the copy runs during the next forward/backward and is waited for
    right before the next optimizer step; files are checksummed, and a tag is loadable only once
    every rank's files of it are durable."""

    def __init__(self, ds_config: Any, rank: Optional[int] = None):
        self.section = DeepSpeedSection.parse(ds_config)
        if rank is None:
            raise CheckpointError("CheckpointEngine(deepspeed_config, rank): the rank is missing")
        self.rank = int(rank)
        dist = torch.distributed
        self.world_size = (dist.get_world_size()
                           if dist.is_available() and dist.is_initialized() else 1)
        self._engine = CheckpointEngine(EngineConfig(
            rank=0, world_size=1, host_cache_bytes=self.section.host_cache_bytes,
            copy_threads=self.section.parser_threads, allow_pickle=self.section.allow_pickle,
            on_durable=self._on_durable))
        self._lock = threading.Lock()
        self._commit_lock = threading.Lock()  # marker and commit writes, one thread at a time
        self._open: Optional[_Tag] = None
        self._pending: List[_Tag] = []  # sealed, not yet committed
        self._durable: set = set()  # ids of durable saves
        self._closed = False
        #: (tag directory, rank, error) of each save that failed here: its tag is never committed.
        self.failed_saves: List[tuple] = []
        self._skipping: Optional[str] = None  # the committed tag whose saves are being skipped
        self._loaded: Optional[str] = None  # the tag directory loaded, until the first save
        self.blocked_s = 0.0  # time the optimizer step waited for snapshots
        _register(self)
        atexit.register(self._atexit)

    # ------------------------------------------------------------ DeepSpeed's calls
    def save(self, state_dict: Any, path: str) -> None:
        """Register the file's snapshot and return before any tensor is copied. A failure (of this
        call or, later, of the background write) fails the file's tag on this rank: one error
        line, the tag is never committed, and training goes on (see `_fail`)."""
        if self._closed:
            raise CheckpointError("the DataStates engine is closed", rank=self.rank)
        if not isinstance(state_dict, dict):
            raise CheckpointError(f"DeepSpeed save: expected a dict for {path}, found "
                                  f"{type(state_dict).__name__}", rank=self.rank, file=path)
        path = os.path.abspath(path)
        tag_dir = os.path.dirname(path)
        if self._loaded is not None:
            self._after_rollback(tag_dir)
        if tag_is_committed(tag_dir):  # never rewritten (e.g. a fixed tag saved again)
            if self._skipping != tag_dir and self.rank == 0:
                logger.warning(
                    "DataStates: skipping the save of DeepSpeed tag %r: %s already holds a "
                    "committed checkpoint, which is never rewritten (save under a new tag, or "
                    "remove it first)", os.path.basename(tag_dir), tag_dir)
            self._skipping = tag_dir
            return None
        with self._lock:
            if self._open is not None and self._open.directory != tag_dir:
                self._seal_locked()
            if self._open is None:
                self._open = self._start_tag(tag_dir)
            tag = self._open
            if tag.failed:
                return None
        m = re.search(r"(\d+)$", os.path.basename(tag_dir))
        try:
            if path in tag.files:
                raise CheckpointError("DeepSpeed save: this file was already saved in this tag",
                                      rank=self.rank, file=path)
            self._clear_leftover(path)
            handle = self._engine.save(encode_objects(state_dict), path,
                                       step=int(m.group(1)) if m else 0)
        except (CheckpointError, OSError) as e:
            text = str(e).replace("EngineConfig(allow_pickle=True)",
                                  f'"allow_pickle": true in the {SECTION} section')
            self._fail(tag, CheckpointError(text, rank=self.rank, file=path))
            return None
        with self._lock:
            tag.files[path] = handle
        self._check_tags()

    def load(self, path: str, map_location: Any = None) -> Any:
        """A file of a tag; the tag is remembered as the one this run resumes from (see
        `_after_rollback`)."""
        path = os.path.abspath(path)
        if os.path.isdir(path):
            state = read_file(path, self.section.allow_pickle, _device(map_location))
        elif os.path.isfile(path):  # a torch.save file, e.g. from before switching engines
            state = decode_objects(
                torch_load(path, file=path, extra_globals=safe_globals(),
                           allow_unsafe=self.section.allow_pickle,
                           way_forward='if you trust this file, set "allow_pickle": true in '
                                       f'the {SECTION} section'),
                path, _device(map_location))
        else:
            raise CheckpointError("DeepSpeed load: no checkpoint file here", rank=self.rank,
                                  file=path)
        self._loaded = os.path.dirname(path)
        return state

    def wait(self, persist: bool = False) -> None:
        """The tag being saved is complete. persist=False: wait until its snapshot is taken (the
        tensors may change); persist=True: until every file saved so far is durable on this rank
        and this rank's tag markers are written."""
        if self._closed:
            return
        with self._lock:
            self._seal_locked()
        self._engine_call(self._engine.wait_for_durable if persist
                          else self._engine.wait_for_snapshot)
        self._engine_call(self._engine.poll)
        self._check_tags(all_durable=persist)

    def commit(self, tag: Any = None) -> bool:
        self.wait(persist=True)
        return True

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait(persist=True)
        finally:
            self._closed = True
            _live.discard(self)
            atexit.unregister(self._atexit)
            self._engine.close()

    # ------------------------------------------------------------ the wait point
    def before_optimizer_step(self) -> None:
        """Run by the optimizer step pre-hook: the tag (if any) is over, its snapshot must be
        complete before the optimizer changes the tensors."""
        if self._closed:
            return
        with self._lock:
            if self._open is None and not self._pending:
                return
            self._seal_locked()
        t0 = time.perf_counter()
        self._engine_call(self._engine.wait_for_snapshot)
        self.blocked_s += time.perf_counter() - t0
        self._engine_call(self._engine.poll)
        self._check_tags()

    # ------------------------------------------------------------ internals
    def _engine_call(self, fn):
        """Call the engine; each background failure it re-raises fails the tag of its file."""
        while True:
            try:
                return fn()
            except CheckpointError as e:
                where = os.path.abspath(e.file) if getattr(e, "file", None) else ""
                with self._lock:
                    tags = [t for t in self._pending + [self._open]
                            if t is not None and where.startswith(t.directory + os.sep)]
                self._fail(tags[0] if tags else None, e)

    def _fail(self, tag: Optional[_Tag], err: CheckpointError) -> None:
        """A save failed on this rank. DeepSpeed's interface has no point where every rank meets
        this engine, so the failure cannot be agreed before DeepSpeed's next collective, and
        raising on this rank alone would leave the others waiting in it. So: the tag is never
        committed (this rank writes no marker for it), `latest` stays where it is, one error line
        says so, and training goes on; the next save tries again."""
        with self._lock:
            if tag is not None:
                tag.failed = True
                if tag in self._pending:
                    self._pending.remove(tag)
            self.failed_saves.append((None if tag is None else tag.directory, self.rank, err))
        name = "?" if tag is None else os.path.basename(tag.directory)
        newest = None if tag is None else newest_committed_tag(os.path.dirname(tag.directory))
        logger.error("DataStates: the save of DeepSpeed tag %r failed on rank %d: %s. That tag "
                     "will not be committed; %s. Training goes on; the next save tries again.",
                     name, self.rank, err, f"latest stays at {newest!r}" if newest
                     else "no tag is committed yet")

    def _after_rollback(self, tag_dir: str) -> None:
        """The first save after a load, into the directory the loaded tag is in (a resume, not a
        fine-tuning into another directory, whose tags are left alone): the committed tags there
        saved after the loaded one are the run this one rolled back from (DeepSpeed's
        `load_checkpoint(tag=...)` of an older tag, or a `latest` behind a committed tag). Left
        in place, this run's saves of those tags would be skipped (a committed tag is never
        rewritten) and `latest` would stay on the other run's newest, which a restart would then
        resume. Rank 0 moves them whole into `<save_dir>/superseded-by-<loaded tag>-<time>/`,
        `latest` back to the loaded tag first; nothing is deleted. Another rank saving into one
        of them waits until it is moved (rank 0 does it in its own first save call)."""
        loaded, self._loaded = self._loaded, None
        save_dir = os.path.dirname(tag_dir)
        if os.path.dirname(loaded) != save_dir:
            return
        name = os.path.basename(loaded)
        tags = newer_committed_tags(save_dir, name)
        if self.rank == 0 and tags:
            try:
                into = supersede_tags(save_dir, tags, name)
            except OSError as e:
                logger.error("DataStates: could not set aside DeepSpeed tag(s) %s of %s, newer than "
                             "the loaded tag %r: %s. Their saves are skipped and `latest` may "
                             "still name the run rolled back from", tags, save_dir, name, e)
                return
            logger.warning("DataStates: set aside DeepSpeed tag(s) %s of %s: newer than tag %r, "
                           "which this run resumed from (another run's, e.g. the one rolled back "
                           "from); moved whole into %s (nothing is deleted); `latest` names %r "
                           "until this run commits a newer tag", tags, save_dir, name, into, name)
        elif os.path.basename(tag_dir) in tags:
            deadline = time.monotonic() + SET_ASIDE_WAIT_S
            while tag_is_committed(tag_dir) and time.monotonic() < deadline:
                time.sleep(0.02)
            if tag_is_committed(tag_dir):
                logger.error("DataStates: rank %d waited %g s for rank 0 to set aside DeepSpeed "
                             "tag %r (newer than the loaded tag %r); it is still there, so this "
                             "rank skips its save", self.rank, SET_ASIDE_WAIT_S,
                             os.path.basename(tag_dir), name)

    def _start_tag(self, tag_dir: str) -> _Tag:
        marker = tag_marker(tag_dir, self.rank)
        if os.path.exists(marker):  # ours, from a save of this tag that did not commit
            os.unlink(marker)
            fsync_dir(os.path.dirname(marker))
        return _Tag(tag_dir)

    def _clear_leftover(self, path: str) -> None:
        """A file of an uncommitted tag from an earlier, interrupted save: moved aside and removed,
        never mixed with the new one. A plain file is another engine's: refused."""
        if os.path.isfile(path):
            raise CheckpointError("DeepSpeed save: a file written by another checkpoint engine "
                                  "is already here; save under a new tag", rank=self.rank,
                                  file=path)
        if os.path.isdir(path):
            aside = os.path.join(os.path.dirname(path),
                                 f".incomplete-{os.path.basename(path)}-{time.time_ns()}")
            os.rename(path, aside)
            shutil.rmtree(aside, ignore_errors=True)

    def _seal_locked(self) -> None:
        self._skipping = None  # the next skipped save_checkpoint says so again
        if self._open is not None:
            self._open.sealed = True
            self._pending.append(self._open)
            self._open = None

    def _on_durable(self, handle: SaveHandle) -> None:
        with self._lock:
            self._durable.add(handle.id)
        self._check_tags()

    def _check_tags(self, all_durable: bool = False) -> None:
        """Write this rank's marker of each sealed tag whose files are all durable (all of them:
        `all_durable`, after `wait_for_durable`), and commit (and point `latest` at) the tags
        every rank has marked. Runs on the caller's thread and the engine's, one at a time. A
        failure fails the tag on this rank (`_fail`)."""
        with self._commit_lock:
            self._check_tags_serialized(all_durable)

    def _check_tags_serialized(self, all_durable: bool) -> None:
        with self._lock:
            if all_durable:  # a failed save has no commit marker: its tag stays open
                self._durable.update(h.id for t in self._pending for h in t.files.values()
                                     if layout.is_committed(h.directory))
            ready = [t for t in self._pending if not t.marked and not t.failed
                     and all(h.id in self._durable for h in t.files.values())]
            for t in ready:
                t.marked = True
                self._durable.difference_update(h.id for h in t.files.values())
            marked = [t for t in self._pending if t.marked]
        for t in ready:
            try:
                os.makedirs(os.path.join(t.directory, TAG_MARKERS), exist_ok=True)
                atomic_write(tag_marker(t.directory, self.rank), layout.dumps(dict(
                    layout.format_header(), rank=self.rank, world_size=self.world_size,
                    files=sorted(os.path.basename(p) for p in t.files), started=t.started)))
            except OSError as e:
                self._fail(t, CheckpointError(f"writing the tag marker failed: {e}",
                                              rank=self.rank, file=t.directory))
        for t in marked:
            try:
                committed = try_commit_tag(t.directory, self.world_size)
                if committed:
                    advance_latest(os.path.dirname(t.directory), os.path.basename(t.directory))
            except (OSError, CheckpointError) as e:
                # This rank's files are durable and marked: another rank may still commit.
                logger.error("DataStates: committing DeepSpeed tag %r failed on rank %d: %s",
                             os.path.basename(t.directory), self.rank, e)
                committed = True  # not retried
            if committed:
                with self._lock:
                    if t in self._pending:
                        self._pending.remove(t)
        with self._lock:  # tags other ranks failed are never committed: retry the newest few
            waiting = [t for t in self._pending if t.marked]
            for t in waiting[:-MARKED_RETRIED]:
                self._pending.remove(t)

    def _atexit(self) -> None:
        try:
            self.close()
        except CheckpointError as e:
            logger.error("DataStates: error while draining DeepSpeed saves at exit: %s", e)


def _device(map_location: Any) -> Optional[torch.device]:
    """Loaded tensors are on the CPU, where DeepSpeed asks for them (a device, a string or the
    identity storage lambda); another device named here is where they are moved."""
    if map_location is None or callable(map_location):
        return None
    device = torch.device(map_location)
    return None if device.type == "cpu" else device
