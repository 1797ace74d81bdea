"""The in-memory level (--non-persistent-ckpt-type in_memory): node-local versions kept in each
node's shared memory (/dev/shm), which outlives a crash of the training processes (a killed rank,
an NCCL timeout, a preempted job step) but not of the node.

The versions themselves are node-local versions (`node_local.py`): every rank writes all it
holds, each node's leader commits its node, a resume takes them only when every node holds the
same newest one. What this module adds is the memory they hold:
  - `check_room` at start-up (collective): each node's shared memory must hold `VERSIONS_KEPT`
    versions of all of its ranks (the one being written and the newest complete one), or every
    rank stops with one error naming the node, the size needed and what is free;
  - `release` after a clean end of training (the node's leader): the memory is given back once
    --save holds a version at least as new as the newest one in memory.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import List, Optional

from ... import control_plane
from ...errors import CheckpointError
from ..paths import TRACKER_FILENAME, tracked_iteration
from .local_tier import local_iterations

__all__ = ["FLAG", "Room", "VERSIONS_KEPT", "check_room", "held_bytes", "release"]

FLAG = "--non-persistent-ckpt-type in_memory"

#: Versions a node's memory holds at once: the one being written and the newest complete one.
#: The previous version is committed right before the next save starts (it became durable when
#: its copy ended, before that iteration's optimizer step), and each node's leader then removes
#: the older one at once, before any rank goes on, freeing every rank's reusable shard file
#: (`datastates/mapped.py`, one slot per version).
VERSIONS_KEPT = 2

#: More versions of its own a node holds with --lazy-save-peer-replica: the one being sent to the
#: next node and the newest one sent whole (`peer_replica.PeerReplicator`, peer_dir mode), which
#: every other node keeps until a newer one is sent, so a node lost mid-transfer is restored.
VERSIONS_HELD_FOR_PEERS = 2
#: Versions of the previous node's ranks a node holds with --lazy-save-peer-replica: the newest
#: one received whole and the one arriving.
PEER_VERSIONS = 2

MiB = 1 << 20


@dataclass(frozen=True)
class Room:
    """This node's shared memory as `check_room` found it."""

    node: int
    ranks: int           # ranks on this node
    need_bytes: int      # VERSIONS_KEPT versions of all of them
    free_bytes: int      # free in the file system of the root, plus what the root already holds


def held_bytes(root: str) -> int:
    """Bytes of the files under `root` (0 when it does not exist), each inode once (a version's
    shard file is a hard link to a reusable slot, `datastates/mapped.py`)."""
    total, seen = 0, set()
    for top, _, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:  # removed meanwhile
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _free_bytes(root: str) -> int:
    """Free bytes of the file system that holds (or will hold) `root`."""
    path = root
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_room(root: str, rank: int, node: int, bytes_per_rank: int,
               versions: int = VERSIONS_KEPT, peer_versions: int = 0) -> Room:
    """Collective (control plane), at start-up: whether the shared memory of every node holds
    `versions` versions of its ranks' checkpoints (`bytes_per_rank` each, this rank's bound) and
    `peer_versions` of the previous node's (peer replicas: nodes in index order, a ring).
    The versions an earlier run left in `root` count as free: they are replaced. Raises the same
    CheckpointError on every rank, naming each node that is short, the size needed and the size
    free, before anything is written."""
    try:
        free = _free_bytes(root) + held_bytes(root)
    except OSError:
        free = -1
    rows = control_plane.all_gather_ints([node, bytes_per_rank, free])
    nodes = {}  # node -> (its ranks, bytes needed, bytes free on its least-free rank)
    order = sorted({r[0] for r in rows})
    for i, n in enumerate(order):
        members = [r for r in rows if r[0] == n]
        previous = [r for r in rows if r[0] == order[i - 1]]
        nodes[n] = (len(members), versions * sum(b for _, b, _ in members)
                    + peer_versions * sum(b for _, b, _ in previous),
                    min(f for _, _, f in members))
    short = {n: v for n, v in nodes.items() if v[2] < v[1]}
    if short:
        peers = (f" and {peer_versions} of the previous node's (peer replicas)"
                 if peer_versions else "")
        parts = [f"node {n} needs {need_b / MiB:.0f} MiB for {versions} versions of its {k} "
                 f"rank(s)' checkpoints{peers} but " + (f"{free_b / MiB:.0f} MiB is free"
                                                 if free_b >= 0 else "it cannot be read")
                 for n, (k, need_b, free_b) in short.items()]
        raise CheckpointError(f"{FLAG}: the shared memory under {os.path.dirname(root)} is too "
                              "small: " + "; ".join(parts) + ". Free memory there (e.g. old "
                              "/dev/shm/datastates-* directories of finished jobs), use fewer "
                              "ranks per node, or use --non-persistent-ckpt-type local. Nothing "
                              "was saved or removed", rank=rank, file=root,
                              ranks=[r for r, row in enumerate(rows) if row[0] in short])
    ranks, need, free = nodes[node]
    return Room(node=node, ranks=ranks, need_bytes=need, free_bytes=free)


def release(root: str, persistent_root: Optional[str]) -> List[int]:
    """A node's leader, after a clean end of training: remove `root` (this node's memory of the
    level) when `persistent_root`'s tracker names an iteration at least as new as its newest
    version; returns the iterations removed ([] and nothing removed when memory holds a newer
    one: it stays, a restart resumes from it). The tracker goes first, so a version is never
    named while it is being removed."""
    newest = tracked_iteration(root)
    persistent = tracked_iteration(persistent_root) if persistent_root else None
    if newest is not None and (persistent is None or persistent < newest):
        return []
    iterations = local_iterations(root)
    tracker = os.path.join(root, TRACKER_FILENAME)
    if os.path.exists(tracker):
        os.remove(tracker)
    shutil.rmtree(root, ignore_errors=True)
    parent = os.path.dirname(root)
    for _ in range(2):  # the level's and the root's directories, unless another node or level
        try:            # (a peer replica) still uses them
            os.rmdir(parent)
        except OSError:
            break
        parent = os.path.dirname(parent)
    return iterations
