"""The in-memory level (--non-persistent-ckpt-type in_memory): node-local versions kept in each
node's shared memory (/dev/shm), which outlives a crash of the training processes (a killed rank,
an NCCL timeout, a preempted job step) but not of the node.

The versions themselves are node-local versions (`node_local.py`): every rank writes all it
holds, each node's leader commits its node, a resume takes them only when every node holds the
same newest one. What this module adds is the memory they hold:
  - `check_room` at start-up (collective): each node's shared memory must hold the versions of
    all of its ranks that it keeps (`versions_held`: the one being written and the newest
    complete one, or more), or every rank stops with one error naming the node, the size needed
    and what is free;
  - `release` after a clean end of training (the node's leader): the memory is given back once
    --save holds a version at least as new as the newest one in memory;
  - `adopt_left_memory` before a restart reads the level (collective): node indices are given
    anew at each launch (torchrun's rendezvous numbers nodes by host name, Slurm by its node
    list), so when a node is replaced the hosts that are left may hold their memory under
    another node's index. Each node whose own directory is missing takes over the one its host
    holds for an index that no node on this host has now; the ranks' files in it are then other
    saved ranks' files, and the restart assembles the version from what the nodes hold
    (`in_memory_relayout`), as at a new layout.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from ... import control_plane
from ...errors import CheckpointError
from ..paths import TRACKER_FILENAME, complete_iterations, tracked_iteration
from .local_tier import local_iterations
from .node_local import forget_node_marks

__all__ = ["FLAG", "Held", "Room", "SLOT_DIR", "VERSIONS_KEPT", "adopt_left_memory",
           "check_room", "held_bytes", "held_versions", "processes_using", "release", "take_over"]

FLAG = "--non-persistent-ckpt-type in_memory"

#: Versions a node's memory holds at once by default: the one being written and the newest
#: complete one. The previous version is committed right before the next save starts (it became
#: durable when its copy ended, before that iteration's optimizer step), and each node's leader
#: then removes the oldest kept one at once, before any rank goes on, freeing every rank's
#: reusable shard file (`datastates/mapped.py`, one slot per version).
VERSIONS_KEPT = 2

#: More versions of its own a node holds with --lazy-save-peer-replica: the one being sent to the
#: next node and the newest one sent whole (`peer_replica.PeerReplicator`, peer_dir mode), which
#: every other node keeps until a newer one is sent, so a node lost mid-transfer is restored.
VERSIONS_HELD_FOR_PEERS = 2
#: Versions of the previous node's ranks a node holds with --lazy-save-peer-replica: the newest
#: one received whole and the one arriving.
PEER_VERSIONS = 2

MiB = 1 << 20


def versions_held(keep: int = 1, peers: bool = False) -> int:
    """Versions of its own ranks' checkpoints a node's memory holds (and slots each rank's engine
    keeps) with the newest `keep` complete ones kept (--keep-last-n-non-persistent): those and
    the one being written; with peer replicas also the one being sent and the newest one sent
    whole (`VERSIONS_HELD_FOR_PEERS`)."""
    return keep + 1 + (VERSIONS_HELD_FOR_PEERS if peers else 0)


def node_needs(node_bytes: List[int], keep: int = 1, peers: bool = False
               ) -> Tuple[int, int, List[int]]:
    """(versions of its own ranks' checkpoints a node holds, versions of the previous node's,
    each node's bytes), for nodes in ring order whose ranks' checkpoints sum to `node_bytes`.
    Peer replicas count only with two or more nodes: on one, nothing is replicated and the
    engines keep no slots for it."""
    peers = peers and len(node_bytes) > 1
    versions, peer_versions = versions_held(keep, peers), PEER_VERSIONS if peers else 0
    return versions, peer_versions, [versions * own + peer_versions * node_bytes[i - 1]
                                     for i, own in enumerate(node_bytes)]


#: Where a node's in-memory engines keep their reusable shard files (`datastates/mapped.py`),
#: under the node's directory of the level.
SLOT_DIR = ".datastates_slots"
#: The name of a node's directory of the level (`megatron.training.config`: in_memory/node{node}).
_NODE_DIR = re.compile(r"node(0|[1-9][0-9]*)")  # as node{node} writes it


@dataclass(frozen=True)
class Room:
    """This node's shared memory as `check_room` found it."""

    node: int
    versions: int        # of its own ranks' checkpoints (`node_needs`)
    peer_versions: int   # of the previous node's
    ranks: int           # ranks on this node
    need_bytes: int      # those versions of all of them
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


@dataclass(frozen=True)
class Held:
    """A directory of versions in a job's shared memory (`held_versions`)."""

    path: str
    complete: List[int]     # iterations with a commit marker, ascending
    tracked: Optional[int]  # what its tracker names (the newest complete one a restart takes)
    other: List[int]        # iterations without one (a save cut short)


def held_versions(top: str) -> List[Held]:
    """The directories under `top` (the shared-memory directory of one --save,
    `megatron.training.config.shared_memory_dir`) that hold versions: each node's directory of
    the in-memory level, and those of the peer replicas and their local copies, sorted."""
    found = []
    for path, dirs, _ in os.walk(top):
        iterations = set(local_iterations(path))
        dirs[:] = sorted(d for d in dirs if d != SLOT_DIR and not d.startswith("iter_"))
        if iterations or os.path.exists(os.path.join(path, TRACKER_FILENAME)):
            done = complete_iterations(path)
            found.append(Held(path, done, tracked_iteration(path),
                              sorted(iterations - set(done))))
    return sorted(found, key=lambda h: h.path)


def processes_using(top: str) -> List[int]:
    """The processes (of those this user may inspect) that have a file under `top` open or
    mapped, as /proc shows them: a training process of a job that still runs on this node."""
    prefix, pids = os.path.realpath(top) + os.sep, []
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                mapped = any(prefix in line for line in maps)
            fds = f"/proc/{pid}/fd"
            used = mapped or any(os.readlink(os.path.join(fds, fd)).startswith(prefix)
                                 for fd in os.listdir(fds))
        except OSError:  # gone, or another user's
            continue
        if used:
            pids.append(int(pid))
    return pids


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


def check_room(root: str, rank: int, node: int, bytes_per_rank: int, keep: int = 1,
               peers: bool = False) -> Room:
    """Collective (control plane), at start-up: whether the shared memory of every node holds
    the versions of its ranks' checkpoints (`bytes_per_rank` each, this rank's bound) and of the
    previous node's (peer replicas: nodes in index order, a ring) that `node_needs` counts.
    The versions an earlier run left in `root` count as free: they are replaced. Raises the same
    CheckpointError on every rank, naming each node that is short, the size needed and the size
    free, before anything is written."""
    try:
        free = _free_bytes(root) + held_bytes(root)
    except OSError:
        free = -1
    rows = control_plane.all_gather_ints([node, bytes_per_rank, free])
    order = sorted({r[0] for r in rows})
    members = {n: [r for r in rows if r[0] == n] for n in order}
    versions, peer_versions, needs = node_needs(
        [sum(b for _, b, _ in members[n]) for n in order], keep, peers)
    # node -> (its ranks, bytes needed, bytes free on its least-free rank)
    nodes = {n: (len(members[n]), need, min(f for _, _, f in members[n]))
             for n, need in zip(order, needs)}
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
    return Room(node=node, versions=versions, peer_versions=peer_versions, ranks=ranks,
                need_bytes=need, free_bytes=free)


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


def host_id(host: Optional[str] = None) -> int:
    """A 56-bit number naming `host` (default: this machine's host name)."""
    name = socket.gethostname() if host is None else host
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "big")


def adopt_left_memory(root: str, rank: int, node: int, host: Optional[str] = None,
                      log: Callable[[str], None] = print) -> Dict[int, int]:
    """Collective (control plane), before a restart reads the level: see the module doc. `root`
    is this rank's node's directory (`.../node{node}`; another name: nothing is done), `host`
    this machine's name (a test's stand-in for several machines). The first rank of each host,
    for every node of that host whose directory does not exist, renames to it a sibling
    `node{j}` directory that no node on this host has now (the newest one first, by its
    tracker) and removes the reusable shard files in it (named after the ranks that made them)
    and the old index's node mark (`node_local.discover`).
    Returns {node: the index its directory had}, the same on every rank; an error on any rank
    is agreed on (a CheckpointError naming it) and nothing more is renamed."""
    parent, name = os.path.split(os.path.normpath(root))
    m = _NODE_DIR.fullmatch(name)
    mine = host_id(host)
    rows = control_plane.all_gather_ints([node if m and int(m.group(1)) == node else -1, mine])
    if any(n < 0 for n, _ in rows):  # a directory of the user's naming on some rank
        return {}
    here = sorted({n for n, h in rows if h == mine})
    first = min(r for r, (_, h) in enumerate(rows) if h == mine) == rank

    def take() -> List[int]:
        if not first or not os.path.isdir(parent):
            return []
        present = {int(x.group(1)): os.path.join(parent, x.group(0))
                   for x in map(_NODE_DIR.fullmatch, os.listdir(parent)) if x}
        needing = [n for n in here if n not in present]
        left = sorted((j for j, path in present.items() if j not in here and _real_dir(path)),
                      key=lambda j: (-_newest(os.path.join(parent, f"node{j}")), j))
        moves = []
        for n, j in zip(needing, left):
            take_over(parent, j, n)
            moves += [n, j]
        return moves

    moves = control_plane.agree(take, "taking over the in-memory checkpoints left on a host "
                                      "under another node's index")
    every = control_plane.all_gather_ints(control_plane.padded(moves, 2 * len(rows)))
    adopted = {row[k]: row[k + 1] for row in every for k in range(0, len(row), 2) if row[k] >= 0}
    for n, j in sorted(adopted.items()):
        if n in here and first:
            log(f"[rank {rank}] node {n} takes over the in-memory checkpoints that node {j} of "
                f"an earlier launch left on this host ({host or socket.gethostname()}): node "
                "indices are assigned anew at each launch")
    return adopted


def take_over(parent: str, old: int, new: int) -> None:
    """Node `new` takes the directory `node{old}` under `parent` for its own (renamed), without
    the reusable shard files the old index's ranks made in it, nor its node mark."""
    target = os.path.join(parent, f"node{new}")
    os.rename(os.path.join(parent, f"node{old}"), target)
    shutil.rmtree(os.path.join(target, SLOT_DIR), ignore_errors=True)
    forget_node_marks(target)


def _real_dir(path: str) -> bool:
    """A directory, not a link to one (a link's target would be renamed into and emptied)."""
    return os.path.isdir(path) and not os.path.islink(path)


def _newest(directory: str) -> int:
    try:
        newest = tracked_iteration(directory)
    except (CheckpointError, OSError, ValueError):
        return -1
    return -1 if newest is None else newest

