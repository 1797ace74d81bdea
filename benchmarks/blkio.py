"""A slow disk for benchmarks (root only): the kernel's block throttling, cgroup v1 blkio.

    mkdir /sys/fs/cgroup/blkio/NAME
    echo "MAJ:MIN BYTES_PER_S" > /sys/fs/cgroup/blkio/NAME/blkio.throttle.write_bps_device
    echo $PID > /sys/fs/cgroup/blkio/NAME/cgroup.procs     # children inherit it

(`read_bps_device` for reads.) It throttles O_DIRECT and fsync'd writes, and reads that reach the
device (drop the page cache first: /proc/sys/vm/drop_caches), and leaves tmpfs (/dev/shm) alone.
MAJ:MIN is the device that holds the benchmark's directory (`lsblk -no MAJ:MIN`; taken from
os.stat here).
"""
from __future__ import annotations

import os
from pathlib import Path

BLKIO = Path("/sys/fs/cgroup/blkio")


class Throttle:
    """This process (and every child it starts) in a blkio group that moves at most `mbps` MiB/s
    to (`what="write"`) or from (`what="read"`) the device that holds `path`."""

    def __init__(self, path: Path, mbps: int, what: str = "write"):
        st = os.stat(path)
        self.device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        self.group = BLKIO / f"datastates-bench-{what}-{os.getpid()}"
        self.group.mkdir()
        (self.group / f"blkio.throttle.{what}_bps_device").write_text(
            f"{self.device} {mbps << 20}")
        (self.group / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        (BLKIO / "cgroup.procs").write_text(str(os.getpid()))
        self.group.rmdir()
