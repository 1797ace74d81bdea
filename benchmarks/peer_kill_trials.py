"""Kill trials of the in-memory level with peer replicas on two nodes (issue 30's kill trials
across in-memory, persistent and replica saves).

    python benchmarks/peer_kill_trials.py --trials 20 --seed 0 [--workdir DIR] [--renumber]
                                          [--in-transfer] [--memory-interval N]

Each trial runs the tiny GPT as two torchrun agents on this machine (two "nodes", one rank each,
DP2 with the distributed optimizer) with an in-memory version every iteration (every N with
--memory-interval N: then a version that commits while a transfer runs is handed over at the
first iteration's end after the transfer), its peer replica (`--lazy-save-peer-replica`) and
`--save` every 4. At a seeded point (after a seeded iteration's
loss line, plus a seeded fraction of an iteration) both agents are SIGKILLed; in half the trials
(seeded) one node's memory is then deleted as well, as if the node were lost. With --renumber,
in half of those (seeded) the replacement is numbered before the survivor, as torchrun or Slurm
would number a new host whose name sorts first: the survivor's memory is then under the other
node's index, as `adopt_left_memory` leaves it on a real cluster (`take_over`; one machine here,
where every index is present, so the restart itself renames nothing). With --in-transfer, a third
of the trials (seeded) kill inside a peer transfer instead: one rank's receiving end of an
in-memory version's replica is paused by the `replica` fault point once every byte arrived,
before the files are moved into place (datastates/faults.py), for longer than the job has left
to run; training goes on meanwhile (later versions commit in memory, their replicas are skipped:
latest wins) and the kill lands after a seeded one to three of them (a trial whose replica
was skipped, latest wins, is killed two iterations after it). The restart runs to the
end. A trial passes when:
  - the restart resumes from the newest version complete on a level that is left after the
    kill: --save's tracker, or the newest in-memory version committed on a node left (its commit
    marker) whose every rank's files that node or the other holds whole (the rank's own copy or,
    as a replica, the next node's; with a lost node, the survivor's own and its replica);
  - its losses after that iteration are bit-identical to an uninterrupted run's;
  - every committed version in --save and in the surviving memory reads back with every checksum
    (no torn or foreign version).
Prints one line per trial and a summary (resumed from which level, iterations lost). Uses 2
cores for ~20 s per trial; run nothing else multi-process meanwhile.
"""
import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from crash_harness import verify_committed  # noqa: E402
from trainer_launch import NO_DROPOUT, TINY_MODEL, Node, free_port, launch  # noqa: E402

ITERS = 12
PERSISTENT_EVERY = 4
ARGS = TINY_MODEL + NO_DROPOUT + ["--eval-interval", "0", "--use-distributed-optimizer",
                                  "--train-iters", str(ITERS)]
_LOSS = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|")
_LOADED = re.compile(r"loaded checkpoint (\S+) \(format \w+, iteration (\d+)")


def _tracked(root: str) -> int:
    try:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def _marker_ok(directory: str, rank: int) -> bool:
    from datastates import layout

    try:
        return layout._valid_rank_marker(directory, rank, 2) is not None
    except Exception:  # noqa: BLE001 - a torn marker is simply not whole
        return False


def _newest_in_memory(memory: str, lost) -> int:
    """The newest in-memory version complete after the kill: committed on a node that is left
    (its commit marker), and each rank's files whole (its marker) on its own node or, as a
    replica, on the other one (two nodes of one rank each: node n holds rank n and the replica
    of rank 1 - n). What the restart must resume from in memory; 0 if none."""
    from datastates import layout

    def whole(rank: int, name: str) -> bool:
        own = os.path.join(memory, f"node{rank}", name)
        replica = os.path.join(memory, f"node{1 - rank}", "peer", name)
        return (rank != lost and _marker_ok(own, rank)) or \
            (1 - rank != lost and _marker_ok(replica, rank))

    committed = set()
    for n in (0, 1):
        root = os.path.join(memory, f"node{n}")
        if n != lost and os.path.isdir(root):
            committed |= {name for name in os.listdir(root) if name.startswith("iter_")
                          and layout.is_committed(os.path.join(root, name))}
    return max((int(name[5:]) for name in committed if whole(0, name) and whole(1, name)),
               default=0)


#: --in-transfer: the replica fault point pauses the receiving end longer than the job has left
#: to run (training goes on meanwhile, later replicas are skipped: latest wins); the kill lands
#: one to three iterations after the pause began.
TRANSFER_PAUSE = 120.0
_FAULT_LINE = "DATASTATES_FAULT phase=replica step={step} rank={rank}"


def run_trial(k: int, rng: random.Random, workdir: str, memory_of, reference, log,
              renumber: bool = False, in_transfer: bool = False, memory_every: int = 1) -> dict:

    save = os.path.join(workdir, f"trial{k}", "save")
    memory = memory_of(save)
    flags = ARGS + ["--async-lazy-save", "--lazy-save-peer-replica", "--save", save,
                    "--load", save, "--save-interval", str(PERSISTENT_EVERY),
                    "--non-persistent-ckpt-type", "in_memory",
                    "--non-persistent-save-interval", str(memory_every)]
    kill_after, frac = rng.randint(2, ITERS - 2), rng.random()
    lost = rng.choice([None, 0, 1])
    renumbered = renumber and lost is not None and rng.random() < 0.5
    paused = rng.choice([0, 1]) if in_transfer and rng.random() < 1 / 3 else None
    if paused is not None:
        kill_after = min(kill_after, ITERS - 4)  # room for the iterations run during the pause
        # The newest in-memory version by then: not one of --save's iterations (Megatron-LM's
        # rule: no in-memory save there).
        kill_after = max([i for i in range(memory_every, kill_after + 1, memory_every)
                          if i % PERSISTENT_EVERY], default=kill_after)
    env = {} if paused is None else {
        "DATASTATES_FAULT_DELAY_REPLICA": f"{TRANSFER_PAUSE}@{kill_after}:{paused}"}

    started = []  # every agent, killed whatever ends the trial (they run in their own sessions)

    def nodes(name, extra_env=None):
        port, logs = free_port(), os.path.join(workdir, f"trial{k}", name)
        os.makedirs(logs)
        started.extend(Node(r, 2, 1, port, flags, logs, extra_env=extra_env) for r in (0, 1))
        return started[-2:]

    try:
        first = nodes("first", env)
        deadline = time.time() + 240
        t_line, hit = None, False  # hit: the pause in the transfer began
        fault = _FAULT_LINE.format(step=kill_after, rank=paused)
        while True:
            seen = [int(m.group(1)) for m in _LOSS.finditer(first[1].stdout())]  # the last rank
            if paused is None:
                if seen and max(seen) >= kill_after and t_line is None:
                    t_line = time.time()
                if t_line is not None and time.time() >= t_line + frac * 0.08:
                    break
            else:
                hit = hit or any(fault in n.err_path.read_text() for n in first)  # rank, not node
                if seen and max(seen) >= kill_after + (1 + int(frac * 3) if hit else 2):
                    break  # or without the pause: that version's replica was skipped
            if first[1].proc.poll() is not None or time.time() > deadline:
                break
            time.sleep(0.005)
        for node in first:
            node.kill()
        last = max([int(m.group(1)) for m in _LOSS.finditer(first[1].stdout())], default=0)
        persistent = _tracked(save)
        in_memory = _newest_in_memory(memory, lost)
        newest = max(persistent, in_memory)
        if lost is not None:
            shutil.rmtree(os.path.join(memory, f"node{lost}"), ignore_errors=True)
            if renumbered:  # the survivor is numbered as the lost node was
                from datastates.megatron_adapter.levels.in_memory import take_over

                take_over(memory, 1 - lost, lost)
        corrupt = verify_committed(save) if os.path.isdir(save) else []
        for n in (0, 1):
            root = os.path.join(memory, f"node{n}")
            if os.path.isdir(root):
                corrupt += [f"memory node{n}: {c}"
                            for c in verify_committed(root, shard_by_shard=True)]
        second = [n.result(timeout=240) for n in nodes("second")]
        out = second[0].stdout
        m = _LOADED.search(out)
        resumed = int(m.group(2)) if m else 0
        level = ("memory" if m and "/in_memory/" in m.group(1) else "--save" if m else "scratch")
        losses = {**second[0].losses(), **second[1].losses()}
        expected = {i: v for i, v in reference.items() if i > resumed}
        ok = (all(r.returncode == 0 for r in second) and resumed == newest and losses == expected
              and not corrupt)
        result = dict(trial=k, kill_after=kill_after, frac=round(frac, 2), lost_node=lost,
                      in_transfer=None if paused is None else dict(rank=paused, hit=hit),
                      renumbered=renumbered, last_logged=last, persistent=persistent, in_memory=in_memory, newest=newest,
                      resumed=resumed, level=level, lost_iterations=max(0, last - resumed),
                      bit_identical=losses == expected, corrupt=corrupt, ok=ok)
        if not ok:
            result["tail"] = (second[0].describe() + second[1].describe())[-4000:]
        log(json.dumps({k2: v for k2, v in result.items() if k2 != "tail"}))
        return result
    finally:
        for node in started:
            if node.proc.poll() is None:  # not reaped yet: its pid is still its own
                node.kill()
        shutil.rmtree(os.path.dirname(memory), ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
    p.add_argument("--renumber", action="store_true",
                   help="in half the trials with a lost node, the survivor is numbered anew")
    p.add_argument("--in-transfer", action="store_true",
                   help="a third of the kills land inside a peer transfer (the replica fault "
                        "point pauses one rank's receiving end)")
    p.add_argument("--memory-interval", type=int, default=1,
                   help="--non-persistent-save-interval of the trials (default 1)")
    a = p.parse_args(argv)
    from megatron.training.config import shared_memory_dir

    workdir = a.workdir or tempfile.mkdtemp(prefix="peer_kill_trials_")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    ref = launch(2, ARGS)
    if ref.returncode != 0:
        print(ref.describe())
        return 1
    reference = ref.losses()
    rng = random.Random(a.seed)
    results = [run_trial(k, rng, workdir, lambda s: shared_memory_dir(s, "in_memory"),
                         reference, lambda m: print(m, flush=True), a.renumber,
                         a.in_transfer, a.memory_interval)
               for k in range(a.trials)]
    lost = [r["lost_iterations"] for r in results]
    levels = {lv: sum(r["level"] == lv for r in results) for lv in ("memory", "--save", "scratch")}
    print(f"trials: {len(results)}, passed: {sum(r['ok'] for r in results)}, bit-identical: "
          f"{sum(r['bit_identical'] for r in results)}, corrupt: "
          f"{sum(bool(r['corrupt']) for r in results)}, node lost: "
          f"{sum(r['lost_node'] is not None for r in results)} (renumbered: "
          f"{sum(r['renumbered'] for r in results)}), killed inside a transfer: "
          f"{sum(bool(r['in_transfer'] and r['in_transfer']['hit']) for r in results)} of "
          f"{sum(r['in_transfer'] is not None for r in results)} planned, resumed from: {levels}, "
          f"iterations lost: mean {sum(lost) / len(lost):.2f} max {max(lost)}")
    print(f"wall time: {time.time() - t0:.0f} s, workdir {workdir}")
    for r in results:
        if not r["ok"]:
            print(f"FAILED: trial {r['trial']}: {r.get('tail', '')}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
