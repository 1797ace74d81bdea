"""The in-memory level against a slow shared file system, side by side in one run (issue 30).

    sudo python benchmarks/memory_level_bench.py --throttle-mbps 100     # the issue's setting
    python benchmarks/memory_level_bench.py --config small --iters 6      # quick, no throttle

Variants, each training the same GPT (one process, mock data, same seed):
  none        no checkpointing: the baseline every ratio is over
  memory      --non-persistent-ckpt-type in_memory every iteration (each node's /dev/shm) and
              --save every --persistent-interval iterations (latest wins while one is in flight)
  every_iter  --async-lazy-save --save-interval 1 to the same disk (what was there before)

Time per iteration is the mean of Megatron's `elapsed time per iteration (ms)` over the iterations
after the first --skip (start-up and the first save's planning excluded); the final drain at exit
is reported apart (end to end minus the last logged iteration). The lag of a persistent
checkpoint is the training iteration at which its commit line was printed minus its own
iteration; deferred persistent saves are counted from their log lines.

The slow disk (root only): the kernel's block throttling (cgroup v1 blkio), which throttles
O_DIRECT and fsync'd writes alike and leaves tmpfs (/dev/shm) alone:
    mkdir /sys/fs/cgroup/blkio/NAME
    echo "MAJ:MIN BYTES_PER_S" > /sys/fs/cgroup/blkio/NAME/blkio.throttle.write_bps_device
    echo $PID > /sys/fs/cgroup/blkio/NAME/cgroup.procs     # children inherit it
with MAJ:MIN the device that holds --out (`lsblk -no MAJ:MIN`; this script takes it from
os.stat). `--throttle-mbps` does this for the benchmark process (and so every run it starts),
and removes the group at the end. Ratios, not absolute times, are the result: these machines are
noisy; variants run interleaved (order rotated per round).
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
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.blkio import Throttle  # noqa: E402

CONFIGS = {
    # ~27M parameters, ~300 MB per checkpoint (fp32 weights + two Adam moments + grads' buffers).
    "27m": ["--num-layers", "6", "--hidden-size", "512", "--num-attention-heads", "8",
            "--seq-length", "256", "--max-position-embeddings", "256", "--vocab-size", "8192",
            "--micro-batch-size", "4", "--global-batch-size", "4"],
    "small": ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
              "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "1024",
              "--micro-batch-size", "2", "--global-batch-size", "2"],
}
COMMON = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--lr", "1e-4", "--min-lr", "1e-5",
          "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--log-interval", "1",
          "--eval-interval", "0", "--seed", "1234"]
_ITER = re.compile(r" iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+) \|")
_COMMIT = re.compile(r" checkpoint iteration\s+(\d+) \|.* committed: (\S+)")


def variant_args(name: str, save: Path, persistent_interval: int) -> List[str]:
    if name == "none":
        return []
    if name == "memory":
        return ["--save", str(save), "--save-interval", str(persistent_interval),
                "--async-lazy-save", "--non-persistent-ckpt-type", "in_memory",
                "--non-persistent-save-interval", "1", "--keep-last-n-checkpoints", "2"]
    return ["--save", str(save), "--save-interval", "1", "--async-lazy-save",
            "--keep-last-n-checkpoints", "2"]


def run(name: str, config: str, iters: int, skip: int, save: Path,
        persistent_interval: int) -> Dict:
    shutil.rmtree(save, ignore_errors=True)
    cmd = [sys.executable, str(REPO / "pretrain_gpt.py")] + CONFIGS[config] + COMMON + [
        "--train-iters", str(iters)] + variant_args(name, save, persistent_interval)
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    iter_ms: Dict[int, float] = {}
    lags: List[int] = []
    current, t_last = 0, None
    deferred = 0
    tail: List[str] = []
    log = open(str(save) + ".log", "w")  # each run's output, beside its --save
    for line in proc.stdout:
        log.write(line)
        tail = (tail + [line])[-40:]
        m = _ITER.search(line)
        if m:
            current, t_last = int(m.group(1)), time.perf_counter()
            iter_ms[current] = float(m.group(2))
        m = _COMMIT.search(line)
        if m and m.group(2).startswith(str(save) + os.sep):
            lags.append(current - int(m.group(1)))
        if line.startswith("deferred the persistent save"):
            deferred += 1
    rc = proc.wait()
    end = time.perf_counter()
    log.close()
    shutil.rmtree(save, ignore_errors=True)
    if rc != 0:
        raise SystemExit(f"{name} failed (rc={rc}):\n" + "".join(tail))
    steady = [v for it, v in iter_ms.items() if it > skip]
    return {"variant": name, "iter_ms": statistics.mean(steady), "iters_timed": len(steady),
            "drain_at_exit_s": end - (t_last or end), "e2e_s": end - t0,
            "persistent_commits": len(lags), "persistent_lag_max": max(lags, default=None),
            "persistent_lag_mean": statistics.mean(lags) if lags else None,
            "deferred": deferred}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="27m")
    ap.add_argument("--iters", type=int, default=22)
    ap.add_argument("--skip", type=int, default=2, help="first iterations left out of the mean")
    ap.add_argument("--persistent-interval", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", default="none,memory,every_iter")
    ap.add_argument("--throttle-mbps", type=int, default=None,
                    help="MiB/s the disk under --out takes (root, cgroup v1 blkio)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "memory_level_bench")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    throttle = Throttle(a.out, a.throttle_mbps) if a.throttle_mbps else None
    variants = a.variants.split(",")
    results = []
    try:
        for rnd in range(a.rounds):
            k = rnd % len(variants)
            for name in variants[k:] + variants[:k]:
                r = run(name, a.config, a.iters, a.skip, a.out / f"{name}_r{rnd}",
                        a.persistent_interval)
                r["round"] = rnd
                results.append(r)
                print(json.dumps(r), flush=True)
    finally:
        if throttle is not None:
            throttle.close()
    base = statistics.mean(r["iter_ms"] for r in results if r["variant"] == "none") \
        if "none" in variants else None
    disk = (f"{a.throttle_mbps} MiB/s (blkio, device {throttle.device})" if throttle
            else "not throttled")
    print(f"\n{a.config} GPT, {a.iters} iterations (mean over iterations > {a.skip}), "
          f"disk {disk}, --save every {a.persistent_interval} with the in-memory level")
    print(f"{'variant':<11} {'ms/iter':>9} {'x none':>7} {'per round (x none)':>24} "
          f"{'drain (s)':>9} {'lag max':>7} {'lag mean':>8} {'commits':>7} {'deferred':>8}")
    for name in variants:
        rs = [r for r in results if r["variant"] == name]
        ms = statistics.mean(r["iter_ms"] for r in rs)
        # Same-round ratios (the machine drifts between rounds); their median is the figure.
        rounds = [r["iter_ms"] / n["iter_ms"] for r in rs for n in results
                  if n["variant"] == "none" and n["round"] == r["round"]]
        per_round = ", ".join(f"{x:.3f}" for x in rounds)
        if rounds:
            per_round += f" (median {statistics.median(rounds):.3f})"
        lag_max = max((r["persistent_lag_max"] for r in rs if r["persistent_lag_max"] is not None),
                      default=None)
        lags = [r["persistent_lag_mean"] for r in rs if r["persistent_lag_mean"] is not None]
        print(f"{name:<11} {ms:>9.1f} {ms / base if base else float('nan'):>7.3f} "
              f"{per_round:>24} {statistics.mean(r['drain_at_exit_s'] for r in rs):>9.2f} "
              f"{'-' if lag_max is None else lag_max:>7} "
              f"{statistics.mean(lags) if lags else float('nan'):>8.1f} "
              f"{sum(r['persistent_commits'] for r in rs):>7} {sum(r['deferred'] for r in rs):>8}")
    (a.out / "results.json").write_text(json.dumps({"runs": results, "disk": disk}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
