"""How bytes move from the host cache to storage (level 2), and what makes a save durable."""
from __future__ import annotations

import errno
import logging
import os
import threading
import zlib
from typing import Callable, List

from . import fileio, layout
from .cache import HostCache
from .checksum import ChecksumFn
from .config import EngineConfig
from .faults import fail_point, fault_point
from .index import build_index
from .job import SaveJob, Segment
from .writeback import drop_cached, start_writeback

logger = logging.getLogger(__name__)
DIRECT_ALIGN = 4096


def write_block(cfg: EngineConfig, crc: ChecksumFn, cache: HostCache, sv: SaveJob,
                segments: List[Segment], start: int, total: int,
                lock: threading.Condition) -> List[int]:
    """Checksum each segment of a cache block (unless its copy did) and write the block, which
    is contiguous in the file, with one write; returns the checksums. O_DIRECT where the block
    is page-aligned."""
    first = segments[0]
    file_off = sv.file_offsets[first.entry] + first.offset
    if cfg.write_hook is not None:
        cfg.write_hook("write", {"rank": cfg.rank, "file": sv.shard_path,
                                 "tensor": sv.entries[first.entry].key, "offset": file_off,
                                 "nbytes": total})
    # Segments whose copy computed their CRC (copycrc) are not read again here.
    crcs = [s.crc if s.crc is not None else crc(cache.memview(start + s.pos, s.nbytes))
            for s in segments]
    last = segments[-1]
    ends_tensor = last.offset + last.nbytes == sv.entries[last.entry].nbytes
    if (sv.dfd >= 0 and file_off % DIRECT_ALIGN == 0 and start % DIRECT_ALIGN == 0
            and (total % DIRECT_ALIGN == 0 or ends_tensor)):
        # A block that ends a tensor is padded to the page: the padding lands in the gap before
        # the next page-aligned block (the cache block is page-rounded too).
        padded = -(-total // DIRECT_ALIGN) * DIRECT_ALIGN
        try:
            fileio.pwrite_all(sv.dfd, cache.memview(start, padded), file_off)
            return crcs
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # The filesystem accepted O_DIRECT at open but not our alignment: go buffered.
            logger.info("DataStates: O_DIRECT write refused for %s (%s); writing buffered",
                        sv.shard_path, e)
            with lock:
                if sv.dfd >= 0:
                    os.close(sv.dfd)
                    sv.dfd = -1
    fileio.pwrite_all(sv.fd, cache.memview(start, total), file_off)
    if cfg.early_writeback:
        start_writeback(sv.fd, file_off, total)
    return crcs


def write_version_files(cfg: EngineConfig, sv: SaveJob, lock: threading.Condition,
                        close_fd: Callable[[SaveJob], None]) -> None:
    """fsync the shard, then write index, format file and, last, this rank's marker."""
    fault_point("flush", sv.handle.step, cfg.rank)
    fail_point("write", sv.handle.step, cfg.rank, sv.shard_path)
    if cfg.write_hook is not None:
        cfg.write_hook("fsync", {"rank": cfg.rank, "file": sv.shard_path, "tensor": None})
    if cfg.fsync:
        os.fsync(sv.fd)
        if cfg.early_writeback:
            drop_cached(sv.fd)
    with lock:
        close_fd(sv)
    directory = sv.write_dir
    index = build_index(cfg, sv.handle.step, sv.entries, sv.file_offsets, sv.chunks, sv.skeleton)
    index_bytes = layout.dumps(index)
    fileio.atomic_write(os.path.join(directory, layout.index_file(cfg.rank)), index_bytes,
                        durable=cfg.fsync)
    fileio.atomic_write(os.path.join(directory, layout.FORMAT_FILE),
                        layout.dumps(layout.format_header()), durable=cfg.fsync)
    marker = dict(layout.format_header(), rank=cfg.rank, world_size=cfg.world_size,
                  step=sv.handle.step, index=layout.index_file(cfg.rank),
                  index_crc32=zlib.crc32(index_bytes), bytes=sv.total_bytes)
    fileio.atomic_write(os.path.join(directory, layout.rank_marker_file(cfg.rank)),
                        layout.dumps(marker), durable=cfg.fsync)


def _copy_file(src: str, dst: str, durable: bool) -> None:
    """Copy inside the kernel (no bytes through Python), then fsync. copy_file_range where the
    kernel allows it; sendfile across filesystems (EXDEV), the usual local -> shared case."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        done = 0
        use_sendfile = False
        while done < size:
            count = min(size - done, 1 << 30)
            if not use_sendfile:
                try:
                    n = os.copy_file_range(fin.fileno(), fout.fileno(), count, done, done)
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    use_sendfile = True
                    continue
            else:
                os.lseek(fout.fileno(), done, os.SEEK_SET)
                n = os.sendfile(fout.fileno(), fin.fileno(), done, count)
            if n <= 0:
                raise OSError(f"copy of {src} stopped at byte {done} of {size}")
            done += n
        if durable:
            os.fsync(fout.fileno())


def migrate_version_files(cfg: EngineConfig, sv: SaveJob) -> None:
    """Level 3: copy this rank's durable local files into the version directory; the rank
    marker goes last, so the version directory never shows a marker without its bytes."""
    src, dst = sv.write_dir, sv.handle.directory
    _copy_file(os.path.join(src, layout.shard_file(cfg.rank)),
               os.path.join(dst, layout.shard_file(cfg.rank)), cfg.fsync)
    for name in (layout.index_file(cfg.rank), layout.FORMAT_FILE,
                 layout.rank_marker_file(cfg.rank)):
        with open(os.path.join(src, name), "rb") as f:
            fileio.atomic_write(os.path.join(dst, name), f.read(), durable=cfg.fsync)
