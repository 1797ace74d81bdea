"""Draw a PNG timeline of training iterations and checkpoint phases from --async-lazy-save telemetry.

    python tools/plot_checkpoint_timeline.py SAVE_DIR/datastates_checkpoints.jsonl -o timeline.png

One panel per training run in the file (a resumed run appends to the same telemetry), then the
stall of every checkpoint in milliseconds on its own axis. Rows of a panel: iterations
(alternating shades between consecutive iteration ends), and per checkpoint the
time training was blocked, the snapshot copy, the flush until every rank was durable, and the
commit. With --lazy-save-local-dir the flush ends when every rank is durable on node-local
storage, and a "migrate" row runs from there until every rank is durable under --save. Needs
matplotlib (`pip install matplotlib`).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Tuple


def read_events(path: str) -> Tuple[List[Dict], List[Dict]]:
    """(iterations, checkpoints); a run's "start" event is kept among the iterations."""
    iterations, checkpoints = [], []
    try:
        f = open(path)
    except OSError as e:
        raise SystemExit(f"error: cannot read {path}: {e.strerror}; expected the "
                         "datastates_checkpoints.jsonl written under --save by --async-lazy-save")
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path}:{lineno}: not a JSON line ({e.msg})")
            kind = rec.get("event")
            if kind in ("iteration", "start"):
                iterations.append(rec)
            elif kind == "checkpoint":
                checkpoints.append(rec)
    if not any(r["event"] == "iteration" for r in iterations) and not checkpoints:
        raise SystemExit(f"error: {path} holds no 'iteration' or 'checkpoint' events; expected the "
                         "datastates_checkpoints.jsonl written under --save by --async-lazy-save")
    return iterations, checkpoints


def phases(iterations: List[Dict], checkpoints: List[Dict]) -> Dict[str, List[Tuple[float, float]]]:
    """Bars (start, width) per row, in seconds from the first event."""
    times = [r["time"] for r in iterations] + [c["t_start"] for c in checkpoints]
    t0 = min(times)
    rows: Dict[str, List[Tuple[float, float]]] = {"iterations": [], "blocked": [], "copy": [],
                                                  "flush": [], "migrate": [], "commit": []}
    for prev, cur in zip(iterations, iterations[1:]):
        rows["iterations"].append((prev["time"] - t0, cur["time"] - prev["time"]))
    for c in checkpoints:
        start = c["t_start"] - t0
        copy_s, durable_s = c["copy_ms"] / 1e3, c["durable_s"]
        rows["blocked"].append((start, c["stall_ms"] / 1e3))
        rows["copy"].append((start, copy_s))
        local_s = c.get("local_durable_s")  # None: no node-local tier
        flushed_s = durable_s if local_s is None else local_s
        rows["flush"].append((start + copy_s, max(0.0, flushed_s - copy_s)))
        if local_s is not None:
            rows["migrate"].append((start + local_s, max(0.0, durable_s - local_s)))
        rows["commit"].append((c["time"] - t0, 0.0))
    return rows


def split_runs(iterations: List[Dict], checkpoints: List[Dict]) -> List[Tuple[List, List]]:
    """One (iterations, checkpoints) pair per training run in the file: a resumed run appends to
    the same telemetry, after a "start" event (files written before there was one: a run starts
    again at or before an iteration already seen)."""
    runs: List[Tuple[List, List]] = []
    starts: List[float] = []
    new_run, starts_at = True, None
    for rec in iterations:
        if rec["event"] == "start":
            new_run = True
            starts_at = rec["time"]
            continue
        if not new_run and rec["iteration"] <= runs[-1][0][-1]["iteration"]:
            new_run, starts_at = True, rec["time"]
        if new_run:
            runs.append(([], []))
            starts.append(starts_at if starts_at is not None else rec["time"])
            new_run, starts_at = False, None
        runs[-1][0].append(rec)
    if not runs:
        return [([], list(checkpoints))]
    for c in checkpoints:  # the run that was going on when the save was called
        i = max([k for k, t in enumerate(starts) if t <= c["t_start"]] or [0])
        runs[i][1].append(c)
    return runs


def draw(runs: List[Tuple[List, List]], out: str, title: str) -> None:
    """One timeline panel per run (rows as in the module doc, commits labelled with their
    iteration), then the stall of each checkpoint in milliseconds on its own axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"blocked": "tab:red", "copy": "tab:orange", "flush": "tab:blue",
              "migrate": "tab:green"}
    fig, axes = plt.subplots(len(runs) + 1, 1, figsize=(12, 2.8 * len(runs) + 2.4),
                             squeeze=False)
    for k, (its, cks) in enumerate(runs):
        ax, rows = axes[k][0], phases(its, cks)
        names = ["iterations", "blocked", "copy", "flush", "migrate", "commit"]
        if not rows["migrate"]:
            names.remove("migrate")
        for y, name in enumerate(reversed(names)):
            bars = rows[name]
            if name == "commit":
                ax.plot([s for s, _ in bars], [y] * len(bars), "k|", markersize=18)
                for (x, _), c in zip(bars, cks):
                    ax.annotate(str(c["iteration"]), (x, y + 0.3), fontsize=7, ha="center")
            elif name == "iterations":
                ax.broken_barh(bars, (y - 0.35, 0.7),
                               facecolors=["0.55" if i % 2 else "0.8" for i in range(len(bars))])
            else:
                ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colors[name], alpha=0.8)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(list(reversed(names)))
        ax.set_xlabel("seconds since the run's first event")
        first = its[0]["iteration"] if its else "?"
        ax.set_title(title if len(runs) == 1 else f"{title} (run {k + 1}: from iteration {first})")
    ax = axes[-1][0]
    cks = [c for _, run_cks in runs for c in run_cks]
    ax.bar(range(len(cks)), [c["stall_ms"] for c in cks], color=colors["blocked"])
    ax.set_xticks(range(len(cks)))
    ax.set_xticklabels([str(c["iteration"]) for c in cks], fontsize=7)
    ax.set_xlabel("checkpoint (iteration)")
    ax.set_ylabel("stall (ms)")
    ax.set_title("time training was blocked per checkpoint")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("telemetry", help="datastates_checkpoints.jsonl under the --save directory")
    p.add_argument("-o", "--output", default="checkpoint_timeline.png")
    p.add_argument("--title", default="--async-lazy-save: iterations and checkpoint phases")
    a = p.parse_args(argv)
    iterations, checkpoints = read_events(a.telemetry)
    runs = split_runs(iterations, checkpoints)
    draw(runs, a.output, a.title)
    print(f"wrote {a.output}: {len(runs)} run(s), {len(iterations)} iterations, "
          f"{len(checkpoints)} checkpoints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
