"""When old checkpoints go: keep the newest K complete ones (`--keep-last-n-checkpoints` under
--save, `--keep-last-n-universal` under the universal root), and under --save every multiple of
`--save-retain-interval` besides them.

Only rank 0 calls this, right after the tracker of a root moved to a newly complete iteration. It
never touches the iteration the tracker names, anything newer (saves still in flight), an
iteration listed as in use (e.g. the source of a merge that is waiting or starting), nor a
directory another process is reading (a merge or a converter holds `fileio.hold_for_reading` on
it): those are kept and go at a later call, once free. A directory is first renamed out of the
`iter_*` namespace, then removed, so a crash half-way through a removal never leaves a partial
directory that looks like a checkpoint. The renamed directory is deleted by `remove` (default:
at once; the lazy trainer passes a background remover, since deleting a checkpoint's files takes
longer than saving one is allowed to stall training).
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional

from datastates.fileio import claim_for_removal

_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
TRASH_PREFIX = ".deleting-"


@dataclass
class Removal:
    """What one retention pass did."""

    removed: List[int] = field(default_factory=list)
    kept_in_use: List[int] = field(default_factory=list)
    """Old enough to go, but read by a merge or a converter: kept until a later pass."""


def iteration_dirs(root: str) -> List[int]:
    """Iterations that have an `iter_*` directory under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root)
                  if (m := _ITER_DIR.match(name)) and os.path.isdir(os.path.join(root, name)))


def remove_now(trash: str) -> None:
    shutil.rmtree(trash, ignore_errors=True)


def apply_retention(root: str, keep: Optional[int], latest: int,
                    in_flight: Iterable[int] = (),
                    remove: Callable[[str], None] = remove_now,
                    retain_every: Optional[int] = None) -> Removal:
    """Remove checkpoints older than the newest `keep` ones up to `latest` (see module doc),
    except multiples of `retain_every` (with it alone, `keep` is 1: Megatron-LM's
    --save-retain-interval); `remove(trash)` deletes each one once it is renamed out of the
    `iter_*` namespace."""
    out = Removal()
    if retain_every:
        keep = keep or 1
    if not keep or keep <= 0:
        return out
    protected = set(in_flight) | {latest}
    candidates = [it for it in iteration_dirs(root) if it <= latest and it not in protected
                  and not (retain_every and it % retain_every == 0)]
    # `latest` itself counts as one of the kept checkpoints.
    for it in candidates[:max(0, len(candidates) - (keep - 1))]:
        name = f"iter_{it:07d}"
        path, trash = os.path.join(root, name), os.path.join(root, TRASH_PREFIX + name)
        with claim_for_removal(path) as free:
            if not free:
                out.kept_in_use.append(it)
                continue
            os.replace(path, trash)
        remove(trash)
        out.removed.append(it)
    return out
