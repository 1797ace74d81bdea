"""Peer transfer speed (issue 31): a rank's shard files sent to its peer the way peer replicas and
their restore send them, against a plain torch.distributed send/recv of the same bytes on the
same group, in the same run.

    python benchmarks/peer_transfer_bench.py --mib 512 --rounds 3

Two gloo processes on this machine (loopback: what "the network" is here). Rank 0 holds a
shard file of --mib MiB plus its index and marker under a directory in /dev/shm (the memory
level's files); each round, alternating the order, (a) `peer_replica._transfer` streams them to
rank 1, which stores them in its own directory, and (b) rank 0 sends a tensor of the same size
with `dist.send` and rank 1 receives it with `dist.recv` (no file on either side). Prints each
round's GB/s and the ratio (a)/(b), and the median ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _worker(rank: int, port: int, base: str, mib: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from datastates import layout
    from datastates.megatron_adapter.levels.peer_replica import (
        _Incoming, _outgoing, _transfer, _write_files)

    src = os.path.join(base, "src")
    nbytes = mib << 20
    if rank == 0:
        shard = os.urandom(1 << 20) * mib
        index = json.dumps({"rank": 0}).encode()
        marker = dict(layout.format_header(), index=layout.index_file(0), rank=0, world_size=2,
                      index_crc32=zlib.crc32(index), step=1)
        _write_files(src, 0, [shard, index, json.dumps(marker).encode()])
    dist.barrier()
    sizes = [os.path.getsize(os.path.join(src, n(0))) for n in
             (layout.shard_file, layout.index_file, layout.rank_marker_file)]
    rows = []
    for r in range(rounds):
        result = {}
        for what in (("files", "plain") if r % 2 == 0 else ("plain", "files")):
            dst = os.path.join(base, f"dst{r}")
            dist.barrier()
            t0 = time.perf_counter()
            if what == "files":
                if rank == 0:
                    _transfer({(1, 0): _outgoing(src, 0)}, {})
                else:
                    _transfer({}, {(0, 0): _Incoming(dst, 0, sizes)})
            else:
                t = torch.empty(nbytes, dtype=torch.uint8)
                if rank == 0:
                    dist.send(t, 1)
                else:
                    dist.recv(t, 0)
            dist.barrier()
            result[what] = time.perf_counter() - t0
            shutil.rmtree(dst, ignore_errors=True)
        rows.append(result)
    if rank == 1:
        with open(out, "w") as f:
            json.dump({"rows": rows, "bytes": nbytes}, f)
    dist.barrier()
    os._exit(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="peer_transfer_", dir="/dev/shm" if os.path.isdir("/dev/shm")
                            else None)
    out = os.path.join(base, "result.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_worker, args=(port, base, a.mib, a.rounds, out), nprocs=2,
                           start_method="spawn")
        result = json.load(open(out))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    gb = result["bytes"] / 1e9
    ratios = []
    for k, row in enumerate(result["rows"]):
        ratio = row["plain"] / row["files"]
        ratios.append(ratio)
        print(f"round {k + 1}: peer files {gb / row['files']:.2f} GB/s, plain send/recv "
              f"{gb / row['plain']:.2f} GB/s, ratio {ratio:.2f}")
    print(f"median ratio (peer transfer / plain send/recv): {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
