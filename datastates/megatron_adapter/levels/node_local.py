"""Node-local versions (Megatron-LM's `local` non-persistent checkpoints): versions whose files
stay on each node's own storage and are never migrated to the shared root.

A node must be able to load such a version from its own directory alone, at the same parallel
layout, so:
  - every rank writes every shard it holds (the save claims every replica:
    `save.preprocess.split(claim=True)`): no replicated tensor is left to a rank on another node.
    Replicas held by two ranks of one node are written twice, as Megatron-LM's local checkpoints
    write each rank's whole state;
  - the node's lowest rank (its leader) writes common.pt, metadata.json, the node's commit marker
    (naming the node's ranks, `layout.try_commit(..., ranks=...)`) and the node root's tracker.
A version commits on every node only once every rank of every node has it durable (the same
agreement as any save), and a resume takes it only when every rank finds the same newest committed
version on its node (`newest_on_every_node`); otherwise --load's checkpoint is used.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from ... import control_plane

from ... import layout
from ...errors import CheckpointError
from ..paths import TRACKER_FILENAME, checkpoint_dir, tracked_iteration
from .local_tier import local_iterations

__all__ = ["Node", "discover", "drop_newer", "newest_on_every_node"]

FLAG = "--non-persistent-local-ckpt-dir"
_NODE_MARK = ".datastates_node_{}"


@dataclass(frozen=True)
class Node:
    """This rank's node: its index (torchrun's GROUP_RANK, else SLURM_NODEID) and its ranks."""

    index: int
    ranks: Tuple[int, ...]

    @property
    def leader(self) -> int:
        return self.ranks[0]


def _node_index() -> int:
    from .peer_replica import node_index

    return node_index()


def discover(root: str, rank: int) -> Node:
    """Collective (control plane), at start-up: this rank's node, after its leader created `root`
    (this rank's expanded --non-persistent-local-ckpt-dir) and marked it with the node's index.
    Every rank stops with the same error when a directory is not usable or two nodes' leaders
    found each other's mark (the directory is shared, not node-local: a node-local version there
    would mix the nodes' commit markers)."""
    indices = control_plane.all_gather_ints(_node_index())
    me = Node(indices[rank], tuple(r for r, n in enumerate(indices) if n == indices[rank]))
    problem = None
    if rank == me.leader:
        try:
            os.makedirs(root, exist_ok=True)
            with open(os.path.join(root, _NODE_MARK.format(me.index)), "w") as f:
                f.write(str(me.index))
        except OSError as err:
            problem = f"{FLAG} {root} is not usable on rank {rank}: {err.strerror or err}"
    control_plane.barrier()  # every leader has marked its directory
    if rank == me.leader and problem is None:
        others = sorted(n for n in set(indices) if n != me.index
                        and os.path.exists(os.path.join(root, _NODE_MARK.format(n))))
        if others:
            problem = (f"{FLAG} {root} is shared by node {me.index} and node(s) {others}: it must "
                       "be node-local (e.g. a path with {node}, or a local disk)")
    bad = [r for r, f in enumerate(control_plane.all_gather_ints(problem is not None)) if f]
    if bad:
        raise CheckpointError((problem or f"{FLAG} is not usable on rank(s) {bad}; see their "
                               "error") + ". Nothing was saved or removed", rank=rank, file=root)
    return me


def forget_node_marks(root: str) -> None:
    """Remove the marks `discover` left in `root` (a directory another node index made: it is
    this node's now, and an old index's mark would read as a shared directory)."""
    for name in os.listdir(root):
        if name.startswith(_NODE_MARK.format("")):
            os.unlink(os.path.join(root, name))


def _committed_here(root: str, rank: int, accept: Callable[[str], bool]) -> Optional[int]:
    """The iteration of `root`'s tracker when its version is committed, names `rank` and is
    accepted by `accept(root)`."""
    iteration = tracked_iteration(root)
    if iteration is None:
        return None
    directory = checkpoint_dir(root, iteration)
    if not layout.is_committed(directory) or not accept(root):
        return None
    commit = layout.read_json(os.path.join(directory, layout.COMMIT_FILE), what="commit marker")
    ranks = commit.get("ranks", range(int(commit.get("world_size", 0))))
    if rank not in ranks or not os.path.exists(os.path.join(directory,
                                                            layout.rank_marker_file(rank))):
        return None
    return iteration


def newest_on_every_node(root: str, rank: int, accept: Callable[[str], bool] = lambda root: True
                         ) -> Tuple[Optional[int], List[int]]:
    """Collective (control plane): (the iteration every rank finds committed under its own
    `root` and `accept(root)` takes (e.g. saved at this run's layout), None when they differ or
    one has none; the ranks that lack the newest one)."""
    try:
        mine = _committed_here(root, rank, accept)
    except (CheckpointError, OSError, ValueError):
        mine = None
    found = control_plane.all_gather_ints(-1 if mine is None else mine)
    newest = max(found)
    lacking = [r for r, it in enumerate(found) if it != newest]
    if newest < 0 or lacking:
        return None, lacking if newest >= 0 else list(range(len(found)))
    return newest, []


def drop_newer(root: str, iteration: int) -> List[int]:
    """A node's leader, when a run starts from `iteration`: the node-local versions under `root`
    newer than it are removed (the tracker first when it names one). A run starts from an older
    iteration only when not every node held them (or they were of another layout or model), so
    no job-wide version is lost; left in place, the run's own saves of those iterations would
    meet a committed version on this node only, which is never rewritten. Returns them."""
    newer = [it for it in local_iterations(root) if it > iteration]
    if not newer:
        return []
    tracked = tracked_iteration(root)
    if tracked is not None and tracked > iteration:
        os.remove(os.path.join(root, TRACKER_FILENAME))
    for it in newer:
        trash = os.path.join(root, f".deleting-iter_{it:07d}")
        os.replace(checkpoint_dir(root, it), trash)
        shutil.rmtree(trash, ignore_errors=True)
    return newer
