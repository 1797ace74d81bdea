"""--non-persistent-ckpt-type in_memory: node-local versions in shared memory (/dev/shm) that
survive a SIGKILL of the whole job, committed at their own pace while a persistent save still
drains (latest wins for --save), resumed from when they are the newest, given back at a clean
end; memory of another model or layout is never loaded, and too little of it is refused at
start, and a failed commit stops every rank with one line (~40 s: 4 launches of 2 ranks, and
in-process units).
"""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from datastates import CheckpointError
from datastates.megatron_adapter import check_memory_room, paths, release_memory
from megatron.training.config import shared_memory_dir

from tools import dry_run as dry_run_cli
from tools import memory_level
from trainer_launch import TINY_MODEL, _kill_tree, after, launch


def _memory_root(save: str) -> str:
    return shared_memory_dir(save, "in_memory/node0")


def test_in_memory_versions_survive_a_kill_keep_their_pace_and_are_given_back(tmp_path,
                                                                              capsys):
    """2 ranks, an in-memory version every iteration, --save every 4. Rank 0's writer of the
    persistent save of iteration 8 is held (a disk that does not keep up): in-memory versions
    are still committed every iteration, and the persistent save due at 12 is deferred, once,
    with one line. The whole job is killed (SIGKILL) once in-memory iteration 13 is committed;
    the restart resumes from memory (newer than --save's 4), says so, continues bit-exactly,
    and at its clean end gives the memory back. The level keeps two complete versions
    (--keep-last-n-non-persistent 2, three with the one being written): on a copy of the kill's
    memory with the newest version damaged, a restart stops with the checksum error and names
    the older in-memory version, and with --ckpt-fallback-to-previous resumes from it, printing
    the killed run's losses."""
    save = str(tmp_path / "ckpt")
    memory = _memory_root(save)
    flags = TINY_MODEL + ["--save", save, "--save-interval", "4", "--async-lazy-save",
                          "--lazy-save-cache-mb", "8", "--non-persistent-ckpt-type", "in_memory",
                          "--non-persistent-save-interval", "1",
                          "--keep-last-n-non-persistent", "2",
                          # Megatron-LM's manual collection, as a user saving every iteration at
                          # GPU speed would run it: the resume must not change.
                          "--manual-gc", "--manual-gc-interval", "5"]
    seen = {"committed": False, "loss": False}

    def kill_when_ahead(line, proc):
        if line.rstrip().endswith(f"committed: {memory}/iter_0000013"):
            seen["committed"] = True
        if " iteration       15/" in line:
            seen["loss"] = True
        if seen["committed"] and seen["loss"]:
            _kill_tree(proc)

    try:
        # The copy of in-memory iteration 6 is held 2 s (the optimizer step waits for it):
        # --save's iteration 4 is then committed before 8 falls due on a loaded machine too,
        # else 8 would be deferred and the held flush would be the in-memory level's.
        first = launch(2, flags + ["--train-iters", "24"], on_line=kill_when_ahead,
                       extra_env={"DATASTATES_FAULT_DELAY_FLUSH": "600@8:0",
                                  "DATASTATES_FAULT_DELAY_COPY": "2@6"})
        assert seen["committed"] and "iteration       24/" not in first.stdout, first.describe()
        assert "in-memory checkpoints: every 1 iteration(s) into " + memory in first.stdout
        assert "(3 versions of its 2 rank(s)' checkpoints; " in first.stdout
        # tools/dry_run.py counts what this start-up check counted, before any launch.
        held = re.search(r"node 0 holds up to (\d+) MiB \(3 versions", first.stdout)
        assert dry_run_cli.main(["--world-size", "2", "--ranks-per-node", "2", "--json",
                                 str(tmp_path / "dry.json"), "--", "--train-iters", "24"]
                                + flags) == 0
        level = json.loads((tmp_path / "dry.json").read_text())["memory_level"]
        assert held and f"{level['node_bytes'][0] / 2**20:.0f}" == held.group(1), level
        assert first.stdout.count("deferred the persistent save of iteration 12:") == 1
        assert "deferred the persistent save of iteration 8" not in first.stdout
        newest = paths.tracked_iteration(memory)
        assert newest is not None and newest >= 13, first.describe()
        # It keeps its newest two (the oldest goes right after a commit: a kill in between
        # leaves it too). A kill between a version's commit marker and its tracker (seen under
        # load) leaves that version committed as well: the restart resumes from the tracker's
        # and removes it.
        kept = paths.complete_iterations(memory)
        assert newest in kept and kept[-1] in (newest, newest + 1) and 2 <= len(kept) <= 3, \
            (kept, newest)
        previous = max(it for it in kept if it < newest)
        # tools/memory_level.py tells what the killed job left on this node.
        memory_level.main([save])
        told = capsys.readouterr().out
        assert "holds " in told and f"for --save {save} (its newest complete checkpoint: " \
            "iteration 4)" in told, told
        assert f"  in_memory/node0: complete iteration(s) {kept}, a restart takes {newest}" \
            in told and f"newer than --save's: iteration(s) {kept}" in told, told
        # Each rank's engine reuses one shard file per version held, and no other.
        assert sorted(os.listdir(os.path.join(memory, ".datastates_slots"))) == [
            f"r0000{r}-{k}.bin" for r in (0, 1) for k in range(3)]
        assert paths.tracked_iteration(save) == 4 and paths.complete_iterations(save) == [4]
        assert {"COMMIT.json", "common.pt", "metadata.json", "done_r00000.json",
                "done_r00001.json"} <= set(os.listdir(os.path.join(memory, f"iter_{newest:07d}")))

        # A copy of --save and of the memory (under the copy's root) with the newest version
        # damaged: the error names the older one in memory; the fallback resumes from it.
        copy = str(tmp_path / "copy")
        shutil.copytree(save, copy)
        shutil.copytree(memory, _memory_root(copy))
        with open(os.path.join(_memory_root(copy), f"iter_{newest:07d}", "shard_r00000.bin"),
                  "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0xFF]))
        on_copy = [copy if f == save else f for f in flags] + ["--load", copy,
                                                                "--train-iters", "24"]
        damaged = launch(2, on_copy)
        assert damaged.returncode != 0 and "checksum mismatch" in damaged.stderr, \
            damaged.describe()
        assert f"pass --ckpt-fallback-to-previous to resume from iteration {previous}, " \
            in damaged.stderr, damaged.describe()
        fallback = launch(2, on_copy + ["--ckpt-fallback-to-previous",
                                        "--exit-interval", str(previous + 2)])
        assert fallback.returncode == 0, fallback.describe()
        assert f"WARNING: --ckpt-fallback-to-previous: resuming from iteration {previous} " \
            f"instead of {newest}; skipped: iteration {newest}: " in fallback.stdout
        # The killed run printed at least the newest version's iteration, previous + 1 or later.
        resumed_two = after(fallback.losses(), previous)
        both = {it: v for it, v in resumed_two.items() if it in first.losses()}
        assert len(resumed_two) == 2 and both and both == {
            it: first.losses()[it] for it in both}, (first.losses(), fallback.losses())

        resumed = launch(2, flags + ["--load", save, "--train-iters", "24"])
        assert resumed.returncode == 0, resumed.describe()
        assert (f"loading the in-memory checkpoint of iteration {newest} from {memory} "
                "(persistent: iteration 4)") in resumed.stdout
        both = {it: v for it, v in after(resumed.losses(), newest).items()
                if it in first.losses()}
        assert both and both == {it: first.losses()[it] for it in both}, (first.losses(),
                                                                         resumed.losses())
        # Clean end: --save holds the last iteration, so the memory is given back.
        assert paths.tracked_iteration(save) == 24
        assert "in-memory checkpoints: removed iteration(s)" in resumed.stdout
        assert not os.path.exists(memory) and not os.path.exists(os.path.dirname(memory))
        # The copy's memory, which no clean end gave back: removed with what it loses.
        memory_level.main([copy, "--remove"])
        told = capsys.readouterr().out
        top = os.path.dirname(os.path.dirname(_memory_root(copy)))
        assert f"removed {top} (" in told and "; lost iteration(s) [" in told, told
        assert not os.path.exists(top)
        memory_level.main([save])
        assert f"no shared memory held for --save {save}" in capsys.readouterr().out
    finally:
        for root in (save, str(tmp_path / "copy")):
            shutil.rmtree(os.path.dirname(os.path.dirname(_memory_root(root))),
                          ignore_errors=True)


def test_torchrun_max_restarts_resumes_from_memory(tmp_path):
    """`torchrun --max-restarts 1`, as Megatron-LM users launch for elastic restarts: one rank is
    SIGKILLed once the in-memory version of iteration 9 is committed; torchrun starts both
    workers again on the same node, which resume from memory (newer than --save's 5), print the
    killed attempt's losses bit for bit and end with status 0. Before, every restarted worker
    failed in init_process_group (the agent's store still held the first attempt's addresses)."""
    import psutil

    save = str(tmp_path / "ckpt")
    memory = _memory_root(save)
    flags = TINY_MODEL + ["--num-layers", "2", "--train-iters", "16", "--save", save, "--load",
                          save, "--save-interval", "5", "--async-lazy-save",
                          "--non-persistent-ckpt-type", "in_memory",
                          "--non-persistent-save-interval", "1"]
    killed = []

    def kill_a_rank(line, proc):
        if not killed and line.rstrip().endswith(f"committed: {memory}/iter_0000009"):
            ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                     if "pretrain_gpt.py" in " ".join(p.cmdline())]
            assert len(ranks) == 2, ranks
            ranks[-1].kill()
            killed.append(line)

    try:
        run = launch(2, flags, on_line=kill_a_rank, torchrun_args=["--max-restarts", "1"])
        assert killed and run.returncode == 0, run.describe()
        (resumed,) = re.findall(r"loading the in-memory checkpoint of iteration (\d+) from "
                                + re.escape(memory) + r" \(persistent: iteration (\d+)\)",
                                run.stdout)
        assert int(resumed[0]) >= 9 and int(resumed[1]) == 5, resumed
        # Each iteration after the resume printed twice where the first attempt got that far:
        # the same loss both times.
        printed = re.findall(r" iteration\s+(\d+)/\s*16 \|.*? lm loss: (\S+) \|", run.stdout)
        losses = {}
        for it, loss in printed:
            losses.setdefault(int(it), set()).add(loss)
        assert sorted(losses) == list(range(1, 17)) and all(len(v) == 1 for v in
                                                            losses.values()), printed
        assert paths.tracked_iteration(save) == 16 and not os.path.exists(memory)
    finally:
        shutil.rmtree(os.path.dirname(os.path.dirname(memory)), ignore_errors=True)


def test_a_failed_commit_stops_every_rank_with_one_line_and_keeps_the_newest_version(tmp_path):
    """2 ranks, an in-memory version every iteration; rank 0's commit of iteration 3 fails. The
    next save settles that commit inside its plan check (one all-reduce): both ranks stop with
    one error naming rank 0 and iteration 3, iteration 2 stays the newest complete version, and
    the directory that next save had prepared (iteration 4) is not left behind."""
    save = str(tmp_path / "ckpt")
    memory = _memory_root(save)
    try:
        run = launch(2, TINY_MODEL + ["--num-layers", "2", "--train-iters", "6", "--save", save,
                                      "--save-interval", "100", "--async-lazy-save",
                                      "--non-persistent-ckpt-type", "in_memory",
                                      "--non-persistent-save-interval", "1"],
                     extra_env={"DATASTATES_FAULT_FAIL_COMMIT": "error@3:0"})
        assert run.returncode != 0, run.describe()
        errors = [ln for ln in run.stderr.splitlines() if "CheckpointError" in ln]
        assert len(errors) == 1 and "DataStates save of iteration 3 failed on rank(s) [0]: " \
            "injected failure of step 'commit'" in errors[0], run.describe()
        assert paths.tracked_iteration(memory) == 2, run.describe()
        assert paths.complete_iterations(memory) == [2]
        assert sorted(n for n in os.listdir(memory) if n.startswith("iter_")) == \
            ["iter_0000002", "iter_0000003"], run.describe()
    finally:
        shutil.rmtree(os.path.dirname(os.path.dirname(memory)), ignore_errors=True)


def test_an_in_memory_version_every_iteration_costs_the_training_thread_no_collective(tmp_path):
    """What the training thread pays per in-memory iteration on 2 ranks, counted by
    benchmarks/save_stall_profile.py (tiny model): no control-plane collective and no
    file-system call. The save worker makes a steady save (its files, and its plan check, which
    also settles the previous commit) during the next forward/backward, and that version's
    agreement during the optimizer step. Megatron's timer report of each save call is printed
    once per committed version, from the agreement's figures (no collective of its own). The
    saves' sharded state comes from the previous save's (state_cache) but the first."""
    save = str(tmp_path / "ckpt")
    memory = _memory_root(save)
    tiny = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
            "--vocab-size 255 --non-persistent-ckpt-type in_memory "
            f"--non-persistent-save-interval 1 --save-interval 100 --save {save}")
    try:
        run = launch(2, ["--config", "small", "--iters", "6", "--extra", tiny],
                     entry="benchmarks/save_stall_profile.py")
        assert run.returncode == 0, run.describe()
        # Each rank's report (not anchored: the two ranks' reports may share a line).
        counts = re.findall(r"control-plane collectives per iteration\s+(\S+)", run.stdout)
        assert counts == ["0", "0"], run.describe()
        files = re.findall(r"file-system calls per iteration \(training thread\)\s+(\S+)",
                           run.stdout)
        assert files == ["0", "0"], run.describe()
        timers = run.stdout.count("save-checkpoint-non-persistent ....")
        committed = len(re.findall(r"committed: \S*/in_memory/node0/iter_", run.stdout))
        assert timers == committed == 6, run.describe()  # one per iteration
        # The final save into --save reports its own, when it commits.
        assert run.stdout.count("save-checkpoint ....") == 1, run.describe()
        # Each save but the first took the model's and the optimizer's sharded state from the
        # previous one (state_cache). 7 saves: 6 in memory, the final one into --save.
        kept = re.findall(r"state kept between saves \(reused/built\): model (\d+)/(\d+), "
                          r"optimizer (\d+)/(\d+)", run.stdout)
        assert kept == [("6", "1", "6", "1")] * 2, run.describe()
        # Retention: on the leader's commit thread (the older version removed right after the
        # tracker, off the loop), --save's too.
        where = re.findall(r"retention runs \(training thread/other threads\): (\d+)/(\d+)",
                           run.stdout)
        assert sorted(where) == [("0", "0"), ("0", "7")], run.describe()
    finally:
        shutil.rmtree(os.path.dirname(os.path.dirname(memory)), ignore_errors=True)


def test_too_little_shared_memory_is_refused_naming_need_and_free(tmp_path, one_rank_group):
    root = str(tmp_path / "mem" / "node0")
    free = shutil.disk_usage(tmp_path).free
    room = check_memory_room(root, 0, 0, 1 << 20)
    assert room.need_bytes == 2 << 20 and room.ranks == 1 and room.free_bytes > 0
    with pytest.raises(CheckpointError) as err:
        check_memory_room(root, 0, 0, free)  # two versions of that cannot fit
    text = str(err.value)
    assert f"node 0 needs {2 * free / 2**20:.0f} MiB for 2 versions of its 1 rank(s)'" in text
    assert "MiB is free" in text and "Nothing was saved or removed" in text
    assert err.value.ranks == [0] and not os.path.exists(root)


def _fake_version(root: str, iteration: int, run_config: dict) -> None:
    os.makedirs(paths.checkpoint_dir(root, iteration))
    with open(os.path.join(root, paths.RUN_CONFIG_FILENAME), "w") as f:
        json.dump(run_config, f)
    with open(os.path.join(root, paths.TRACKER_FILENAME), "w") as f:
        f.write(str(iteration))


def test_memory_of_another_model_or_layout_is_skipped_with_its_reason(tmp_path):
    from megatron.training.checkpointing.loading import _foreign_reason
    from test_trainer_units import config

    ours = config("--save /s --async-lazy-save --non-persistent-save-interval 1 "
                  "--non-persistent-ckpt-type in_memory")
    root = str(tmp_path / "mem")
    assert _foreign_reason(root, ours) == (None, False)  # nothing there
    saved = json.loads(ours.to_json())
    _fake_version(root, 7, saved)
    assert _foreign_reason(root, ours) == (None, False)
    saved["parallel"]["tensor_model_parallel_size"] = 2
    saved["parallel"]["world_size"] = 2
    _fake_version(str(tmp_path / "tp2"), 7, saved)
    why, other_layout = _foreign_reason(str(tmp_path / "tp2"), ours)
    assert "saved at parallel layout {'tp': 2" in why and other_layout  # assembled for ours
    wider = json.loads(ours.to_json())
    wider["model"]["hidden_size"] *= 2
    wider["parallel"]["world_size"] = 2  # another model at another layout: the model decides
    _fake_version(str(tmp_path / "wider"), 7, wider)
    why, other_layout = _foreign_reason(str(tmp_path / "wider"), ours)
    assert why.startswith("saved by another model (hidden_size: ") and " here" in why
    assert not other_layout
    # Memory of a --load that was removed (`rm -rf` to start over) or made anew since: the run
    # that saved it prepared --load at its start (the tracker's spare), so it is not this one's.
    load = str(tmp_path / "load")
    resumed = config(f"--save {load} --load {load} --async-lazy-save "
                     "--non-persistent-save-interval 1 --non-persistent-ckpt-type in_memory")
    why, other_layout = _foreign_reason(root, resumed)
    assert why == (f"{load} holds no trace of the run that saved it (neither its "
                   "latest_checkpointed_iteration.txt nor the spare made at its start): "
                   f"{load} was removed or made anew since") and not other_layout
    os.makedirs(load)
    assert _foreign_reason(root, resumed)[0] == why  # made anew: empty
    paths.prepare_root(load)  # what the run that saved it did at its start
    assert _foreign_reason(root, resumed) == (None, False)


def test_memory_is_given_back_only_when_save_is_as_new(tmp_path):
    memory, save = str(tmp_path / "m" / "in_memory" / "node0"), str(tmp_path / "save")
    _fake_version(memory, 9, {})
    _fake_version(save, 8, {})
    assert release_memory(memory, save) == [] and paths.tracked_iteration(memory) == 9
    _fake_version(save + "2", 9, {})
    assert release_memory(memory, save + "2") == [9]
    assert not os.path.exists(memory) and not os.path.exists(str(tmp_path / "m"))
