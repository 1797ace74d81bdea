"""Draw a PNG timeline of training iterations and checkpoint phases from --async-lazy-save telemetry.

    python tools/plot_checkpoint_timeline.py SAVE_DIR/datastates_checkpoints.jsonl -o timeline.png

One panel per training run in the file (a resumed run appends to the same telemetry), then the
stall of every checkpoint in milliseconds on its own axis. Rows of a panel: iterations
(alternating shades between consecutive iteration ends; their numbers on the top axis), the
validation runs, and per checkpoint the time training was blocked, the snapshot copy, the flush
until every rank was durable, and the commit (labelled with its iteration where there is room).
With --lazy-save-local-dir the flush ends when every rank is durable on node-local storage, and a
"migrate" row runs from there until every rank is durable under --save. A run that stopped before
logging its last commit (killed) gets it from the next run's start, which records the iteration
--save's tracker named then: drawn at the run's end, labelled "N*". Needs matplotlib
(`pip install matplotlib`).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Tuple


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
            if kind in ("iteration", "start", "validation"):
                iterations.append(rec)
            elif kind == "checkpoint":
                checkpoints.append(rec)
    if not any(r["event"] == "iteration" for r in iterations) and not checkpoints:
        raise SystemExit(f"error: {path} holds no 'iteration' or 'checkpoint' events; expected the "
                         "datastates_checkpoints.jsonl written under --save by --async-lazy-save")
    return iterations, checkpoints


def phases(iterations: List[Dict], checkpoints: List[Dict]) -> Dict[str, List[Tuple[float, float]]]:
    """Bars (start, width) per row, in seconds from the first event."""
    times = [r.get("t_start", r["time"]) for r in iterations] + [c["t_start"] for c in checkpoints]
    t0 = min(times)
    rows: Dict[str, List[Tuple[float, float]]] = {"iterations": [], "validation": [],
                                                  "blocked": [], "copy": [], "flush": [],
                                                  "migrate": [], "commit": []}
    ends = [r for r in iterations if r["event"] == "iteration"]
    for prev, cur in zip(ends, ends[1:]):
        rows["iterations"].append((prev["time"] - t0, cur["time"] - prev["time"]))
    for v in iterations:
        if v["event"] == "validation":
            rows["validation"].append((v["t_start"] - t0, v["time"] - v["t_start"]))
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
        if rec["event"] != "iteration":  # a validation: part of the run going on
            if runs and not new_run:
                runs[-1][0].append(rec)
            continue
        if not new_run and rec["iteration"] <= _last_iteration(runs[-1][0]):
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


def _last_iteration(records: List[Dict]) -> int:
    return max(r["iteration"] for r in records if r["event"] == "iteration")


def run_starts(iterations: List[Dict], runs: List[Tuple[List, List]]) -> List[Dict]:
    """Per run, its "start" event ({} when the file has none): "committed" is the iteration
    --save's tracker named then (what the run resumed from), "newest_complete" the newest
    complete checkpoint there (newer than the tracker's when the run before was killed between
    its commit marker and its tracker move)."""
    starts = [r for r in iterations if r["event"] == "start"]
    out = []
    for its, _ in runs:
        first = min((r["time"] for r in its if r["event"] == "iteration"), default=None)
        before = [s for s in starts if first is not None and s["time"] <= first]
        out.append(before[-1] if before else {})
    return out


def unlogged_commits(runs: List[Tuple[List, List]], starts: List[Dict]) -> List[Optional[int]]:
    """Per run, the checkpoint it committed but did not log (it stopped first, e.g. killed), as
    the next run's start found it on disk; None if there is none."""
    out: List[Optional[int]] = []
    for k, (its, cks) in enumerate(runs):
        nxt = starts[k + 1] if k + 1 < len(starts) else {}
        newest = nxt.get("newest_complete", nxt.get("committed"))
        ends = [r["iteration"] for r in its if r["event"] == "iteration"]
        logged = {c["iteration"] for c in cks}
        out.append(newest if newest is not None and ends and newest not in logged
                   and ends[0] <= newest <= ends[-1] + 1 else None)
    return out


def _spaced(xs: List[float], min_dx: float) -> List[int]:
    """Indices of `xs` (ascending) to label so that labels are at least `min_dx` apart, the last
    one always among them."""
    keep: List[int] = []
    for i in range(len(xs) - 1, -1, -1):
        if not keep or xs[keep[-1]] - xs[i] >= min_dx:
            keep.append(i)
    return keep[::-1]


def draw(runs: List[Tuple[List, List]], out: str, title: str,
         starts: Optional[List[Dict]] = None) -> None:
    """One timeline panel per run (rows as in the module doc, commits labelled with their
    iteration), then the stall of each checkpoint in milliseconds on its own axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"blocked": "tab:red", "copy": "tab:orange", "flush": "tab:blue",
              "migrate": "tab:green", "validation": "tab:purple"}
    starts = starts or [{} for _ in runs]
    unlogged_of = unlogged_commits(runs, starts)
    fig, axes = plt.subplots(len(runs) + 1, 1, figsize=(12, 3.0 * len(runs) + 2.4),
                             squeeze=False)
    for k, (its, cks) in enumerate(runs):
        ax, rows = axes[k][0], phases(its, cks)
        ends = [r for r in its if r["event"] == "iteration"]
        t0 = min([r.get("t_start", r["time"]) for r in its] + [c["t_start"] for c in cks])
        span = max([r["time"] for r in its] + [c["time"] for c in cks]) - t0 or 1.0
        unlogged = unlogged_of[k]  # committed, not logged: the run stopped first
        names = ["iterations", "validation", "blocked", "copy", "flush", "migrate", "commit"]
        for optional in ("migrate", "validation"):
            if not rows[optional]:
                names.remove(optional)
        for y, name in enumerate(reversed(names)):
            bars = rows[name]
            if name == "commit":
                xs = [s for s, _ in bars]
                ax.plot(xs, [y] * len(bars), "k|", markersize=18)
                labels = [str(c["iteration"]) for c in cks]
                if unlogged is not None:
                    end = max(r["time"] for r in its) - t0
                    ax.plot([end], [y], "|", color="0.5", markersize=18)
                    xs, labels = xs + [end], labels + [f"{unlogged}*"]
                order = sorted(range(len(xs)), key=lambda i: xs[i])
                xs, labels = [xs[i] for i in order], [labels[i] for i in order]
                for i in _spaced(xs, span / 45):
                    ax.annotate(labels[i], (xs[i], y + 0.3), fontsize=7, ha="center")
            elif name == "iterations":
                ax.broken_barh(bars, (y - 0.35, 0.7),
                               facecolors=["0.55" if i % 2 else "0.8" for i in range(len(bars))])
            else:
                ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colors[name], alpha=0.8)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(list(reversed(names)))
        ax.set_xlabel("seconds since the run's first event")
        # Iteration numbers on top, at the end of each iteration, thinned to fit.
        top = ax.twiny()
        top.set_xlim(ax.get_xlim())
        step = next((s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
                     if len(ends) / s <= 20), max(1, len(ends) // 20))
        shown = [r for r in ends if r["iteration"] % step == 0 or r is ends[-1]]
        shown = [shown[i] for i in _spaced([r["time"] - t0 for r in shown], span / 30)]
        top.set_xticks([r["time"] - t0 for r in shown])
        top.set_xticklabels([str(r["iteration"]) for r in shown], fontsize=7)
        top.set_xlabel("iteration (end)", fontsize=8)
        first = ends[0]["iteration"] if ends else "?"
        last = ends[-1]["iteration"] if ends else "?"
        what = f"iterations {first}-{last}"
        if starts[k].get("committed") is not None and len(runs) > 1:
            what += f", resumed from checkpoint {starts[k]['committed']}"
        if unlogged is not None:
            what += f"; {unlogged}* committed, the run stopped before logging it"
        ax.set_title(title if len(runs) == 1 else f"{title}\n(run {k + 1}: {what})", fontsize=10)
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
    draw(runs, a.output, a.title, run_starts(iterations, runs))
    n_iterations = sum(r["event"] == "iteration" for r in iterations)
    print(f"wrote {a.output}: {len(runs)} run(s), {n_iterations} iterations, "
          f"{len(checkpoints)} checkpoints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
