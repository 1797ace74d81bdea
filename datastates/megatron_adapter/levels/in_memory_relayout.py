"""The in-memory level's newest version, restored at another layout: fewer nodes, or another
TP/PP/DP, from what the nodes that are left hold in memory.

An in-memory version lives only in memory, spread over the nodes: each node's directory holds its
own ranks' files and, with --lazy-save-peer-replica, its predecessor's under `peer/`
(`in_memory_peers`). At the saved layout each rank reads its own files (`node_local`). At another
layout a rank needs boxes that other saved ranks wrote, and the reader plans from every saved
rank's index. So before a restart chooses its level, every rank (collective, `assemble`):

1. says which saved ranks' files of its node's newest versions are intact there (its own or a
   replica, each rank marker matching its index) and whether the node holds the version's common
   state (common.pt, metadata.json);
2. the newest version whose every saved rank some node holds is chosen (none: the restart reads
   the other levels, as it did before);
3. each node's leader assembles it under `<root>/relayout/iter_N`: what its node holds is linked
   in (no copy); every other saved rank's index and marker, and the common state, come from a
   holder over the process group; the directory is committed for every saved rank and gets a
   tracker of its own.

At the load each node receives, once, the shard files its ranks read and lack
(`peer_replica.bring_needed`), and the assembled directory loads like any other DataStates
checkpoint, at any layout. A failure on any rank is agreed on by every rank; the restart then
reads the other levels.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Dict, List, Optional, Set, Tuple

from ... import control_plane, layout
from ...errors import CheckpointError
from ...fileio import atomic_write
from ..paths import COMMON_FILENAME, METADATA_FILENAME, checkpoint_dir, tracked_iteration, \
    write_tracker
from .in_memory_peers import PEER_DIR, _intact
from .local_tier import local_iterations
from .node_local import drop_newer
from .peer_replica import _Incoming, _Outgoing, _bit, _bitmap, _rank_names, _transfer, node_index

__all__ = ["RELAYOUT_DIR", "assemble", "holds_other_ranks", "is_assembled"]

#: Under a node's directory of the level: the version assembled for a restart at a new layout.
RELAYOUT_DIR = "relayout"
#: The common state every assembled version needs, from a node that holds it.
_COMMON = (COMMON_FILENAME, METADATA_FILENAME)
#: Versions each rank reports (newest first).
_REPORTED = 4
_MARKER = re.compile(r"done_r(\d{5})\.json$")


def is_assembled(root: str) -> bool:
    """Whether `root` is a version assembled by `assemble`."""
    return os.path.basename(os.path.normpath(root)) == RELAYOUT_DIR


def holds_other_ranks(root: str, rank: int, world_size: int) -> bool:
    """Whether the newest version `root`'s tracker names holds other saved ranks' intact files
    but not `rank`'s: the node's memory was saved under another node index
    (`in_memory.adopt_left_memory`), so it is read as at a new layout (`assemble`)."""
    try:
        iteration = tracked_iteration(root)
        if iteration is None:
            return False
        directory = checkpoint_dir(root, iteration)
        names = os.listdir(directory)
    except (CheckpointError, OSError, ValueError):
        return False
    if _intact(directory, rank, world_size):
        return False
    return any(m and int(m.group(1)) != rank and _intact(directory, int(m.group(1)), world_size)
               for m in map(_MARKER.match, names))


def _sources(root: str, iteration: int) -> List[str]:
    return [checkpoint_dir(root, iteration), checkpoint_dir(os.path.join(root, PEER_DIR),
                                                            iteration)]


def _scan(root: str, iteration: int) -> Tuple[int, Dict[int, str], Optional[str]]:
    """(saved world size, {saved rank: directory holding its intact files}, a directory holding
    the common state or None) of one version on this node; world size 0: nothing usable."""
    world, where, common = 0, {}, None
    for directory in _sources(root, iteration):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        if common is None and all(n in names for n in _COMMON):
            common = directory
        for name in names:
            m = _MARKER.match(name)
            if not m or int(m.group(1)) in where:
                continue
            try:
                size = int(layout.read_json(os.path.join(directory, name),
                                            what="rank marker")["world_size"])
            except (CheckpointError, OSError, KeyError, TypeError, ValueError):
                continue
            if world in (0, size) and _intact(directory, int(m.group(1)), size) and \
                    os.path.isfile(os.path.join(directory, layout.shard_file(int(m.group(1))))):
                world = size
                where[int(m.group(1))] = directory
    return world, where, common


def _held(root: str) -> Dict[int, Tuple[int, Dict[int, str], Optional[str]]]:
    """`_scan` of the newest versions this node holds (own or replica), at most _REPORTED."""
    found = {}
    for it in sorted(set(local_iterations(root))
                     | set(local_iterations(os.path.join(root, PEER_DIR))), reverse=True):
        world, where, common = _scan(root, it)
        if world:
            found[it] = (world, where, common)
        if len(found) == _REPORTED:
            break
    return found


def assemble(root: str, rank: int, log=print) -> Optional[str]:
    """Every rank, collective: see the module doc. `root` is this rank's node's directory of the
    level. Returns the assembled root (`<root>/relayout`, with its tracker), the same on every
    rank, or None when no version is held whole by the nodes together."""
    import torch.distributed as dist

    world = dist.get_world_size()
    nodes = control_plane.all_gather_ints(node_index())
    leaders = {n: min(r for r in range(world) if nodes[r] == n) for n in set(nodes)}
    leader = leaders[nodes[rank]] == rank
    try:
        held = _held(root)
    except OSError:
        held = {}
    most = max(control_plane.all_gather_ints(max([w for w, _, _ in held.values()] + [0])))
    if most == 0:
        return None
    width = 3 + len(_bitmap([], most))
    row: List[int] = []
    for it, (w, where, common) in sorted(held.items(), reverse=True):
        row += [it, w, int(common is not None)] + _bitmap(sorted(where), most)
    rows = control_plane.all_gather_ints(control_plane.padded(row, width * _REPORTED))
    holds: Dict[Tuple[int, int], Dict[int, Set[int]]] = {}  # (it, world) -> rank -> saved ranks
    commons: Dict[Tuple[int, int], List[int]] = {}
    for r, values in enumerate(rows):
        for k in range(_REPORTED):
            entry = values[k * width:(k + 1) * width]
            if entry[0] < 0:
                continue
            key = (entry[0], entry[1])
            holds.setdefault(key, {})[r] = {s for s in range(entry[1]) if _bit(entry[3:], s)}
            if entry[2]:
                commons.setdefault(key, []).append(r)
    whole = [key for key, by in holds.items()
             if key in commons and set().union(*by.values()) == set(range(key[1]))]
    if not whole:
        return None
    iteration, saved_world = max(whole)
    by_rank = holds[(iteration, saved_world)]
    # (tag, from, to): each node's leader lacking a saved rank's index and marker (tag: that
    # saved rank) or the common state (tag: saved_world) gets them from the lowest holder.
    plan = []
    for tag in range(saved_world + 1):
        holders = (commons[(iteration, saved_world)] if tag == saved_world
                   else sorted(r for r, saved in by_rank.items() if tag in saved))
        for to in sorted(leaders.values()):
            if to not in holders:
                plan.append((tag, holders[0], to))
    relayout = os.path.join(root, RELAYOUT_DIR)
    directory = checkpoint_dir(relayout, iteration)
    _, where, common = held.get(iteration, (0, {}, None))

    def names(tag: int) -> List[str]:
        return list(_COMMON) if tag == saved_world else _rank_names(tag)[1:]

    def prepare() -> None:
        if not leader:
            return
        shutil.rmtree(relayout, ignore_errors=True)  # a stale one of an earlier restart
        os.makedirs(directory)
        for s, source in where.items():
            for name in _rank_names(s):
                os.link(os.path.join(source, name), os.path.join(directory, name))
        if common is not None:
            for name in _COMMON:
                os.link(os.path.join(common, name), os.path.join(directory, name))
        fmt = os.path.join(directory, layout.FORMAT_FILE)
        if not os.path.exists(fmt):
            atomic_write(fmt, layout.dumps(layout.format_header()))

    control_plane.agree(prepare, f"preparing the in-memory checkpoint of iteration {iteration} "
                                 "for this run's layout")

    def transfer() -> None:
        mine = [(tag, to) for tag, frm, to in plan if frm == rank]
        sends = {(to, tag): _Outgoing([os.path.join(common if tag == saved_world else where[tag],
                                                    n) for n in names(tag)])
                 for tag, to in mine}
        most_sends = max([sum(1 for p in plan if p[1] == r) for r in range(world)] + [0])
        sizes_of_mine = [n for tag, to in mine for n in sends[(to, tag)].sizes]
        sizes = control_plane.all_gather_ints(
            control_plane.padded(sizes_of_mine, 2 * most_sends, fill=0))
        recvs = {}
        for tag, frm, to in plan:
            if to == rank:  # `frm` gathered its streams' sizes in plan order
                k = [(p[0], p[2]) for p in plan if p[1] == frm].index((tag, to))
                recvs[(frm, tag)] = _Incoming(directory, tag, sizes[frm][2 * k:2 * k + 2],
                                              names(tag))
        _transfer(sends, recvs)

    control_plane.agree(transfer, f"gathering the in-memory checkpoint of iteration {iteration} "
                                  "from the nodes that hold it")

    def commit() -> List[int]:
        if not leader:
            return []
        if not layout.try_commit(directory, saved_world):
            raise CheckpointError(f"the in-memory checkpoint of iteration {iteration} assembled "
                                  "for this run's layout lacks a saved rank's marker",
                                  rank=rank, file=directory)
        write_tracker(relayout, iteration)
        # Newer versions of this node's, which not every saved rank's part survived: the run's
        # own saves of those iterations must not meet them (see `drop_newer`).
        return drop_newer(root, iteration)

    dropped = control_plane.agree(commit, f"committing the in-memory checkpoint of iteration "
                                          f"{iteration} assembled for this run's layout")
    if dropped:
        log(f"[rank {rank}] in-memory checkpoints: removed iteration(s) {dropped} from {root}: "
            f"newer than iteration {iteration}, which is the newest every saved rank's part of "
            "survived")
    if rank == 0:
        got = sorted({tag for tag, _, _ in plan if tag < saved_world})
        log(f"in-memory checkpoint of iteration {iteration} (saved by {saved_world} ranks) "
            f"assembled on every node for this run's layout from the memory of the nodes left"
            + (f"; indexes of saved rank(s) {got} came from other nodes" if got else ""))
    return relayout
