"""Loading: a committed version directory -> tensors (any global box) and the nested state."""
from __future__ import annotations

import errno
import glob
import json
import os
import re
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import checksum, fileio, layout
from .buffers import PAGE, BufferPool, round_up
from .config import Checksum
from .errors import CheckpointError
from .index import ShardMeta, parse_index
from .flatten import TensorShard, decode_skeleton


@dataclass(frozen=True)
class TensorMeta:
    """A global tensor as saved: its shape, dtype and the shards (rank, global offset, shape)."""

    key: str
    dtype: torch.dtype
    global_shape: Tuple[int, ...]
    shards: Tuple[Tuple[int, Tuple[int, ...], Tuple[int, ...]], ...]


class CheckpointReader:
    """Read-only view of one version directory.

    Refuses a directory without a commit marker unless `allow_uncommitted` (then it reads the
    ranks whose markers are present). With `verify`, every chunk a read touches is checked
    against its checksum, and each index against its rank marker. With `local_dir` (level 3),
    a rank whose node-local copy carries a marker for the same index (same checksum) is read
    from the local copy; `source(rank)` says which copy a rank is read from. A local copy that
    fails a read (missing or truncated file, checksum mismatch) is dropped for that rank: the
    read is retried, and later ones made, from the version directory (`fallbacks` says why).
    `read_stats()` gives bytes and read seconds per kind of source ("local", "shared").

    With `direct`, shard bytes are read with O_DIRECT (widened to whole pages, into reused
    page-aligned buffers): no copy out of the page cache and no pages left behind in it, for
    readers of whole checkpoints (the merge, the converters) whose files are read once. A file
    system that refuses O_DIRECT is read through the page cache.
    """

    def __init__(self, directory: str, verify: bool = True, allow_pickle: bool = False,
                 allow_uncommitted: bool = False, threads: int = 4,
                 local_dir: Optional[str] = None, direct: bool = False):
        self.directory = directory
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._dfds: Dict[str, int] = {}  # path -> O_DIRECT descriptor, -1 where refused
        self._retired: List[int] = []  # O_DIRECT descriptors whose reads were refused
        self._pool = BufferPool()
        self.local_dir = local_dir
        self._sources: Dict[int, str] = {}
        self._parsed_from: Dict[int, str] = {}  # directory the rank's ShardMeta paths start with
        self.fallbacks: Dict[int, str] = {}  # rank -> why its local copy was dropped
        self._stats: Dict[str, List[float]] = {}  # "local"/"shared" -> [bytes, seconds]
        self.verify = verify
        self.allow_pickle = allow_pickle
        self.threads = max(1, threads)
        if not os.path.isdir(directory):
            raise CheckpointError("checkpoint directory does not exist", file=directory)
        commit_path = os.path.join(directory, layout.COMMIT_FILE)
        if layout.is_committed(directory):
            commit = layout.read_json(commit_path, what="commit marker")
            self.world_size = int(commit["world_size"])
            self.step = commit.get("step")
            # A node-local version lists the ranks of its node (`megatron_adapter.node_local`).
            ranks = _committed_ranks(commit, self.world_size, commit_path)
        elif allow_uncommitted:
            pattern = re.compile(r"done_r(\d{5})\.json$")
            found = glob.glob(os.path.join(directory, "done_r*.json"))
            ranks = sorted(int(m.group(1)) for p in found if (m := pattern.search(p)))
            self.world_size = None
            self.step = None
        else:
            raise CheckpointError(
                f"checkpoint is not committed (no valid {layout.COMMIT_FILE}): its save did not "
                f"finish on every rank, and it is never loaded. Load the iteration "
                f"latest_checkpointed_iteration.txt names (the newest complete one; "
                f"--ckpt-fallback-to-previous picks the newest intact one); a later save of this "
                f"iteration moves it aside. From Python, CheckpointReader(directory, "
                f"allow_uncommitted=True) opens it for inspection", file=directory)
        self._fds: Dict[str, int] = {}
        self._fd_lock = threading.Lock()
        self._by_rank: Dict[int, List[ShardMeta]] = {}
        self._objects: Dict[int, Any] = {}
        self._index_paths: Dict[int, str] = {}
        self._checksum: Dict[int, Optional[checksum.ChecksumFn]] = {}  # None: not verified
        self._by_key: Dict[str, List[ShardMeta]] = {}
        for r in ranks:
            self._load_rank(r)

    # ----------------------------------------------------------------- metadata
    def _load_rank(self, rank: int) -> None:
        marker_path = os.path.join(self.directory, layout.rank_marker_file(rank))
        marker = layout.read_json(marker_path, rank=rank, what="rank marker")
        layout.check_format(marker, marker_path, rank)
        directory = self._local_copy(rank, marker) or self.directory
        self._sources[rank] = self._parsed_from[rank] = directory
        index_path = fileio.safe_join(directory, marker.get("index"), rank=rank,
                                      what="rank marker")
        try:
            raw = fileio.read_confined(index_path, rank=rank, what="index")
        except OSError as e:
            raise CheckpointError(f"cannot read index: {e}", rank=rank, file=index_path) from e
        if self.verify and zlib.crc32(raw) != marker.get("index_crc32"):
            raise CheckpointError("index does not match the checksum in its rank marker (edited or "
                                  "corrupted)", rank=rank, file=index_path)
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"index is not valid JSON: {e}", rank=rank,
                                  file=index_path) from e
        metas = parse_index(doc, rank, directory, index_path)
        self._by_rank[rank] = metas
        self._objects[rank] = doc.get("objects")
        self._index_paths[rank] = index_path
        kind = checksum.from_name(doc["checksum"], rank=rank, file=index_path)
        self._checksum[rank] = (checksum.function(kind)
                                if self.verify and kind is not Checksum.NONE else None)
        for m in metas:
            known = self._by_key.setdefault(m.key, [])
            if known and (known[0].global_shape != m.global_shape or known[0].dtype != m.dtype):
                raise CheckpointError(
                    f"rank {known[0].rank} saved it as {known[0].dtype}"
                    f"{list(known[0].global_shape)}, rank {rank} as {m.dtype}"
                    f"{list(m.global_shape)}", rank=rank, file=index_path, tensor=m.key)
            known.append(m)

    def _local_copy(self, rank: int, marker: dict) -> Optional[str]:
        """The node-local version directory if it holds this rank's files for the same index."""
        if self.local_dir is None:
            return None
        local = layout.local_version_dir(self.local_dir, self.directory)
        try:
            doc = layout.read_json(os.path.join(local, layout.rank_marker_file(rank)), rank=rank)
            layout.check_format(doc, local, rank)
        except CheckpointError:
            return None
        same = (doc.get("index_crc32") == marker.get("index_crc32")
                and doc.get("index") == marker.get("index")
                and doc.get("step") == marker.get("step"))
        return local if same else None

    def source(self, rank: int) -> str:
        """Directory this rank's shards are read from (now)."""
        return self._sources[rank]

    def read_stats(self) -> Dict[str, Tuple[int, float]]:
        """{"local"|"shared": (bytes read, seconds spent reading)} since the reader was built;
        seconds add up over reader threads."""
        with self._fd_lock:
            return {k: (int(v[0]), v[1]) for k, v in self._stats.items()}

    def _path(self, m: ShardMeta) -> Tuple[str, str]:
        """(path, "local" or "shared"): where shard `m`'s bytes are read from now (its rank may
        have fallen back to the version directory)."""
        now = self._sources[m.rank]  # index file names are plain names (fileio.safe_join)
        path = m.path if now == self._parsed_from[m.rank] else \
            os.path.join(now, os.path.basename(m.path))
        return path, "shared" if now == self.directory else "local"

    def _fall_back(self, m: ShardMeta, err: CheckpointError) -> bool:
        """True when the failed read came from a local copy: the rank reads from the version
        directory from now on."""
        with self._fd_lock:
            if self._parsed_from[m.rank] == self.directory:
                return False
            if self._sources[m.rank] != self.directory:
                self._sources[m.rank] = self.directory
                self.fallbacks[m.rank] = str(err)
            return True

    def ranks(self) -> List[int]:
        return sorted(self._by_rank)

    def tensor_keys(self, shards_only: bool = False) -> List[str]:
        """Global keys of saved tensors; with `shards_only`, only those saved as TensorShard
        (not plain tensors nested in small objects, e.g. RNG states)."""
        return sorted(k for k, metas in self._by_key.items()
                      if not shards_only or metas[0].is_shard)

    def tensor_meta(self, key: str) -> TensorMeta:
        metas = self._metas(key)
        return TensorMeta(key, metas[0].dtype, metas[0].global_shape,
                          tuple((m.rank, m.global_offset, m.shape) for m in metas))

    def _metas(self, key: str) -> List[ShardMeta]:
        metas = self._by_key.get(key)
        if not metas:
            raise CheckpointError(f"no tensor with this key; the checkpoint has "
                                  f"{len(self._by_key)} keys, e.g. {self.tensor_keys()[:5]}",
                                  file=self.directory, tensor=key)
        return metas

    # ----------------------------------------------------------------- reading
    def close(self) -> None:
        with self._fd_lock:
            for fd in (list(self._fds.values()) + [d for d in self._dfds.values() if d >= 0]
                       + self._retired):
                os.close(fd)
            self._fds.clear()
            self._dfds.clear()
            self._retired.clear()
        self._pool.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fd(self, path: str, m: ShardMeta) -> int:
        with self._fd_lock:
            fd = self._fds.get(path)
            if fd is None:
                try:  # checked when the index was parsed; again here, as it is opened
                    fd = fileio.open_confined(path, rank=m.rank, what="shard file")
                except OSError as e:
                    raise CheckpointError(f"cannot open shard file: {e}", rank=m.rank, file=path,
                                          tensor=m.key) from e
                self._fds[path] = fd
            return fd

    def _dfd(self, path: str, m: ShardMeta) -> int:
        """The O_DIRECT descriptor of `path`, or -1 where O_DIRECT is off or refused."""
        if not self.direct:
            return -1
        with self._fd_lock:
            fd = self._dfds.get(path)
            if fd is None:
                try:
                    fd = fileio.open_confined(path, rank=m.rank, what="shard file",
                                              flags=os.O_DIRECT)
                except OSError:
                    fd = -1  # e.g. tmpfs (EINVAL): the buffered descriptor reads it
                self._dfds[path] = fd
            return fd

    def _read_bytes(self, m: ShardMeta, b0: int, b1: int
                    ) -> Tuple[torch.Tensor, int, torch.Tensor]:
        """Bytes [b0, b1) of the tensor's image, widened to whole chunks and verified when
        `verify`. Returns (bytes, position of b0 in them, the pool buffer holding them: give it
        back once nothing reads the bytes any more, or keep it)."""
        try:
            return self._read_bytes_at(m, b0, b1, *self._path(m))
        except CheckpointError as err:
            if not self._fall_back(m, err):
                raise
            return self._read_bytes_at(m, b0, b1, *self._path(m))

    def _pread(self, path: str, m: ShardMeta, start: int, end: int
               ) -> Tuple[torch.Tensor, int, torch.Tensor]:
        """(bytes [start, end) of the shard, their length read, the pool buffer holding them)."""
        pos, n = m.offset + start, end - start
        dfd = self._dfd(path, m)
        if dfd >= 0:
            a0 = pos - pos % PAGE
            span = round_up(pos + n) - a0
            lease = self._pool.take(span)
            try:
                got = os.preadv(dfd, [memoryview(lease[:span].numpy())], a0)
                return lease[pos - a0:pos - a0 + n], max(0, min(n, got - (pos - a0))), lease
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                with self._fd_lock:  # alignment refused at read time: read buffered from now on
                    if self._dfds.get(path, -1) >= 0:  # closed by close(): another thread may
                        self._retired.append(self._dfds[path])  # still be reading with it
                        self._dfds[path] = -1
            self._pool.give(lease)
        lease = self._pool.take(n)
        buf = lease[:n]
        return buf, os.preadv(self._fd(path, m), [memoryview(buf.numpy())], pos), lease

    def _read_bytes_at(self, m: ShardMeta, b0: int, b1: int, path: str,
                       kind: str) -> Tuple[torch.Tensor, int, torch.Tensor]:
        t0 = time.perf_counter()
        start, end = b0, b1
        crc_fn = self._checksum[m.rank]
        check = crc_fn is not None
        if check:
            chunks = [c for c in m.chunks if c[0] < b1 and c[0] + c[1] > b0]
            start, end = chunks[0][0], chunks[-1][0] + chunks[-1][1]
        buf, got, lease = self._pread(path, m, start, end)
        if got != end - start:
            self._pool.give(lease)
            raise CheckpointError(f"shard file is truncated: expected {end - start} bytes at "
                                  f"offset {m.offset + start}, read {got}", rank=m.rank,
                                  file=path, tensor=m.key)
        if check:
            arr = buf.numpy()
            for off, n, crc in chunks:
                found = crc_fn(memoryview(arr[off - start:off - start + n]))
                if found != crc:
                    self._pool.give(lease)
                    raise CheckpointError(f"checksum mismatch in bytes [{off}, {off + n}) of the "
                                          f"tensor (file offset {m.offset + off}): expected "
                                          f"{crc:#010x}, found {found:#010x}", rank=m.rank,
                                          file=path, tensor=m.key)
        with self._fd_lock:
            stat = self._stats.setdefault(kind, [0, 0.0])
            stat[0] += end - start
            stat[1] += time.perf_counter() - t0
        return buf, b0 - start, lease

    def _read_local_box(self, m: ShardMeta, lo: Sequence[int], shape: Sequence[int]
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(the box of shard `m` at local offset `lo` with `shape`, the pool buffer it is a view
        of: None, or for `_pool.give` once the box is copied)."""
        if m.nbytes == 0 or math_prod(shape) == 0:
            return torch.empty(tuple(shape), dtype=m.dtype), None
        if not m.shape:
            buf, at, lease = self._read_bytes(m, 0, m.nbytes)
            return buf[at:at + m.nbytes].view(m.dtype).view(()), lease
        row_bytes = m.nbytes // m.shape[0]
        r0, r1 = lo[0], lo[0] + shape[0]
        buf, at, lease = self._read_bytes(m, r0 * row_bytes, r1 * row_bytes)
        rows = buf[at:at + (r1 - r0) * row_bytes].view(m.dtype).view((r1 - r0,) + m.shape[1:])
        index = (slice(None),) + tuple(slice(o, o + s) for o, s in zip(lo[1:], shape[1:]))
        return rows[index], lease

    def read(self, key: str, global_offset: Optional[Sequence[int]] = None,
             shape: Optional[Sequence[int]] = None, out: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
        """The box of global tensor `key` at `global_offset` (default: origin) with `shape`
        (default: to the end), assembled from every overlapping shard of every rank. With
        `out` (a tensor of the box's shape and dtype) the box is written into it and `out`
        returned; the reader's own buffers are then reused from one read to the next."""
        metas = self._metas(key)
        gshape = metas[0].global_shape
        off = tuple(global_offset) if global_offset is not None else (0,) * len(gshape)
        shp = tuple(shape) if shape is not None else tuple(g - o for g, o in zip(gshape, off))
        if (len(off) != len(gshape) or len(shp) != len(gshape)
                or any(o < 0 or s < 0 or o + s > g for o, s, g in zip(off, shp, gshape))):
            raise CheckpointError(f"requested box at {list(off)} of shape {list(shp)} does not fit "
                                  f"in the global shape {list(gshape)}", file=self.directory,
                                  tensor=key)
        if out is not None and (tuple(out.shape) != shp or out.dtype != metas[0].dtype):
            raise ValueError(f"out is {out.dtype}{list(out.shape)}, the box "
                             f"{metas[0].dtype}{list(shp)}")
        for m in metas:  # fast path: one shard is exactly the box
            if m.global_offset == off and m.shape == shp:
                box, lease = self._read_local_box(m, (0,) * len(shp), shp)
                if out is None:
                    return box  # a view of its buffer, which stays with it
                out.copy_(box)
                self._give(lease)
                return out
        if out is None:
            out = torch.empty(shp, dtype=metas[0].dtype)
        if out.numel() == 0:
            return out
        jobs = _tiling_jobs(metas, off, shp)
        if jobs is None:  # shards that overlap partially: count every element
            jobs = self._covering_jobs(key, metas, off, shp)

        def run(job):
            m, dst, lo, size = job
            box, lease = self._read_local_box(m, lo, size)
            out[dst] = box
            del box
            self._give(lease)

        self._parallel(run, jobs)
        return out

    def _give(self, lease: Optional[torch.Tensor]) -> None:
        if lease is not None:
            self._pool.give(lease)

    def _covering_jobs(self, key: str, metas: List[ShardMeta], off, shp) -> List[tuple]:
        covered = torch.zeros(shp, dtype=torch.bool)
        jobs = []
        for m, lo, hi in _overlaps(metas, off, shp):
            job = _job(m, lo, hi, off)
            if bool(covered[job[1]].all()):
                continue  # a replica of what another shard already provides
            covered[job[1]] = True
            jobs.append(job)
        if not bool(covered.all()):
            raise CheckpointError(f"the saved shards do not cover the requested box at {list(off)} "
                                  f"of shape {list(shp)}", file=self.directory, tensor=key)
        return jobs

    def _parallel(self, fn, items) -> List[Any]:
        if len(items) <= 1 or self.threads == 1:
            return [fn(x) for x in items]
        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(fn, items))

    def load_objects(self, rank: int = 0) -> Any:
        """The nested state as `rank` saved it, without its TensorShard leaves (None in their
        place): small objects and the plain tensors among them (e.g. RNG states), read without
        touching the shards' bytes."""
        if rank not in self._by_rank:
            raise CheckpointError(f"no such rank; the checkpoint has ranks {self.ranks()}",
                                  rank=rank, file=self.directory)
        metas = self._by_rank[rank]
        leaves = [None if m.is_shard else self._plain(m) for m in metas]
        return self._decode(rank, leaves)

    def load_state(self, rank: int = 0) -> Any:
        """The nested state as `rank` saved it. Plain tensors come back as tensors, TensorShard
        leaves as TensorShard(data, key, global_shape, global_offset) holding that rank's data."""
        if rank not in self._by_rank:
            raise CheckpointError(f"no such rank; the checkpoint has ranks {self.ranks()}",
                                  rank=rank, file=self.directory)
        metas = self._by_rank[rank]
        tensors = self._parallel(
            lambda m: self._read_local_box(m, (0,) * len(m.shape), m.shape)[0]
            if m.is_shard else self._plain(m), metas)
        leaves = [TensorShard(t, m.key, m.global_shape, m.global_offset) if m.is_shard else t
                  for t, m in zip(tensors, metas)]
        return self._decode(rank, leaves)

    def _plain(self, m: ShardMeta) -> torch.Tensor:
        """A plain tensor of the nested state (e.g. an RNG state), in memory of its own: a view
        into a read buffer would keep the buffer alive, and `torch.set_rng_state` misreads a
        view that does not start its storage."""
        box, lease = self._read_local_box(m, (0,) * len(m.shape), m.shape)
        if lease is None:
            return box
        own = box.clone()
        del box
        self._give(lease)
        return own

    def _decode(self, rank: int, leaves: List[Any]) -> Any:
        try:
            return decode_skeleton(self._objects[rank], leaves, self.allow_pickle)
        except CheckpointError as err:  # name the index the object came from
            if err.file is not None:
                raise
            raise type(err)(err.args[0], rank=rank, file=self._index_paths[rank]) from None


def _committed_ranks(commit: dict, world_size: int, path: str) -> List[int]:
    ranks = commit.get("ranks", list(range(world_size)))
    if (not isinstance(ranks, list) or not ranks
            or not all(isinstance(r, int) and 0 <= r < world_size for r in ranks)):
        raise CheckpointError(f"commit marker lists ranks {ranks!r}; expected a non-empty list of "
                              f"ranks below its world size {world_size}", file=path)
    return ranks


def math_prod(xs: Sequence[int]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _overlaps(metas: List[ShardMeta], off, shp):
    """(shard, lo, hi) of every shard that overlaps the box at `off` with shape `shp`."""
    for m in metas:
        lo = tuple(max(o, mo) for o, mo in zip(off, m.global_offset))
        hi = tuple(min(o + s, mo + ms) for o, s, mo, ms in zip(off, shp, m.global_offset, m.shape))
        if all(h > l for l, h in zip(lo, hi)):
            yield m, lo, hi


def _job(m: ShardMeta, lo, hi, off) -> tuple:
    """(shard, destination slices in the box, offset in the shard, shape) of one piece."""
    return (m, tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, off)),
            tuple(l - mo for l, mo in zip(lo, m.global_offset)),
            tuple(h - l for l, h in zip(lo, hi)))


def _tiling_jobs(metas: List[ShardMeta], off, shp) -> Optional[List[tuple]]:
    """The pieces of the box when the shards tile it (replicas of one box dropped, the rest
    pairwise disjoint, their volumes summing to the box's): checked on the boxes' corners, not by
    marking every element (which cost a merge ~0.4 s of CPU per GB). None when they do not."""
    pieces = {}
    for m, lo, hi in _overlaps(metas, off, shp):
        pieces.setdefault((lo, hi), (m, lo, hi))
    boxes = list(pieces)
    for i, (lo_a, hi_a) in enumerate(boxes):
        for lo_b, hi_b in boxes[i + 1:]:
            if all(max(la, lb) < min(ha, hb) for la, ha, lb, hb in zip(lo_a, hi_a, lo_b, hi_b)):
                return None
    if sum(math_prod([h - l for l, h in zip(lo, hi)]) for lo, hi in boxes) != math_prod(shp):
        return None
    return [_job(m, lo, hi, off) for m, lo, hi in pieces.values()]

