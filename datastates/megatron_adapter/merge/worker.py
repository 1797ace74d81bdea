"""The persistent merge worker: ``python -m datastates.megatron_adapter.merge.worker``.

Started once per training run by `BackgroundMerger` (low priority; one interpreter and one torch
import per run instead of one per merge). It reads one JSON request per line on stdin and answers
each with one JSON line on stdout, in order; everything else it prints goes to stderr (its log):

  {"id": 1, "op": "merge", "source": DIR, "output": DIR, "root": ROOT, "max_file_bytes": N,
   "max_bytes_per_s": R}            the whole merge, committed (merge.run_merge)
  {"id": 2, "op": "part", "source": DIR, "tmp": DIR, "part": k, "parts": P, "max_file_bytes": N,
   "max_bytes_per_s": R, "create": false}  part k of a parallel merge of P parts
                                    (universal.parts.write_part; create: make tmp if missing)
  {"id": 3, "op": "commit", "source": DIR, "output": DIR, "tmp": DIR, "parts": P, "nodes": N,
   "root": ROOT, "max_file_bytes": N, "started": T}  commit the P durable parts
                                    (universal.parts.commit_parts)

  answer: {"id": ..., "ok": true, "result": {...}, "line": "..."} or {"id": ..., "ok": false,
  "error": "..."}

It exits when stdin closes (the trainer finished or closed it) and when its parent dies: the
trainer sets PR_SET_PDEATHSIG before exec, and a watchdog thread exits when the parent process
changes (covers a parent thread that exits while the process lives on). Killed mid-request it
leaves only a temporary directory (writer.py, parts.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
import traceback

from ...errors import CheckpointError
from ...universal.parts import commit_parts, write_part
from .run import log_line, record, run_merge
from .sources import open_source


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)  # orphaned: the trainer is gone, nothing waits for this merge
        time.sleep(0.5)


def handle(req: dict) -> dict:
    op = req.get("op")
    size = dict(max_file_bytes=int(req.get("max_file_bytes", 2 << 30)))
    if op == "merge":
        r = run_merge(req["source"], req["output"], req.get("root"),
                      max_bytes_per_s=req.get("max_bytes_per_s"), **size)
        return {"result": r.to_json(), "line": log_line(r)}
    source = open_source(req["source"], allow_unsafe_pickle=bool(req.get("allow_unsafe_pickle")))
    try:
        if op == "part":
            t0 = time.perf_counter()
            n = write_part(source, req["tmp"], int(req["part"]), int(req["parts"]),
                           max_bytes_per_s=req.get("max_bytes_per_s"),
                           create=bool(req.get("create", True)), **size)
            return {"result": {"bytes": n, "seconds": time.perf_counter() - t0}}
        if op == "commit":
            r = commit_parts(source, req["tmp"], req["output"], int(req["parts"]), **size)
            if "started" in req and not r.skipped:  # the whole parallel merge, not this step
                r = dataclasses.replace(r, seconds=time.time() - float(req["started"]))
            if req.get("root"):
                record(req["root"], r, req["source"], parts=int(req["parts"]),
                       nodes=int(req.get("nodes", 1)))
            return {"result": r.to_json(), "line": log_line(r)}
    finally:
        source.close()
    raise ValueError(f"unknown op {op!r}: expected merge, part or commit")


def serve(inp, out) -> int:
    for line in inp:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            reply = dict(handle(req), ok=True)
        except CheckpointError as err:
            reply = {"ok": False, "error": str(err)}
        except Exception as err:  # reported, and the worker serves the next request
            traceback.print_exc(file=sys.stderr)
            reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        print(f"merge worker: {req.get('op')} {req.get('source')}: "
              f"{reply.get('line') or reply.get('error') or 'done'}", file=sys.stderr, flush=True)
        out.write(json.dumps(dict(reply, id=req.get("id"))) + "\n")
        out.flush()
    return 0


def main() -> int:
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to the log, not replies
    return serve(sys.stdin, out)


if __name__ == "__main__":
    sys.exit(main())
