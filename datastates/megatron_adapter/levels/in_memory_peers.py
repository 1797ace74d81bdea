"""Peer replicas of the in-memory level (--non-persistent-ckpt-type in_memory with
--lazy-save-peer-replica): restoring a lost node's in-memory version from the next node.

Saving (`peer_replica.PeerReplicator` in peer_dir mode, driven by `LazyCheckpointer`): whenever
every rank's previous transfer is done, the newest complete in-memory version is handed to a
background thread on every rank, which sends the rank's files of it (and, from a node's leader,
the node's common.pt, metadata.json and run_config.json) to the same position on the next node
of the ring. There they land in `<node root>/peer/iter_N/`: a copy of the previous node's version
directory. The version being sent and the newest one sent whole stay in their node's memory until
a newer one is sent whole, so while a transfer runs every node still holds the previous one.

Restoring (`restore_memory_from_peers`, every rank, before a resume chooses its level): every
rank says which in-memory versions it holds intact (its node's commit marker names it and its
own rank marker matches its index) and which versions of its predecessor it holds as a replica.
The newest version that every saved rank has on its own node or on its successor is chosen; each
rank that lacks it receives its files from its successor, its node's leader writes the node's
commit marker and tracker, and versions newer than it, which no longer have every rank's part,
are removed from every node (one line says so). A resume then finds the same newest version on
every node and loads it from memory (`node_local.newest_on_every_node`). A replica is trusted only
when its rank marker matches its index; chunk checksums are verified when it is read, as always.
Any failure on any rank is agreed on: no rank moves a tracker, and the resume falls back to the
levels it would have read without peers.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ... import control_plane, layout
from ...errors import CheckpointError
from ...fileio import atomic_write, read_confined
from ..paths import COMMON_FILENAME, METADATA_FILENAME, RUN_CONFIG_FILENAME, checkpoint_dir, \
    tracked_iteration, write_tracker
from .local_tier import local_iterations
from .node_local import drop_newer
from .peer_replica import _NODE_NAMES, _Incoming, _Outgoing, _rank_names, _transfer, Ring

__all__ = ["PEER_DIR", "MemoryRestore", "restore_memory_from_peers"]

#: Where a node keeps the previous node's in-memory versions, under its own root of the level.
PEER_DIR = "peer"
#: Versions each rank reports per kind (own, replica): more than a node ever holds.
_REPORTED = 6


@dataclass(frozen=True)
class MemoryRestore:
    """What `restore_memory_from_peers` did, the same on every rank."""

    iteration: Optional[int]
    """The in-memory version every node now holds (None: no version every saved rank has)."""
    restored: Dict[int, int]
    """saved rank -> the peer rank its files came from."""
    dropped: List[int]
    """Newer versions removed: some rank's part of them was lost with its node."""


def _intact(directory: str, rank: int, world_size: int) -> bool:
    """`rank`'s files in `directory` match its marker (index checksum, world size)."""
    try:
        return layout._valid_rank_marker(directory, rank, world_size) is not None
    except (CheckpointError, OSError, ValueError, TypeError):
        return False


def _named_by_commit(directory: str, rank: int, world_size: int) -> bool:
    """The commit marker of `directory` names `rank` of `world_size` ranks."""
    try:
        commit = layout.read_json(os.path.join(directory, layout.COMMIT_FILE),
                                  what="commit marker")
        layout.check_format(commit, directory)
        return rank in commit.get("ranks", range(int(commit.get("world_size", 0)))) and \
            int(commit.get("world_size", -1)) == world_size
    except (CheckpointError, OSError, ValueError, TypeError):
        return False


def _held(root: str, rank: int, leads: bool, pred: int, pred_leads: bool, world_size: int
          ) -> Tuple[List[int], List[int], List[int]]:
    """(versions this rank holds of its own, those of them its node committed, versions of its
    predecessor's it holds), newest first, each at most _REPORTED. A version the node did not
    commit counts as held when this rank's files (and, on the node's leader, common.pt) are
    there: a version committed on any node was durable on every rank (the commit follows the
    agreement), so a crash between two nodes' commits loses nothing."""
    own, committed = [], []
    for it in reversed(local_iterations(root)):
        directory = checkpoint_dir(root, it)
        if not _intact(directory, rank, world_size) or (
                leads and not os.path.isfile(os.path.join(directory, COMMON_FILENAME))):
            continue
        own.append(it)
        if _named_by_commit(directory, rank, world_size):
            committed.append(it)
    peer = os.path.join(root, PEER_DIR)
    replica = [it for it in reversed(local_iterations(peer))
               if _intact(checkpoint_dir(peer, it), pred, world_size)
               and (not pred_leads or all(os.path.isfile(os.path.join(checkpoint_dir(peer, it), n))
                                          for n in _NODE_NAMES))]
    return own[:_REPORTED], committed[:_REPORTED], replica[:_REPORTED]


def _copy_metadata(root: str, directory: str) -> None:
    """metadata.json into `directory` from another version of this node or of its replicas
    (megatron's dist_checkpointing config: the same for every version of a run)."""
    for base in (root, os.path.join(root, PEER_DIR)):
        for it in reversed(local_iterations(base)):
            source = os.path.join(checkpoint_dir(base, it), METADATA_FILENAME)
            if os.path.isfile(source) and os.path.normpath(source) != os.path.normpath(
                    os.path.join(directory, METADATA_FILENAME)):
                atomic_write(os.path.join(directory, METADATA_FILENAME),
                             read_confined(source, what=METADATA_FILENAME))
                return
    raise CheckpointError(f"no {METADATA_FILENAME} for the restored in-memory version: no other "
                          f"version under {root} has one", file=directory)


def restore_memory_from_peers(root: str, world_size: int, rank: int,
                              log=print) -> MemoryRestore:
    """Every rank, collective (control plane): see the module doc. `root` is this rank's node's
    directory of the level, `world_size` this run's."""
    try:
        ring = Ring.discover()
    except CheckpointError:  # one node, or unequal nodes: refused when the checkpointer starts
        return MemoryRestore(None, {}, [])
    node = ring.nodes[ring.node_of(rank)]
    leader = rank == node[0]
    pred = ring.predecessor(rank)
    pred_leads = ring.nodes[ring.node_of(pred)][0] == pred
    try:
        own, committed, replica = _held(root, rank, leader, pred, pred_leads, world_size)
    except OSError:
        own, committed, replica = [], [], []
    rows = control_plane.all_gather_ints([v for kind in (own, committed, replica)
                                          for v in control_plane.padded(kind, _REPORTED)])
    n = _REPORTED
    owns = {r: {i for i in row[:n] if i >= 0} for r, row in enumerate(rows)}
    committed_by = {r: {i for i in row[n:2 * n] if i >= 0} for r, row in enumerate(rows)}
    ever_committed = set().union(*committed_by.values())
    replicas = {ring.predecessor(r): {i for i in row[2 * n:] if i >= 0}
                for r, row in enumerate(rows)}
    common = ever_committed.intersection(*(owns[s] | replicas[s] for s in range(world_size)))
    if not common:
        return MemoryRestore(None, {}, [])
    chosen = max(common)
    lacking = [s for s in range(world_size) if chosen not in owns[s]]
    directory = checkpoint_dir(root, chosen)
    restored = {s: ring.successor(s) for s in lacking}

    def receive() -> None:
        if lacking and leader and any(s in node for s in lacking):
            os.makedirs(directory, exist_ok=True)
            try:  # the node's commit marker is rewritten once every rank has its files
                os.unlink(os.path.join(directory, layout.COMMIT_FILE))
            except FileNotFoundError:
                pass

    control_plane.agree(receive, f"preparing the in-memory checkpoint of iteration {chosen}")
    t0 = time.perf_counter()

    def transfer() -> int:
        peer = checkpoint_dir(os.path.join(root, PEER_DIR), chosen)
        sends: Dict[Tuple[int, int], _Outgoing] = {}
        mine = [-1] * (len(_NODE_NAMES) + 3)
        if pred in lacking:  # this rank holds its predecessor's replica: send it back
            names = (list(_NODE_NAMES) if pred_leads else []) + _rank_names(pred)
            out = _Outgoing([os.path.join(peer, n) for n in names])
            mine = [-1] * (len(mine) - len(names)) + out.sizes
            sends[(pred, pred)] = out
        sizes = control_plane.all_gather_ints(mine)
        recvs = {}
        if rank in lacking:
            incoming = sizes[ring.successor(rank)]
            names = [n for n, size in zip(_NODE_NAMES, incoming) if size >= 0]
            recvs[(ring.successor(rank), rank)] = _Incoming(
                directory, rank, [n for n in incoming if n >= 0], names + _rank_names(rank))
        _transfer(sends, recvs)
        got = sum(n for n in sizes[ring.successor(rank)] if n >= 0) if rank in lacking else 0
        if rank in lacking and not _intact(directory, rank, world_size):
            raise CheckpointError(f"the copy of its in-memory shards of iteration {chosen} "
                                  f"received from peer rank {ring.successor(rank)} does not "
                                  "match its marker", rank=rank, file=directory)
        return got

    got = control_plane.agree(transfer, f"restoring the in-memory checkpoint of iteration "
                                        f"{chosen} from peer replicas")
    if rank in lacking:
        log(f"[rank {rank}] received its in-memory shards of iteration {chosen} from peer rank "
            f"{ring.successor(rank)}: {got / 2**20:.2f} MiB in {time.perf_counter() - t0:.3f} s")
    newer = sorted({i for s in range(world_size) for i in owns[s] if i > chosen})
    uncommitted = sorted({ring.node_of(s) for s in range(world_size) if s not in lacking
                          and chosen not in committed_by[s]})

    def commit() -> None:
        if not leader:
            return
        moved = os.path.join(directory, RUN_CONFIG_FILENAME)
        if os.path.exists(moved):  # the node's run_config.json travels with its leader's files
            if os.path.exists(os.path.join(root, RUN_CONFIG_FILENAME)):
                os.unlink(moved)
            else:
                os.replace(moved, os.path.join(root, RUN_CONFIG_FILENAME))
        if not os.path.isfile(os.path.join(directory, METADATA_FILENAME)):
            _copy_metadata(root, directory)  # written at commit: a version never committed here
        if not layout.try_commit(directory, world_size, ranks=list(node)):
            raise CheckpointError(f"the in-memory checkpoint of iteration {chosen} lacks a rank "
                                  f"of node {ring.node_of(rank)} after its restore",
                                  rank=rank, file=directory)
        drop_newer(root, chosen)  # this node's part of `newer`, the tracker first if it names one
        if tracked_iteration(root) != chosen:
            write_tracker(root, chosen)

    control_plane.agree(commit, f"committing the restored in-memory checkpoint of iteration "
                                f"{chosen}")
    if rank == 0 and (lacking or newer or uncommitted):
        parts = []
        if uncommitted:
            parts.append(f"committed on node(s) {uncommitted} (every rank's files were there; "
                         "the job ended before that node's commit marker)")
        if lacking:
            parts.append("rank(s) " + ", ".join(f"{s} (from rank {f})"
                                                for s, f in sorted(restored.items()))
                         + " restored from their peer replicas")
        if newer:
            parts.append(f"newer, incomplete iteration(s) {newer} removed (not every rank's "
                         "part of them survived)")
        log(f"in-memory checkpoint of iteration {chosen}: " + "; ".join(parts))
    return MemoryRestore(chosen, restored, newer)

