"""When old checkpoints go: keep the newest K complete ones (`--keep-last-n-checkpoints`).

Only rank 0 calls this, right after the tracker moved to a newly complete iteration. It never
touches the iteration the tracker names, anything newer (saves still in flight), or an iteration
listed as in flight. A directory is first renamed out of the `iter_*` namespace, then removed, so
a crash half-way through a removal never leaves a partial directory that looks like a checkpoint.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Iterable, List, Optional

_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
TRASH_PREFIX = ".deleting-"


def iteration_dirs(root: str) -> List[int]:
    """Iterations that have an `iter_*` directory under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root)
                  if (m := _ITER_DIR.match(name)) and os.path.isdir(os.path.join(root, name)))


def apply_retention(root: str, keep: Optional[int], latest: int,
                    in_flight: Iterable[int] = ()) -> List[int]:
    """Remove checkpoints older than the newest `keep` ones up to `latest`; returns what went."""
    if not keep or keep <= 0:
        return []
    protected = set(in_flight) | {latest}
    candidates = [it for it in iteration_dirs(root) if it <= latest and it not in protected]
    # `latest` itself counts as one of the kept checkpoints.
    doomed = candidates[:max(0, len(candidates) - (keep - 1))]
    for it in doomed:
        name = f"iter_{it:07d}"
        trash = os.path.join(root, TRASH_PREFIX + name)
        os.replace(os.path.join(root, name), trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed
