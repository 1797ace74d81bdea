"""End-to-end benchmark: a training-like loop with a checkpoint after every update.

Usage:
  python benchmarks/engine_overlap.py [--dir DIR] [--size-gb 1.0] [--iters 4] [--compute-s 1.6]
                                      [--json out.json] [--paired N] [--matmuls M]

Each iteration: a read-only compute phase (matmuls, ~compute-s seconds, like forward/backward),
then an in-place update of the whole state (like optimizer.step), then a checkpoint. Variants, in
this order: no checkpoint, torch.save + fsync (synchronous), DataStates engine (save after the
update, wait_for_snapshot before the next update). Reports end-to-end time and how much the compute
phase slowed down, since on 2 cores background work competes with compute.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch

from datastates import CheckpointEngine, EngineConfig


def make_state(total_bytes: int, n: int = 64) -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i:03d}": torch.randn(total_bytes // 4 // n, generator=g) for i in range(n)}


def calibrate(compute_s: float) -> int:
    a = torch.randn(1024, 1024)
    t0 = time.perf_counter()
    for _ in range(5):
        a @ a
    per = (time.perf_counter() - t0) / 5
    return max(1, int(compute_s / per))


def compute(n: int) -> float:
    a = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    for _ in range(n):
        a @ a
    return time.perf_counter() - t0


def update(state: dict) -> None:
    for t in state.values():
        t.add_(1e-3)


def run(variant: str, state: dict, iters: int, n_mm: int, root: str, cache: int,
        nice: int = 0) -> dict:
    comp = []
    t0 = time.perf_counter()
    if variant == "engine":
        with CheckpointEngine(EngineConfig(host_cache_bytes=cache, background_nice=nice)) as eng:
            t0 = time.perf_counter()
            for it in range(iters):
                comp.append(compute(n_mm))
                eng.wait_for_snapshot()
                update(state)
                eng.save(state, os.path.join(root, f"engine_{it}"), step=it)
                eng.poll()
            eng.wait_for_durable()
            total = time.perf_counter() - t0
    else:
        for it in range(iters):
            comp.append(compute(n_mm))
            update(state)
            if variant == "torch.save":
                with open(os.path.join(root, f"torch_{it}.pt"), "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
        total = time.perf_counter() - t0
    for name in os.listdir(root):
        path = os.path.join(root, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    return {"variant": variant, "total_s": total, "compute_s": sum(comp)}


def paired(state: dict, pairs: int, n_mm: int, root: str, cache: int, nice: int) -> dict:
    """Compute phases with the engine idle and with a save in the background, alternately."""
    idle, busy = [], []
    with CheckpointEngine(EngineConfig(host_cache_bytes=cache, background_nice=nice)) as eng:
        for it in range(pairs):
            eng.wait_for_durable()
            idle.append(compute(n_mm))
            update(state)
            eng.save(state, os.path.join(root, f"engine_{it}"), step=it)
            busy.append(compute(n_mm))
            eng.wait_for_snapshot()
            update(state)
        eng.wait_for_durable()
    for name in os.listdir(root):
        shutil.rmtree(os.path.join(root, name))
    ratios = [b / a - 1 for a, b in zip(idle, busy)]
    return {"idle_s": idle, "busy_s": busy, "slowdown": ratios,
            "median_slowdown": statistics.median(ratios)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default="/tmp/datastates_overlap")
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--compute-s", type=float, default=1.6)
    p.add_argument("--nice", type=int, default=10,
                   help="EngineConfig.background_nice for the engine variant")
    p.add_argument("--variants", default="none,torch.save,engine")
    p.add_argument("--matmuls", type=int, default=0,
                   help="matmuls per compute phase instead of calibrating to --compute-s (the "
                        "same work in runs to be compared, e.g. two engine versions)")
    p.add_argument("--paired", type=int, default=0,
                   help="instead of the variants: N pairs of compute phases, engine idle / engine "
                        "saving in the background (see above)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    state = make_state(int(args.size_gb * 1e9))
    nbytes = sum(t.nbytes for t in state.values())
    n_mm = args.matmuls or calibrate(args.compute_s)
    load_before = os.getloadavg()
    if args.paired:
        res = paired(state, args.paired, n_mm, args.dir, nbytes + (16 << 20), args.nice)
        print(f"state {nbytes / 1e9:.2f} GB, {args.paired} pairs of {n_mm} matmuls; engine "
              f"background_nice "
              f"{args.nice}; load avg before " + " ".join(f"{x:.2f}" for x in load_before)
              + ", after " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        print(f"compute phase, engine idle: median {statistics.median(res['idle_s']):.3f} s; "
              f"with a save in the background: {statistics.median(res['busy_s']):.3f} s; "
              f"slowdown median {100 * res['median_slowdown']:+.1f}% (pairs: "
              + ", ".join(f"{100 * x:+.1f}%" for x in res["slowdown"]) + ")")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(res, state_bytes=nbytes, matmuls=n_mm, load_before=load_before,
                               load_after=os.getloadavg()), f, indent=1)
        return
    results = [run(v, state, args.iters, n_mm, args.dir, nbytes + (16 << 20), args.nice)
               for v in args.variants.split(",")]
    base = results[0]
    print(f"state {nbytes / 1e9:.2f} GB, {args.iters} iterations, checkpoint every iteration; "
          f"engine background_nice {args.nice}; load avg before "
          + " ".join(f"{x:.2f}" for x in load_before) + ", after "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print("| variant | end-to-end (s) | vs no checkpoint | compute phase (s) | compute slowdown |")
    print("|---|---|---|---|---|")
    for r in results:
        r["vs_none"] = r["total_s"] / base["total_s"]
        r["compute_slowdown"] = r["compute_s"] / base["compute_s"] - 1
        print(f"| {r['variant']} | {r['total_s']:.2f} | {r['vs_none']:.2f}x | {r['compute_s']:.2f} "
              f"| {100 * r['compute_slowdown']:+.0f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_bytes": nbytes, "iters": args.iters, "results": results,
                       "load_before": load_before, "load_after": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
