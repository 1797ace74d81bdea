"""Benchmark: DataStates engine vs raw disk bandwidth and torch.save, from one run.

Usage:
  python benchmarks/engine_bench.py [--dir DIR] [--size-gb 1.0] [--tensors 64] [--rounds 2]
                                    [--cache-mb 256] [--json out.json]

Each round runs, in this order, on the same directory: raw write (dd, conv=fdatasync), the engine
(save -> wait_for_snapshot with no overlapping work -> wait_for_durable), torch.save + fsync.
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

from datastates import CheckpointEngine, EngineConfig


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default="/tmp/datastates_bench")
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cache-mb", type=int, default=256)
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--no-early-writeback", action="store_true",
                   help="disable EngineConfig.early_writeback (for comparison)")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    state = make_state(int(args.size_gb * 1e9), args.tensors)
    nbytes = sum(v["weight"].nbytes for k, v in state.items() if k != "step")
    rounds = []
    with CheckpointEngine(EngineConfig(host_cache_bytes=args.cache_mb << 20,
                                       early_writeback=not args.no_early_writeback)) as eng:
        base_rss = psutil.Process().memory_info().rss  # state + engine cache, before any save
        for r in range(args.rounds):
            subprocess.run(["sync"], check=True)
            dd = raw_dd(os.path.join(args.dir, "dd.bin"), nbytes)
            e = engine_save(eng, state, os.path.join(args.dir, f"engine_{r}"), r)
            ts = torch_save(state, os.path.join(args.dir, "torch_save.pt"))
            e.update(round=r, raw_gbps=dd, torch_save_s=ts,
                     engine_gbps=nbytes / e["durable_s"] / 1e9,
                     engine_flush_gbps=nbytes / e["flush_s"] / 1e9)
            e["engine_vs_raw"] = e["engine_gbps"] / dd
            rounds.append(e)
    med = lambda k: statistics.median(x[k] for x in rounds)  # noqa: E731
    result = {
        "state_bytes": nbytes, "tensors": args.tensors, "cache_bytes": args.cache_mb << 20,
        "load_avg": os.getloadavg(), "rounds": rounds,
        "median": {k: med(k) for k in rounds[0] if k != "round"},
        "rss_before_bytes": base_rss,
    }
    print(f"state {nbytes / 1e9:.3f} GB in {args.tensors} tensors, cache {args.cache_mb} MiB, "
          f"early writeback {not args.no_early_writeback}, load avg (1/5/15 min) "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    rows = [("raw dd conv=fdatasync (GB/s)", "raw_gbps", "{:.3f}"),
            ("torch.save + fsync (s)", "torch_save_s", "{:.3f}"),
            ("engine blocked, no overlap (s)", "blocked_s", "{:.3f}"),
            ("engine time to durable (s)", "durable_s", "{:.3f}"),
            ("engine GB/s to durable", "engine_gbps", "{:.3f}"),
            ("engine GB/s / raw GB/s", "engine_vs_raw", "{:.2f}"),
            ("engine CPU seconds per save", "cpu_s", "{:.2f}"),
            ("peak RSS / state size", None, None),
            ("(peak RSS - RSS before) / state size", None, "extra")]
    print(f"| {'metric':34s} | " + " | ".join(f"round {x['round']}" for x in rounds) + " | median |")
    print("|" + "-" * 36 + "|" + "---------|" * (len(rounds) + 1))
    for name, key, fmt in rows:
        if key is None:
            base = base_rss if fmt == "extra" else 0
            vals = [(x["peak_rss"] - base) / nbytes for x in rounds]
            cells = [f"{v:.2f}" for v in vals] + [f"{statistics.median(vals):.2f}"]
        else:
            cells = [fmt.format(x[key]) for x in rounds] + [fmt.format(med(key))]
        print(f"| {name:34s} | " + " | ".join(f"{c:7s}" for c in cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
