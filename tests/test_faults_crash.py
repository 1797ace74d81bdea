"""Crash trials in CI: a DP2 --async-lazy-save job SIGKILLed inside the copy, the flush and the
commit of a checkpoint (whole job and single ranks), restarted with --load each time.

benchmarks/crash_trials.py runs the same harness for 50+ trials (docs/FAULTS.md has the figures).
"""
from crash_harness import run_trials, summary


def test_kills_inside_each_phase_resume_bit_identically(tmp_path):
    trials = run_trials(3, str(tmp_path), seed=3, nproc=2, train_iters=8,
                        phases=("copy", "flush", "commit"), victims=["job", "rank", "rank"])
    report = summary(trials)
    assert sorted(t.plan.phase for t in trials) == ["commit", "copy", "flush"], report
    for t in trials:
        assert t.hit, (t, report)  # the kill landed inside the planned phase
        assert t.corrupt == [], (t, report)  # every committed checkpoint reads back
        # The restart resumed from what the tracker named after the crash: the newest
        # checkpoint whose save completed on every rank (it may be 0: none yet).
        assert t.resumed_from == t.tracker_after, (t, report)
        assert t.bit_identical, (t, report)  # lm loss equal to the uninterrupted run, bit for bit
        if t.plan.phase == "flush":
            # Training runs on while the paused flush holds the writer, and versions commit in
            # order: nothing from the paused step on can have been committed.
            assert t.resumed_from < t.plan.step, (t, report)
        elif t.plan.phase == "commit":
            # Training runs on while the paused commit holds rank 0's commit thread, and versions
            # commit in order: nothing after the paused step can have been committed (the paused
            # one itself only when another rank was the victim and rank 0 finished it meanwhile).
            assert t.resumed_from <= t.plan.step, (t, report)
            if t.plan.victim == "job" or t.plan.rank == 0:
                assert t.resumed_from < t.plan.step, (t, report)
        else:
            assert 0 <= t.lost <= t.plan.step + 1, (t, report)
