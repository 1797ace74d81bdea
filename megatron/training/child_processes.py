"""What runs first in a process a rank starts and that must not outlive it.

Kept free of torch and of every other import that takes time, so that a spawned child that runs
one of these as its initializer starts in milliseconds (a forked one, such as the results-queue
Manager of `mcore_fixes.results_queue_dies_with_rank`, has everything already).
"""
from __future__ import annotations

__all__ = ["die_with_parent", "serve_until_the_rank_dies"]


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG); elsewhere nothing."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve_until_the_rank_dies() -> None:
    """A Manager's initializer: ignore SIGTERM and SIGINT (a launcher signals the whole process
    tree, and the rank may still save on SIGTERM, --exit-signal-handler) and die with the rank
    instead."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
