"""Benchmark: what the background universal merge costs a training run, and how fast it merges.

Usage:
  python benchmarks/universal_merge_bench.py [--dir DIR] [--pairs 2] [--iters 40] [--save-interval 5]
                                             [--hidden 384] [--layers 4] [--nproc 2] [--json out.json]

Each pair runs pretrain_gpt.py twice with the same model, data and --async-lazy-save interval:
without and with --universal-checkpoint-interval 1 (every committed checkpoint merged by a nice'd
background process). Variants alternate (A B A B ...) because this machine's speed drifts; the
slowdown is the ratio of mean iteration times within a pair, then the median over pairs.
Iteration 1 (warm-up) is left out. Per merge: the merge's own seconds and GB/s from its JSON line,
plus the process wall time (interpreter start-up included). Finally one merge is timed alone on
the idle machine, for the merge's throughput without contention.
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


def merge_alone(save: str) -> dict:
    """The newest checkpoint of `save`, merged again into a fresh directory on the idle machine."""
    it = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    out_dir = os.path.join(save, "alone")
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "datastates.megatron_adapter.merge", "--source",
           os.path.join(save, f"iter_{it:07d}"), "--output", out_dir]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(out.stdout + out.stderr)
    return dict(json.loads(out.stdout.splitlines()[-1]), process_s=wall)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/universal_bench")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    results = []
    for i in range(a.pairs):
        pair = {}
        for universal in (False, True):
            r = run(a, os.path.join(a.dir, f"run{i}_{int(universal)}"), universal)
            pair["with" if universal else "without"] = r
            print(json.dumps({"pair": i, **{k: v for k, v in r.items() if k != "merges"},
                              "merges": len(r["merges"])}), flush=True)
        pair["slowdown"] = pair["with"]["mean_iter_ms"] / pair["without"]["mean_iter_ms"]
        results.append(pair)
    alone = merge_alone(os.path.join(a.dir, f"run{a.pairs - 1}_1"))
    merges = [m for pair in results for m in pair["with"]["merges"] if m.get("bytes")]
    summary = {
        "config": vars(a),
        "slowdown_per_pair": [round(p["slowdown"], 4) for p in results],
        "median_slowdown": round(statistics.median(p["slowdown"] for p in results), 4),
        "mean_iter_ms_without": [round(p["without"]["mean_iter_ms"], 1) for p in results],
        "mean_iter_ms_with": [round(p["with"]["mean_iter_ms"], 1) for p in results],
        "merges_during_training": len(merges),
        "merge_bytes": merges[0]["bytes"] if merges else 0,
        "merge_s_median": statistics.median(m["seconds"] for m in merges) if merges else None,
        "merge_gbps_median": statistics.median(m["gbps"] for m in merges) if merges else None,
        "merge_process_s_median": statistics.median(
            s for p in results for s in p["with"]["merge_process_s"]) if merges else None,
        "merge_alone": alone,
    }
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
