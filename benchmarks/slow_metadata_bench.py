"""What a slow metadata server costs a persistent save: --save on a file system whose every
metadata operation waits --latency-ms, code versions side by side in one run.

    sudo python benchmarks/slow_metadata_bench.py --latency-ms 20
    sudo python benchmarks/slow_metadata_bench.py --latency-ms 20 --repos /tmp/old,.   # A/B
    sudo python benchmarks/slow_metadata_bench.py --latency-ms 20 --commit-ranks 64

On a parallel file system (Lustre, GPFS) creating, opening, listing, renaming or removing a file,
and looking one up, is a round trip to a metadata server; a checkpoint makes every rank do several
at the same moment, and a busy server answers in tens of milliseconds to seconds. Whatever the
training thread does of them is stall, and every rank waits behind the slowest at its next
collective. This benchmark mounts a pass-through FUSE file system over a directory of the local
disk (`SlowMetadata`: lookups, creations, opens, listings, renames, removals and truncations wait
--latency-ms first; reads and writes pass straight through) and trains the small GPT with
`--async-lazy-save` and --save on it, one process, mock data, in rounds that interleave:

  none        no checkpointing (the baseline of every ratio)
  REPO        each checkout in --repos (default: this one), --save every --save-interval

It prints, per variant, the mean iteration time after the first --skip iterations and its
median-of-rounds ratio to `none`, and the median stall per save that the checkpoint lines report
(save call + wait before the optimizer step, the first save excluded: it plans).

`--commit-ranks N` instead times the commit of one version of N ranks (`layout.try_commit`,
what rank 0's commit thread does once every rank is durable: each rank's marker and the index it
names are read and checked) on that file system, the markers read one after the other against
today's way, interleaved over --rounds.

Needs root, /dev/fuse, libfuse 2 (Debian: `apt-get install fuse libfuse2`) and `pip install
fusepy` in the Python that runs it. The file system is served by a child process of this
script (`--serve`) and unmounted at the end. The latency is a sleep: it emulates a server that
answers late, not one that is loaded by these calls.
"""
from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional

REPO = Path(__file__).resolve().parent.parent

SMALL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "1024",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--lr", "1e-4", "--min-lr", "1e-5",
         "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--log-interval", "1",
         "--eval-interval", "0", "--seed", "1234"]
_ITER = re.compile(r" iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+) \|")
_STALL = re.compile(r" checkpoint iteration\s+(\d+) \|.*? stall \(ms\): ([\d.]+) \|")


def serve(backing: str, mountpoint: str, latency_s: float) -> None:
    """The FUSE server (this script with --serve): pass-through to `backing`, metadata late."""
    from fuse import FUSE, FuseOSError, Operations

    def late(fn):
        def wrapped(self, path, *args):
            time.sleep(latency_s)
            return fn(self, path, *args)
        return wrapped

    class SlowMetadata(Operations):
        def _real(self, path: str) -> str:
            return os.path.join(backing, path.lstrip("/"))

        def __call__(self, op, path, *args):
            try:
                return super().__call__(op, path, *args)
            except OSError as err:  # the caller sees the backing file system's errno
                raise FuseOSError(err.errno or errno.EIO) from err

        @late
        def getattr(self, path, fh=None):
            st = os.lstat(self._real(path))
            return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid",
                                                "st_size", "st_atime", "st_mtime", "st_ctime",
                                                "st_blocks")}

        @late
        def readdir(self, path, fh):
            return [".", ".."] + os.listdir(self._real(path))

        @late
        def mkdir(self, path, mode):
            os.mkdir(self._real(path), mode)

        @late
        def rmdir(self, path):
            os.rmdir(self._real(path))

        @late
        def unlink(self, path):
            os.unlink(self._real(path))

        @late
        def rename(self, old, new):
            os.rename(self._real(old), self._real(new))

        @late
        def link(self, target, source):
            os.link(self._real(source), self._real(target))

        @late
        def truncate(self, path, length, fh=None):
            os.truncate(self._real(path), length)

        @late
        def create(self, path, mode, fi=None):
            return os.open(self._real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        @late
        def open(self, path, flags):
            return os.open(self._real(path), flags & ~getattr(os, "O_DIRECT", 0))

        def chmod(self, path, mode):
            os.chmod(self._real(path), mode)

        def utimens(self, path, times=None):
            os.utime(self._real(path), times)

        def statfs(self, path):
            st = os.statvfs(self._real(path))
            return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize",
                                                "f_favail", "f_ffree", "f_files", "f_flag",
                                                "f_frsize", "f_namemax")}

        def read(self, path, size, offset, fh):
            return os.pread(fh, size, offset)

        def write(self, path, data, offset, fh):
            return os.pwrite(fh, data, offset)

        def fsync(self, path, datasync, fh):
            os.fsync(fh)

        def flush(self, path, fh):
            return 0

        def release(self, path, fh):
            os.close(fh)

    FUSE(SlowMetadata(), mountpoint, foreground=True, nothreads=False, big_writes=True,
         max_write=1 << 20)


@contextmanager
def mounted(backing: Path, mountpoint: Path, latency_ms: float) -> Iterator[None]:
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(backing), str(mountpoint),
                               str(latency_ms / 1e3)])
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mountpoint):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the FUSE server did not mount {mountpoint} (needs root, "
                                 "/dev/fuse, libfuse 2 and fusepy)")
            time.sleep(0.1)
        yield
    finally:
        subprocess.run(["fusermount", "-u", str(mountpoint)], check=False)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def run(repo: Optional[Path], iters: int, skip: int, save: Path, interval: int) -> Dict:
    """One training run (repo None: no checkpointing); its mean iteration time after `skip`
    and its saves' stalls but the first."""
    cwd = repo or REPO
    args = [sys.executable, str(cwd / "pretrain_gpt.py"), *SMALL, "--train-iters", str(iters)]
    if repo is not None:
        args += ["--async-lazy-save", "--save", str(save), "--save-interval", str(interval),
                 "--keep-last-n-checkpoints", "2"]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0")
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"run failed ({args}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    times = [float(ms) for it, ms in _ITER.findall(out.stdout) if int(it) > skip]
    stalls = [float(ms) for it, ms in _STALL.findall(out.stdout)][1:]
    return {"iter_ms": statistics.mean(times), "stall_ms": stalls}


def commit_times(ranks: int, latency_ms: float, rounds: int, out: Optional[str]) -> None:
    """--commit-ranks: `try_commit` of a version of `ranks` ranks (tiny shards, written to the
    local disk first) on the slow mount, markers read serially against concurrently."""
    sys.path.insert(0, str(REPO))
    import torch

    from datastates import CheckpointEngine, CommitPolicy, EngineConfig, layout

    work = Path(tempfile.mkdtemp(prefix="slowmeta-", dir=out))
    backing, mnt = work / "backing", work / "mnt"
    backing.mkdir()
    mnt.mkdir()
    version = backing / "iter_0000005"
    concurrent_from = layout._SERIAL_MARKERS
    times: Dict[str, List[float]] = {"one after the other": [], "concurrently": []}
    try:
        for r in range(ranks):
            with CheckpointEngine(EngineConfig(rank=r, world_size=ranks, host_cache_bytes=1 << 20,
                                               commit_policy=CommitPolicy.MANUAL)) as eng:
                eng.wait_for_durable(eng.save({"x": torch.full((4,), float(r))}, str(version), 5))
        with mounted(backing, mnt, latency_ms):
            for rnd in range(rounds):
                order = list(times) if rnd % 2 == 0 else list(reversed(times))
                for name in order:
                    layout._SERIAL_MARKERS = 1 << 30 if name == "one after the other" \
                        else concurrent_from
                    (version / layout.COMMIT_FILE).unlink(missing_ok=True)
                    t0 = time.perf_counter()
                    if not layout.try_commit(str(mnt / version.name), ranks):
                        raise SystemExit("the version did not commit")
                    times[name].append(time.perf_counter() - t0)
    finally:
        layout._SERIAL_MARKERS = concurrent_from
        shutil.rmtree(work, ignore_errors=True)
    serial = statistics.median(times["one after the other"])
    print(f"commit of {ranks} ranks, metadata latency {latency_ms:g} ms, {rounds} rounds:")
    for name, xs in times.items():
        print(f"  markers read {name:20s} median {statistics.median(xs):7.2f} s  "
              f"({', '.join(f'{x:.2f}' for x in xs)})  "
              f"{serial / statistics.median(xs):5.1f}x")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", nargs=3, metavar=("BACKING", "MOUNTPOINT", "LATENCY_S"),
                   help=argparse.SUPPRESS)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--repos", default=str(REPO),
                   help="comma-separated checkouts to compare (each runs its own pretrain_gpt.py)")
    p.add_argument("--iters", type=int, default=24)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="where the backing directory goes (a local disk)")
    p.add_argument("--commit-ranks", type=int, default=0, metavar="N",
                   help="time the commit of a version of N ranks instead of training")
    a = p.parse_args(argv)
    if a.serve:
        serve(a.serve[0], a.serve[1], float(a.serve[2]))
        return 0
    if a.commit_ranks:
        commit_times(a.commit_ranks, a.latency_ms, a.rounds, a.out)
        return 0
    repos = [Path(r).resolve() for r in a.repos.split(",")]
    names = ["none"] + [str(r) for r in repos]
    work = Path(tempfile.mkdtemp(prefix="slowmeta-", dir=a.out))
    backing, mnt = work / "backing", work / "mnt"
    backing.mkdir()
    mnt.mkdir()
    results: Dict[str, List[Dict]] = {n: [] for n in names}
    try:
        with mounted(backing, mnt, a.latency_ms):
            for rnd in range(a.rounds):
                order = names[rnd % len(names):] + names[:rnd % len(names)]
                for name in order:
                    repo = None if name == "none" else Path(name)
                    save = mnt / f"r{rnd}-{len(results[name])}-{abs(hash(name)) % 10000}"
                    r = run(repo, a.iters, a.skip, save, a.save_interval)
                    results[name].append(r)
                    print(f"round {rnd} {name}: {r['iter_ms']:.1f} ms per iteration, stall "
                          f"median {statistics.median(r['stall_ms']) if r['stall_ms'] else 0:.1f}"
                          f" ms over {len(r['stall_ms'])} saves", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nmetadata latency {a.latency_ms:g} ms, --save every {a.save_interval} iteration(s), "
          f"{a.rounds} rounds of {a.iters} iterations (the first {a.skip} excluded)")
    print(f"{'variant':50s} {'ms/iter':>8s} {'ratio':>6s} {'stall ms':>9s}")
    for name in names:
        rs = results[name]
        ratios = [r["iter_ms"] / base["iter_ms"] for r, base in zip(rs, results["none"])]
        stalls = [s for r in rs for s in r["stall_ms"]]
        print(f"{name[-50:]:50s} {statistics.mean(r['iter_ms'] for r in rs):8.1f} "
              f"{statistics.median(ratios):6.3f} "
              f"{statistics.median(stalls) if stalls else 0.0:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
