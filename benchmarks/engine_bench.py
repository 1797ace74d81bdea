"""Benchmark: DataStates engine vs raw disk bandwidth and torch.save, from one run.

Usage:
  python benchmarks/engine_bench.py [--dir DIR] [--size-gb 1.0] [--tensors 64] [--rounds 2]
                                    [--cache-mb MB] [--writers 1] [--modes buffered,direct]
                                    [--checksums crc32c] [--json out.json]

Each round runs, in this order, on the same directory: for each engine write mode, a raw write
(dd, conv=fdatasync) then the engine (save -> wait_for_snapshot with no overlapping work ->
wait_for_durable); then a raw write and torch.save + fsync. Each variant's ratio uses the dd run
right before it, since disk bandwidth drifts within a run.
Ratios use the raw bandwidth of the same round, since disk bandwidth swings between runs.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import threading
import time

import psutil
import torch

from datastates import Checksum, CheckpointEngine, EngineConfig, WriteMode


class PeakRSS:
    """Samples this process's RSS every few milliseconds while active."""

    def __init__(self):
        self.proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_state(total_bytes: int, n: int) -> dict:
    per = total_bytes // 4 // n
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i:03d}": {"weight": torch.randn(per, generator=g)} for i in range(n)}
    state["step"] = 1
    return state


def raw_dd(path: str, nbytes: int) -> float:
    bs = 64 << 20
    count = max(1, nbytes // bs)
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}",
                    "conv=fdatasync"], check=True, capture_output=True)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return count * bs / dt / 1e9


def torch_save(state: dict, path: str) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


def engine_save(eng: CheckpointEngine, state: dict, directory: str, step: int) -> dict:
    with PeakRSS() as rss:
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        h = eng.save(state, directory, step=step)
        eng.wait_for_snapshot()
        t_blocked = time.perf_counter() - t0
        (rec,) = eng.wait_for_durable(h)
        t_durable = time.perf_counter() - t0
        cpu = cpu_seconds() - c0
    shutil.rmtree(directory)
    return {"blocked_s": t_blocked, "durable_s": t_durable, "flush_s": rec.flush_s,
            "copy_s": rec.copy_s, "peak_cache_bytes": rec.peak_cache_bytes,
            "peak_rss": rss.peak, "cpu_s": cpu}


def print_table(rounds, nbytes, modes):
    rows = [("raw dd conv=fdatasync (GB/s)", "raw_gbps", "{:.3f}"),
            ("torch.save + fsync (s)", "torch_save_s", "{:.3f}"),
            ("torch.save GB/s / raw GB/s", "torch_save_vs_raw", "{:.2f}")]
    for m in modes:
        rows += [(f"[{m}] raw dd right before (GB/s)", f"{m}.raw_gbps", "{:.3f}"),
                 (f"[{m}] engine blocked, no overlap (s)", f"{m}.blocked_s", "{:.3f}"),
                 (f"[{m}] engine time to durable (s)", f"{m}.durable_s", "{:.3f}"),
                 (f"[{m}] engine GB/s to durable", f"{m}.engine_gbps", "{:.3f}"),
                 (f"[{m}] engine GB/s / raw GB/s", f"{m}.engine_vs_raw", "{:.2f}"),
                 (f"[{m}] engine CPU s per GB saved", f"{m}.cpu_s_per_gb", "{:.2f}"),
                 (f"[{m}] peak RSS / state size", f"{m}.peak_rss_ratio", "{:.2f}"),
                 (f"[{m}] peak cache / state size", f"{m}.peak_cache_ratio", "{:.2f}")]
    width = max(42, max(len(name) for name, _, _ in rows))
    header = " | ".join(f"round {x['round']}" for x in rounds)
    print(f"| {'metric':{width}s} | {header} | median  |")
    print("|" + "-" * (width + 2) + "|" + "---------|" * (len(rounds) + 1))
    for name, key, fmt in rows:
        vals = [x[key] for x in rounds]
        cells = [fmt.format(v) for v in vals] + [fmt.format(statistics.median(vals))]
        print(f"| {name:{width}s} | " + " | ".join(f"{c:7s}" for c in cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default="/tmp/datastates_bench")
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cache-mb", type=int, default=None,
                   help="host cache size (default: the state size, so the snapshot never waits "
                        "for the disk)")
    p.add_argument("--writers", type=int, default=1)
    p.add_argument("--modes", default="buffered,direct",
                   help="comma-separated WriteMode values to compare")
    p.add_argument("--checksums", default="crc32c",
                   help="comma-separated Checksum values (crc32c, crc32, none); each is run with "
                        "every mode, labelled mode/checksum when more than one is given")
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    state = make_state(int(args.size_gb * 1e9), args.tensors)
    nbytes = sum(v["weight"].nbytes for k, v in state.items() if k != "step")
    cache = (args.cache_mb << 20) if args.cache_mb else nbytes + (16 << 20)
    checksums = [Checksum(c) for c in args.checksums.split(",")]
    variants = [(m if len(checksums) == 1 else f"{m}/{c.value}", WriteMode(m), c)
                for m in args.modes.split(",") for c in checksums]
    modes = [label for label, _, _ in variants]
    load_before = os.getloadavg()
    rounds = []
    for r in range(args.rounds):
        res = {"round": r}
        # Every variant is compared with a dd run right before it: disk bandwidth drifts.
        for m, mode, checksum in variants:
            subprocess.run(["sync"], check=True)
            res[f"{m}.raw_gbps"] = raw_dd(os.path.join(args.dir, "dd.bin"), nbytes)
            # A fresh engine per variant and round: its cache is allocated before the save.
            with CheckpointEngine(EngineConfig(host_cache_bytes=cache, writer_threads=args.writers,
                                               write_mode=mode, checksum=checksum)) as eng:
                base = psutil.Process().memory_info().rss
                target = os.path.join(args.dir, "engine_" + m.replace("/", "_"))
                e = engine_save(eng, state, target, r)
            e["engine_gbps"] = nbytes / e["durable_s"] / 1e9
            e["engine_vs_raw"] = e["engine_gbps"] / res[f"{m}.raw_gbps"]
            e["cpu_s_per_gb"] = e["cpu_s"] / (nbytes / 1e9)
            e["peak_rss_ratio"] = e["peak_rss"] / nbytes
            e["extra_rss_ratio"] = (e["peak_rss"] - base) / nbytes
            e["peak_cache_ratio"] = e["peak_cache_bytes"] / nbytes
            res.update({f"{m}.{k}": v for k, v in e.items()})
        subprocess.run(["sync"], check=True)
        res["raw_gbps"] = raw_dd(os.path.join(args.dir, "dd.bin"), nbytes)
        res["torch_save_s"] = torch_save(state, os.path.join(args.dir, "torch_save.pt"))
        res["torch_save_vs_raw"] = nbytes / res["torch_save_s"] / 1e9 / res["raw_gbps"]
        rounds.append(res)
    print(f"state {nbytes / 1e9:.3f} GB in {args.tensors} tensors, cache {cache / 2**20:.0f} MiB, "
          f"{args.writers} writer thread(s); load avg (1/5/15 min) before "
          + " ".join(f"{x:.2f}" for x in load_before) + ", after "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print_table(rounds, nbytes, modes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_bytes": nbytes, "tensors": args.tensors, "cache_bytes": cache,
                       "writers": args.writers, "load_before": load_before,
                       "load_after": os.getloadavg(), "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
