"""--ckpt-verify-replicas (issue 33): no false alarms on honest runs, and what a verified save costs.

    python benchmarks/replica_check_bench.py                  # both parts
    python benchmarks/replica_check_bench.py --part alarms    # 200 verified saves only
    python benchmarks/replica_check_bench.py --part cost --rounds 3

Part "alarms": honest runs of the tiny GPT with a save every iteration, every save verified:
DP2 and DP3, each with and without the distributed optimizer, and DP2 with --bf16 and the
distributed optimizer (40 saves each, 200 in all). Every save must commit; any refused version or
replica warning is a false alarm.

Part "cost": the 27M GPT (about 108 MB of fp32 parameters per replica), DP2 on this machine, a
save every iteration, verification off and on, interleaved per round (these machines are noisy:
ratios within a round are the result). Per variant: mean `elapsed time per iteration (ms)` after
the first --skip iterations, and the mean stall of a save as the checkpoint lines report it
(`stall (ms)`: the save call plus the wait before the next optimizer step, which now includes the
fingerprints). Then the CPU cost of the fingerprints alone: CPU seconds per GB of CRC-32C pieces on
one thread over a 256 MiB tensor, and of the device-side sum run on the CPU (what a GPU runs).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--vocab-size", "255"]
MODEL_27M = ["--num-layers", "6", "--hidden-size", "512", "--num-attention-heads", "8",
             "--seq-length", "256", "--max-position-embeddings", "256", "--vocab-size", "8192",
             "--micro-batch-size", "2"]
COMMON = ["--mock-data", "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine",
          "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "0",
          "--seed", "1234", "--async-lazy-save", "--save-interval", "1",
          "--keep-last-n-checkpoints", "2"]
_ITER = re.compile(r" iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+) \|")
_SAVE = re.compile(r" checkpoint iteration\s+(\d+) \|.*?stall \(ms\): ([\d.]+) \|.*committed: ")


def launch(nproc: int, args: List[str], save: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(REPO / "pretrain_gpt.py")] + args + ["--save", save]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{out.stdout[-3000:]}\n"
                         f"{out.stderr[-3000:]}")
    return out.stdout


def alarms(workdir: str, saves: int) -> bool:
    runs = [(2, []), (2, ["--use-distributed-optimizer"]), (3, []),
            (3, ["--use-distributed-optimizer"]), (2, ["--use-distributed-optimizer", "--bf16"])]
    total, ok = 0, True
    for k, (dp, extra) in enumerate(runs):
        out = launch(dp, TINY + COMMON + extra + [
            "--global-batch-size", str(2 * dp), "--train-iters", str(saves),
            "--ckpt-verify-replicas"], os.path.join(workdir, f"alarms{k}"))
        committed = len(_SAVE.findall(out))
        refused = out.count("replica check of iteration")
        total += committed
        print(f"DP{dp} {' '.join(extra) or '(plain optimizer)'}: {committed} verified saves "
              f"committed, {refused} refused", flush=True)
        ok &= committed == saves and refused == 0
    print(f"false alarms: {'none' if ok else 'SOME'} in {total} verified saves")
    return ok


def _timing(out: str, skip: int) -> Dict[str, float]:
    iters = [float(ms) for it, ms in _ITER.findall(out) if int(it) > skip]
    stalls = [float(ms) for it, ms in _SAVE.findall(out) if int(it) > skip]
    return {"iter_ms": statistics.mean(iters), "stall_ms": statistics.mean(stalls)}


def cost(workdir: str, rounds: int, iters: int, skip: int) -> None:
    variants = {"off": [], "verify": ["--ckpt-verify-replicas"]}
    results: Dict[str, List[Dict[str, float]]] = {v: [] for v in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for v in order:
            out = launch(2, MODEL_27M + COMMON + variants[v] + [
                "--global-batch-size", "4", "--train-iters", str(iters)],
                os.path.join(workdir, f"cost_{v}_{r}"))
            results[v].append(_timing(out, skip))
        off, on = results["off"][-1], results["verify"][-1]
        print(f"round {r + 1}: off {off['iter_ms']:.0f} ms/iter, stall {off['stall_ms']:.1f} ms; "
              f"verify {on['iter_ms']:.0f} ms/iter, stall {on['stall_ms']:.1f} ms; ratio "
              f"{on['iter_ms'] / off['iter_ms']:.3f}; added stall "
              f"{on['stall_ms'] - off['stall_ms']:+.1f} ms", flush=True)
    ratios = [b["iter_ms"] / a["iter_ms"] for a, b in zip(results["off"], results["verify"])]
    added = [b["stall_ms"] - a["stall_ms"] for a, b in zip(results["off"], results["verify"])]
    print(f"median iteration-time ratio verify/off: {statistics.median(ratios):.3f} "
          f"({', '.join(f'{x:.3f}' for x in ratios)}); median added stall per verified save: "
          f"{statistics.median(added):+.1f} ms")
    import torch

    from datastates.megatron_adapter.save.replica_check import fingerprint

    t = torch.randn(64 << 20)  # 256 MiB
    gb = t.numel() * 4 / 1e9
    for name, device_side in (("CRC-32C pieces (host)", False),
                              ("device-side sum, run on the CPU", True)):
        fingerprint(t, device_side)  # warm
        c0, w0 = time.thread_time(), time.perf_counter()
        fingerprint(t, device_side)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
        print(f"{name}: {cpu / gb:.3f} CPU s per GB ({wall / gb:.3f} s per GB wall)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["alarms", "cost", "both"], default="both")
    p.add_argument("--saves", type=int, default=40, help="verified saves per honest run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=14)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--workdir", default=None)
    a = p.parse_args(argv)
    workdir = a.workdir or tempfile.mkdtemp(prefix="replica_check_bench_")
    ok = True
    if a.part in ("alarms", "both"):
        ok = alarms(workdir, a.saves)
    if a.part in ("cost", "both"):
        cost(workdir, a.rounds, a.iters, a.skip)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
