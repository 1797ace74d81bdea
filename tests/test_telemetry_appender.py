"""`telemetry.JsonlAppender`: the training loop's telemetry lines (one per iteration and per
commit, under --save on a shared file system) are written by a background thread, so a slow or
hung file system never holds the caller; lines keep their order, and a failure is said once."""
import json
import os
import threading
import time

from datastates import telemetry


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_lines_keep_their_order_and_flush_writes_them(tmp_path):
    path = str(tmp_path / "sub" / "t.jsonl")  # its directory is made by the thread
    a = telemetry.JsonlAppender(path)
    for i in range(500):
        a.append({"event": "iteration", "iteration": i})
    assert a.flush(30)
    assert [r["iteration"] for r in _read(path)] == list(range(500))
    # One appender per file in a process: two callers' lines stay in order.
    b1, b2 = telemetry.appender(str(tmp_path / "u.jsonl")), \
        telemetry.appender(str(tmp_path / ".." / tmp_path.name / "u.jsonl"))
    assert b1 is b2
    b1.append({"n": 1})
    b2.append({"n": 2})
    assert telemetry.flush_all(30)
    assert _read(tmp_path / "u.jsonl") == [{"n": 1}, {"n": 2}]


def test_a_hung_file_never_holds_the_caller(tmp_path):
    """A FIFO without a reader: opening it blocks, as a hung file system would."""
    fifo = str(tmp_path / "hung.jsonl")
    os.mkfifo(fifo)
    warnings = []
    a = telemetry.JsonlAppender(fifo, warn=warnings.append, max_queued=50)
    t0 = time.perf_counter()
    for i in range(60):  # more than may wait: the rest are dropped, said once
        a.append({"i": i})
    assert time.perf_counter() - t0 < 1.0
    assert not a.flush(0.2)  # still blocked
    assert len(warnings) == 1 and "not keeping up" in warnings[0]
    got = []
    reader = threading.Thread(target=lambda: got.extend(open(fifo).read().splitlines()))
    reader.start()  # the file system answers: what waited is written, in order
    assert a.flush(30)
    reader.join(30)
    # The first line may have been taken before the queue filled: 50 or 51 lines, in order.
    seen = [json.loads(line)["i"] for line in got]
    assert seen == list(range(len(seen))) and len(seen) in (50, 51)


def test_a_failure_is_said_once_and_turns_the_file_off(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    warnings = []
    a = telemetry.JsonlAppender(str(tmp_path / "file" / "t.jsonl"), warn=warnings.append)
    a.append({"i": 0})
    assert a.flush(30) and a.off
    a.append({"i": 1})
    assert a.flush(1)
    assert len(warnings) == 1 and "telemetry is off" in warnings[0] and "file" in warnings[0]
