"""Where bytes live: file names of a version directory, atomic small-file writes, markers, commit.

A version directory (one per checkpoint step) holds, per rank r:
  shard_r{r:05d}.bin   raw tensor bytes
  index_r{r:05d}.json  tensor entries (dtype, shape, global box, file offset, chunk checksums) and
                       the small-object skeleton
  done_r{r:05d}.json   rank marker: written last by rank r, after its shard and index are fsync'd
and, once every rank's marker is present, the version's commit marker COMMIT.json. The format
version lives in FORMAT.json (apart from content) and is repeated in every marker.

A checkpoint is untrusted input. Every file name a reader takes from a checkpoint's own files
(index entries, rank markers, manifests, trackers) goes through `safe_join`, and every file it
opens through `open_confined`: no '..', no absolute path, no symlink resolving out of the
checkpoint directory.
"""
from __future__ import annotations

import json
import os
import re
import uuid
import zlib
from typing import Any, Dict, Optional, Tuple

from .errors import CheckpointError

FORMAT_NAME = "datastates"
FORMAT_VERSION = 1
FORMAT_FILE = "FORMAT.json"
COMMIT_FILE = "COMMIT.json"
_STEP_DIR = re.compile(r"^step_(\d{9,})$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def shard_file(rank: int) -> str:
    return f"shard_r{rank:05d}.bin"


def index_file(rank: int) -> str:
    return f"index_r{rank:05d}.json"


def rank_marker_file(rank: int) -> str:
    return f"done_r{rank:05d}.json"


def local_version_dir(local_root: str, directory: str) -> str:
    """Node-local counterpart of a version directory (level 3)."""
    return os.path.join(local_root, os.path.basename(os.path.normpath(directory)))


def step_dir(root: str, step: int) -> str:
    """Conventional version directory for a step: ROOT/step_000000010."""
    return os.path.join(root, f"step_{step:09d}")


def latest_committed(root: str) -> Optional[Tuple[int, str]]:
    """(step, directory) of the highest-step committed `step_*` directory under `root` (as
    named by `step_dir`), or None. Uncommitted (partial) versions are skipped."""
    best = None
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return None
    for name in names:
        m = _STEP_DIR.match(name)
        if not m:
            continue
        path = os.path.join(root, name)
        try:
            confined_path(root, path)
        except CheckpointError:
            continue  # a link out of the root is not one of its versions
        if is_committed(path) and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), path)
    return best


def confined_path(directory: str, path: str, *, rank: Optional[int] = None,
                  what: str = "file") -> str:
    """The real path of `path` (symlinks resolved), refusing one that lies outside `directory`
    (its real path too, so a checkpoint directory that is itself a symlink is fine). A symlink to
    another file of the same directory stays allowed; `path` need not exist."""
    real_dir, real = os.path.realpath(directory), os.path.realpath(path)
    if real == real_dir or os.path.commonpath([real_dir, real]) != real_dir:
        raise CheckpointError(f"{what} resolves through a symlink to {real}, not inside the "
                              f"checkpoint directory {real_dir}; expected a path inside it (a "
                              f"checkpoint holds its files, not links out of it)",
                              rank=rank, file=path)
    return real


def safe_join(directory: str, name: Any, *, rank: Optional[int] = None,
              what: str = "index") -> str:
    """Join a file name read from a checkpoint's own metadata (`what` names that metadata, e.g.
    "index", "manifest", "tracker") to `directory`, refusing names that could point outside it
    (absolute paths, separators, '..', odd characters) and files that resolve outside it through
    a symlink (`confined_path`). Returns the joined path, unresolved."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
        raise CheckpointError(f"{what} names file {name!r}; expected a plain file name inside the "
                              f"checkpoint directory (letters, digits, '_', '.', '-')",
                              rank=rank, file=directory)
    path = os.path.join(directory, name)
    confined_path(directory, path, rank=rank, what=f"{what} names file {name!r}, which")
    return path


def open_confined(path: str, *, directory: Optional[str] = None, rank: Optional[int] = None,
                  what: str = "file") -> int:
    """A read-only descriptor of `path`, a file of `directory` (default: its parent), refused
    with CheckpointError if it resolves outside it. The resolved path is opened with O_NOFOLLOW,
    so a symlink put in its place after the check is refused rather than followed. Other
    failures raise OSError, for the caller to word."""
    real = confined_path(os.path.dirname(path) if directory is None else directory, path,
                         rank=rank, what=what)
    return os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))


def read_confined(path: str, *, directory: Optional[str] = None, rank: Optional[int] = None,
                  what: str = "file", limit: Optional[int] = None) -> bytes:
    """The bytes of `path` (at most `limit`), read through `open_confined`."""
    with os.fdopen(open_confined(path, directory=directory, rank=rank, what=what), "rb") as f:
        return f.read() if limit is None else f.read(limit)


_DECIMAL = re.compile(r"[0-9]+")
#: Longest tracker file read; an iteration number is a few bytes.
TRACKER_MAX_BYTES = 64


def read_iteration(path: str, *, what: str = "tracker") -> int:
    """The iteration a tracker file (Megatron's latest_checkpointed_iteration.txt) names: a
    non-negative plain ASCII decimal, surrounding whitespace allowed. `int()` alone would also
    take '-5', '1_000' and non-ASCII digits. Join the iteration's directory to the tracker's
    with `safe_join(..., what="tracker")`, so that a symlink out of it is refused too."""
    try:
        raw = read_confined(path, what=what, limit=TRACKER_MAX_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read {what}: {e}", file=path) from e
    text = raw.decode("ascii", errors="replace").strip()
    if text == "release":
        raise CheckpointError(f"expected an iteration number in {what}, found 'release' (a "
                              "Megatron-LM release checkpoint): release checkpoints are not "
                              "supported", file=path)
    if len(raw) > TRACKER_MAX_BYTES or not _DECIMAL.fullmatch(text):
        raise CheckpointError(f"expected a non-negative decimal iteration number in {what}, "
                              f"found {raw[:40]!r}", file=path)
    return int(text)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, mv, offset: int) -> None:
    """pwrite all of `mv` at `offset`, looping over short writes."""
    done = 0
    while done < len(mv):
        n = os.pwrite(fd, mv[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        done += n


def _naming(err: OSError, path: str) -> OSError:
    """`err` with `path` as its file name if it names none (write and fsync errors do not)."""
    if err.filename is not None:
        return err
    named = OSError(err.errno, err.strerror or str(err), path)
    named.__cause__ = err
    return named


def atomic_write(path: str, data: bytes, *, durable: bool = True) -> None:
    """Write `data` to `path` so that readers see either nothing or all of it:
    temp file + fsync + rename + directory fsync."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(err, OSError):
            raise _naming(err, path)
        raise
    if durable:
        fsync_dir(directory)


#: Default size of the spare file kept beside a file updated with `replace_from_spare`.
SPARE_BYTES = 4096


def spare_path(path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(path)),
                        f".{os.path.basename(path)}.spare")


def make_spare(path: str, nbytes: int = SPARE_BYTES) -> bool:
    """Allocate (write and fsync `nbytes`) the spare of `path` if there is none. Best effort:
    False, with nothing left behind, if the filesystem has no room for it."""
    spare = spare_path(path)
    if os.path.isfile(spare):
        return True
    try:
        with open(spare, "wb") as f:
            f.write(bytes(nbytes))
            f.flush()
            os.fsync(f.fileno())
        return True
    except OSError:
        try:
            os.unlink(spare)
        except OSError:
            pass
        return False


def release_spare(path: str) -> None:
    """Delete the spare of `path`, if any, so that its blocks can hold what is written next."""
    try:
        os.unlink(spare_path(path))
    except FileNotFoundError:
        pass


def replace_from_spare(path: str, data: bytes, *, renew: bool = True) -> None:
    """`atomic_write` for a small file that must be writable when the disk fills up (the
    tracker naming the newest complete checkpoint, a version's commit marker): the temp file is
    a spare whose blocks were allocated earlier (`make_spare`), so the write overwrites blocks
    it owns instead of asking a full filesystem for new ones, then is renamed over `path`.
    Without a spare big enough it is a plain `atomic_write`. With `renew`, a new spare is
    allocated afterwards, best effort (the replaced file's blocks are free by then); otherwise
    no spare is left behind."""
    spare = spare_path(path)
    try:
        room = os.path.getsize(spare)
    except OSError:
        room = -1
    if room < len(data):
        atomic_write(path, data)
        if not renew:
            release_spare(path)
    else:
        try:
            fd = os.open(spare, os.O_WRONLY)
            try:
                pwrite_all(fd, data, 0)
                os.ftruncate(fd, len(data))  # shrinking frees nothing the data needs
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(spare, path)
        except OSError as err:
            raise _naming(err, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    if renew:
        make_spare(path)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()


def format_header() -> Dict[str, Any]:
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}


def read_json(path: str, *, rank: Optional[int] = None, what: str = "file") -> Any:
    """A JSON file of a checkpoint directory; refused if it is a symlink to a file outside it."""
    try:
        return json.loads(read_confined(path, rank=rank, what=what))
    except FileNotFoundError:
        raise CheckpointError(f"{what} is missing", rank=rank, file=path) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {what}: {e}", rank=rank, file=path) from e


def check_format(doc: Any, path: str, rank: Optional[int] = None) -> None:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CheckpointError(f"expected a {FORMAT_NAME} checkpoint file, found "
                              f"{str(doc)[:80]!r}", rank=rank, file=path)
    if doc.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"expected format version {FORMAT_VERSION}, found "
                              f"{doc.get('format_version')!r}; this engine cannot read it",
                              rank=rank, file=path)


def invalidate(directory: str, rank: int) -> None:
    """Before rank `rank` rewrites a version directory: remove the commit marker and this rank's
    marker (durably), so the directory reads as incomplete until the new save commits."""
    removed = False
    for name in (COMMIT_FILE, rank_marker_file(rank)):
        try:
            os.unlink(os.path.join(directory, name))
            removed = True
        except FileNotFoundError:
            pass
    if removed:
        fsync_dir(directory)


def is_committed(directory: str) -> bool:
    """True if `directory` carries a valid commit marker."""
    path = os.path.join(directory, COMMIT_FILE)
    try:
        doc = read_json(path, what="commit marker")
        check_format(doc, path)
    except CheckpointError:
        return False
    return True


def _valid_rank_marker(directory: str, rank: int, world_size: int) -> Optional[Dict[str, Any]]:
    """The rank's marker if present and consistent with its index, else None. Raises when the
    marker is present but contradicts the expected world size (a mixed-up directory)."""
    path = os.path.join(directory, rank_marker_file(rank))
    if not os.path.exists(path):
        return None
    doc = read_json(path, rank=rank, what="rank marker")
    check_format(doc, path, rank)
    if doc.get("world_size") != world_size or doc.get("rank") != rank:
        raise CheckpointError(f"rank marker says rank {doc.get('rank')} of world size "
                              f"{doc.get('world_size')}, expected rank {rank} of {world_size}",
                              rank=rank, file=path)
    idx_path = safe_join(directory, doc.get("index"), rank=rank, what="rank marker")
    try:
        crc = zlib.crc32(read_confined(idx_path, rank=rank, what="index"))
    except OSError as e:
        raise CheckpointError(f"index named by the rank marker cannot be read: {e}",
                              rank=rank, file=idx_path) from e
    if crc != doc.get("index_crc32"):
        raise CheckpointError(f"index checksum {crc:#010x} does not match the rank marker's "
                              f"{doc.get('index_crc32')!r}", rank=rank, file=idx_path)
    return doc


def try_commit(directory: str, world_size: int) -> bool:
    """Non-blocking commit attempt, callable from any process (normally rank 0).

    If every rank 0..world_size-1 has written a valid marker, atomically write the commit marker
    and return True; return False if some marker is still missing. Idempotent.
    """
    if is_committed(directory):
        return True
    markers = []
    for r in range(world_size):
        doc = _valid_rank_marker(directory, r, world_size)
        if doc is None:
            return False
        markers.append(doc)
    steps = {m.get("step") for m in markers}
    if len(steps) != 1:
        raise CheckpointError(f"rank markers disagree on the step: {sorted(map(str, steps))}",
                              file=directory)
    commit = dict(format_header(), world_size=world_size, step=markers[0].get("step"),
                  ranks=list(range(world_size)),
                  bytes=sum(int(m.get("bytes", 0)) for m in markers))
    # Into the space set aside at save time, if the caller did (see `make_spare`).
    replace_from_spare(os.path.join(directory, COMMIT_FILE), dumps(commit), renew=False)
    return True
