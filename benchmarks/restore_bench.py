"""Restore time by source, and the work a failure costs with and without --save-interval auto.

    python benchmarks/restore_bench.py --config 117m --out runs/restore_bench
    python benchmarks/restore_bench.py --config small          # quick

Two "nodes" on this machine (two torchrun agents, one rank each, data parallel with the
distributed optimizer) train the GPT with --async-lazy-save --lazy-save-peer-replica and
--save-interval auto, then resume the final checkpoint six ways, same run, alternated over
--rounds:

- memory: both nodes' memory copies (/dev/shm) intact;
- peer: node 1's memory copy deleted (a lost node, replaced): its rank gets its shards from node
  0 over the process group, then reads them from memory;
- survivor: node 1 lost with its memory, the same command restarted on node 0 alone (DP1): node
  0 reads its own shards and node 1's replica from its memory, nothing over the network;
- survivor_shared: the same restart on node 0 alone from --save (no copy anywhere), page cache
  dropped first; the survivor's baseline;
- local: the copies on the machine's disk instead of /dev/shm (`--lazy-save-local-dir` on disk),
  page cache dropped first (as root: /proc/sys/vm/drop_caches);
- shared: no copy anywhere, every shard from --save, page cache dropped first.

Per scenario: the slowest rank's `load-checkpoint` time (the trainer's `checkpoint load` line:
the whole restore, common state included), the bytes each source gave (the `restore` telemetry
event) and the peer transfer time. Then, from the costs the training run measured (the
`checkpoint interval` lines: checkpoint cost C to the loop, undisturbed iteration time t), the
expected work lost per failure and the total overhead for a few MTBF values M, for fixed
intervals and for auto's Daly interval, with the measured memory and shared restore times R:

    per failure: interval/2 + R        overhead: C / interval + (interval/2 + R) / M

(computed from measured costs, not measured failures). Ratios, not absolute times, are the
result: these machines are noisy.

`--throttle-read-mbps N` (root) emulates the shared file system a whole job restores from: the
benchmark and every run it starts go into a cgroup v1 blkio group reading at most N MiB/s from
the disk under --out (`benchmarks/blkio.py`; the page cache is dropped before the local and shared
restores, so their reads reach the disk). Memory and peers (/dev/shm) are not throttled; the
"local" copy sits on the same disk here, so it is throttled too (a node's NVMe would not be).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.blkio import Throttle  # noqa: E402
from benchmarks.checkpoint_compare import COMMON, CONFIGS  # noqa: E402
from megatron.training.checkpointing.save_interval import optimal_compute_seconds  # noqa: E402

_LOAD = re.compile(r" checkpoint load \| iteration\s+\d+ \| bytes read: (\d+) \| time \(s\): "
                   r"([\d.]+) \|")
_DECISION = re.compile(r" checkpoint interval \|.*? checkpoint cost \(s\): (\S+) \|.*? "
                       r"iteration time \(s\): (\S+) \|.*? set by: (\S+) \|")
_RECEIVED = re.compile(r"received saved rank \d+'s shards from peer rank \d+: [\d.]+ MiB in "
                       r"([\d.]+) s")


#: Restores, alternated in this order every round: both nodes again (memory; peer: node 1's
#: memory lost; local; shared), then node 0 alone at DP1 (survivor: node 1 lost, node 0 reads its
#: own shards and node 1's replica from its memory; survivor_shared: the same restart from --save).
SCENARIOS = ("memory", "peer", "survivor", "survivor_shared", "local", "shared")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(args: List[str], logs: Path, timeout: float, nnodes: int = 2) -> List[str]:
    """`nnodes` torchrun agents of one job (one rank each); their stdout, node 0 first."""
    logs.mkdir(parents=True, exist_ok=True)
    port, procs = _port(), []
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
               f"--node-rank={node}", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=restore-bench",
               str(REPO / "pretrain_gpt.py")] + args
        out = open(logs / f"node{node}.out", "w")
        procs.append((subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=out,
                                       stderr=subprocess.STDOUT), out))
    for proc, out in procs:
        proc.wait(timeout=timeout)
        out.close()
        if proc.returncode != 0:
            raise SystemExit(f"a node failed ({proc.returncode}); see {logs}")
    return [(logs / f"node{n}.out").read_text() for n in range(nnodes)]


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def restore_event(save: Path) -> dict:
    lines = (save / "datastates_checkpoints.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if '"restore"' in x][-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--iters", type=int, default=10, help="training iterations before restoring")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "runs" / "restore_bench"))
    p.add_argument("--memory", default="/dev/shm/datastates-restore-bench",
                   help="memory directory (one subdirectory per node)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--throttle-read-mbps", type=int, default=None,
                   help="MiB/s the disk under --out gives the restores (root, cgroup v1 blkio)")
    a = p.parse_args()
    out, memory = Path(a.out), Path(a.memory)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(memory, ignore_errors=True)
    out.mkdir(parents=True)
    throttle = Throttle(out, a.throttle_read_mbps, "read") if a.throttle_read_mbps else None
    try:
        run(a, out, memory, throttle)
    finally:
        if throttle is not None:
            throttle.close()


def run(a, out: Path, memory: Path, throttle) -> None:
    save = out / "save"
    base = CONFIGS[a.config] + COMMON + ["--micro-batch-size", "2",  # global batch 4 over DP2

        "--use-distributed-optimizer", "--train-iters", str(a.iters), "--async-lazy-save",
        "--lazy-save-peer-replica", "--save", str(save), "--load", str(save)]
    train = run_nodes(base + ["--save-interval", "auto", "--mtbf-hours", "1",
                              "--lazy-save-local-dir", str(memory / "node{node}")],
                      out / "train", a.timeout)
    decisions = _DECISION.findall(train[0])
    if not decisions or decisions[-1][0] == "n/a":
        raise SystemExit("the training run measured no checkpoint cost: raise --iters")
    cost, iteration_s = float(decisions[-1][0]), float(decisions[-1][1])
    disk = out / "disk_copy"
    shutil.copytree(memory, disk)
    times: Dict[str, List[float]] = {}
    detail: Dict[str, dict] = {}
    dropped = True
    for r in range(a.rounds):
        for scenario in SCENARIOS:
            local = {"memory": memory, "peer": memory, "survivor": memory, "local": disk,
                     "shared": out / "no_copy", "survivor_shared": out / "no_copy"}[scenario]
            if scenario == "memory" and not (memory / "node1").exists():
                shutil.copytree(disk / "node1", memory / "node1")  # lost in the last round
            if scenario in ("peer", "survivor"):  # node 1 lost, its memory too
                shutil.rmtree(memory / "node1", ignore_errors=True)
            if scenario in ("local", "shared", "survivor_shared"):
                dropped = drop_caches() and dropped
            logs = run_nodes(base + ["--save-interval", "1000",
                                     "--lazy-save-local-dir", str(local / "node{node}")],
                             out / f"{scenario}{r}", a.timeout,
                             nnodes=1 if scenario.startswith("survivor") else 2)
            m = _LOAD.search(logs[0])
            times.setdefault(scenario, []).append(float(m.group(2)))
            event = restore_event(save)
            detail[scenario] = {
                "bytes_read_calls": int(m.group(1)),
                "peer_transfer_s": [float(x) for x in _RECEIVED.findall(logs[-1])],
                "ranks": event["ranks"]}
            shutil.rmtree(out / "no_copy", ignore_errors=True)
    shared_s = statistics.median(times["shared"])
    print(f"\nrestore of iteration {a.iters} ({a.config}, 2 nodes x 1 rank), median of "
          f"{a.rounds} round(s); page cache {'dropped' if dropped else 'NOT dropped (not root)'} "
          "before local and shared; disk reads " + (
              f"throttled to {a.throttle_read_mbps} MiB/s (blkio, device {throttle.device})"
              if throttle is not None else "not throttled"))
    print("vs shared: against the restore from --save at the same layout (shared at DP2, "
          "survivor_shared at DP1)")
    print(f"{'source':15s} {'load (s)':>9s} {'vs shared':>10s} {'peer B':>10s} "
          f"{'memory B':>10s} {'shared B':>10s} {'read() B':>13s}")
    for scenario, ts in times.items():
        d, t = detail[scenario], statistics.median(ts)
        base_s = statistics.median(times["survivor_shared" if scenario.startswith("survivor")
                                         else "shared"])
        col = {k: sum(v[k] for v in d["ranks"].values())
               for k in ("peer_bytes", "local_bytes", "shared_bytes")}
        print(f"{scenario:15s} {t:9.3f} {t / base_s:9.2f}x {col['peer_bytes']:10d} "
              f"{col['local_bytes']:10d} {col['shared_bytes']:10d} "
              f"{d['bytes_read_calls']:13d}")
    memory_s = statistics.median(times["memory"])
    print(f"\nexpected lost work per failure, from measured costs (checkpoint cost C = {cost:.4f} s "
          f"to the loop, iteration {iteration_s:.3f} s; restore R from memory {memory_s:.2f} s, "
          f"from shared {shared_s:.2f} s):")
    print(f"{'MTBF (h)':>8s} {'interval':>16s} {'lost/failure (s)':>17s} {'overhead':>9s}")
    rows = []
    for mtbf_h in (1.0, 4.0, 24.0):
        m_s = mtbf_h * 3600
        auto = max(iteration_s, optimal_compute_seconds(cost, m_s))
        for label, interval_s, restore in (
                ("100 it (shared)", 100 * iteration_s, shared_s),
                ("1000 it (shared)", 1000 * iteration_s, shared_s),
                (f"auto {round(auto / iteration_s)} it (mem)", auto, memory_s)):
            lost = interval_s / 2 + restore
            overhead = cost / interval_s + lost / m_s
            rows.append({"mtbf_h": mtbf_h, "interval": label, "interval_s": interval_s,
                         "lost_per_failure_s": lost, "overhead": overhead})
            print(f"{mtbf_h:8.0f} {label:>16s} {lost:17.1f} {overhead * 100:8.3f}%")
    (out / "restore_bench.json").write_text(json.dumps({
        "config": a.config, "times_s": times, "detail": detail, "cost_s": cost,
        "iteration_s": iteration_s, "caches_dropped": dropped, "lost_work": rows}, indent=2))
    shutil.rmtree(memory, ignore_errors=True)


if __name__ == "__main__":
    main()
