"""tools/plot_checkpoint_timeline.py: telemetry lines -> phase bars -> PNG."""
import json

import pytest

from tools.plot_checkpoint_timeline import (_spaced, main, phases, read_events, run_starts,
                                            split_runs, unlogged_commits)

EVENTS = [
    {"event": "iteration", "iteration": 1, "time": 100.0},
    {"event": "checkpoint", "iteration": 1, "bytes": 10, "stall_ms": 20.0, "copy_ms": 50.0,
     "durable_s": 0.3, "gbps": 0.0, "ranks": 1, "t_start": 100.0, "t_returned": 100.01,
     "time": 100.5},
    {"event": "iteration", "iteration": 2, "time": 101.0},
]


def _write(tmp_path, events):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(path)


def test_phase_bars(tmp_path):
    rows = phases(*read_events(_write(tmp_path, EVENTS)))
    assert rows["iterations"] == [(0.0, 1.0)]
    assert rows["blocked"] == [(0.0, 0.02)]
    assert rows["copy"] == [(0.0, 0.05)]
    assert rows["flush"][0][0] == pytest.approx(0.05) and rows["flush"][0][1] == pytest.approx(0.25)
    assert rows["commit"] == [(0.5, 0.0)] and rows["migrate"] == []


def test_local_tier_splits_flush_and_migration(tmp_path):
    events = [dict(e, local_durable_s=0.1) if e["event"] == "checkpoint" else e for e in EVENTS]
    rows = phases(*read_events(_write(tmp_path, events)))
    assert rows["flush"][0] == (pytest.approx(0.05), pytest.approx(0.05))
    assert rows["migrate"][0] == (pytest.approx(0.1), pytest.approx(0.2))


def test_png_written(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "t.png"
    assert main([_write(tmp_path, EVENTS), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _resumed(events):
    """The same events again 60 s later, as a run resumed from iteration 1 appends them."""
    later = []
    for e in events:
        e = dict(e, time=e["time"] + 60)
        if e["event"] == "checkpoint":
            e.update(t_start=e["t_start"] + 60, t_returned=e["t_returned"] + 60)
        later.append(e)
    return events + later


def test_a_resumed_run_is_its_own_panel_not_one_long_iteration(tmp_path):
    runs = split_runs(*read_events(_write(tmp_path, _resumed(EVENTS))))
    assert [[r["iteration"] for r in its] for its, _ in runs] == [[1, 2], [1, 2]]
    assert [[c["t_start"] for c in cks] for _, cks in runs] == [[100.0], [160.0]]
    assert phases(*runs[1])["iterations"] == [(0.0, 1.0)]  # not a 60 s iteration
    pytest.importorskip("matplotlib")
    out = tmp_path / "two.png"
    assert main([_write(tmp_path, _resumed(EVENTS)), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_start_events_split_runs_that_continue_the_iteration_count(tmp_path):
    """A run resumed from the last checkpoint logs iterations 3, 4 after 1, 2: the trainer's
    "start" event, not the numbering, says where it began."""
    second = [{"event": "start", "time": 150.0},
              {"event": "iteration", "iteration": 3, "time": 152.0},
              {"event": "iteration", "iteration": 4, "time": 153.0}]
    runs = split_runs(*read_events(_write(tmp_path, [{"event": "start", "time": 99.0}] + EVENTS
                                          + second)))
    assert [[r["iteration"] for r in its] for its, _ in runs] == [[1, 2], [3, 4]]
    assert [len(cks) for _, cks in runs] == [1, 0]


def test_killed_run_gets_its_unlogged_commit_and_validation_has_a_row(tmp_path):
    """Run 1 is killed after committing iteration 3 and before logging it (between its commit
    marker and its tracker move: the tracker still names 2); run 2 resumes from 2, validates at
    4. The plot takes 3 from run 2's start event and draws run 2's validation."""
    ck = EVENTS[1]
    events = [{"event": "start", "time": 99.0, "committed": None, "newest_complete": None},
              {"event": "iteration", "iteration": 1, "time": 100.0},
              dict(ck, iteration=1), {"event": "iteration", "iteration": 2, "time": 101.0},
              dict(ck, iteration=2, t_start=101.0, time=101.5),
              {"event": "iteration", "iteration": 3, "time": 102.0},
              {"event": "start", "time": 150.0, "committed": 2, "newest_complete": 3},
              {"event": "iteration", "iteration": 3, "time": 152.0},
              {"event": "validation", "iteration": 3, "t_start": 152.0, "time": 152.5},
              {"event": "iteration", "iteration": 4, "time": 153.0}]
    iterations, checkpoints = read_events(_write(tmp_path, events))
    runs = split_runs(iterations, checkpoints)
    assert [[r["iteration"] for r in its if r["event"] == "iteration"] for its, _ in runs] == \
        [[1, 2, 3], [3, 4]]
    starts = run_starts(iterations, runs)
    assert [s.get("committed") for s in starts] == [None, 2]
    assert unlogged_commits(runs, starts) == [3, None]
    rows = phases(*runs[1])
    assert rows["validation"] == [(0.0, 0.5)] and rows["iterations"] == [(0.0, 1.0)]
    pytest.importorskip("matplotlib")
    out = tmp_path / "killed.png"
    assert main([_write(tmp_path, events), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_labels_are_thinned_to_fit_the_last_one_kept():
    assert _spaced([0.0, 0.1, 0.2, 1.0, 1.05, 2.0], 0.5) == [2, 4, 5]
    assert _spaced([0.0, 1.0, 2.0], 0.5) == [0, 1, 2]


def test_bad_input_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(EVENTS[0]) + "\n{oops\n")
    with pytest.raises(SystemExit, match="bad.jsonl:2"):
        read_events(str(path))


def test_missing_telemetry_file_is_one_line_not_a_traceback(tmp_path):
    import subprocess
    import sys

    missing = tmp_path / "nope.jsonl"
    out = subprocess.run([sys.executable, "-m", "tools.plot_checkpoint_timeline", str(missing)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == (f"error: cannot read {missing}: No such file or directory; "
                                  "expected the datastates_checkpoints.jsonl written under --save "
                                  "by --async-lazy-save")
