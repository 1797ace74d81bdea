"""Benchmark: how fast the universal merge is against the disk, and what it costs a training run.

Usage:
  python benchmarks/universal_merge_bench.py [--dir DIR] [--gib 1] [--rounds 3] [--workers 2]
         [--pairs 3] [--iters 40] [--save-interval 5] [--hidden 384] [--layers 4] [--nproc 2]
         [--json out.json]

1) Merge vs dd: a committed `--gib` GiB DataStates checkpoint (2 ranks) is merged by persistent
   merge workers at normal priority (one worker, then `--workers` in parallel), its files evicted
   from the page cache before each merge (the engine drops them after its fsync, so a background
   merge reads from disk), alternated with `dd if=/dev/zero bs=16M conv=fsync` of the same size in
   the same directory, with oflag=direct too, and with oflag=direct from a file of random bytes
   in /dev/shm (the virtual disk stores zeros faster than data) (A B A B ...: this machine's
   speed drifts).
   Printed: merge GB/s (bytes of the universal checkpoint / the merge's own seconds: reading,
   checksums, writing, fsyncs), its CPU seconds per GB, dd GB/s and the ratios (median over
   rounds), with the load average before and after. Each worker's first merge (it pays the
   imports a persistent worker pays once per run) runs before the rounds, timed apart.
2) Training cost: each pair runs pretrain_gpt.py twice with the same model, data and
   --async-lazy-save interval: without and with --universal-checkpoint-interval 1 (every committed
   checkpoint merged by the nice'd, idle-I/O background worker). Pairs alternate their order
   (without, with; then with, without; ...: A B B A, so a drift of the machine's speed does not
   favour one variant); the slowdown is the ratio of mean iteration times within a pair, and the
   median over the pairs (at least 3 for a median that one outlier cannot move) is printed. Iteration 1
   (warm-up) is left out. Per merge: its own seconds and GB/s, and the wall time from the commit
   to the merge's answer (`process (s)`: the wait for CPU at low priority, plus the worker's
   start-up for the first merge of the run).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ITER = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")


def model_args(a) -> list:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", "8", "--seq-length", "128", "--max-position-embeddings", "128",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-4",
            "--mock-data", "--vocab-size", "8000", "--log-interval", "1", "--eval-interval", "0",
            "--train-iters", str(a.iters), "--use-distributed-optimizer",
            "--async-lazy-save", "--save-interval", str(a.save_interval),
            "--keep-last-n-checkpoints", "1000"]


def run(a, save: str, universal: bool) -> dict:
    shutil.rmtree(save, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={a.nproc}", os.path.join(REPO, "pretrain_gpt.py")] + model_args(a) + \
        ["--save", save] + (["--universal-checkpoint-interval", "1"] if universal else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    times = {int(m.group(1)): float(m.group(2)) for m in _ITER.finditer(out.stdout)}
    steady = [ms for it, ms in times.items() if it > 1]
    merges = []
    jsonl = os.path.join(save, "universal", "universal_merges.jsonl")
    if universal and os.path.exists(jsonl):
        merges = [json.loads(x) for x in open(jsonl)]
    process_s = [float(m.group(1)) for m in re.finditer(r"process \(s\): ([\d.]+)", out.stdout)]
    return {"universal": universal, "mean_iter_ms": statistics.mean(steady),
            "median_iter_ms": statistics.median(steady), "wall_s": wall, "merges": merges,
            "merge_process_s": process_s}


def synthetic_source(directory: str, gib: float) -> str:
    """A committed 2-rank DataStates checkpoint of `gib` GiB (weights and Adam state of stacked
    [4, 2048, 1024] fp32 layers, split over the ranks as TP splits columns), written by the real
    engine (tests/universal_fixtures.py). Returns its iter_ directory."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    sys.path.insert(0, REPO)
    import torch
    from universal_fixtures import write_datastates_checkpoint

    shape = (4, 2048, 1024)
    per_key = 4 * 4 * shape[0] * shape[1] * shape[2]  # weight + param + exp_avg + exp_avg_sq
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(max(1, round(gib * (1 << 30) / per_key))):
        key = f"decoder.layers.k{i}.weight"
        for kind in ("", "param.", "exp_avg.", "exp_avg_sq."):
            name = key if not kind else f"optimizer.state.{kind}{key}"
            tensors[name] = torch.randn(shape, generator=g)
    src = os.path.join(directory, "iter_0000005")
    shutil.rmtree(directory, ignore_errors=True)
    write_datastates_checkpoint(src, tensors)
    return src


def evict(directory: str) -> None:
    """Drop `directory`'s files from the page cache (the engine does so after its fsync: a
    background merge reads its source from disk)."""
    for base, _, names in os.walk(directory):
        for n in names:
            fd = os.open(os.path.join(base, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dd_gbps(directory: str, nbytes: int, direct: bool = False, source: str = "/dev/zero") -> float:
    """The disk's write bandwidth as `dd` measures it: `nbytes` of `source` (zeros by default),
    conv=fsync (through the page cache, or with oflag=direct when `direct`)."""
    path = os.path.join(directory, "dd.bin")
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={source}", f"of={path}", "bs=16M", f"count={nbytes >> 24}",
                    "conv=fsync"] + (["oflag=direct"] if direct else []), check=True,
                   capture_output=True)
    wall = time.perf_counter() - t0
    os.unlink(path)
    return (nbytes >> 24 << 24) / wall / 1e9


def merge_vs_dd(a) -> dict:
    """Merges of a >= 1 GiB checkpoint by persistent workers at normal priority (1 worker, and
    `--workers` when more than 1), alternated with dd (A B A B: this machine's speed drifts)."""
    sys.path.insert(0, REPO)
    from datastates.megatron_adapter import BackgroundMerger, MergerConfig

    work = os.path.join(a.dir, "alone")
    src = synthetic_source(os.path.join(work, "src"), a.gib)
    nbytes = sum(os.path.getsize(os.path.join(b, n)) for b, _, ns in os.walk(src) for n in ns)
    out: dict = {"source_bytes": nbytes, "dir": work, "load_before": os.getloadavg()}
    # dd of zeros can overstate what the disk gives data: this virtual disk stored zeros faster
    # in back-to-back pairs (O_DIRECT, 512 MiB: 0.43-0.84 GB/s against 0.28-0.52 for random
    # bytes). A checkpoint is not zeros, so dd also writes random bytes from memory (tmpfs).
    random_src = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else work,
                              f"merge_bench_random.{os.getpid()}")
    with open(random_src, "wb") as f:
        for _ in range(0, nbytes, 16 << 20):
            f.write(os.urandom(16 << 20))
    counts = sorted({1, a.workers})
    mergers = {k: BackgroundMerger(MergerConfig(os.path.join(work, f"u{k}"), nice=0, idle_io=False,
                                                workers=k), log=lambda line: None)
               for k in counts}
    for k, merger in mergers.items():  # the run's first merge also imports torch & co.
        evict(src)
        merger.on_commit(10 ** 6, src)
        merger.drain()
        out[f"first_merge_s_{k}w"] = merger.results[-1]["seconds"]
        shutil.rmtree(merger.results[-1]["directory"], ignore_errors=True)
    rounds = []
    for r in range(a.rounds):
        row = {"dd_gbps": dd_gbps(work, nbytes), "dd_direct_gbps": dd_gbps(work, nbytes, True),
               "dd_direct_random_gbps": dd_gbps(work, nbytes, True, random_src)}
        for k, merger in mergers.items():
            evict(src)
            shutil.rmtree(merger.output_dir(r), ignore_errors=True)
            merger.on_commit(r, src)
            merger.drain()
            m = merger.results[-1]
            row[f"merge_gbps_{k}w"] = m["gbps"]
            row[f"merge_s_{k}w"] = m["seconds"]
            if k == 1:  # CPU seconds per GB: what a loaded machine's scheduler must grant
                row["merge_cpu_s_per_gb_1w"] = m["cpu_s"] / (m["bytes"] / 1e9)
            shutil.rmtree(m["directory"], ignore_errors=True)
        rounds.append(row)
        print(json.dumps({"round": r, **row}), flush=True)
    for merger in mergers.values():
        merger.wait()
    out.update(rounds=rounds, load_after=os.getloadavg(),
               worker_starts={k: m.worker_starts for k, m in mergers.items()},
               dd_gbps=statistics.median(x["dd_gbps"] for x in rounds),
               dd_direct_gbps=statistics.median(x["dd_direct_gbps"] for x in rounds),
               dd_direct_random_gbps=statistics.median(x["dd_direct_random_gbps"]
                                                       for x in rounds))
    os.unlink(random_src)
    for k in counts:
        out[f"merge_gbps_{k}w"] = statistics.median(x[f"merge_gbps_{k}w"] for x in rounds)
        out[f"ratio_{k}w"] = statistics.median(x[f"merge_gbps_{k}w"] / x["dd_gbps"]
                                               for x in rounds)
        out[f"ratio_direct_random_{k}w"] = statistics.median(
            x[f"merge_gbps_{k}w"] / x["dd_direct_random_gbps"] for x in rounds)
        out[f"ratio_direct_{k}w"] = statistics.median(x[f"merge_gbps_{k}w"] / x["dd_direct_gbps"]
                                                      for x in rounds)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/universal_bench")
    p.add_argument("--pairs", type=int, default=3, help="training pairs, alternating their "
                   "order (0: merge vs dd only)")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--gib", type=float, default=1.0, help="size of the merge-vs-dd checkpoint")
    p.add_argument("--rounds", type=int, default=3, help="dd / merge alternations")
    p.add_argument("--workers", type=int, default=2, help="parallel merge workers also timed")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    alone = merge_vs_dd(a)
    results = []
    for i in range(a.pairs):
        pair = {}
        for universal in ((False, True) if i % 2 == 0 else (True, False)):
            r = run(a, os.path.join(a.dir, f"run{i}_{int(universal)}"), universal)
            pair["with" if universal else "without"] = r
            print(json.dumps({"pair": i, **{k: v for k, v in r.items() if k != "merges"},
                              "merges": len(r["merges"])}), flush=True)
        pair["slowdown"] = pair["with"]["mean_iter_ms"] / pair["without"]["mean_iter_ms"]
        results.append(pair)
    merges = [m for pair in results for m in pair["with"]["merges"] if m.get("bytes")]
    summary = {
        "config": vars(a),
        "slowdown_per_pair": [round(p["slowdown"], 4) for p in results],
        "median_slowdown": round(statistics.median(p["slowdown"] for p in results), 4)
        if results else None,
        "mean_iter_ms_without": [round(p["without"]["mean_iter_ms"], 1) for p in results],
        "mean_iter_ms_with": [round(p["with"]["mean_iter_ms"], 1) for p in results],
        "merges_during_training": len(merges),
        "merge_bytes": merges[0]["bytes"] if merges else 0,
        "merge_s_median": statistics.median(m["seconds"] for m in merges) if merges else None,
        "merge_gbps_median": statistics.median(m["gbps"] for m in merges) if merges else None,
        "merge_process_s_median": statistics.median(
            s for p in results for s in p["with"]["merge_process_s"]) if merges else None,
        "merge_vs_dd": alone,
    }
    print(json.dumps(summary, indent=1))
    for k in sorted({1, a.workers}):
        print(f"merge alone: {alone[f'merge_gbps_{k}w']:.3f} GB/s with {k} worker(s); dd "
              f"oflag=direct of random bytes {alone['dd_direct_random_gbps']:.3f} GB/s, of zeros "
              f"{alone['dd_direct_gbps']:.3f}: ratio {alone[f'ratio_direct_random_{k}w']:.2f} and "
              f"{alone[f'ratio_direct_{k}w']:.2f} (median of {a.rounds} alternated rounds)")
    if results:
        print(f"training slowdown with merges: median {summary['median_slowdown']:.3f}x over "
              f"{len(results)} alternating pairs {summary['slowdown_per_pair']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
