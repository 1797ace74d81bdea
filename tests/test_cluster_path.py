"""The path our users run on GPU clusters, checked on CPU: NCCL's rules for collectives, the
node-local tier, two nodes on one machine, and a lazy save that overlaps the next step."""
import os
import re
import shutil

from trainer_launch import NO_DROPOUT, REPO, TINY_MODEL, Node, after, free_port, launch

LAZY = ["--async-lazy-save", "--save-interval", "1"]
NCCL_LIKE = str(REPO / "tests" / "nccl_like.py")


def _checked_counts(stdout):
    """Per rank, the calls tests/nccl_like.py checked (two ranks' lines may interleave)."""
    return [int(n) for n in re.findall(r"NCCL-LIKE rank=\d+ checked=(\d+)", stdout)]


def test_checkpoint_collectives_run_where_nccl_would_accept_them(tmp_path):
    """Collectives on non-gloo groups refuse CPU tensors (tests/nccl_like.py): a lazy save with
    commit, then a verified resume (--ckpt-fallback-to-previous) that saves as torch_dist (fully
    parallel, Megatron-LM's default). The lazy run passes --no-ckpt-fully-parallel-save: the
    first data-parallel rank writes every replicated model shard."""
    from datastates import CheckpointReader

    lazy, dist_root = tmp_path / "lazy", tmp_path / "dist"
    args = TINY_MODEL + NO_DROPOUT + ["--eval-interval", "0", "--use-distributed-optimizer"]
    first = launch(2, args + LAZY + ["--train-iters", "4", "--exit-interval", "3",
                                      "--save", str(lazy), "--no-ckpt-fully-parallel-save"],
                   entry=NCCL_LIKE)
    assert first.returncode == 0, first.describe()
    assert (lazy / "iter_0000003" / "COMMIT.json").is_file()
    reader = CheckpointReader(str(lazy / "iter_0000003"))
    writers = {rank for key in reader.tensor_keys(shards_only=True)
               if not key.startswith("optimizer.") for rank, _, _ in reader.tensor_meta(key).shards}
    assert writers == {0}
    counts = _checked_counts(first.stdout)
    assert len(counts) == 2 and min(counts) > 0, first.stdout[-2000:]
    resumed = launch(2, args + ["--train-iters", "4", "--load", str(lazy), "--save",
                                str(dist_root), "--save-interval", "1",
                                "--ckpt-fallback-to-previous"], entry=NCCL_LIKE)
    assert resumed.returncode == 0, resumed.describe()
    assert " iteration        4/" in resumed.stdout
    assert (dist_root / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert min(_checked_counts(resumed.stdout)) > 0


def _two_nodes(args, tmp_path, name, env=None):
    """Two torchrun agents of one job (one rank each), each "node" with its own local dir;
    `env` maps a node to extra environment variables."""
    port, logs = free_port(), tmp_path / name
    logs.mkdir()
    return [Node(r, 2, 1, port, args + ["--lazy-save-local-dir", str(tmp_path / f"node{r}")],
                 logs, (env or {}).get(r)) for r in (0, 1)]


def test_two_nodes_one_lost_resume_from_local_copy_and_shared(tmp_path):
    """Two nodes on one machine save every iteration to their node-local dirs (migrated to the
    shared --save); node 1 is killed and its local dir deleted; both resume: node 0 reads its
    shards from its local copy, node 1 from --save, and the losses match an uninterrupted run.

    Node 1's copy of iteration 11 is held (a fault point), so the kill lands before the run can
    end: without it a fast machine finished every iteration before the kill, and the test
    resumed from nothing. The kill waits for the tracker to name iteration 3, not for its log
    line: the line is printed at a poll after the commit, and training may already be held
    (under load, 1 run in 5 here never printed it)."""
    args = TINY_MODEL + NO_DROPOUT + ["--eval-interval", "0", "--use-distributed-optimizer",
                                      "--train-iters", "12"]
    reference = launch(2, args)
    assert reference.returncode == 0, reference.describe()
    save = tmp_path / "save"
    lazy = args + LAZY + ["--save", str(save), "--load", str(save)]
    first = _two_nodes(lazy, tmp_path, "first", {1: {"DATASTATES_FAULT_DELAY_COPY": "600@11:1"}})
    first[0].wait_for_tracker(save, 3, timeout=240)
    first[1].kill()
    shutil.rmtree(tmp_path / "node1")
    first[0].result(timeout=60)
    latest = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= latest < 11  # iteration 11 cannot commit: node 1 never copied it
    assert (tmp_path / "node0" / f"iter_{latest:07d}").is_dir()

    second = _two_nodes(lazy, tmp_path, "second")
    runs = [n.result(timeout=240) for n in second]
    assert all(r.returncode == 0 for r in runs), runs[0].describe() + runs[1].describe()
    local_copy = tmp_path / "node0" / f"iter_{latest:07d}"
    assert f"restored shards from local {local_copy}: " in runs[0].stdout, runs[0].stdout
    node1 = [line for line in runs[1].stdout.splitlines() if "restored shards from" in line]
    assert len(node1) == 1 and "from shared " in node1[0] and "local" not in node1[0], node1
    losses = {**runs[0].losses(), **runs[1].losses()}
    assert losses == after(reference.losses(), latest), (losses, reference.losses())
    assert (save / "iter_0000012" / "COMMIT.json").is_file()
    kept = sorted(os.listdir(tmp_path / "node0"))
    assert kept == ["iter_0000011", "iter_0000012"], kept  # --lazy-save-local-keep default 2


ONE_RANK = TINY_MODEL + NO_DROPOUT + ["--eval-interval", "0"]


def _errors(run):
    return [line for line in run.stderr.splitlines() if "error:" in line]


def test_local_dir_that_cannot_be_written_is_refused_at_start(tmp_path):
    (tmp_path / "a_file").write_text("")
    bad = tmp_path / "a_file" / "local"
    run = launch(1, ONE_RANK + LAZY + ["--train-iters", "2", "--save", str(tmp_path / "save"),
                                       "--lazy-save-local-dir", str(bad)])
    assert run.returncode != 0
    assert any(f"--lazy-save-local-dir {bad} is not usable on rank 0" in e for e in _errors(run)), \
        run.describe()
    assert " iteration " not in run.stdout


def test_full_local_dir_fails_the_save_and_keeps_what_was_committed(tmp_path):
    """A node-local tmpfs with room for one checkpoint: the save that does not fit fails with an
    error naming the local file; no shared copy is committed from a partial local one. (Whether
    iteration 1 commits first depends on timing: an agreed failure stops the run at once.)"""
    from tmpfs import mounted_tmpfs

    save = tmp_path / "save"
    with mounted_tmpfs(tmp_path / "nvme", "5m") as local:
        run = launch(1, ONE_RANK + LAZY + ["--train-iters", "4", "--save", str(save),
                                           "--lazy-save-local-dir", str(local)])
    assert run.returncode != 0
    assert any("failed on rank(s) [0]" in e and f"{local}/iter_0000002" in e
               and "No space left" in e for e in _errors(run)), run.describe()
    tracker = save / "latest_checkpointed_iteration.txt"
    assert not tracker.exists() or tracker.read_text().strip() == "1"
    assert (save / "iter_0000001" / "COMMIT.json").is_file() == tracker.exists()
    assert not (save / "iter_0000002" / "COMMIT.json").exists()
    assert not (save / "iter_0000002" / "done_r00000.json").exists()


def test_local_dir_deleted_mid_run_is_a_clear_error(tmp_path):
    save, local = tmp_path / "save", tmp_path / "local"

    def delete_after_commit_2(line, proc):
        if line.startswith(" checkpoint iteration        2 |") and local.exists():
            os.rename(local, tmp_path / "gone")  # at once, like an unmount; writers may be busy
            shutil.rmtree(tmp_path / "gone", ignore_errors=True)

    # Save 3's flush waits 2 s: the run is still going when the line is read, however loaded
    # the machine (without it, the run could end before this process read the line).
    run = launch(1, ONE_RANK + LAZY + ["--train-iters", "8", "--save", str(save),
                                       "--lazy-save-local-dir", str(local)],
                 on_line=delete_after_commit_2, extra_env={"DATASTATES_FAULT_DELAY_FLUSH": "2@3"})
    assert run.returncode != 0, run.describe()
    assert any(str(local) in e and "failed on rank(s) [0]" in e for e in _errors(run)), \
        run.describe()
    latest = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert latest >= 2 and (save / f"iter_{latest:07d}" / "COMMIT.json").is_file()
    assert not local.exists()  # not recreated (an unmounted disk's mount point stays empty)
