"""File-safety primitives every writer and reader of ours uses: the engine, the universal writer,
the Megatron adapter and the trainer. One rule each, written once.

Writing (durability is explicit):
  `atomic_write`       temp file + fsync + rename + directory fsync: readers see all or nothing
  `fsync_file`, `fsync_dir`, `pwrite_all` (loops over short writes)
  `give_default_mode`  the permissions open() would have given (0644 under umask 0022), for files
                       a library created with 0600 (safetensors does)
  `make_spare` / `replace_from_spare` / `release_spare`: a small file (tracker, commit marker)
                       rewritten into blocks allocated earlier, so it can move on a full disk
Keeping a checkpoint while it is read (retention must not remove what a merge or a converter
still reads; a lock file beside the directory, so it works on NFS too and dies with its holder):
  `hold_for_reading`   a shared lock on ``.<name>.lock`` for as long as the block runs
  `claim_for_removal`  an exclusive lock if nobody reads it; the remover's block runs under it
Reading untrusted checkpoints (no path outside the checkpoint directory):
  `safe_join`          a file name from a checkpoint's own metadata: plain name, no '..', no link out
  `confined_path`      realpath containment check; `open_confined` / `read_confined` open with
                       O_NOFOLLOW after it
  `read_iteration`     a tracker file's iteration: a non-negative plain ASCII decimal
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import uuid
from typing import Any, Iterator, Optional

from .errors import CheckpointError

__all__ = ["SPARE_BYTES", "TRACKER_MAX_BYTES", "atomic_write", "claim_for_removal",
           "confined_path", "fsync_dir", "fsync_file", "give_default_mode", "hold_for_reading",
           "lock_path", "make_spare", "naming", "open_confined", "pwrite_all", "read_confined",
           "read_iteration", "release_spare", "replace_from_spare", "safe_join", "spare_path",
           "umask"]

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


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
              what: str = "index", confine_to: Optional[str] = None) -> str:
    """Join a file name read from a checkpoint's own metadata (`what` names that metadata, e.g.
    "index", "manifest", "tracker") to `directory`, refusing names that could point outside it
    (absolute paths, separators, '..', odd characters) and files that resolve outside it through
    a symlink (`confined_path`; outside `confine_to` when given, a directory above it whose
    files its links may name). Returns the joined path, unresolved."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
        raise CheckpointError(f"{what} names file {name!r}; expected a plain file name inside the "
                              f"checkpoint directory (letters, digits, '_', '.', '-')",
                              rank=rank, file=directory)
    path = os.path.join(directory, name)
    confined_path(confine_to or directory, path, rank=rank,
                  what=f"{what} names file {name!r}, which")
    return path


def open_confined(path: str, *, directory: Optional[str] = None, rank: Optional[int] = None,
                  what: str = "file", flags: int = 0) -> int:
    """A read-only descriptor of `path`, a file of `directory` (default: its parent), refused
    with CheckpointError if it resolves outside it. The resolved path is opened with O_NOFOLLOW,
    so a symlink put in its place after the check is refused rather than followed. Other
    failures raise OSError, for the caller to word. `flags` are added (e.g. O_DIRECT)."""
    real = confined_path(os.path.dirname(path) if directory is None else directory, path,
                         rank=rank, what=what)
    return os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | flags)


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


def fsync_file(path: str) -> None:
    """fsync a file already written (e.g. by a library that does not), by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """This process's umask, read without changing it (os.umask can only set it, and setting it
    to read it races with threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)  # no /proc (not Linux): the only portable way
    os.umask(old)
    return old


def give_default_mode(path: str) -> None:
    """Give a file the permissions a plain open() would have created it with: 0o666 minus the
    umask (0644 under umask 0022). For files written by libraries that create them 0600
    (safetensors' save_file does), so teammates on a shared file system can read them."""
    os.chmod(path, 0o666 & ~umask())


def pwrite_all(fd: int, mv, offset: int) -> None:
    """pwrite all of `mv` at `offset`, looping over short writes."""
    done = 0
    while done < len(mv):
        n = os.pwrite(fd, mv[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        done += n


def naming(err: OSError, path: str) -> OSError:
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
            raise naming(err, path)
        raise
    if durable:
        fsync_dir(directory)


#: Default size of the spare file kept beside a file updated with `replace_from_spare`.
SPARE_BYTES = 4096


def spare_path(path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(path)),
                        f".{os.path.basename(path)}.spare")


def make_spare(path: str, nbytes: int = SPARE_BYTES) -> bool:
    """Allocate `nbytes` of blocks for the spare of `path` if there is none. Best effort:
    False, with nothing left behind, if the filesystem has no room for it.

    `posix_fallocate` takes the blocks at once (writes into them can no longer fail for lack of
    space) without a data write or an fsync: the spare holds no data, so nothing about it needs
    to survive a crash (`replace_from_spare` falls back to a plain atomic write without one).
    Where the filesystem cannot allocate ahead (libc then writes zeros, e.g. on NFS) the blocks
    are counted only once written back: the fsync then takes them now, as a write would."""
    spare = spare_path(path)
    if os.path.isfile(spare):
        return True
    try:
        fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            if os.fstat(fd).st_blocks * 512 < nbytes:
                os.fsync(fd)
        finally:
            os.close(fd)
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
            raise naming(err, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    if renew:
        make_spare(path)


# ----------------------------------------------------------------------------- leases

def lock_path(directory: str) -> str:
    """The lock file of a checkpoint directory: ``.<name>.lock`` beside it."""
    directory = os.path.abspath(directory)
    return os.path.join(os.path.dirname(directory), f".{os.path.basename(directory)}.lock")


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF,
             errno.EACCES, errno.EPERM, errno.EROFS, errno.ELOOP)


def _lock(path: str, how: int) -> Optional[int]:
    """A descriptor of lock file `path` locked with flock(`how`); None if `how` is non-blocking
    and another process holds a conflicting lock. OSError with an errno of `_NO_LOCKS` where the
    file system cannot lock (or the directory is read-only). A lock file unlinked by its last
    holder while we waited is not ours: we retry on the new one."""
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
        try:
            fcntl.flock(fd, how)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:
            os.close(fd)
            raise
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _unlock(fd: int, path: str) -> None:
    """Release; the last holder removes the lock file (so none is left behind)."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
    except OSError:
        pass  # someone else holds it: they remove it
    finally:
        os.close(fd)


@contextlib.contextmanager
def hold_for_reading(directory: str) -> Iterator[None]:
    """Every process that reads a checkpoint directory for long (a merge, a converter): while
    the block runs, `claim_for_removal` of `directory` fails, in this process or another (locks
    die with their process: a killed reader leaves nothing that blocks retention). Where locks
    cannot be taken (a read-only directory, a file system without locks) the block runs
    unprotected. Refused with CheckpointError if `directory` was removed before the lock."""
    import fcntl

    path = lock_path(directory)
    try:
        fd = _lock(path, fcntl.LOCK_SH)
    except OSError as err:
        if err.errno not in _NO_LOCKS:
            raise
        fd = None
    if fd is not None and not os.path.isdir(directory):
        _unlock(fd, path)
        raise CheckpointError("the checkpoint was removed (by retention?) before it could be "
                              "read", file=directory)
    try:
        yield
    finally:
        if fd is not None:
            _unlock(fd, path)


@contextlib.contextmanager
def claim_for_removal(directory: str) -> Iterator[bool]:
    """Retention, for each directory it would remove: yields False while a reader holds it
    (`hold_for_reading`; keep it for now), True otherwise (remove it inside the block: a reader
    that starts meanwhile waits, then finds it gone). True as well where locks cannot be taken."""
    import fcntl

    path = lock_path(directory)
    try:
        fd = _lock(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in _NO_LOCKS:
            raise
        yield True
        return
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)
