"""DeepSpeed's default torch.save checkpoint engine against ours (DeepSpeed's own
DataStatesCheckpointEngine on `datastates`), same model, same run, interleaved rounds.

    python benchmarks/deepspeed_engine_bench.py                       # 2 ranks, ZeRO-1, 3 rounds
    python benchmarks/deepspeed_engine_bench.py --zero-stage 2 --hidden 1024 --layers 8

Each round launches examples/deepspeed/train_zero.py under torchrun (DS_ACCELERATOR=cpu, gloo) once
per engine, saving every --save-interval steps into a fresh directory. Per engine it reports:
- the stall per save: the `save_checkpoint` call plus what the next optimizer step waited for the
  snapshot (the example's `save stall (ms)` column; 0 wait for torch.save, which is synchronous);
- the mean step time of steps without a save, and of steps with one;
- end-to-end: first step to the last file durable (DeepSpeed's `destroy()`, which drains ours).
Ratios are ours / torch within the same round (these machines are noisy; the median is the result).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "deepspeed" / "train_zero.py"
_STEP = re.compile(r"^step (\d+)/ \d+ \| loss: \S+ \| step time \(ms\): (\S+) \| save stall "
                   r"\(ms\): (\S+)", re.M)
_DONE = re.compile(r"^done \| train time \(s\): (\S+) \| end-to-end incl\. drain \(s\): (\S+)",
                   re.M)


def run_once(engine: str, args, workdir: str) -> Dict[str, float]:
    save = os.path.join(workdir, f"ckpt_{engine}")
    shutil.rmtree(save, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", str(EXAMPLE), "--engine", engine,
           "--zero-stage", str(args.zero_stage), "--steps", str(args.steps),
           "--save", save, "--save-interval", str(args.save_interval),
           "--hidden", str(args.hidden), "--layers", str(args.layers), "--batch", str(args.batch),
           "--host-cache-gib", str(args.host_cache_gib)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True,
                         timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(f"{engine} run failed (rc {out.returncode}):\n{out.stdout[-3000:]}\n"
                         f"{out.stderr[-3000:]}")
    steps = [(int(s), float(t), float(st)) for s, t, st in _STEP.findall(out.stdout)]
    done = _DONE.search(out.stdout)
    if not steps or done is None:
        raise SystemExit(f"{engine}: no step lines:\n{out.stdout[-3000:]}")
    saves = [st for s, _, st in steps if s % args.save_interval == 0]
    # A save's stall is its call plus the wait at the next step (reported on that step's line).
    stall = [st + next((w for s2, _, w in steps if s2 == s + 1), 0.0)
             for s, _, st in steps if s % args.save_interval == 0]
    plain = [t for s, t, _ in steps if s % args.save_interval not in (0, 1) and s > 2]
    with_save = [t for s, t, _ in steps if s % args.save_interval in (0, 1) and s > 2]
    size = sum(f.stat().st_size for f in Path(save).rglob("*") if f.is_file()) / max(
        1, len(saves))
    shutil.rmtree(save, ignore_errors=True)
    return {"stall_ms": statistics.mean(stall), "step_ms": statistics.mean(plain),
            "save_step_ms": statistics.mean(with_save), "end_to_end_s": float(done.group(2)),
            "bytes_per_save": size}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--host-cache-gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="ds_engine_bench_")
    params = args.layers * (8 * args.hidden ** 2 + 7 * args.hidden) + args.hidden ** 2 + args.hidden
    print(f"model: {args.layers} blocks, hidden {args.hidden}: {params / 1e6:.1f}M parameters; "
          f"{args.nproc} ranks, ZeRO-{args.zero_stage}, save every {args.save_interval} of "
          f"{args.steps} steps; directory {workdir}", flush=True)
    ratios: Dict[str, List[float]] = {"stall_ms": [], "end_to_end_s": []}
    for r in range(args.rounds):
        order = ("torch", "datastates") if r % 2 == 0 else ("datastates", "torch")
        res = {e: run_once(e, args, workdir) for e in order}
        for e in ("torch", "datastates"):
            m = res[e]
            print(f"round {r + 1} {e:10s} | stall per save (ms): {m['stall_ms']:8.1f} | step "
                  f"(ms): {m['step_ms']:7.1f} | step with save (ms): {m['save_step_ms']:8.1f} | "
                  f"end-to-end (s): {m['end_to_end_s']:6.2f} | MB per save: "
                  f"{m['bytes_per_save'] / 1e6:7.1f}", flush=True)
        for k in ratios:
            ratios[k].append(res["datastates"][k] / max(res["torch"][k], 1e-9))
        print(f"round {r + 1} ours/torch | stall {ratios['stall_ms'][-1]:.3f}x | end-to-end "
              f"{ratios['end_to_end_s'][-1]:.3f}x", flush=True)
    print(f"median ours/torch over {args.rounds} rounds | stall per save "
          f"{statistics.median(ratios['stall_ms']):.3f}x | end-to-end "
          f"{statistics.median(ratios['end_to_end_s']):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
