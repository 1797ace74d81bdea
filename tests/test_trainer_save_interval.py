"""`--save-interval auto --mtbf-hours H`: the interval from measured checkpoint costs (Young/Daly).

Units first (the formula by hand, the state machine fed known iteration times and records, the
flag errors), then one 2-rank lazy run whose saves must land exactly where its logged decisions
say, with the decisions also in TensorBoard.
"""
import re

import pytest

from megatron.training.arguments import ArgumentError, build_run_config, parse_args
from megatron.training.checkpointing.save_interval import (
    MAX_PENDING,
    PROBE_CHECKPOINTS,
    PROBE_INTERVAL,
    WARMUP_ITERATIONS,
    AutoInterval,
    optimal_compute_seconds,
)

from test_trainer_logging import _scalars
from trainer_launch import TINY_MODEL, launch

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --mock-data --vocab-size 255")


def test_optimum_by_hand():
    # C = 10 s, M = 4 h = 14400 s: Young sqrt(2CM) = 536.656 s; Daly's correction with
    # r = C/2M = 1/2880: (1 + sqrt(r)/3 + r/9) = 1.0062487 -> 540.010 - C = 530.010 s.
    assert optimal_compute_seconds(10.0, 14400.0) == pytest.approx(530.0104, abs=1e-3)
    # Cheap checkpoints: Daly tends to Young.
    assert optimal_compute_seconds(1e-3, 14400.0) == pytest.approx((2 * 1e-3 * 14400) ** 0.5,
                                                                   rel=1e-3)
    assert optimal_compute_seconds(100.0, 40.0) == 40.0  # C >= 2M: checkpoint every MTBF
    assert optimal_compute_seconds(0.0, 40.0) == 0.0


class _Fake:
    """AutoInterval on "rank 0" of a one-rank job; collects the log lines and reports."""

    def __init__(self, mtbf_hours, start=0):
        self.lines, self.reports = [], []
        self.auto = AutoInterval(mtbf_hours, start, True, lambda v: v, self.lines.append,
                                 lambda it, d: self.reports.append((it, d.interval, d.reason)))
        self.iteration = start

    def run(self, seconds, record=None):
        """One iteration taking `seconds`; saves if due; then a record if given."""
        self.iteration += 1
        saved = self.auto.should_save(self.iteration)
        if saved:
            self.auto.saved(self.iteration)
        if record is not None:
            self.auto.record(*record)
        self.auto.iteration_done(seconds)
        return saved


def test_warm_up_probe_then_formula_then_durability_bound():
    # MTBF 1 h and a cost of 0.5 s: Young sqrt(2 * 0.5 * 3600) = 60 s = 60 iterations of 1 s.
    f = _Fake(1.0, start=10)
    assert not f.run(1.0) and not f.run(1.0)  # 11, 12: warm-up, undisturbed (1 s each)
    assert f.run(1.0) and f.auto.next_save == 13 + PROBE_INTERVAL  # 13 = start + WARMUP
    assert WARMUP_ITERATIONS == 3 and f.reports == [(13, PROBE_INTERVAL, "probe")]
    # 14 is slowed by the flush (+0.5 s) and the checkpoint becomes durable during it: the
    # disturbed iterations 13 (1.0) and 14 (1.5) cost 0.5 s over the undisturbed 1.0 s.
    f.run(1.5, record=(13, 0.2, 1.2))
    assert f.auto._costs == [pytest.approx(0.5)]
    # Probing at the durability bound: ceil(1.2 s / 1.0 s) + 1 = 3 (a new line: it changed).
    assert f.run(1.0) and f.auto.next_save == 15 + 3 and f.reports[-1] == (15, 3, "probe")
    f.run(1.0, record=(15, 0.6, 0.5))  # no slowdown measured: the stall (0.6 s) is the cost
    assert f.auto._costs[-1] == pytest.approx(0.6)
    assert not f.run(1.0)  # 17: undisturbed
    assert f.run(1.0) and f.auto.next_save == 18 + 2  # durable in 0.5 s -> bound 1 + 1
    f.run(1.4, record=(18, 0.1, 0.5))
    assert f.auto._costs == [pytest.approx(c) for c in (0.5, 0.6, 0.4)]
    assert len(f.auto._costs) == PROBE_CHECKPOINTS
    assert f.run(1.0)  # 20: the median cost 0.5 s goes into the formula
    interval = round(optimal_compute_seconds(0.5, 3600.0) / 1.0)
    assert interval == 60 and f.auto.next_save == 20 + interval
    assert f.reports[-1] == (20, interval, "young-daly")
    line = f.lines[-1]
    for field in ("iteration:       20", "checkpoint cost (s): 5.000000E-01", "MTBF (h): 1 ",
                  "interval (iterations): 60", "iteration time (s): 1.000000E+00",
                  "durable (s): 5.000000E-01", "set by: young-daly"):
        assert field in line, line
    # A much shorter MTBF: the optimum (1 iteration) is below the durability bound, which wins.
    f.auto.mtbf_hours = 1e-6
    for _ in range(interval - 2):
        assert not f.run(1.0)
    f.run(1.0, record=(20, 0.5, 7.5))
    assert f.run(1.0) and f.auto.decision.reason == "durability"
    assert f.auto.next_save == 80 + 8 + 1


def test_unchanged_decision_is_not_logged_again_and_lost_records_are_dropped():
    f = _Fake(1.0)
    for _ in range(WARMUP_ITERATIONS + 2 * PROBE_INTERVAL):
        f.run(1.0)  # saves at 3, 5, 7, no record ever arrives (e.g. failed saves)
    assert [r[0] for r in f.reports] == [3] and len(f.lines) == 1
    assert len(f.auto._pending) == MAX_PENDING


@pytest.mark.parametrize("extra,message", [
    ("--save /tmp/x --save-interval auto", "--save-interval auto needs --mtbf-hours"),
    ("--save /tmp/x --save-interval 5 --mtbf-hours 4", "--mtbf-hours is only used by"),
    ("--save /tmp/x --save-interval auto --mtbf-hours 0", "--mtbf-hours must be > 0"),
    ("--save-interval auto --mtbf-hours 4", "--save-interval needs --save"),
])
def test_bad_flags_get_one_line(extra, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        build_run_config(parse_args((BASE + " " + extra).split()), world_size=1)


def test_not_a_number_nor_auto_is_refused():
    with pytest.raises(ArgumentError, match="expected a number of iterations or 'auto', got "
                                            "'often'"):
        parse_args((BASE + " --save-interval often").split())


def test_flags_resolve():
    ckpt = build_run_config(parse_args(
        (BASE + " --save /tmp/x --save-interval auto --mtbf-hours 2.5").split()), 1).checkpoint
    assert ckpt.save_interval_auto and ckpt.save_interval is None and ckpt.mtbf_hours == 2.5


_DECISION = re.compile(r" checkpoint interval \| iteration:\s+(\d+) \| checkpoint cost \(s\): "
                       r"(\S+) \| MTBF \(h\): (\S+) \| interval \(iterations\): (\d+) \| "
                       r"iteration time \(s\): (\S+) \| durable \(s\): (\S+) \| set by: (\S+) \|")
_COMMITTED = re.compile(r" checkpoint iteration\s+(\d+) \|.*committed: ")


def test_two_ranks_save_where_the_agreed_decisions_say(tmp_path):
    train_iters = 24
    run = launch(2, TINY_MODEL + [
        "--train-iters", str(train_iters), "--save", str(tmp_path / "save"),
        "--async-lazy-save", "--save-interval", "auto", "--mtbf-hours", "0.001",
        "--tensorboard-dir", str(tmp_path / "tb")])
    assert run.returncode == 0, run.describe()
    decisions = [(int(m[1]), int(m[4]), m[7]) for m in _DECISION.finditer(run.stdout)]
    committed = sorted(int(m[1]) for m in _COMMITTED.finditer(run.stdout))
    assert decisions and decisions[0][:2] == (WARMUP_ITERATIONS, PROBE_INTERVAL), run.stdout
    assert committed[0] == WARMUP_ITERATIONS and committed[-1] == train_iters, committed
    # Every save (but the end-of-training one) is followed by the next at the interval in force.
    in_force = {}
    for it, interval, _ in decisions:
        in_force[it] = interval
    interval = None
    for prev, nxt in zip(committed, committed[1:]):
        interval = in_force.get(prev, interval)
        assert nxt == prev + interval or nxt == train_iters, (prev, nxt, decisions)
    # After the probes, the formula (or the durability bound) decides.
    assert any(reason in ("young-daly", "durability") for _, _, reason in decisions), decisions
    # Rank 0 wrote each change to TensorBoard.
    tb = _scalars(tmp_path / "tb")
    assert {it: int(v) for it, v in tb["checkpoint/interval-iterations"].items()} == \
        {it: n for it, n, _ in decisions}


def test_a_level_whose_saves_never_queue_may_save_every_iteration():
    """The in-memory level's AutoInterval (`queues=False`): while probing it keeps undisturbed
    iterations between saves; once its costs are known the durability bound is one iteration
    (each save commits the one before it first), so a cheap level saves every iteration."""
    lines = []
    auto = AutoInterval(1e-4, 0, True, lambda v: v, lines.append, level="in-memory",
                        queues=False)
    it = 0
    while len(auto._costs) < PROBE_CHECKPOINTS:
        it += 1
        saved = auto.should_save(it)
        if saved:
            auto.saved(it)
            assert auto.next_save - it == PROBE_INTERVAL  # probing: never every iteration
        if it - 1 in auto._pending:
            auto.record(it - 1, 0.001, 2.5)  # durable a few iterations later: no bound now
        auto.iteration_done(1.0 if not auto._pending else 1.001)
    while not auto.should_save(it):
        it += 1
    auto.saved(it)
    assert auto.decision.interval == 1 and auto.decision.reason == "young-daly", auto.decision
    assert lines[-1].startswith(" checkpoint interval | level: in-memory | iteration: "), lines


def test_non_persistent_interval_flags():
    auto = build_run_config(parse_args((BASE + " --save /tmp/x --save-interval auto --mtbf-hours "
                                        "1 --async-lazy-save --non-persistent-ckpt-type "
                                        "in_memory").split()), 1).checkpoint
    assert auto.non_persistent_save_interval_auto and auto.non_persistent_save_interval is None
    assert auto.non_persistent_save_root() is not None
    fixed = build_run_config(parse_args((BASE + " --save /tmp/x --save-interval auto --mtbf-hours "
                                         "1 --async-lazy-save --non-persistent-ckpt-type "
                                         "in_memory --non-persistent-save-interval 2").split()),
                             1).checkpoint
    assert not fixed.non_persistent_save_interval_auto and fixed.non_persistent_save_interval == 2
    with pytest.raises(ArgumentError, match=re.escape(
            "--non-persistent-save-interval auto sets the level's interval from its measured "
            "cost and --mtbf-hours, as --save-interval auto does for --save; it needs "
            "--save-interval auto, got --save-interval 5")):
        build_run_config(parse_args((BASE + " --save /tmp/x --save-interval 5 --async-lazy-save "
                                     "--non-persistent-ckpt-type in_memory "
                                     "--non-persistent-save-interval auto").split()), 1)


_MEMORY_DECISION = re.compile(r" checkpoint interval \| level: in-memory \| iteration:\s+(\d+) \|"
                              r".*? interval \(iterations\): (\d+) \|.*? set by: (\S+) \|")


def test_each_level_saves_at_its_own_auto_interval(tmp_path):
    """2 ranks, --save-interval auto with the in-memory level: each level logs its own decisions
    (the in-memory ones tagged `level: in-memory`) and its versions land where they say, except
    where a persistent save took that iteration (the in-memory save then comes right after)."""
    train_iters = 24
    save = str(tmp_path / "save")
    run = launch(2, TINY_MODEL + [
        "--train-iters", str(train_iters), "--save", save, "--async-lazy-save",
        "--save-interval", "auto", "--mtbf-hours", "0.001", "--non-persistent-ckpt-type",
        "in_memory", "--tensorboard-dir", str(tmp_path / "tb")])
    assert run.returncode == 0, run.describe()
    assert "in-memory checkpoints: at an interval set from their own measured cost" in run.stdout
    memory = [(int(m[1]), int(m[2]), m[3]) for m in _MEMORY_DECISION.finditer(run.stdout)]
    persistent = [(int(m[1]), int(m[4]), m[7]) for m in _DECISION.finditer(run.stdout)]
    assert memory and memory[0][:2] == (WARMUP_ITERATIONS + 1, PROBE_INTERVAL), run.stdout
    assert persistent and persistent[0][:2] == (WARMUP_ITERATIONS, PROBE_INTERVAL)
    committed = [(int(m[1]), "/in_memory/" in m[0]) for m in _COMMITTED_ANY.finditer(run.stdout)]
    saved_memory = sorted(it for it, mem in committed if mem)
    saved_persistent = {it for it, mem in committed if not mem}
    in_force, interval = dict((it, n) for it, n, _ in memory), None
    for prev, nxt in zip(saved_memory, saved_memory[1:]):
        interval = in_force.get(prev, interval)
        due = prev + interval
        assert nxt == due or (nxt > due and all(i in saved_persistent for i in range(due, nxt))), \
            (prev, nxt, memory, sorted(saved_persistent))
    assert any(reason == "young-daly" for _, _, reason in memory), memory
    tb = _scalars(tmp_path / "tb")
    assert {it: int(v) for it, v in tb["checkpoint-in_memory/interval-iterations"].items()} == \
        {it: n for it, n, _ in memory}


_COMMITTED_ANY = re.compile(r" checkpoint iteration\s+(\d+) \|.*committed: (\S+)")
