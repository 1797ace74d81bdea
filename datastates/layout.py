"""Where bytes live: file names of a version directory, atomic small-file writes, markers, commit.

A version directory (one per checkpoint step) holds, per rank r:
  shard_r{r:05d}.bin   raw tensor bytes
  index_r{r:05d}.json  tensor entries (dtype, shape, global box, file offset, chunk checksums) and
                       the small-object skeleton
  done_r{r:05d}.json   rank marker: written last by rank r, after its shard and index are fsync'd
and, once every rank's marker is present, the version's commit marker COMMIT.json. The format
version lives in FORMAT.json (apart from content) and is repeated in every marker.
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
        path = os.path.join(root, name)
        if m and is_committed(path) and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), path)
    return best


def safe_join(directory: str, name: Any, *, rank: Optional[int] = None) -> str:
    """Join a file name read from an index to its directory, refusing names that could point
    outside it (absolute paths, separators, '..', odd characters)."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
        raise CheckpointError(f"index names file {name!r}; expected a plain file name inside the "
                              f"checkpoint directory (letters, digits, '_', '.', '-')",
                              rank=rank, file=directory)
    path = os.path.join(directory, name)
    if os.path.dirname(os.path.abspath(path)) != os.path.abspath(directory):
        raise CheckpointError(f"index names file {name!r} outside the checkpoint directory",
                              rank=rank, file=directory)
    return path


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
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
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
    idx_path = safe_join(directory, doc.get("index"), rank=rank)
    try:
        with open(idx_path, "rb") as f:
            crc = zlib.crc32(f.read())
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
