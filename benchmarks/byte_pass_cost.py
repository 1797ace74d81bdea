"""CPU seconds per GB of each pass a saved byte goes through, on one thread of this machine.

    python benchmarks/byte_pass_cost.py [--mb 512] [--block-kb 256] [--rounds 3]

The engine copies each byte into its host cache (`memmove`), checksums it (CRC-32C, `crc32c`
package) and writes it with O_DIRECT. This measures each pass alone (thread CPU time, median of
`--rounds`), both passes one after the other over the whole buffer, and both fused block by block
(copy `--block-kb`, checksum it while it is in the core's cache, continue the CRC): whether
touching each byte once saves CPU depends on whether the checksum is limited by memory bandwidth
(then fusing helps) or by the CRC instruction (then it does not). Ratios within one run only.

It also times the engine's one-pass copy + CRC (datastates/copycrc.py, when its library is built),
and the memmove in `--block-kb` calls: glibc switches to non-temporal stores only above its
threshold (192 MiB here), so the engine's per-tensor copies do not get the one-call rate. The
cache is allocated as the engine's is (private, transparent huge pages where the kernel allows).
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time

import numpy as np
import torch


def main(argv=None) -> int:
    import crc32c

    from datastates import copycrc

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--block-kb", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the O_DIRECT write goes")
    a = p.parse_args(argv)
    n, block = a.mb << 20, a.block_kb << 10
    src = torch.randn(n // 4)
    cache = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        cache.madvise(mmap.MADV_HUGEPAGE)
    dst = np.frombuffer(cache, dtype=np.uint8)
    dst.fill(0)
    base, view = dst.ctypes.data, memoryview(cache)

    def copy():
        ctypes.memmove(base, src.data_ptr(), n)

    def crc():
        crc32c.crc32c(view)

    def copy_blocks():
        s = src.data_ptr()
        for off in range(0, n, block):
            ctypes.memmove(base + off, s + off, block)

    def one_pass():
        value, s = 0, src.data_ptr()
        for off in range(0, n, block):
            value = copycrc.copy_crc32c(base + off, s + off, block, value)

    def fused():
        value, s = 0, src.data_ptr()
        for off in range(0, n, block):
            ctypes.memmove(base + off, s + off, block)
            value = crc32c.crc32c(view[off:off + block], value)

    def write():
        path = os.path.join(a.dir, f"byte_pass_cost.{os.getpid()}.bin")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        try:
            for off in range(0, n, 64 << 20):
                os.pwrite(fd, view[off:off + (64 << 20)], off)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(path)

    passes = [("memmove into the cache", copy), (f"memmove per {a.block_kb} KiB", copy_blocks),
              ("crc32c of the cache", crc),
              ("memmove, then crc32c", lambda: (copy(), crc())),
              (f"fused per {a.block_kb} KiB block", fused)]
    if copycrc.available:
        passes.append((f"copycrc one pass, {a.block_kb} KiB calls", one_pass))
    passes.append(("O_DIRECT write + fsync", write))
    print(f"{a.mb} MiB, crc32c hardware: {crc32c.hardware_based}, load average "
          f"{os.getloadavg()[0]:.2f}")
    for name, fn in passes:
        xs = []
        for _ in range(a.rounds):
            t0 = time.thread_time()
            fn()
            xs.append((time.thread_time() - t0) / (n / 1e9))
        print(f"{name:36s} {statistics.median(xs):.3f} CPU-s/GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
