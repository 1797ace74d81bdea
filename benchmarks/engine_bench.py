"""Benchmark: DataStates engine vs raw disk bandwidth and torch.save, from one run.

Usage:
  python benchmarks/engine_bench.py [--dir DIR] [--size-gb 1.0] [--tensors 64] [--rounds 2]
                                    [--cache-mb MB] [--writers 1] [--modes buffered,direct]
                                    [--checksums crc32c] [--json out.json]
                                    [--device cpu|cuda] [--snapshot-only [--mapped-dir DIR]]
                                    [--no-torch-save]

Each round runs, in this order, on the same directory: for each engine write mode, a raw write
(dd, conv=fdatasync) then the engine (save -> wait_for_snapshot with no overlapping work ->
wait_for_durable); then a raw write and torch.save + fsync. Each variant's ratio uses the dd run
right before it, since disk bandwidth drifts within a run.
Ratios use the raw bandwidth of the same round, since disk bandwidth swings between runs.

--device cuda puts the state on the GPU. --snapshot-only measures instead only what the caller
waits for, the copy into host memory: engine save + wait_for_snapshot against plain torch copies
(`copy_(non_blocking=True)` into one preallocated host buffer, pinned on CUDA, then a
synchronize), both in each round, and prints engine GB/s / torch GB/s:
  python benchmarks/engine_bench.py --snapshot-only --device cuda --size-gb 2 --rounds 3
With --mapped-dir (a directory on /dev/shm), each round also times the in-memory level's engine:
WriteMode.MAPPED, copying straight into a reused shard file there (a slot, registered with CUDA
for DMA); its slot is made in an untimed warm-up save of the whole state, as in training, where
the level's slots are reused from the third save on. A version of that level commits once
durable: every piece checksummed, by the engine's writers where the copies do not checksum as
they copy (CUDA's do not), so each round also times save -> wait_for_durable with one writer and
with --checksum-threads writers (default: what the trainer gives a GPU rank that has this
machine's cores to itself, `checksum.threads_for_device_copies`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import threading
import time
from typing import Optional

import torch

from datastates import Checksum, CheckpointEngine, EngineConfig, WriteMode
from datastates.checksum import threads_for_device_copies


class PeakRSS:
    """Samples this process's RSS every 20 ms while active. Its CPU counts in the process CPU
    reported next to the engine's, so it is kept small: /proc/self/statm (~2.5 us a read here;
    psutil's memory_info took ~24 us) and 50 wake-ups a second (at 200 a second, waking took
    ~0.036 CPU-s per 1 GB save). The cache is allocated before a save, so the peak is not
    missed between samples."""

    def __init__(self):
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.02)

    def __enter__(self):
        self.peak = self.rss()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        os.close(self._fd)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def engine_thread_cpu(eng: CheckpointEngine) -> dict:
    """CPU seconds so far of each kind of engine thread (copy, write, migrate), from the
    threads' own CPU clocks: what the engine spends, without the benchmark's sampler."""
    out = {}
    for t in eng._threads:
        kind = t.name.split("-")[1]  # datastates-<kind>-<i>
        out[kind] = out.get(kind, 0.0) + time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return out


def make_state(total_bytes: int, n: int, device: str = "cpu") -> dict:
    per = total_bytes // 4 // n
    g = torch.Generator(device=device).manual_seed(0)
    state = {f"layer{i:03d}": {"weight": torch.randn(per, generator=g, device=device)}
             for i in range(n)}
    state["step"] = 1
    return state


def _tensors(state: dict) -> list:
    return [v["weight"] for k, v in state.items() if k != "step"]


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def torch_copy(state: dict, buffer: torch.Tensor, device: str) -> float:
    """Seconds for plain torch copies of every tensor into `buffer`, a preallocated host buffer
    (pinned on CUDA): the baseline a hand-written snapshot would get."""
    _synchronize(device)
    t0 = time.perf_counter()
    offset = 0
    for t in _tensors(state):
        dst = buffer[offset:offset + t.nbytes].view(t.dtype)
        dst.copy_(t.reshape(-1), non_blocking=True)
        offset += t.nbytes
    _synchronize(device)
    return time.perf_counter() - t0


def engine_snapshot(eng: CheckpointEngine, state: dict, directory: str, step: int,
                    device: str, durable: Optional[list] = None) -> float:
    """Seconds the caller waits for the engine's snapshot (save + wait_for_snapshot: every byte
    in the host cache). The flush to disk that follows is timed only into `durable` (appended:
    seconds from the save until wait_for_durable returned)."""
    _synchronize(device)
    t0 = time.perf_counter()
    h = eng.save(state, directory, step=step)
    eng.wait_for_snapshot()
    dt = time.perf_counter() - t0
    eng.wait_for_durable(h)
    if durable is not None:
        durable.append(time.perf_counter() - t0)
    shutil.rmtree(directory)
    return dt


def mapped_engine(slot_dir: str, writers: int = 1) -> CheckpointEngine:
    """The in-memory level's engine: copies into a reused /dev/shm slot, `writers` checksumming."""
    return CheckpointEngine(EngineConfig(host_cache_bytes=64 << 10, write_mode=WriteMode.MAPPED,
                                         mapped_slot_dir=slot_dir, writer_threads=writers))


def snapshot_bench(args) -> dict:
    """Engine snapshot rate against plain torch copies of the same state, in the same rounds."""
    state = make_state(int(args.size_gb * 1e9), args.tensors, args.device)
    nbytes = sum(t.nbytes for t in _tensors(state))
    pinned = args.device == "cuda"
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    buffer.fill_(0)  # touch the pages once, as the engine does with its cache
    target = os.path.join(args.dir, "engine_snapshot")
    rounds = []
    threads = args.checksum_threads or threads_for_device_copies(len(os.sched_getaffinity(0)), 1)
    with CheckpointEngine(EngineConfig(host_cache_bytes=nbytes + (16 << 20))) as eng, \
            contextlib.ExitStack() as stack:
        meng = mengs = None
        if args.mapped_dir:  # the in-memory level's engine, with one writer and with `threads`
            meng, mengs = (stack.enter_context(mapped_engine(
                os.path.join(args.mapped_dir, f"slots-{i}"), n))
                for i, n in enumerate((1, threads)))
        cache_pinned = eng._cache.pinned  # what the D2H copy lands in (pinned when CUDA exists)
        # Warm-up, untimed: the copy stream, events and the first pinned copies.
        first = {"layer000": state["layer000"]}
        torch_copy(first, buffer, args.device)
        engine_snapshot(eng, first, target, 0, args.device)
        if meng is not None:
            mtarget = os.path.join(args.mapped_dir, "engine_snapshot")
            for m in (meng, mengs):
                engine_snapshot(m, state, mtarget, 0, args.device)  # makes the slot
        for r in range(args.rounds):
            torch_s = torch_copy(state, buffer, args.device)
            engine_s = engine_snapshot(eng, state, target, r + 1, args.device)
            rounds.append({"round": r, "torch_copy_s": torch_s, "engine_snapshot_s": engine_s,
                           "torch_copy_gbps": nbytes / torch_s / 1e9,
                           "engine_snapshot_gbps": nbytes / engine_s / 1e9,
                           "engine_vs_torch": torch_s / engine_s})
            if meng is not None:
                durable: list = []
                mapped_s = engine_snapshot(meng, state, mtarget, r + 1, args.device, durable)
                engine_snapshot(mengs, state, mtarget, r + 1, args.device, durable)
                rounds[-1].update({"mapped_snapshot_s": mapped_s,
                                   "mapped_snapshot_gbps": nbytes / mapped_s / 1e9,
                                   "mapped_vs_torch": torch_s / mapped_s,
                                   "mapped_durable_gbps": nbytes / durable[0] / 1e9,
                                   "mapped_durable_threads_gbps": nbytes / durable[1] / 1e9,
                                   "mapped_durable_threads_speedup": durable[0] / durable[1]})
        slots = meng._slots.slots if meng is not None else []
        registered = bool(slots) and all(s.registered for s in slots)
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "round"}
    return {"mode": "snapshot", "device": args.device, "pinned_baseline": pinned,
            "engine_cache_pinned": cache_pinned, "state_bytes": nbytes,
            "mapped_slots": len(slots), "mapped_registered": registered,
            "checksum_threads": threads if meng is not None else None,
            "tensors": args.tensors, "rounds": rounds, "median": median}


def print_snapshot(res: dict) -> None:
    m = res["median"]
    print(f"state {res['state_bytes'] / 1e9:.3f} GB in {res['tensors']} tensors on "
          f"{res['device']}; copies into host memory, medians of {len(res['rounds'])} rounds:")
    print(f"| torch copy_ into a {'pinned ' if res['pinned_baseline'] else ''}buffer (GB/s) "
          f"| {m['torch_copy_gbps']:.2f} |")
    print(f"| engine save + wait_for_snapshot (GB/s) | {m['engine_snapshot_gbps']:.2f} |")
    print(f"| engine GB/s / torch GB/s | {m['engine_vs_torch']:.2f} |")
    if "mapped_snapshot_gbps" in m:
        print(f"| engine into a /dev/shm slot{' (registered)' if res['mapped_registered'] else ''}"
              f" (GB/s) | {m['mapped_snapshot_gbps']:.2f} |")
        print(f"| mapped GB/s / torch GB/s | {m['mapped_vs_torch']:.2f} |")
        print(f"| mapped, until durable (checksummed), 1 writer (GB/s) | "
              f"{m['mapped_durable_gbps']:.2f} |")
        print(f"| mapped, until durable, {res['checksum_threads']} writers (GB/s) | "
              f"{m['mapped_durable_threads_gbps']:.2f} |")


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
        th0, caller0 = engine_thread_cpu(eng), time.thread_time()
        t0 = time.perf_counter()
        h = eng.save(state, directory, step=step)
        eng.wait_for_snapshot()
        t_blocked = time.perf_counter() - t0
        (rec,) = eng.wait_for_durable(h)
        t_durable = time.perf_counter() - t0
        cpu = cpu_seconds() - c0
        caller = time.thread_time() - caller0
        th = {k: v - th0[k] for k, v in engine_thread_cpu(eng).items()}
    shutil.rmtree(directory)
    return {"blocked_s": t_blocked, "durable_s": t_durable, "flush_s": rec.flush_s,
            "copy_s": rec.copy_s, "peak_cache_bytes": rec.peak_cache_bytes,
            "peak_rss": rss.peak, "cpu_s": cpu, "caller_cpu_s": caller,
            "copy_cpu_s": th.get("copy", 0.0), "write_cpu_s": th.get("write", 0.0),
            "engine_cpu_s": caller + sum(th.values())}


def print_table(rounds, nbytes, modes):
    rows = [("raw dd conv=fdatasync (GB/s)", "raw_gbps", "{:.3f}"),
            ("torch.save + fsync (s)", "torch_save_s", "{:.3f}"),
            ("torch.save GB/s / raw GB/s", "torch_save_vs_raw", "{:.2f}")]
    rows = [r for r in rows if r[1] in rounds[0]]
    for m in modes:
        rows += [(f"[{m}] raw dd right before (GB/s)", f"{m}.raw_gbps", "{:.3f}"),
                 (f"[{m}] engine blocked, no overlap (s)", f"{m}.blocked_s", "{:.3f}"),
                 (f"[{m}] engine time to durable (s)", f"{m}.durable_s", "{:.3f}"),
                 (f"[{m}] engine GB/s to durable", f"{m}.engine_gbps", "{:.3f}"),
                 (f"[{m}] engine GB/s / raw GB/s", f"{m}.engine_vs_raw", "{:.2f}"),
                 (f"[{m}] engine CPU s per GB saved (process)", f"{m}.cpu_s_per_gb", "{:.3f}"),
                 (f"[{m}] . caller + engine threads", f"{m}.engine_cpu_s_per_gb", "{:.3f}"),
                 (f"[{m}] . . copy threads", f"{m}.copy_cpu_s_per_gb", "{:.3f}"),
                 (f"[{m}] . . writer threads", f"{m}.write_cpu_s_per_gb", "{:.3f}"),
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
    p.add_argument("--no-torch-save", action="store_true",
                   help="leave out the torch.save baseline (and its dd run): e.g. for CPU "
                        "comparisons of two engine versions")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the saved state lives")
    p.add_argument("--snapshot-only", action="store_true",
                   help="compare only the copy into host memory with plain torch copies")
    p.add_argument("--mapped-dir", default=None,
                   help="with --snapshot-only: also time the in-memory level's engine copying "
                        "into a reused shard file in this directory (on /dev/shm)")
    p.add_argument("--checksum-threads", type=int, default=None,
                   help="with --mapped-dir: the writers of the second in-memory engine timed "
                        "until durable (default: threads_for_device_copies of this machine's "
                        "cores for one rank)")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.snapshot_only:
        res = snapshot_bench(args)
        print_snapshot(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    state = make_state(int(args.size_gb * 1e9), args.tensors, args.device)
    nbytes = sum(t.nbytes for t in _tensors(state))
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
                with PeakRSS() as probe:
                    base = probe.peak
                target = os.path.join(args.dir, "engine_" + m.replace("/", "_"))
                e = engine_save(eng, state, target, r)
            e["engine_gbps"] = nbytes / e["durable_s"] / 1e9
            e["engine_vs_raw"] = e["engine_gbps"] / res[f"{m}.raw_gbps"]
            for k in ("cpu", "engine_cpu", "copy_cpu", "write_cpu"):
                e[f"{k}_s_per_gb"] = e[f"{k}_s"] / (nbytes / 1e9)
            e["peak_rss_ratio"] = e["peak_rss"] / nbytes
            e["extra_rss_ratio"] = (e["peak_rss"] - base) / nbytes
            e["peak_cache_ratio"] = e["peak_cache_bytes"] / nbytes
            res.update({f"{m}.{k}": v for k, v in e.items()})
        if not args.no_torch_save:
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
