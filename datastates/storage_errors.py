"""What a failed file operation means for the user, told apart by errno.

A full disk, a read-only mount, a missing directory and a permission problem need different
fixes; a message that reports free space on a read-only file system sends the user the wrong
way. `explain` turns an error into one sentence naming the path, the cause and what to do (`advice`
alone gives the last two, for a message that already quotes the error); `kind` gives the short
name the fault tests and the logs use.
"""
from __future__ import annotations

import errno
import re
import shutil
from typing import Optional

__all__ = ["advice", "explain", "kind", "root_os_error"]

_KINDS = {
    errno.ENOSPC: "full", errno.EDQUOT: "full", errno.EFBIG: "full",
    errno.EROFS: "read-only",
    errno.EACCES: "permission-denied", errno.EPERM: "permission-denied",
    errno.ENOENT: "missing", errno.ENOTDIR: "missing",
}


_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]|OSError\((\d+), ")


def kind(err: BaseException) -> str:
    """'full', 'read-only', 'permission-denied', 'missing', 'io' (another OSError) or 'error'.
    An error that crossed a process boundary (a writer process's result, a pickled exception)
    has lost its cause chain: the errno its text quotes is used then."""
    if isinstance(err, OSError):
        return _KINDS.get(err.errno, "io")
    match = _ERRNO_IN_TEXT.search(str(err))
    if match:
        return _KINDS.get(int(match.group(1) or match.group(2)), "io")
    return "error"


def _free_mib(path: Optional[str]) -> Optional[float]:
    try:
        return shutil.disk_usage(path).free / 2**20
    except (OSError, TypeError, ValueError):
        return None


def root_os_error(err: Optional[BaseException]) -> Optional[OSError]:
    """The OSError behind `err` (itself, or the first one in its cause/context chain)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def advice(err: BaseException, flag: str = "--save", root: Optional[str] = None) -> str:
    """' (why, in plain words; what to do)' for the OSError behind `err`, '' for other errors."""
    cause = kind(root_os_error(err) or err)
    where = flag if not root or root in flag else f"{flag} ({root})"
    if cause == "full":
        free = _free_mib(root)
        return (f" (the file system under {where} is full"
                + (f": {free:.1f} MiB free" if free is not None else "")
                + f"; free space there or point {flag} elsewhere)")
    if cause == "read-only":
        return (f" (the file system under {where} is mounted read-only; remount it read-write or "
                f"point {flag} at writable storage)")
    if cause == "permission-denied":
        return (f" (this process may not write under {where}; fix the directory's owner or "
                f"permissions, or point {flag} elsewhere)")
    if cause == "missing":
        return (f" (a directory under {where} does not exist, or was removed while the job ran; "
                f"create it or point {flag} elsewhere)")
    return ""


def explain(err: BaseException, flag: str = "--save", root: Optional[str] = None) -> str:
    """One line: what failed (the error, with its file), why in plain words, and what to do.
    `flag` names the setting that chose the storage (e.g. "--save"), `root` its directory (for
    the free space of a full disk)."""
    return f"{type(err).__name__}: {err}{advice(err, flag, root)}"
