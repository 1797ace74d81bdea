"""Peer replicas (`--lazy-save-peer-replica`): every rank's shards of the newest committed
checkpoint live on its own node and on the next node of a fixed ring, outside the training process.

Where: the node-local level (`--lazy-save-local-dir`; with peer replicas its default is a directory
under /dev/shm, which outlives the training processes but not the node). The engine writes each
rank's files there first (level 3), as for any local dir; after the version commits, a background
thread on every rank sends them to its ring successor, which stores them in its own node-local
directory under the sender's rank number (files are named by rank, so one directory holds the
node's own ranks and the previous node's).

The ring: nodes in the order of their index (torchrun's GROUP_RANK, else SLURM_NODEID); the rank
at position i of node n (ranks of a node in increasing order) sends to position i of node n+1,
and the last node to the first. Every node must run the same number of ranks.

Restore (`restore_before_load`, every rank, before the reader is built): each saved rank s has two
holders, its own rank on its node and its successor. A holder whose copy is missing or does not
match the committed rank marker in --save (step, index name, index checksum) receives it from the
other holder over the control plane. Then every node receives, once, the saved ranks its ranks
will read (`needed_saved_ranks`: the shards overlapping what each rank loads) and lacks. The
reader reads every saved rank it finds intact in the node-local directory from there (chunk
checksums verified, as always) and the rest from --save.
A copy that fails verification is never used: the reader falls back to --save for that rank.

Budget: `budget_bytes` bounds what a rank holds of one version (its own files plus the replica
it receives); a replica that would exceed it is skipped for that version, with a warning.
"""
from __future__ import annotations

import contextlib
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ... import control_plane

from ... import layout
from ...errors import CheckpointError
from ...faults import fault_point
from ...fileio import atomic_write, fsync_dir, fsync_file, hold_for_reading
from . import local_tier
from ..paths import COMMON_FILENAME, METADATA_FILENAME, RUN_CONFIG_FILENAME, checkpoint_dir

__all__ = ["PeerReplicator", "RestoreStats", "Ring", "restore_before_load"]

FLAG = "--lazy-save-peer-replica"
_CHUNK = 32 << 20  # bytes per point-to-point round (a transfer holds two per stream)
_FILES = (layout.shard_file, layout.index_file, layout.rank_marker_file)  # marker written last
#: What a node's leader sends first in peer_dir mode: its node's small files of the version.
_NODE_NAMES = (RUN_CONFIG_FILENAME, COMMON_FILENAME, METADATA_FILENAME)


def node_index(env: Optional[Dict[str, str]] = None) -> int:
    env = os.environ if env is None else env
    return int(env.get("GROUP_RANK", env.get("SLURM_NODEID", "0")))


@dataclass(frozen=True)
class Ring:
    """The ranks of each node, nodes in index order (see module doc)."""

    nodes: Tuple[Tuple[int, ...], ...]

    @classmethod
    def of(cls, node_of_rank: List[int]) -> "Ring":
        """From every rank's node index; raises CheckpointError when the ring cannot be built."""
        by_node: Dict[int, List[int]] = {}
        for rank, node in enumerate(node_of_rank):
            by_node.setdefault(node, []).append(rank)
        nodes = tuple(tuple(by_node[n]) for n in sorted(by_node))
        if len(nodes) < 2:
            raise CheckpointError(f"{FLAG} sends each rank's shards to another node, but all "
                                  f"{len(node_of_rank)} rank(s) run on one node (node index "
                                  f"{node_of_rank[0]}): run on two or more nodes, or drop {FLAG}")
        sizes = sorted({len(r) for r in nodes})
        if len(sizes) > 1:
            raise CheckpointError(f"{FLAG} pairs ranks across nodes and needs the same number "
                                  f"of ranks on every node; found " + ", ".join(
                                      f"node {n}: {len(by_node[n])}" for n in sorted(by_node)))
        return cls(nodes)

    @classmethod
    def discover(cls) -> "Ring":
        """Collective (control plane): every rank's node index."""
        return cls.of(control_plane.all_gather_ints(node_index()))

    @classmethod
    def for_replicas(cls, log: Callable[[str], None]) -> Optional["Ring"]:
        """Collective: the ring, or None when every rank runs on one node (a restart on the one
        node left: no peer to send to, which `log` says once; the restore still reads the
        node's copies); unequal nodes are refused (`of`)."""
        nodes = control_plane.all_gather_ints(node_index())
        if len(set(nodes)) == 1:
            log(f"WARNING: {FLAG}: all {len(nodes)} rank(s) run on one node, so no checkpoint "
                "is replicated to another node in this run (the node's own copy is kept; "
                "--save holds every checkpoint)")
            return None
        return cls.of(nodes)

    def _where(self, rank: int) -> Tuple[int, int]:
        for n, ranks in enumerate(self.nodes):
            if rank in ranks:
                return n, ranks.index(rank)
        raise ValueError(f"rank {rank} is not in the ring")

    def successor(self, rank: int) -> int:
        n, i = self._where(rank)
        return self.nodes[(n + 1) % len(self.nodes)][i]

    def predecessor(self, rank: int) -> int:
        n, i = self._where(rank)
        return self.nodes[(n - 1) % len(self.nodes)][i]

    def node_of(self, rank: int) -> int:
        return self._where(rank)[0]

    @property
    def world(self) -> int:
        return sum(len(r) for r in self.nodes)


# -- files of one saved rank in one version directory ---------------------------------------------

class _Outgoing:
    """Files read chunk by chunk as one stream (`paths`, in order), straight into the buffer
    that is sent (`read_into`: one copy, from the page cache or tmpfs into it)."""

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)
        self.sizes = [os.path.getsize(p) for p in self.paths]  # OSError: not all there
        self.failed = False
        self._fds: Dict[str, int] = {}

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill `view` with bytes [offset, offset + len(view)) of the stream. Each file is opened
        when the stream reaches it and read from that descriptor to its end. Once a read fails (a
        file vanished before the stream reached it), the rest of the stream is zeros: the
        receiver's copy then has no valid marker (sent last), is never trusted, and the transfer
        still completes on both sides."""
        pos, n = 0, len(view)
        for path, size in zip(self.paths, self.sizes):
            lo, hi = max(offset, pos), min(offset + n, pos + size)
            if lo < hi:
                part = view[lo - offset:hi - offset]
                if not self.failed:
                    self.failed = not self._pread(path, part, lo - pos)
                if self.failed:
                    part[:] = bytes(len(part))
            pos += size

    def _pread(self, path: str, part: memoryview, at: int) -> bool:
        try:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            done = 0
            while done < len(part):
                got = os.preadv(fd, [part[done:]], at + done)
                if got <= 0:
                    return False  # shorter than it was: truncated meanwhile
                done += got
            return True
        except OSError:
            return False

    def read(self, offset: int, n: int) -> bytes:
        """`read_into` a new buffer, at most to the end of the stream (tests)."""
        buf = bytearray(max(0, min(n, sum(self.sizes) - offset)))
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _rank_names(rank: int) -> List[str]:
    """One saved rank's files in a version directory, its marker last."""
    return [name(rank) for name in _FILES]


def _outgoing(directory: str, rank: int) -> Optional[_Outgoing]:
    try:
        return _Outgoing([os.path.join(directory, n) for n in _rank_names(rank)])
    except OSError:
        return None


class _Incoming:
    """Files arriving as one stream: written to temporary files, then moved into place in
    order, the last one (a rank marker) last, after `rank`'s old marker is removed (a reader
    never sees a marker before the files it describes). A local write failure (a full /dev/shm)
    does not stop the stream: the sender is mid-transfer, so the rest is received and dropped,
    and `commit` raises the failure."""

    def __init__(self, directory: str, rank: int, sizes: List[int],
                 names: Optional[Sequence[str]] = None):
        self.directory, self.rank, self.sizes = directory, rank, sizes
        self.names = list(names) if names is not None else _rank_names(rank)
        self.tmp = [os.path.join(directory, f".{name}.peer.tmp") for name in self.names]
        self.failed: Optional[OSError] = None
        try:
            os.makedirs(directory, exist_ok=True)
            for path in self.tmp:
                open(path, "wb").close()
        except OSError as err:
            self.failed = err

    def write(self, offset: int, data: bytes) -> None:
        pos = 0
        for path, size in zip(self.tmp, self.sizes):
            lo, hi = max(offset, pos), min(offset + len(data), pos + size)
            if lo < hi and self.failed is None:
                try:
                    with open(path, "r+b") as f:
                        f.seek(lo - pos)
                        f.write(data[lo - offset:hi - offset])
                except OSError as err:
                    self.failed = err
            pos += size

    def commit(self) -> None:
        if self.failed is not None:
            raise self.failed
        fmt = os.path.join(self.directory, layout.FORMAT_FILE)
        if not os.path.exists(fmt):
            atomic_write(fmt, layout.dumps(layout.format_header()))
        try:
            os.unlink(os.path.join(self.directory, layout.rank_marker_file(self.rank)))
        except FileNotFoundError:
            pass
        for tmp, name in zip(self.tmp, self.names):
            fsync_file(tmp)
            os.replace(tmp, os.path.join(self.directory, name))
        fsync_dir(self.directory)

    def abort(self) -> None:
        for path in self.tmp:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _write_files(directory: str, rank: int, files: List[bytes]) -> None:
    """`rank`'s files (shard, index, marker) into `directory`, marker last."""
    incoming = _Incoming(directory, rank, [len(b) for b in files])
    incoming.write(0, b"".join(files))
    incoming.commit()


def _matches(copy_dir: str, shared_dir: str, rank: int) -> bool:
    """True when `copy_dir` holds a marker of `rank` naming the same index (name, checksum, step)
    as the committed one in `shared_dir`, and the files it names are there."""
    try:
        mine = layout.read_json(os.path.join(copy_dir, layout.rank_marker_file(rank)), rank=rank)
        ref = layout.read_json(os.path.join(shared_dir, layout.rank_marker_file(rank)), rank=rank)
        layout.check_format(mine, copy_dir, rank)
    except CheckpointError:
        return False
    same = all(mine.get(k) == ref.get(k) for k in ("index", "index_crc32", "step"))
    return same and all(os.path.isfile(os.path.join(copy_dir, n(rank))) for n in _FILES[:2])


def _transfer(sends: Dict[Tuple[int, int], _Outgoing], recvs: Dict[Tuple[int, int], _Incoming],
              group=None, step: Optional[int] = None) -> None:
    """Streams keyed by (peer rank, saved rank): send each to its peer and receive each into its
    files, in rounds of at most _CHUNK bytes per stream (the saved rank is the message tag, so
    two streams between one pair never mix), then move what arrived into place. Both ends know
    every size beforehand. Two buffers per stream take turns: while one round is on the wire,
    the previous round's bytes are written out and the next round's read in, each straight
    between its file and the buffer the collective uses (no copy in Python). `step`: the
    replicated version's iteration, for the `replica` fault point (none while restoring)."""
    total = max([sum(x.sizes) for x in list(sends.values()) + list(recvs.values())] + [0])
    slots = [{key: torch.empty(min(_CHUNK, sum(x.sizes)), dtype=torch.uint8)
              for key, x in list(sends.items()) + list(recvs.items())} for _ in range(2)]
    in_flight = None  # (works, round's offset, its receive buffers)

    def land(flight) -> None:
        works, offset, into = flight
        for w in works:
            w.wait()
        for key, t in into.items():
            recvs[key].write(offset, memoryview(t.numpy()))

    try:  # every round runs to the end on both sides, whatever fails locally (see _Incoming)
        for k, offset in enumerate(range(0, total, _CHUNK)):
            bufs = slots[k % 2]
            out = {}
            for key, x in sends.items():
                n = min(_CHUNK, sum(x.sizes) - offset)
                if n > 0:
                    out[key] = bufs[key][:n]
                    x.read_into(offset, memoryview(out[key].numpy()))
            into = {key: bufs[key][:min(_CHUNK, sum(x.sizes) - offset)]
                    for key, x in recvs.items() if offset < sum(x.sizes)}
            works = control_plane.post_exchange(out, into, group=group)
            if in_flight is not None:
                land(in_flight)
            in_flight = (works, offset, into)
        if in_flight is not None:
            land(in_flight)
        if step is not None:
            fault_point("replica", step, torch.distributed.get_rank())
        for incoming in recvs.values():
            incoming.commit()
    finally:
        for outgoing in sends.values():
            outgoing.close()
        for incoming in recvs.values():
            incoming.abort()  # what was not committed (none once all were)


# -- save side ---------------------------------------------------------------------------------

class PeerReplicator:
    """Every rank: after each commit, a background thread sends this rank's files of that version
    to its ring successor and stores its predecessor's, then drops older replicas it holds.

    Call order, every rank: 1) `PeerReplicator(...)` (collective: creates its group);
    2) `on_commit(iteration)` after each commit, before old local copies are pruned;
    3) `unfinished()` whenever pruning: versions whose own files the thread still needs;
    4) `close(timeout)` at exit. The threads of all ranks handle the same versions in the same
    order: each round they agree (MIN) on the newest version every rank has queued, so a slow
    rank makes the others skip versions, never diverge.

    With `peer_dir` (the in-memory level, `in_memory_peers.py`): the trainer hands a version over
    (`hand_off`, every rank, the same versions) only when every rank's thread is `idle`, so the
    replica takes the newest complete version whenever the network frees up (latest wins). The
    predecessor's files go to `peer_dir`, one directory per version (with the node's common.pt,
    metadata.json and run_config.json when the predecessor is its node's leader): a copy of the
    predecessor node's version. The version being sent and the newest one sent are held
    (`fileio.hold_for_reading`) so the level's retention keeps them: a node lost mid-transfer is
    restored from the previous replica, which every other node still holds.
    """

    def __init__(self, local_dir: str, ring: Ring, rank: int, budget_bytes: int,
                 log: Callable[[str], None] = print, peer_dir: Optional[str] = None,
                 leader: bool = False):
        self.local_dir, self.ring, self.rank = local_dir, ring, rank
        self.budget_bytes = budget_bytes
        self.log = log
        self.peer_dir, self.leader = peer_dir, leader
        self.successor, self.predecessor = ring.successor(rank), ring.predecessor(rank)
        self._group = control_plane.new_side_group()
        self._queue: "queue.Queue[Optional[int]]" = queue.Queue()
        self._unfinished: Set[int] = set()
        self._lock = threading.Lock()
        self._holds: Dict[int, contextlib.ExitStack] = {}  # pinned own versions (peer_dir)
        self._sent: Optional[int] = None  # the newest version sent whole (peer_dir)
        self.replicated: List[Tuple[int, int, float]] = []  # (iteration, bytes sent, seconds)
        self._thread = threading.Thread(target=self._run, name="datastates-peer-replica",
                                        daemon=True)
        self._thread.start()

    def on_commit(self, iteration: int) -> None:
        with self._lock:
            self._unfinished.add(iteration)
        self._queue.put(iteration)

    @property
    def idle(self) -> bool:
        """No version queued or being sent (this rank's thread)."""
        with self._lock:
            return not self._unfinished

    def hand_off(self, iteration: int) -> None:
        """peer_dir mode, every rank, once every rank is `idle`: replicate `iteration` (the newest
        committed version), held until a newer one is sent whole."""
        self._pin(iteration)
        self.on_commit(iteration)

    def unfinished(self) -> List[int]:
        with self._lock:
            return sorted(self._unfinished)

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            where = ("the in-memory versions are not affected" if self.peer_dir is not None
                     else "the checkpoint in --save is not affected")
            self.log(f"[rank {self.rank}] WARNING: the peer replica of the newest checkpoint did "
                     f"not finish within {timeout:.0f} s; it is incomplete ({where})")
            return
        for it in list(self._holds):
            self._unpin(it)

    # -- pins (peer_dir mode) -----------------------------------------------------------------
    def _pin(self, iteration: int) -> None:
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(hold_for_reading(checkpoint_dir(self.local_dir, iteration)))
        except (CheckpointError, OSError):
            return  # removed already: its transfer sends zeros and is never trusted
        with self._lock:
            self._holds[iteration] = stack

    def _unpin(self, iteration: Optional[int]) -> None:
        with self._lock:
            stack = self._holds.pop(iteration, None)
        if stack is not None:
            stack.close()

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        queued: List[int] = []
        stopping = False
        while True:
            while not stopping and (not queued or not self._queue.empty()):
                item = self._queue.get()
                if item is None:
                    stopping = True
                else:
                    queued.append(item)
            newest = queued[-1] if queued else -1
            (agreed,) = control_plane.all_reduce([newest], op=torch.distributed.ReduceOp.MIN,
                                                 group=self._group)
            if agreed < 0:
                return  # some rank has nothing left to replicate and is stopping: all stop
            skipped = [it for it in queued if it < agreed]
            queued = [it for it in queued if it > agreed]
            whole = False
            try:
                whole = self._replicate(agreed)
            except Exception as err:  # noqa: BLE001 - reported; the next version tries again
                kept = ("the in-memory version is not affected" if self.peer_dir is not None
                        else "--save holds the checkpoint")
                self.log(f"[rank {self.rank}] WARNING: peer replica of iteration {agreed} "
                         f"failed: {err}; {kept}, and the next one is replicated again")
            if self.peer_dir is not None:
                for it in skipped:
                    self._unpin(it)
                if whole:  # the newest version sent whole is held instead of the previous one
                    previous, self._sent = self._sent, agreed
                    self._unpin(previous)
                else:
                    self._unpin(agreed)
            with self._lock:
                self._unfinished.difference_update(skipped + [agreed])

    def _own_paths(self, directory: str) -> List[str]:
        """The files this rank sends of the version in `directory` (its node's first in
        peer_dir mode, none when it is not the node's leader; its own last, marker last)."""
        node = []
        if self.peer_dir is not None and self.leader:
            node = [os.path.join(self.local_dir, RUN_CONFIG_FILENAME)] + [
                os.path.join(directory, n) for n in (COMMON_FILENAME, METADATA_FILENAME)]
        return node + [os.path.join(directory, n) for n in _rank_names(self.rank)]

    def _replicate(self, iteration: int) -> bool:
        """Sends and receives one version; True when this rank's own files went whole."""
        t0 = time.perf_counter()
        directory = checkpoint_dir(self.local_dir, iteration)
        paths = self._own_paths(directory)
        width = len(_NODE_NAMES) + 3 if self.peer_dir is not None else 3
        try:
            own: Optional[_Outgoing] = _Outgoing(paths)
            mine = [-1] * (width - len(paths)) + own.sizes
        except OSError:
            own, mine = None, [-1] * width
        own_size = sum(own.sizes) if own else -1
        sizes = control_plane.all_gather_ints(mine, group=self._group)
        incoming = sizes[self.predecessor]
        succ = sizes[self.successor]
        succ_own = sum(succ[-3:]) if min(succ[-3:]) >= 0 else 0
        # Both ends decide alike from the gathered sizes: send only what the receiver may keep.
        send_ok = own is not None and own_size + succ_own <= self.budget_bytes
        recv_ok = min(incoming[-3:]) >= 0 and \
            sum(n for n in incoming if n > 0) + max(own_size, 0) <= self.budget_bytes
        if own is not None and not send_ok:
            self.log(f"[rank {self.rank}] WARNING: no peer replica of iteration {iteration}: "
                     f"rank {self.successor} would hold {(own_size + succ_own) / 2**20:.1f} MiB, "
                     f"over the {self.budget_bytes / 2**20:.0f} MiB of "
                     f"{FLAG}-mb")
        into = None
        if recv_ok:
            names = [n for n, size in zip(_NODE_NAMES, incoming) if size >= 0] \
                if self.peer_dir is not None else []
            into = _Incoming(checkpoint_dir(self.peer_dir or self.local_dir, iteration),
                             self.predecessor, [n for n in incoming if n >= 0],
                             names + _rank_names(self.predecessor))
        _transfer({(self.successor, self.rank): own} if send_ok else {},
                  {(self.predecessor, self.predecessor): into} if into is not None else {},
                  group=self._group, step=iteration)
        self._drop_older(iteration)
        self.replicated.append((iteration, own_size if send_ok else 0,
                                time.perf_counter() - t0))
        return own is not None and send_ok and not own.failed

    def _drop_older(self, iteration: int) -> None:
        """The replicas this rank holds (its predecessor's files) of versions before
        `iteration`; this rank's own old files go with the local tier's pruning (peer_dir mode:
        with the level's retention)."""
        if self.peer_dir is not None:  # peer_dir holds the predecessor node's versions only
            for it in local_tier.local_iterations(self.peer_dir):
                if it < iteration:
                    shutil.rmtree(checkpoint_dir(self.peer_dir, it), ignore_errors=True)
            return
        for it in local_tier.local_iterations(self.local_dir):
            if it < iteration:
                local_tier.remove_rank_files(checkpoint_dir(self.local_dir, it), self.predecessor)


# -- restore side ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RestoreStats:
    """What one rank's node-local directory received from peers before the load."""

    received: Dict[int, Tuple[int, int, float]]
    """saved rank -> (from rank, bytes, seconds)."""
    unavailable: List[int]
    """Saved ranks with no intact copy on either holder (read from --save)."""


def restore_before_load(shared_dir: str, local_dir: str, world_size: int,
                        needed: Sequence[int] = ()) -> RestoreStats:
    """Every rank, collective: at the saved layout (`world_size` ranks saved it, this run has as
    many, on two or more nodes), make both holders of every saved rank hold an intact copy of
    version `shared_dir` in their node-local directories, where one of them still does; then, at
    any layout, bring every saved rank in `needed` (the files this rank will read,
    `needed_saved_ranks`) that its node lacks from whichever rank holds it intact, once per node
    (see module doc). Saved ranks no rank holds are read from --save (`unavailable`)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = control_plane.all_gather_ints(node_index())
    copy_dir = layout.local_version_dir(local_dir, shared_dir)
    received: Dict[int, Tuple[int, int, float]] = {}
    ring = None
    if world_size == world and len(set(nodes)) > 1:
        try:
            ring = Ring.of(nodes)
        except CheckpointError:  # unequal nodes: no pairs to refill (phase 2 still runs)
            ring = None
    if ring is not None:
        received.update(_refill_holders(shared_dir, copy_dir, ring, rank))
        control_plane.barrier()
    stats = bring_needed(shared_dir, copy_dir, world_size, needed, nodes)
    return RestoreStats({**received, **stats.received}, stats.unavailable)


def bring_needed(shared_dir: str, copy_dir: str, world_size: int, needed: Sequence[int],
                 nodes: Optional[List[int]] = None) -> RestoreStats:
    """Phase 2, every rank, collective, any layout: each node receives, once, every saved rank in
    `needed` (this rank's) that its `copy_dir` lacks, from a rank that holds an intact copy
    (its marker naming `shared_dir`'s index); `nodes`: every rank's node index."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = control_plane.all_gather_ints(node_index()) if nodes is None else nodes
    received: Dict[int, Tuple[int, int, float]] = {}
    # Who holds what, intact (every rank scans its node-local copy).
    try:
        held = [s for s in range(world_size) if _matches(copy_dir, shared_dir, s)]
    except OSError:
        held = []
    holds = [set(s for s in range(world_size) if _bit(b, s))
             for b in control_plane.all_gather_ints(_bitmap(held, world_size))]
    lacking = [s for s in needed if s not in holds[rank]]
    wants = control_plane.all_gather_ints(_bitmap(lacking, world_size))
    plan = []  # (saved rank, from, to): the lowest wanting rank of each node that lacks it
    for s in range(world_size):
        holders = [r for r in range(world) if s in holds[r]]
        if not holders:
            continue
        receivers: Dict[int, int] = {}
        for r in range(world):
            if _bit(wants[r], s) and nodes[r] not in receivers:
                receivers[nodes[r]] = r
        # From a holder on another node, the one that sends the least so far.
        for to in receivers.values():
            remote = [h for h in holders if nodes[h] != nodes[to]] or holders
            frm = min(remote, key=lambda h: (sum(1 for p in plan if p[1] == h), h))
            plan.append((s, frm, to))
    mine = [(s, to) for s, frm, to in plan if frm == rank]
    width = max([sum(1 for p in plan if p[1] == r) for r in range(world)] + [0])
    out = {}
    sizes_of_mine: List[int] = []
    for s, to in mine:
        o = _outgoing(copy_dir, s)
        out[(to, s)] = o
        sizes_of_mine += o.sizes if o is not None else [0, 0, 0]
    sizes = control_plane.all_gather_ints(sizes_of_mine + [0] * (3 * width - len(sizes_of_mine))) \
        if width else [[] for _ in range(world)]
    recvs = {}
    for s, frm, to in plan:
        if to == rank:  # `frm` gathered its streams' sizes in plan order
            k = [(p[0], p[2]) for p in plan if p[1] == frm].index((s, to))
            recvs[(frm, s)] = _Incoming(copy_dir, s, sizes[frm][3 * k:3 * k + 3])
    t0 = time.perf_counter()
    _transfer({k: v for k, v in out.items() if v is not None}, recvs)
    seconds = time.perf_counter() - t0
    received.update({s: (frm, sum(recvs[(frm, s)].sizes), seconds)
                     for s, frm, to in plan if to == rank})
    wanted = set(s for r in range(world) for s in range(world_size) if _bit(wants[r], s))
    lost = sorted(s for s in wanted if not any(s in h for h in holds))
    return RestoreStats(received, lost)


def _refill_holders(shared_dir: str, copy_dir: str, ring: Ring, rank: int
                    ) -> Dict[int, Tuple[int, int, float]]:
    """Phase 1, at the saved layout: each saved rank s has two holders, s on its node and its
    successor; one whose copy is missing or stale receives it from the other."""
    world_size = ring.world
    pred = ring.predecessor(rank)
    held = {s: _outgoing(copy_dir, s) if _matches(copy_dir, shared_dir, s) else None
            for s in (rank, pred)}
    # Per rank: sizes of its own saved files here, then of its predecessor's (-1: no intact copy).
    mine: List[int] = []
    for s in (rank, pred):
        mine += held[s].sizes if held[s] else [-1] * 3
    sizes = control_plane.all_gather_ints(mine)
    own = {r: sizes[r][:3] for r in range(world_size)}
    replica = {ring.predecessor(r): sizes[r][3:] for r in range(world_size)}
    plan = []  # (saved rank, from, to, sizes)
    for s in range(world_size):
        succ = ring.successor(s)
        if own[s][0] >= 0 and replica[s][0] < 0:
            plan.append((s, s, succ, own[s]))
        elif replica[s][0] >= 0 and own[s][0] < 0:
            plan.append((s, succ, s, replica[s]))
    t0 = time.perf_counter()
    _transfer({(to, s): held[s] for s, frm, to, _ in plan if frm == rank},
              {(frm, s): _Incoming(copy_dir, s, n) for s, frm, to, n in plan if to == rank})
    seconds = time.perf_counter() - t0
    for o in held.values():
        if o is not None:
            o.close()
    return {s: (frm, sum(n), seconds) for s, frm, to, n in plan if to == rank}


def _bitmap(ranks: Sequence[int], world_size: int) -> List[int]:
    words = [0] * (-(-world_size // 62))
    for r in ranks:
        words[r // 62] |= 1 << (r % 62)
    return words


def _bit(words: Sequence[int], rank: int) -> bool:
    return bool(words[rank // 62] >> (rank % 62) & 1)


def needed_saved_ranks(shared_dir: str, sharded_state_dict) -> List[int]:
    """The saved ranks whose shard files a load of `sharded_state_dict` (megatron-core's, this
    rank's) reads: every saved shard overlapping a box it asks for. Leaves that are not plain
    ShardedTensors (factories, flattened ranges) count every shard of their key: a superset."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from ...reader import CheckpointReader

    reader = CheckpointReader(shared_dir, verify=False)
    try:
        keys = set(reader.tensor_keys(shards_only=True))
        ranks = set()
        for leaf in nested_values(sharded_state_dict):
            key = getattr(leaf, "key", None)
            if key is None:
                continue
            exact = isinstance(leaf, ShardedTensor) and leaf.flattened_range is None
            for k in ([key] if exact else [k for k in keys if k.startswith(key)]):
                if k not in keys:
                    continue
                for saved, offset, shape in reader.tensor_meta(k).shards:
                    if not exact or _overlaps(leaf, offset, shape):
                        ranks.add(saved)
        return sorted(ranks)
    finally:
        reader.close()


def _overlaps(sh, offset: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether ShardedTensor `sh`'s global box meets the box at `offset` with `shape`."""
    lo = tuple(sh.global_offset)
    hi = tuple(o + n for o, n in zip(sh.global_offset[:sh.prepend_axis_num],
                                     (1,) * sh.prepend_axis_num)) + tuple(
        o + n for o, n in zip(sh.global_offset[sh.prepend_axis_num:], sh.local_shape))
    return all(a < o + n and o < b for a, b, o, n in zip(lo, hi, offset, shape))
