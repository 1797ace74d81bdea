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

The format: each file DeepSpeed names is a one-rank DataStates version directory at that path
(shard, checksummed index, commit marker). A tag is committed when every rank has written
`<tag>/.datastates/rank_NNNNN.json` (its files, all durable) and one of them then writes
`<tag>/.datastates/COMMIT.json`; `load` refuses any file of a tag without it, by name. A tag that
is committed is never rewritten.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import layout
from .config import EngineConfig
from .engine import CheckpointEngine, SaveHandle
from .errors import CheckpointError
from .fileio import atomic_write, fsync_dir
from .reader import CheckpointReader
from .safe_load import torch_load

logger = logging.getLogger(__name__)

SECTION = "datastates_ckpt"
TAG_MARKERS = ".datastates"
TAG_COMMIT = "COMMIT.json"
GiB = 1 << 30
#: Tags this rank has marked that wait for other ranks' markers, retried at each step (a tag
#: another rank failed never commits; the last rank to mark a tag commits it itself).
MARKED_RETRIED = 4
#: Keys of the section we read, and those of the reference implementation we accept and ignore.
KNOWN_KEYS = ("host_cache_size", "parser_threads", "allow_pickle")
IGNORED_KEYS = ("fast_cache_init", "pin_host_cache")

#: DeepSpeed classes found in its state dicts (ZeRO's loss scaler, its parameter slice
#: mappings). Stored as their class name and attribute dict; rebuilt without running their code.
_OBJ = "__datastates_deepspeed_object__"
SAFE_CLASSES = ("deepspeed.runtime.fp16.loss_scaler:LossScaler",
                "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
                "deepspeed.utils.tensor_fragment:fragment_address")


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


# ------------------------------------------------------------------ DeepSpeed objects, safely
def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


def encode_objects(obj: Any) -> Any:
    """DeepSpeed's own objects and sets as plain dicts the safe format stores; the rest as is.
    Containers are rebuilt (a shallow copy); tensors are not touched."""
    if isinstance(obj, dict):
        return {k: encode_objects(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [encode_objects(v) for v in obj]
    if type(obj) is tuple:
        return tuple(encode_objects(v) for v in obj)
    if isinstance(obj, (set, frozenset)):
        return {_OBJ: type(obj).__name__, "items": [encode_objects(v) for v in sorted(obj, key=repr)]}
    if _class_name(obj) in SAFE_CLASSES:
        return {_OBJ: _class_name(obj), "state": encode_objects(dict(vars(obj)))}
    return obj


def _rebuild(name: str, state: Dict[str, Any], file: str) -> Any:
    if name not in SAFE_CLASSES:
        raise CheckpointError(f"{file} names class {name!r}, which a DeepSpeed checkpoint may "
                              f"not build (allowed: {list(SAFE_CLASSES)})", file=file)
    module, _, qual = name.partition(":")
    cls = sys.modules.get(module)  # never imported here: importing may run code
    for part in qual.split("."):
        cls = getattr(cls, part, None)
    if not isinstance(cls, type):
        raise CheckpointError(f"{file} holds a {name}; import deepspeed before loading it",
                              file=file)
    obj = object.__new__(cls)  # no __init__, no __setstate__: nothing of the class runs
    obj.__dict__.update(state)
    return obj


def decode_objects(obj: Any, file: str, device: Optional[torch.device] = None) -> Any:
    """Inverse of `encode_objects`, in place where it can; tensors moved to `device` if given."""
    if isinstance(obj, torch.Tensor):
        return obj if device is None else obj.to(device)
    rec = lambda v: decode_objects(v, file, device)  # noqa: E731
    if isinstance(obj, dict):
        kind = obj.get(_OBJ)
        if kind in ("set", "frozenset") and set(obj) == {_OBJ, "items"}:
            items = [rec(v) for v in obj["items"]]
            return set(items) if kind == "set" else frozenset(items)
        if isinstance(kind, str) and set(obj) == {_OBJ, "state"}:
            return _rebuild(kind, rec(obj["state"]), file)
        for k, v in obj.items():
            obj[k] = rec(v)
        return obj
    if isinstance(obj, list):
        return [rec(v) for v in obj]
    if type(obj) is tuple:
        return tuple(rec(v) for v in obj)
    return obj


def _safe_globals() -> List[Any]:
    """The DeepSpeed classes a plain torch.save file of DeepSpeed's may hold (weights_only)."""
    out = []
    for name in SAFE_CLASSES + ("deepspeed.runtime.zero.config:ZeroStageEnum",):
        module, _, qual = name.partition(":")
        cls = getattr(sys.modules.get(module), qual, None)
        if isinstance(cls, type):
            out.append(cls)
    return out


# ------------------------------------------------------------------ tags: the unit DeepSpeed loads
def tag_marker(tag_dir: str, rank: int) -> str:
    return os.path.join(tag_dir, TAG_MARKERS, f"rank_{rank:05d}.json")


def tag_commit(tag_dir: str) -> str:
    return os.path.join(tag_dir, TAG_MARKERS, TAG_COMMIT)


def _read_doc(path: str) -> Optional[Dict[str, Any]]:
    try:
        doc = layout.read_json(path, what="DeepSpeed tag marker")
    except CheckpointError:
        return None
    return doc if isinstance(doc, dict) else None


def tag_is_committed(tag_dir: str) -> bool:
    return _read_doc(tag_commit(tag_dir)) is not None


def try_commit_tag(tag_dir: str, world_size: int) -> bool:
    """If every rank's marker is there and every file it lists is committed, write the tag's
    commit marker (atomically; any rank may, the content is the same) and return True."""
    if tag_is_committed(tag_dir):
        return True
    # One directory read first: only the last rank(s) to mark read every marker (each rank
    # reading all of them would be world_size^2 reads of the shared file system per tag).
    try:
        names = os.listdir(os.path.join(tag_dir, TAG_MARKERS))
    except OSError:
        return False
    if sum(1 for n in names if n.startswith("rank_") and n.endswith(".json")) < world_size:
        return False
    files: List[str] = []
    started = []
    for r in range(world_size):
        doc = _read_doc(tag_marker(tag_dir, r))
        if doc is None or doc.get("world_size") != world_size:
            return False
        for name in doc.get("files", []):
            path = os.path.join(tag_dir, os.path.basename(str(name)))
            if not layout.is_committed(path):
                return False
            files.append(os.path.basename(str(name)))
        started.append(float(doc.get("started", 0.0)))
    atomic_write(tag_commit(tag_dir), layout.dumps(dict(
        layout.format_header(), tag=os.path.basename(tag_dir), world_size=world_size,
        files=sorted(set(files)), started=min(started))))
    return True


def _tag_order(save_dir: str, tag: str) -> tuple:
    """Sort key of a committed tag: DeepSpeed's default tags by step, others by save time."""
    m = re.fullmatch(r"global_step(\d+)", tag)
    doc = _read_doc(tag_commit(os.path.join(save_dir, tag))) or {}
    return (int(m.group(1)) if m else -1, float(doc.get("started", 0.0)))


def advance_latest(save_dir: str, tag: str) -> None:
    """Point DeepSpeed's `latest` file at `tag` unless it names a newer committed tag."""
    path = os.path.join(save_dir, "latest")
    try:
        with open(path) as f:
            current = f.read().strip()
    except OSError:
        current = ""
    if current and current != tag and tag_is_committed(os.path.join(save_dir, current)) \
            and _tag_order(save_dir, current) > _tag_order(save_dir, tag):
        return
    if current != tag:
        atomic_write(path, tag.encode())


def newest_committed_tag(save_dir: str) -> Optional[str]:
    try:
        names = [n for n in os.listdir(save_dir)
                 if tag_is_committed(os.path.join(save_dir, n))]
    except OSError:
        return None
    return max(names, key=lambda n: _tag_order(save_dir, n), default=None)


def check_tag(tag_dir: str, file: str) -> None:
    """The tag is committed; otherwise a CheckpointError (naming `file`) names the tag and the
    newest committed one in its save directory."""
    if not tag_is_committed(tag_dir):
        save_dir = os.path.dirname(tag_dir)
        newest = newest_committed_tag(save_dir)
        raise CheckpointError(
            f"DeepSpeed checkpoint tag {os.path.basename(tag_dir)!r} in {save_dir} is not "
            f"committed: its save was interrupted before every rank's files were durable "
            f"(no {TAG_MARKERS}/{TAG_COMMIT}); "
            + (f"the newest committed tag there is {newest!r}" if newest
               else "no tag there is committed"), file=file)


def check_loadable(path: str) -> None:
    """`path`, a file of a DeepSpeed tag written by us, may be read: its tag is committed and
    lists it."""
    tag_dir = os.path.dirname(path)
    check_tag(tag_dir, path)
    doc = _read_doc(tag_commit(tag_dir)) or {}
    if os.path.basename(path) not in doc.get("files", []):
        raise CheckpointError(f"DeepSpeed checkpoint tag {os.path.basename(tag_dir)!r} was "
                              f"committed without this file", file=path)


def read_file(path: str, allow_pickle: bool = False,
              device: Optional[torch.device] = None) -> Any:
    """One file of a committed tag, every piece verified, DeepSpeed's objects rebuilt."""
    check_loadable(path)
    with CheckpointReader(path, allow_pickle=allow_pickle) as reader:
        return decode_objects(reader.load_state(rank=0), path, device)


def resolve_tag(src: str) -> str:
    """The tag directory `src` names: itself (it holds our tag markers), or the tag that
    DeepSpeed's `latest` file in it names."""
    src = os.path.abspath(src)
    if os.path.isdir(os.path.join(src, TAG_MARKERS)):
        return src
    try:
        with open(os.path.join(src, "latest")) as f:
            tag = f.read().strip()
    except OSError:
        raise CheckpointError("expected a DeepSpeed tag written with DataStates (it holds "
                              f"{TAG_MARKERS}/) or a save directory with a `latest` file; "
                              "found neither", file=src) from None
    tag_dir = os.path.join(src, os.path.basename(tag))
    if not os.path.isdir(os.path.join(tag_dir, TAG_MARKERS)):
        raise CheckpointError(f"`latest` names tag {tag!r}, which was not written with DataStates",
                              file=tag_dir)
    return tag_dir


def export_torch(src: str, dst: str, allow_pickle: bool = False) -> Tuple[str, List[str]]:
    """Write the committed tag that `src` names as DeepSpeed's own torch.save files,
    `dst/<tag>/<file>`, and `dst/latest`, for the tools that torch.load them (DeepSpeed's
    zero_to_fp32.py, ds_to_universal). Every piece is verified as it is read; deepspeed must be
    imported (its objects are rebuilt). Nothing is left in `dst/<tag>` unless every file was
    written. Returns (tag, file names)."""
    tag_dir = resolve_tag(src)
    tag = os.path.basename(tag_dir)
    check_tag(tag_dir, tag_dir)
    names = list((_read_doc(tag_commit(tag_dir)) or {}).get("files", []))
    out = os.path.join(os.path.abspath(dst), tag)
    if os.path.exists(out):
        raise CheckpointError("the output tag directory already exists; remove it or choose "
                              "another destination", file=out)
    partial = f"{out}.partial-{time.time_ns()}"
    os.makedirs(partial)
    try:
        for name in names:
            state = read_file(os.path.join(tag_dir, name), allow_pickle)
            torch.save(state, os.path.join(partial, name))
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    fsync_dir(os.path.dirname(out))
    atomic_write(os.path.join(os.path.dirname(out), "latest"), tag.encode())
    return tag, names


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
        if tag_is_committed(tag_dir):  # never rewritten (e.g. a resume from an older tag)
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
        path = os.path.abspath(path)
        if os.path.isdir(path):
            return read_file(path, self.section.allow_pickle, _device(map_location))
        if os.path.isfile(path):  # a torch.save file, e.g. from before switching engines
            state = torch_load(path, file=path, extra_globals=_safe_globals(),
                               allow_unsafe=self.section.allow_pickle,
                               way_forward='if you trust this file, set "allow_pickle": true in '
                                           f'the {SECTION} section')
            return decode_objects(state, path, _device(map_location))
        raise CheckpointError("DeepSpeed load: no checkpoint file here", rank=self.rank,
                              file=path)

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
