"""Benchmark: what verifying a universal checkpoint's checksums costs its readers and its merge.

Usage:
  python benchmarks/universal_verify_bench.py [--dir DIR] [--mib 512] [--rounds 5] [--json out.json]

Writes one universal checkpoint (`--mib` MiB of fp32 tensors shaped like a GPT's stacked layer
weights, [layers, rows, cols]) through `write_universal`, and a copy of it without checksums (the
same files, the manifest of a checkpoint written before checksums existed). Then, alternating the
two (A B A B ...: this machine's speed drifts), reads with `UniversalCheckpoint.read`:
  whole      every tensor whole (to-torch-dist, to-hf);
  pp2        the first half of the layer axis (a pipeline stage: contiguous bytes);
  tp2_rows   half of the rows of every layer (column-parallel weights: one run per layer);
  tp2_cols   half of the last dimension (row-parallel weights: every row touched).
The files stay in the page cache (read once before timing), so the figures are the CPU cost of
verification, not the disk's. Reported: GB/s of the bytes each read returns per CPU second of the
reading process (each tensor's median read time over the rounds, every round a fresh open, so
every chunk is verified again), and the ratio verified / unverified. The merge's
own checksum time is timed too (`chunk_checksums` over the same bytes, CPU time).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import List

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from datastates.universal import Entry, MergeSource, Role, UniversalCheckpoint, write_universal  # noqa: E402
from datastates.universal.tensor_files import chunk_checksums, tensor_bytes  # noqa: E402

LAYERS, ROWS, COLS = 8, 1024, 1024  # 32 MiB per fp32 tensor


class _Synthetic(MergeSource):
    """Random fp32 tensors of [LAYERS, ROWS, COLS], as many as `mib` asks for."""

    kind = "synthetic"

    def __init__(self, mib: int):
        self.directory = tempfile.mkdtemp(prefix="verify_bench_src_")
        n = max(1, (mib << 20) // (LAYERS * ROWS * COLS * 4))
        self._names = [f"decoder.layers.w{i}.weight" for i in range(n)]

    def iteration(self):
        return 1

    def objects(self):
        return {}

    def entries(self):
        return [Entry(n, Role.WEIGHT, n, n, torch.float32, (LAYERS, ROWS, COLS))
                for n in self._names]

    def read(self, key):
        g = torch.Generator().manual_seed(hash(key) % (1 << 31))
        return torch.randn((LAYERS, ROWS, COLS), generator=g)

    def manifest_fields(self):
        return {"iteration": 1}


BOXES = {
    "whole": None,
    "pp2": ((0, 0, 0), (LAYERS // 2, ROWS, COLS)),
    "tp2_rows": ((0, 0, 0), (LAYERS, ROWS // 2, COLS)),
    "tp2_cols": ((0, 0, 0), (LAYERS, ROWS, COLS // 2)),
}


def _read_times(directory: str, box) -> List[float]:
    """CPU seconds of this process for each tensor's read, in one freshly opened checkpoint (CPU
    time, not wall time: on a shared machine the wall clock measures the neighbours)."""
    out = []
    with UniversalCheckpoint(directory) as u:
        for name in u.names():
            t0 = time.process_time()
            t = u.read(name) if box is None else u.read(name, *box)
            out.append(time.process_time() - t0)
            del t
    return out


def _gbps(times: List[List[float]], nbytes: int) -> float:
    """Bytes per CPU second from the median time of each tensor over the rounds."""
    return nbytes / sum(statistics.median(per) for per in zip(*times)) / 1e9


def _strip(src: str, dst: str) -> None:
    shutil.copytree(src, dst)
    m = json.load(open(os.path.join(dst, "manifest.json")))
    m.pop("checksum")
    for e in m["tensors"].values():
        e.pop("crc32c")
    json.dump(m, open(os.path.join(dst, "manifest.json"), "w"))
    c = json.load(open(os.path.join(dst, "UNIVERSAL_COMMIT.json")))
    c.pop("manifest_crc32c")
    c.pop("index_crc32c")
    json.dump(c, open(os.path.join(dst, "UNIVERSAL_COMMIT.json"), "w"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None)
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    work = a.dir or tempfile.mkdtemp(prefix="verify_bench_")
    source = _Synthetic(a.mib)
    verified = os.path.join(work, "verified")
    write_universal(source, verified, overwrite=True)
    unverified = os.path.join(work, "unverified")
    shutil.rmtree(unverified, ignore_errors=True)
    _strip(verified, unverified)
    for d in (verified, unverified):
        _read_times(d, None)  # into the page cache
    results = {}
    tensors = len(source._names)
    for variant, box in BOXES.items():
        shape = (LAYERS, ROWS, COLS) if box is None else box[1]
        nbytes = tensors * 4 * shape[0] * shape[1] * shape[2]
        with_crc, without = [], []
        for _ in range(a.rounds):
            with_crc.append(_read_times(verified, box))
            without.append(_read_times(unverified, box))
        results[variant] = {"verified_gbps": _gbps(with_crc, nbytes),
                            "unverified_gbps": _gbps(without, nbytes)}
        results[variant]["ratio"] = (results[variant]["verified_gbps"]
                                     / results[variant]["unverified_gbps"])
    t = source.read(source._names[0])
    crc_s = []
    for _ in range(a.rounds):
        t0 = time.process_time()
        chunk_checksums(tensor_bytes(t))
        crc_s.append(time.process_time() - t0)
    results["merge_checksum_gbps"] = t.numel() * 4 / statistics.median(crc_s) / 1e9
    results["checkpoint_mib"] = len(source._names) * LAYERS * ROWS * COLS * 4 >> 20
    print(f"{'read':<10} {'verified GB/s':>14} {'unverified GB/s':>16} {'ratio':>7}  (per CPU s)")
    for variant in BOXES:
        r = results[variant]
        print(f"{variant:<10} {r['verified_gbps']:>14.2f} {r['unverified_gbps']:>16.2f} "
              f"{r['ratio']:>7.2f}")
    print(f"merge: CRC-32C of the written bytes at {results['merge_checksum_gbps']:.2f} GB/s "
          f"({results['checkpoint_mib']} MiB checkpoint)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.dir is None:
        shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(source.directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
