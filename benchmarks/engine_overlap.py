"""End-to-end benchmark: a training-like loop with a checkpoint after every update.

Usage:
  python benchmarks/engine_overlap.py [--dir DIR] [--size-gb 1.0] [--iters 4] [--compute-s 1.6]
                                      [--json out.json] [--paired N] [--matmuls M]
                                      [--device cpu|cuda]

Each iteration: a read-only compute phase (matmuls, ~compute-s seconds, like forward/backward),
then an in-place update of the whole state (like optimizer.step), then a checkpoint. Variants, in
this order: no checkpoint, torch.save + fsync (synchronous), DataStates engine (save after the
update, wait_for_snapshot before the next update). Reports end-to-end time and how much the compute
phase slowed down, since on 2 cores background work competes with compute.

With `--device cuda` the state lives on the GPU and the compute phase is bf16 4096x4096 matmuls on
the GPU, timed with a synchronize at its end: what it measures is whether the engine's
device-to-host copies, its host threads (GIL) and the writes slow down a GPU training loop.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import threading
import time

import torch

from datastates import CheckpointEngine, EngineConfig
from datastates.universal.sink import Sink


DEVICE = torch.device("cpu")  # set by main() from --device


def make_state(total_bytes: int, n: int = 64) -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i:03d}": torch.randn(total_bytes // 4 // n, generator=g).to(DEVICE)
            for i in range(n)}


def _matrix() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if DEVICE.type == "cuda":
        return torch.randn(4096, 4096, generator=g).to(DEVICE, torch.bfloat16)
    return torch.randn(1024, 1024, generator=g)


def calibrate(compute_s: float) -> int:
    compute(5)  # warm-up (cuBLAS handles, clocks)
    per = compute(20) / 20
    return max(1, int(compute_s / per))


def compute(n: int) -> float:
    a = _matrix()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        a @ a
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
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


class BareCopyWrite:
    """The least any checkpoint of `state` does, in one background thread: memmove each tensor
    into a preallocated page-aligned buffer (on CUDA: one device-to-host copy per tensor on a side
    stream into the same buffer, page-locked), then write the buffer in 64 MiB pieces and fsync
    (no checksum, no index, no commit) through the universal writer's `Sink`: O_DIRECT straight
    from the buffer's memory, buffered where the file system refuses it. Its compute slowdown is
    the floor the engine's is compared with."""

    def __init__(self, state: dict, path: str):
        self.state, self.path = state, path
        self.nbytes = sum(t.nbytes for t in state.values())
        size = -(-self.nbytes // (64 << 20)) * (64 << 20)
        self.thread = None
        if DEVICE.type == "cuda":  # page-locked and page-aligned (cudaHostAlloc)
            self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self.stream = torch.cuda.Stream()
            return
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # as the engine's host cache
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.buf = torch.frombuffer(self._map, dtype=torch.uint8)

    def _run(self) -> None:
        off = 0
        if DEVICE.type == "cuda":
            self.stream.wait_stream(torch.cuda.default_stream())  # the update before it
            with torch.cuda.stream(self.stream):
                for t in self.state.values():
                    self.buf[off:off + t.nbytes].copy_(t.view(-1).view(torch.uint8),
                                                       non_blocking=True)
                    off += t.nbytes
            self.stream.synchronize()
        else:
            base = self.buf.data_ptr()
            for t in self.state.values():
                ctypes.memmove(base + off, t.data_ptr(), t.nbytes)
                off += t.nbytes
        sink = Sink(self.path)
        try:
            for o in range(0, self.buf.numel(), 64 << 20):
                sink.write(self.buf[o:o + (64 << 20)])
        except BaseException:
            sink.abort()
            raise
        sink.close()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        os.unlink(self.path)


def paired(state: dict, pairs: int, n_mm: int, root: str, cache: int, nice: int) -> dict:
    """Compute phases with nothing in the background and with a save in the background,
    alternately; the same around a bare copy + O_DIRECT write of the state (BareCopyWrite)."""
    out = {k: [] for k in ("idle_s", "busy_s", "snapshot_wait_s", "idle2_s", "bare_s")}
    bare = BareCopyWrite(state, os.path.join(root, "bare.bin"))
    with CheckpointEngine(EngineConfig(host_cache_bytes=cache, background_nice=nice)) as eng:
        for it in range(pairs):
            eng.wait_for_durable()
            out["idle_s"].append(compute(n_mm))
            update(state)
            eng.save(state, os.path.join(root, f"engine_{it}"), step=it)
            out["busy_s"].append(compute(n_mm))
            t0 = time.perf_counter()
            eng.wait_for_snapshot()
            out["snapshot_wait_s"].append(time.perf_counter() - t0)
            update(state)
            eng.wait_for_durable()
            out["idle2_s"].append(compute(n_mm))
            bare.start()
            out["bare_s"].append(compute(n_mm))
            bare.join()
    for name in os.listdir(root):
        shutil.rmtree(os.path.join(root, name))
    out["slowdown"] = [b / a - 1 for a, b in zip(out["idle_s"], out["busy_s"])]
    out["bare_slowdown"] = [b / a - 1 for a, b in zip(out["idle2_s"], out["bare_s"])]
    out["median_slowdown"] = statistics.median(out["slowdown"])
    out["median_bare_slowdown"] = statistics.median(out["bare_slowdown"])
    return out


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
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the state lives and the compute phase runs (see above)")
    args = p.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
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
        print(f"compute phase, nothing in the background: median "
              f"{statistics.median(res['idle_s']):.3f} s; with a save in the background: "
              f"{statistics.median(res['busy_s']):.3f} s; slowdown median "
              f"{100 * res['median_slowdown']:+.1f}% (pairs: "
              + ", ".join(f"{100 * x:+.1f}%" for x in res["slowdown"]) + "); wait_for_snapshot "
              f"after it: median {1000 * statistics.median(res['snapshot_wait_s']):.1f} ms")
        print(f"floor, a bare {'device-to-host copy' if DEVICE.type == 'cuda' else 'memmove'}"
              f" + O_DIRECT write of the state in the background: slowdown "
              f"median {100 * res['median_bare_slowdown']:+.1f}% (pairs: "
              + ", ".join(f"{100 * x:+.1f}%" for x in res["bare_slowdown"]) + ")")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(res, state_bytes=nbytes, matmuls=n_mm, device=args.device,
                               load_before=load_before,
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
