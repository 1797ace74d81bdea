"""Where bytes live: file names of a version directory, its markers, and the commit.

A version directory (one per checkpoint step) holds, per rank r:
  shard_r{r:05d}.bin   raw tensor bytes
  index_r{r:05d}.json  tensor entries (dtype, shape, global box, file offset, chunk checksums) and
                       the small-object skeleton
  done_r{r:05d}.json   rank marker: written last by rank r, after its shard and index are fsync'd
and, once every rank's marker is present, the version's commit marker COMMIT.json. The format
version lives in FORMAT.json (apart from content) and is repeated in every marker.

How small files are written (atomic, durable, into space set aside) and how names read from a
checkpoint are confined to it: `fileio`.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time
import zlib
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .errors import CheckpointError
from .fileio import confined_path, fsync_dir, read_confined, replace_from_spare, safe_join

FORMAT_NAME = "datastates"
FORMAT_VERSION = 1
FORMAT_FILE = "FORMAT.json"
COMMIT_FILE = "COMMIT.json"
_STEP_DIR = re.compile(r"^step_(\d{9,})$")


def shard_file(rank: int) -> str:
    return f"shard_r{rank:05d}.bin"


def index_file(rank: int) -> str:
    return f"index_r{rank:05d}.json"


def rank_marker_file(rank: int) -> str:
    return f"done_r{rank:05d}.json"


def local_version_dir(local_root: str, directory: str) -> str:
    """Node-local counterpart of a version directory (level 3)."""
    return os.path.join(local_root, os.path.basename(os.path.normpath(directory)))


#: Where a run that starts from an older checkpoint moves the newer ones it replaces.
SUPERSEDED_PREFIX = "superseded-"


def superseded_dir(root: str, by: str) -> str:
    """Under `root`, where a run that starts from the checkpoint named `by` (an ``iter_*``
    directory, a DeepSpeed tag) moves the newer ones: named by it and the time (the name of the
    one rank that moves them is the one used)."""
    return os.path.join(root, f"{SUPERSEDED_PREFIX}by-{by}-{time.strftime('%Y%m%dT%H%M%S')}")


def move_aside(root: str, names: Sequence[str], into: str) -> None:
    """Move the entries `names` of `root`, whole and untouched, into `into` (made if needed);
    then both directories' entries are made durable."""
    os.makedirs(into, exist_ok=True)
    for name in names:
        os.replace(os.path.join(root, name), os.path.join(into, name))
    fsync_dir(into)
    fsync_dir(root)


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


#: Above this many ranks, `try_commit` lists the directory once and reads the markers
#: `_MARKER_READERS` at a time: on a shared file system each marker is ~3 metadata round trips
#: (its existence, the marker, the index it names), which one thread would make in sequence
#: (~60 s at 1024 ranks and 20 ms each).
_SERIAL_MARKERS = 8
_MARKER_READERS = 32


def _rank_markers(directory: str, ranks: List[int], world_size: int
                  ) -> Optional[List[Dict[str, Any]]]:
    """Every rank's valid marker in `ranks`' order, or None while one is missing; otherwise
    raises the error of the first (in that order) that contradicts its version, as reading them
    one by one would. (Above `_SERIAL_MARKERS` ranks a missing marker is seen before any other's
    error: the attempt once all are there raises it.)"""
    if len(ranks) <= _SERIAL_MARKERS:
        return _all_present(_valid_rank_marker(directory, r, world_size) for r in ranks)
    try:
        present = set(os.listdir(directory))
    except FileNotFoundError:
        return None
    if any(rank_marker_file(r) not in present for r in ranks):
        return None  # (one listing instead of a read per rank while some are still writing)
    with concurrent.futures.ThreadPoolExecutor(
            min(_MARKER_READERS, len(ranks)), thread_name_prefix="datastates-markers") as pool:
        futures = [pool.submit(_valid_rank_marker, directory, r, world_size) for r in ranks]
        docs = _all_present(f.result() for f in futures)  # (raises a rank's error, in order)
        if docs is None:
            for f in futures:
                f.cancel()
        return docs


def _all_present(docs: Iterable[Optional[Dict[str, Any]]]) -> Optional[List[Dict[str, Any]]]:
    """`docs` as a list, or None at the first that is None (the rest not taken)."""
    out = []
    for doc in docs:
        if doc is None:
            return None
        out.append(doc)
    return out


def try_commit(directory: str, world_size: int, ranks: Optional[Sequence[int]] = None) -> bool:
    """Non-blocking commit attempt, callable from any process (normally rank 0).

    If every rank of `ranks` (default 0..world_size-1; a node-local version names its node's)
    has written a valid marker, atomically write the commit marker (which lists them) and return
    True; return False if some marker is still missing. Idempotent.
    """
    if is_committed(directory):
        return True
    ranks = list(range(world_size)) if ranks is None else sorted(ranks)
    markers = _rank_markers(directory, ranks, world_size)
    if markers is None:
        return False
    steps = {m.get("step") for m in markers}
    if len(steps) != 1:
        raise CheckpointError(f"rank markers disagree on the step: {sorted(map(str, steps))}",
                              file=directory)
    commit = dict(format_header(), world_size=world_size, step=markers[0].get("step"),
                  ranks=ranks,
                  bytes=sum(int(m.get("bytes", 0)) for m in markers))
    # Into the space set aside at save time, if the caller did (see `make_spare`).
    replace_from_spare(os.path.join(directory, COMMIT_FILE), dumps(commit), renew=False)
    return True
