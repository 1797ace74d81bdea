"""Side-by-side: no checkpointing vs Megatron's savers vs --async-lazy-save, one run, same disk.

    python benchmarks/checkpoint_compare.py --config 117m --iters 10 --out runs/bench
    python benchmarks/checkpoint_compare.py --config small --iters 10      # quick

Each variant trains the same GPT (same seed, mock data, one process) with a checkpoint after every
iteration; variants run interleaved (rotated order per round) so drifting disk/CPU speed hits all
of them. Per variant it reports: median stall per checkpoint (time the loop was blocked: the logged
save-call time, plus for --async-lazy-save the wait before the next optimizer step), median
iteration time and its excess over the no-checkpoint run, end-to-end time (training start to process
exit, so draining in-flight saves counts) over the no-checkpoint run, durable throughput against
`dd ... conv=fdatasync` measured in the same run, peak RSS of the process tree (RSS summed: pages
a forked writer shares copy-on-write are counted twice), and whether the checkpoint saved while the
next iteration ran holds exactly what torch_dist sync saved (stock megatron-core load, bit-exact).
The `io_floor` variant trains without checkpointing while a `dd` writes a checkpoint's worth of
bytes after every iteration: what the I/O alone costs the 2 compute cores, the floor for any saver
(add `--variants none,io_floor,async_lazy` to see how close ours gets); when it runs, every
variant's end-to-end and median iteration time are also printed over io_floor's (/floor, it/floor). `async_lazy_zlib`
(named explicitly) saves with zlib crc32 chunk checksums instead of crc32c: the checksum's cost.
`async_lazy_local` adds the node-local tier (--lazy-save-local-dir on --local-dir, a tmpfs by
default, standing in for a node's NVMe): its rows report the local-durable time (every rank's
shards on local storage) beside the shared-durable one (in --save, what the commit waits for).
Writes JSON and a bar-chart PNG (matplotlib, optional). Ratios, not absolute times, are the result:
these machines are noisy.
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
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import psutil

REPO = Path(__file__).resolve().parent.parent

CONFIGS = {
    # ~117M parameters; ~6 s per iteration on 2 cores.
    "117m": ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "256", "--max-position-embeddings", "256",
             "--micro-batch-size", "4", "--global-batch-size", "4", "--vocab-size", "8191"],
    # ~5M parameters: a quick check of the script and the savers.
    "small": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
              "--seq-length", "128", "--max-position-embeddings", "128",
              "--micro-batch-size", "4", "--global-batch-size", "4", "--vocab-size", "8191"],
}
COMMON = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--lr", "1e-4", "--min-lr", "1e-5",
          "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--log-interval", "1",
          "--eval-interval", "0", "--seed", "1234", "--hidden-dropout", "0",
          "--attention-dropout", "0"]
VARIANTS = {
    "none": [],
    "torch": ["--ckpt-format", "torch"],
    "torch_dist": ["--ckpt-format", "torch_dist"],
    "torch_dist_async": ["--ckpt-format", "torch_dist", "--async-save"],
    "async_lazy": ["--async-lazy-save"],
    # No checkpointing, but after every iteration a separate `dd` process writes a checkpoint's
    # worth of bytes (12 B per parameter: fp32 weights + two Adam moments) with O_DIRECT and
    # fdatasync. No copy, no checksum, no Python: the cost of the I/O alone on this machine, a
    # floor for any background saver that writes every iteration.
    "io_floor": [],
    # --async-lazy-save with zlib's crc32 per chunk (the default before crc32c): what the
    # checksum costs the training loop. Not run unless named in --variants.
    "async_lazy_zlib": ["--async-lazy-save", "--lazy-save-checksum", "crc32"],
    # --async-lazy-save with the node-local tier: durable on --local-dir first, then migrated to
    # --save in the background (the local directory is added per run).
    "async_lazy_local": ["--async-lazy-save"],
}
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "async_lazy_zlib"]
LAZY = ("async_lazy", "async_lazy_zlib", "async_lazy_local")  # saves log DataStates lines
_PARAMS = re.compile(r"GPT model: (\d+) parameters")
NO_SAVE = ("none", "io_floor")  # variants that run without --save
REFERENCE = "torch_dist"  # what the other dist_checkpointing variants must equal, bit for bit

_ITER = re.compile(r" iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                   r".*? lm loss: (\S+) \|")
_SAVED = re.compile(r"saved checkpoint at iteration\s+(\d+) .* in ([\d.]+) ms")
_LAZY = re.compile(r" checkpoint iteration\s+(\d+) \| bytes: (\d+) \| stall \(ms\): ([\d.]+) \| "
                   r"copy \(ms\): ([\d.]+) \| durable \(s\): ([\d.]+)"
                   r"(?:.*? local durable \(s\): ([\d.]+))?")


@dataclass
class Result:
    variant: str
    round: int
    e2e_s: float
    iter_ms: List[float]
    losses: Dict[int, str]
    stall_ms: List[float] = field(default_factory=list)
    durable_s: List[float] = field(default_factory=list)
    local_durable_s: List[float] = field(default_factory=list)
    ckpt_bytes: int = 0
    peak_rss_gb: float = 0.0
    consistent: Optional[bool] = None


def dd_bandwidth(directory: Path, gib: int = 1) -> float:
    """GB/s of a sequential write with fdatasync, the raw ceiling for any saver here."""
    target = directory / "dd.bin"
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=64M", f"count={16 * gib}",
                    "conv=fdatasync"], check=True, capture_output=True)
    dt = time.perf_counter() - t0
    target.unlink()
    return gib * (1 << 30) / dt / 1e9


class RssPeak(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root] + root.children(recursive=True)
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs
                                               if p.is_running()))
            except psutil.Error:
                pass
            self.stop.wait(0.2)


def run_variant(name: str, config: str, iters: int, work: Path, rnd: int,
                local_root: Optional[Path] = None) -> Result:
    save = work / f"{name}_r{rnd}"
    shutil.rmtree(save, ignore_errors=True)
    args = CONFIGS[config] + COMMON + ["--train-iters", str(iters)] + VARIANTS[name]
    local = None
    if name == "async_lazy_local":
        local = (local_root or work / "local") / f"{name}_r{rnd}"
        shutil.rmtree(local, ignore_errors=True)
        args += ["--lazy-save-local-dir", str(local)]
    if name not in NO_SAVE:
        # Keep two: the one saved while the last iteration ran is checked for consistency.
        args += ["--save", str(save), "--save-interval", "1", "--keep-last-n-checkpoints", "2"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(REPO / "pretrain_gpt.py")] + args, cwd=str(REPO),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rss = RssPeak(proc.pid)
    rss.start()
    lines, t_begin, floor = [], None, None
    for line in proc.stdout:
        lines.append(line)
        if t_begin is None and line.startswith("training from iteration"):
            t_begin = time.perf_counter()
        if name == "io_floor":
            m = _PARAMS.search(line)
            if m:
                floor = IoFloor(save, int(m.group(1)))
            elif _ITER.match(line):
                if floor is None:
                    proc.kill()
                    raise SystemExit("io_floor: the first iteration was logged before the "
                                     "'GPT model: N parameters' line; cannot size the writes")
                floor.on_iteration()
    proc.wait()
    if floor is not None:
        floor.drain()  # like a saver's end-of-training drain, it counts in end-to-end time
    t_end = time.perf_counter()
    rss.stop.set()
    rss.join()
    out = "".join(lines)
    if proc.returncode != 0 or t_begin is None:
        raise SystemExit(f"variant {name} failed (exit {proc.returncode}):\n{out[-3000:]}")
    res = Result(name, rnd, t_end - t_begin, [float(m.group(2)) for m in _ITER.finditer(out)],
                 {int(m.group(1)): m.group(3) for m in _ITER.finditer(out)},
                 peak_rss_gb=rss.peak / 1e9)
    if floor is not None:
        res.ckpt_bytes = floor.bytes
    if name in LAZY:
        for m in _LAZY.finditer(out):
            res.stall_ms.append(float(m.group(3)))
            res.durable_s.append(float(m.group(5)))
            if m.group(6) is not None:
                res.local_durable_s.append(float(m.group(6)))
            res.ckpt_bytes = int(m.group(2))
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)  # the tmpfs is small
    elif name not in NO_SAVE:
        res.stall_ms = [float(m.group(2)) for m in _SAVED.finditer(out)]
        res.ckpt_bytes = _dir_bytes(save / f"iter_{iters:07d}")
        if name in ("torch", "torch_dist"):  # synchronous: the save call ends durable-ish
            res.durable_s = [s / 1e3 for s in res.stall_ms]
    return res


class IoFloor:
    """For the io_floor variant: one `dd` per iteration writing a checkpoint's bytes (a dd still
    running when the next iteration ends is not doubled: like a saver, it falls behind)."""

    def __init__(self, save: Path, params: int):
        self.count = max(1, round(12 * params / (64 << 20)))  # 64 MiB blocks
        self.bytes = self.count * (64 << 20)
        save.mkdir(parents=True, exist_ok=True)
        self.target, self.proc = save / "floor.bin", None

    def on_iteration(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(["dd", "if=/dev/zero", f"of={self.target}", "bs=64M",
                                      f"count={self.count}", "oflag=direct", "conv=fdatasync"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def drain(self) -> None:
        if self.proc is not None:
            self.proc.wait()


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_consistency(results: List[Result], work: Path, iters: int) -> None:
    """The checkpoint of iteration iters-1 was saved while iteration `iters` updated the state:
    compare it, bit for bit, with torch_dist sync's (stock megatron load of every tensor)."""
    ref = {r.round: work / f"{REFERENCE}_r{r.round}" / f"iter_{iters - 1:07d}"
           for r in results if r.variant == REFERENCE}
    for r in results:
        if r.variant not in ("torch_dist_async",) + LAZY or r.round not in ref:
            continue
        mine = work / f"{r.variant}_r{r.round}" / f"iter_{iters - 1:07d}"
        check = subprocess.run([sys.executable, str(REPO / "tests" / "stock_load.py"),
                                str(ref[r.round]), str(mine)], capture_output=True, text=True,
                               env=dict(os.environ, PYTHONWARNINGS="ignore"))
        r.consistent = check.returncode == 0 and "MATCH" in check.stdout


def summarize(results: List[Result], dd_gbps: List[float]) -> Dict[str, Dict]:
    base = [r for r in results if r.variant == "none"]
    base_e2e = statistics.median(r.e2e_s for r in base)
    base_iter = statistics.median(x for r in base for x in r.iter_ms[1:])
    dd = statistics.median(dd_gbps)
    floor = [r for r in results if r.variant == "io_floor"]
    floor_e2e = statistics.median(r.e2e_s for r in floor) if floor else None
    floor_iter = (statistics.median(x for r in floor for x in r.iter_ms[1:]) if floor
                  else None)
    table = {}
    for name in VARIANTS:
        rs = [r for r in results if r.variant == name]
        if not rs:
            continue
        iter_ms = statistics.median(x for r in rs for x in r.iter_ms[1:])
        stall = [x for r in rs for x in r.stall_ms]
        durable = [x for r in rs for x in r.durable_s]
        local = [x for r in rs for x in r.local_durable_s]
        nbytes = max(r.ckpt_bytes for r in rs)
        gbps = nbytes / statistics.median(durable) / 1e9 if durable and nbytes else None
        consistent = {r.consistent for r in rs} - {None}
        table[name] = {
            "stall_ms_median": statistics.median(stall) if stall else 0.0,
            "stall_pct_of_iteration": (statistics.median(stall) / base_iter * 100) if stall else 0.0,
            "iteration_ms_median": iter_ms,
            "iteration_excess_ms": iter_ms - base_iter,
            "e2e_s": statistics.median(r.e2e_s for r in rs),
            "e2e_over_none": statistics.median(r.e2e_s for r in rs) / base_e2e,
            # Against what the I/O alone costs in the same run (None without io_floor).
            "e2e_over_io_floor": (statistics.median(r.e2e_s for r in rs) / floor_e2e
                                  if floor_e2e else None),
            "iteration_over_io_floor": iter_ms / floor_iter if floor_iter else None,
            "checkpoint_bytes": nbytes,
            "durable_gbps": gbps,
            "durable_over_dd": gbps / dd if gbps else None,
            "durable_s_median": statistics.median(durable) if durable else None,
            "local_durable_s_median": statistics.median(local) if local else None,
            "peak_rss_gb": max(r.peak_rss_gb for r in rs),
            "consistent": (consistent == {True}) if consistent else None,
        }
    return table


def print_table(table: Dict[str, Dict], dd: List[float]) -> None:
    print(f"\ndd conv=fdatasync: {', '.join(f'{x:.2f}' for x in dd)} GB/s; "
          f"load average {os.getloadavg()[0]:.2f}")
    hdr = (f"{'variant':18s} {'stall ms':>9s} {'% iter':>7s} {'iter ms':>8s} {'e2e s':>7s} "
           f"{'e2e/none':>8s} {'/floor':>6s} {'it/floor':>8s} {'GB/s':>6s} {'/dd':>5s} {'local s':>7s} {'shared s':>8s} "
           f"{'RSS GB':>7s} {'consistent':>10s}")
    print(hdr)
    for name, t in table.items():
        g = f"{t['durable_gbps']:.2f}" if t["durable_gbps"] else "n/a"
        f = f"{t['durable_over_dd']:.2f}" if t["durable_over_dd"] else "n/a"
        c = {True: "yes", False: "NO", None: "n/a"}[t["consistent"]]
        loc = "n/a" if t["local_durable_s_median"] is None else f"{t['local_durable_s_median']:.3f}"
        sh = "n/a" if t["durable_s_median"] is None else f"{t['durable_s_median']:.3f}"
        fl = "n/a" if t["e2e_over_io_floor"] is None else f"{t['e2e_over_io_floor']:.3f}"
        it = ("n/a" if t["iteration_over_io_floor"] is None
              else f"{t['iteration_over_io_floor']:.3f}")
        print(f"{name:18s} {t['stall_ms_median']:9.1f} {t['stall_pct_of_iteration']:7.2f} "
              f"{t['iteration_ms_median']:8.1f} {t['e2e_s']:7.2f} {t['e2e_over_none']:8.3f} "
              f"{fl:>6s} {it:>8s} "
              f"{g:>6s} {f:>5s} {loc:>7s} {sh:>8s} {t['peak_rss_gb']:7.2f} {c:>10s}")
    if "async_lazy_local" in table:
        t = table["async_lazy_local"]
        print(f"async_lazy_local: durable on local storage after {t['local_durable_s_median']:.3f}"
              f" s, under --save after {t['durable_s_median']:.3f} s (medians)")
    if "async_lazy" in table:
        for name, label in (("torch_dist", "torch_dist sync"),
                            ("torch_dist_async", "torch_dist --async-save")):
            if name in table:
                print(f"async_lazy end-to-end speed-up over {label}: "
                      f"{table[name]['e2e_s'] / table['async_lazy']['e2e_s']:.2f}x")


def plot(table: Dict[str, Dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    names = list(table)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    axes[0].bar(names, [table[n]["e2e_over_none"] for n in names], color="tab:blue")
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_title("end-to-end time / no checkpointing")
    axes[1].bar(names, [table[n]["stall_ms_median"] for n in names], color="tab:red")
    axes[1].set_title("median stall per checkpoint (ms)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--iters", type=int, default=10, help="iterations, a checkpoint after each")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default: all but "
                        f"async_lazy_zlib)")
    p.add_argument("--out", default="runs/checkpoint_compare", help="work dir (on the disk to test)")
    p.add_argument("--local-dir", default="/dev/shm/datastates_bench_local",
                   help="node-local directory of async_lazy_local (default: a tmpfs standing in "
                        "for NVMe)")
    a = p.parse_args(argv)
    variants = a.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown or "none" not in variants:
        p.error(f"--variants must include 'none' and only {sorted(VARIANTS)}; got {variants}")
    if a.iters < 3:
        p.error(f"--iters must be >= 3, got {a.iters}")
    work = Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    dd, results = [dd_bandwidth(work)], []
    for rnd in range(a.rounds):
        order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
        for name in order:
            r = run_variant(name, a.config, a.iters, work, rnd, Path(a.local_dir))
            print(f"round {rnd} {name:18s} e2e {r.e2e_s:7.2f} s  median iter "
                  f"{statistics.median(r.iter_ms[1:]):8.1f} ms", flush=True)
            results.append(r)
    dd.append(dd_bandwidth(work))
    losses = {r.variant: r.losses for r in results if r.round == 0}
    same_losses = all(v == losses["none"] for v in losses.values())
    check_consistency(results, work, a.iters)
    table = summarize(results, dd)
    print_table(table, dd)
    print(f"identical lm loss across variants: {'yes' if same_losses else 'NO'}")
    (work / "results.json").write_text(json.dumps(
        {"config": a.config, "iters": a.iters, "rounds": a.rounds, "dd_gbps": dd,
         "load_average": os.getloadavg(), "identical_losses": same_losses, "table": table,
         "runs": [asdict(r) for r in results]}, indent=1))
    plot(table, work / "results.png")
    for r in results:
        shutil.rmtree(work / f"{r.variant}_r{r.round}", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
