"""--ckpt-verify-replicas: data-parallel replicas compared before a version commits (issue 33).

Units: fingerprints (host CRC pieces; the device-side sum on CPU tensors), the comparison's words
for two replicas and for a minority of three. Then two launches with one bit of one rank's
parameter replica flipped before save 4: DP2 stops naming the tensor and both ranks, `latest`
stays at 2; DP3 with the distributed optimizer and --ckpt-failure-policy continue names the
minority rank, goes on, and commits save 6 (the optimizer step's all-gather repaired the copy).
"""
import re

import torch

from datastates.megatron_adapter.save.replica_check import PIECE_BYTES, compare, fingerprint

from trainer_launch import TINY_MODEL, launch


def test_fingerprints_change_with_one_flipped_bit_and_locate_its_piece():
    t = torch.arange(3 * PIECE_BYTES // 4 + 5, dtype=torch.float32)  # 3 pieces and a bit
    for device_side in (False, True):  # the GPU's sum runs on any device
        before = fingerprint(t, device_side)
        flipped = t.clone()
        flipped.view(torch.uint8)[PIECE_BYTES + 17] ^= 4  # one bit in the second piece
        after = fingerprint(flipped, device_side)
        assert len(before) == 4 and before != after
        assert [i for i, (a, b) in enumerate(zip(before, after)) if a != b] == [1]
        assert fingerprint(t.clone(), device_side) == before  # the same bytes, the same prints
    bf16 = torch.ones(10, dtype=torch.bfloat16)
    assert fingerprint(bf16) == fingerprint(bf16.clone()) and len(fingerprint(bf16)) == 1


def test_comparison_names_both_of_two_and_the_minority_of_three():
    box = ("decoder.weight", (0, 0), 3 * PIECE_BYTES)
    two = compare({0: {box: [1, 2, 3]}, 1: {box: [1, 9, 3]}})
    assert two == [f"replicas of decoder.weight (global offset [0, 0], bytes {PIECE_BYTES}-"
                   f"{2 * PIECE_BYTES} of {3 * PIECE_BYTES}) disagree between rank(s) [0, 1] (no "
                   "majority tells which copy is corrupted)"]
    three = compare({0: {box: [1, 2, 3]}, 1: {box: [1, 2, 3]}, 2: {box: [1, 2, 7]}})
    assert three == [f"replicas of decoder.weight (global offset [0, 0], bytes "
                     f"{2 * PIECE_BYTES}-{3 * PIECE_BYTES} of {3 * PIECE_BYTES}) disagree: "
                     "rank(s) [2] differ from rank(s) [0, 1] (the minority is the likely "
                     "corrupted copy)"]
    # Agreeing replicas, and a box one rank alone holds (a distributed-optimizer shard): quiet.
    other = ("optimizer.shard", (0,), 8)
    assert compare({0: {box: [1], other: [5]}, 1: {box: [1]}}) == []


FLAGS = TINY_MODEL + ["--num-layers", "2", "--save-interval", "2", "--async-lazy-save",
                      "--ckpt-verify-replicas"]
_COMMITTED = re.compile(r" checkpoint iteration\s+(\d+) \|.*committed: ")


def test_dp2_refuses_the_save_and_stops_naming_tensor_and_ranks(tmp_path):
    save = tmp_path / "save"
    run = launch(2, FLAGS + ["--train-iters", "6", "--save", str(save)],
                 extra_env={"DATASTATES_FAULT_FLIP_BIT": "any@4:1"})
    assert run.returncode != 0, run.describe()
    assert "ReplicaMismatch: [rank 0, file " in run.stderr and (
        "the replica check of iteration 4 failed on rank(s) [0, 1]: replicas of "
        "embedding.word_embeddings.weight (global offset [0, 0], bytes 0-") in run.stderr, \
        run.describe()
    # Every assertion names the run: this test failed once under a loaded two-worker suite,
    # with nothing to tell which of these it was.
    assert "disagree between rank(s) [0, 1] (no majority tells which copy is corrupted)" in \
        run.stderr, run.describe()
    assert run.stderr.count("ReplicaMismatch") == 1, run.describe()  # one line, printed once
    tracker = save / "latest_checkpointed_iteration.txt"
    assert tracker.is_file() and tracker.read_text().strip() == "2", run.describe()
    assert "(complete: 1; refused, replicas disagreed: 1)" in run.stdout, run.describe()


def test_dp3_names_the_minority_and_with_continue_commits_once_repaired(tmp_path):
    save = tmp_path / "save"
    run = launch(3, FLAGS + ["--train-iters", "6", "--save", str(save), "--global-batch-size",
                             "12", "--use-distributed-optimizer", "--ckpt-failure-policy",
                             "continue", "--tensorboard-dir", str(tmp_path / "tb")],
                 extra_env={"DATASTATES_FAULT_FLIP_BIT": "any@4:2"})
    assert run.returncode == 0, run.describe()
    assert ("disagree: rank(s) [2] differ from rank(s) [0, 1] (the minority is the likely "
            "corrupted copy)") in run.stdout, run.describe()
    assert "Continuing (--ckpt-failure-policy continue) without this checkpoint" in run.stdout
    assert sorted(int(m[1]) for m in _COMMITTED.finditer(run.stdout)) == [2, 6]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert "(complete: 2; refused, replicas disagreed: 1)" in run.stdout
    from test_trainer_logging import _scalars

    assert dict(_scalars(tmp_path / "tb")["checkpoint/replica-mismatches"]) == {4: 1.0}
