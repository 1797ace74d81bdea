"""How bytes move from the host cache to storage (level 2), and what makes a save durable."""
from __future__ import annotations

import errno
import logging
import os
import threading
import zlib
from typing import Callable

from . import layout
from .cache import HostCache
from .config import Checksum, EngineConfig
from .faults import fault_point
from .index import build_index
from .job import SaveJob
from .writeback import drop_cached, start_writeback

logger = logging.getLogger(__name__)
DIRECT_ALIGN = 4096


def pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    done = 0
    while done < len(mv):
        n = os.pwrite(fd, mv[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        done += n


def write_piece(cfg: EngineConfig, cache: HostCache, sv: SaveJob, i: int, off: int, nbytes: int,
                start: int, lock: threading.Condition) -> int:
    """Checksum and write one cached piece of tensor i at its planned file offset; returns the
    checksum. O_DIRECT where the piece is page-aligned, buffered otherwise."""
    mv = cache.memview(start, nbytes)
    file_off = sv.file_offsets[i] + off
    if cfg.write_hook is not None:
        cfg.write_hook("write", {"rank": cfg.rank, "file": sv.shard_path,
                                 "tensor": sv.entries[i].key, "offset": file_off, "nbytes": nbytes})
    crc = zlib.crc32(mv) if cfg.checksum is Checksum.CRC32 else 0
    last = off + nbytes == sv.entries[i].nbytes
    if (sv.dfd >= 0 and file_off % DIRECT_ALIGN == 0 and start % DIRECT_ALIGN == 0
            and (nbytes % DIRECT_ALIGN == 0 or last)):
        # A last piece is padded to the page: the padding lands in the gap before the next
        # page-aligned tensor (the cache block is page-rounded too).
        padded = -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN
        try:
            pwrite_all(sv.dfd, cache.memview(start, padded), file_off)
            return crc
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
    pwrite_all(sv.fd, mv, file_off)
    if cfg.early_writeback:
        start_writeback(sv.fd, file_off, nbytes)
    return crc


def write_version_files(cfg: EngineConfig, sv: SaveJob, lock: threading.Condition,
                        close_fd: Callable[[SaveJob], None]) -> None:
    """fsync the shard, then write index, format file and, last, this rank's marker."""
    fault_point("flush", sv.handle.step, cfg.rank)
    if cfg.write_hook is not None:
        cfg.write_hook("fsync", {"rank": cfg.rank, "file": sv.shard_path, "tensor": None})
    if cfg.fsync:
        os.fsync(sv.fd)
        if cfg.early_writeback:
            drop_cached(sv.fd)
    with lock:
        close_fd(sv)
    directory = sv.handle.directory
    index = build_index(cfg, sv.handle.step, sv.entries, sv.file_offsets, sv.chunks, sv.skeleton)
    index_bytes = layout.dumps(index)
    layout.atomic_write(os.path.join(directory, layout.index_file(cfg.rank)), index_bytes,
                        durable=cfg.fsync)
    layout.atomic_write(os.path.join(directory, layout.FORMAT_FILE),
                        layout.dumps(layout.format_header()), durable=cfg.fsync)
    marker = dict(layout.format_header(), rank=cfg.rank, world_size=cfg.world_size,
                  step=sv.handle.step, index=layout.index_file(cfg.rank),
                  index_crc32=zlib.crc32(index_bytes), bytes=sv.total_bytes)
    layout.atomic_write(os.path.join(directory, layout.rank_marker_file(cfg.rank)),
                        layout.dumps(marker), durable=cfg.fsync)
