"""Damaged checkpoints at --load: every case fails with an error naming rank, file and tensor (where
there is one) and saying what to do; --ckpt-fallback-to-previous resumes from the newest intact
older checkpoint; common.pt is never unpickled with code execution.

One training launch writes iterations 1-3 (--async-lazy-save); every damaged copy is probed by
one process (tests/faults_load_probe.py), so megatron-core starts twice in all.
"""
import json
import os
import pickle
import shutil
import subprocess
import sys
import zlib

import pytest

from trainer_launch import NO_DROPOUT, REPO, TINY_MODEL, launch

ARGS = TINY_MODEL + NO_DROPOUT + ["--eval-interval", "0"]
TRACKER = "latest_checkpointed_iteration.txt"


class _Pwned:
    """A pickle that would create a file if it were ever unpickled with code execution."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _copy(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("datastates_checkpoints.jsonl"))
    return dst


def _index(d):
    return json.load(open(os.path.join(d, "index_r00000.json")))


def _largest_tensor(d):
    return max(_index(d)["tensors"], key=lambda t: t["nbytes"])


def _rewrite_index(d, doc):
    """Forge an index consistently: also fix the crc its rank marker records."""
    raw = json.dumps(doc).encode()
    open(os.path.join(d, "index_r00000.json"), "wb").write(raw)
    marker_path = os.path.join(d, "done_r00000.json")
    marker = json.load(open(marker_path))
    marker["index_crc32"] = zlib.crc32(raw)
    json.dump(marker, open(marker_path, "w"))


def _make_cases(src, root, pwned_path):
    """name -> (--load directory, fallback flag); each damages iteration 3 of a copy."""
    cases = {}

    def case(name, damage, fallback=False):
        d = _copy(src, os.path.join(root, name))
        damage(os.path.join(d, "iter_0000003"))
        cases[name] = {"name": name, "load": d, "fallback": fallback}

    def flip(it):
        t = _largest_tensor(it)
        with open(os.path.join(it, "shard_r00000.bin"), "r+b") as f:
            f.seek(t["offset"] + t["nbytes"] // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x01]))

    def truncate(it):
        t = _largest_tensor(it)
        with open(os.path.join(it, "shard_r00000.bin"), "r+b") as f:
            f.truncate(t["offset"] + 8)

    def missing(it):
        os.remove(os.path.join(it, "shard_r00000.bin"))

    def edit_index(it):  # edited by hand: the rank marker's crc no longer matches
        doc = _index(it)
        doc["tensors"][0]["offset"] += 4096
        open(os.path.join(it, "index_r00000.json"), "w").write(json.dumps(doc))

    def traversal(it):  # forged consistently: only the file-name check can stop it
        doc = _index(it)
        doc["tensors"][0]["file"] = "../../" + TRACKER
        _rewrite_index(it, doc)

    def edit_metadata(it):
        path = os.path.join(it, "metadata.json")
        doc = json.load(open(path))
        doc["sharded_backend"] = "torch_dist"
        json.dump(doc, open(path, "w"))

    def forged_common(it):
        with open(os.path.join(it, "common.pt"), "wb") as f:
            pickle.dump({"run_config": _Pwned(pwned_path)}, f)

    case("flipped", flip)
    case("flipped_fallback", flip, fallback=True)
    case("truncated", truncate)
    case("missing", missing)
    case("edited_index", edit_index)
    case("traversal", traversal)
    case("edited_metadata", edit_metadata)
    case("forged_common", forged_common)
    case("forged_common_fallback", forged_common, fallback=True)
    return cases


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    root = tmp_path_factory.mktemp("corrupt")
    src = root / "src"
    run = launch(1, ARGS + ["--train-iters", "3", "--async-lazy-save", "--save-interval", "1",
                            "--save", str(src)])
    assert run.returncode == 0, run.describe()
    assert open(src / TRACKER).read().strip() == "3"
    pwned = str(root / "PWNED")
    cases = _make_cases(str(src), str(root), pwned)
    spec = root / "cases.json"
    spec.write_text(json.dumps(list(cases.values())))
    out = subprocess.run([sys.executable, str(REPO / "tests" / "faults_load_probe.py"), str(spec),
                          "--"] + ARGS + ["--train-iters", "3"], cwd=str(REPO), text=True,
                         capture_output=True, timeout=300,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    results = {r["name"]: r for r in (json.loads(line[6:]) for line in out.stdout.splitlines()
                                      if line.startswith("PROBE "))}
    assert sorted(results) == sorted(cases), out.stdout[-3000:] + out.stderr[-3000:]
    return results, pwned


FALLBACK_HINT = "--ckpt-fallback-to-previous to resume from iteration 2"


@pytest.mark.parametrize("name,needles", [
    ("flipped", ["checksum mismatch", "rank 0", "iter_0000003/shard_r00000.bin", "tensor '"]),
    ("truncated", ["shard file is truncated", "rank 0", "iter_0000003/shard_r00000.bin",
                   "tensor '"]),
    ("missing", ["cannot open shard file", "No such file", "rank 0",
                 "iter_0000003/shard_r00000.bin", "tensor '"]),
    ("edited_index", ["index does not match the checksum in its rank marker", "rank 0",
                      "iter_0000003/index_r00000.json"]),
    ("traversal", ["expected a plain file name inside the checkpoint directory", "rank 0",
                   "../../" + TRACKER]),
    ("edited_metadata", ["iter_0000003"]),
    ("forged_common", ["UnsafePickleError", "iter_0000003/common.pt", "common.pt holds a pickle "
                           "that names io.open", "--allow-unsafe-pickle"]),
])
def test_damage_is_named_with_what_to_do(probed, name, needles):
    results, _ = probed
    r = results[name]
    assert not r["ok"] and r["error"] is not None, r
    assert not r["error"].startswith("UNEXPECTED"), r["error"]
    for needle in needles + [FALLBACK_HINT]:
        assert needle in r["error"], (needle, r["error"])


def test_fallback_resumes_from_previous_intact_checkpoint(probed):
    results, _ = probed
    for name in ("flipped_fallback", "forged_common_fallback"):
        assert results[name]["ok"] and results[name]["iteration"] == 2, results[name]


def test_common_pt_is_never_unpickled_with_code(probed):
    _, pwned = probed
    assert not os.path.exists(pwned)


def _fallback_worker(rank, port, tmp, out):
    """One rank of `test_fallback_agrees_on_versions_every_node_holds`: each case's candidates
    are this rank's node-local root (node<rank>) and a shared --load (save); verification fails
    where the case's damaged.json says ("<rank or *>:<node or save>/<iteration>")."""
    import torch.distributed as dist

    from megatron.training.checkpointing import verify

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    results = {}
    for case in sorted(os.listdir(tmp)):
        node, save = os.path.join(tmp, case, f"node{rank}"), os.path.join(tmp, case, "save")
        damaged = set()
        for entry in json.load(open(os.path.join(tmp, case, "damaged.json"))):
            who, where = entry.split(":")
            level, it = where.split("/")
            if who in ("*", str(rank)):
                damaged.add(os.path.join(node if level == "node" else save, f"iter_{int(it):07d}"))

        def fake_verify(directory, config, damaged=damaged):
            if directory in damaged:
                raise ValueError(f"checksum mismatch in {directory}")

        verify.verify_local_share = fake_verify
        try:
            chosen = verify.newest_intact([(node, 6), (save, max(_listed(save)))], None)
            results[case] = [os.path.basename(chosen[0]), chosen[1]]
        except Exception as err:  # noqa: BLE001 - recorded for the test
            results[case] = f"{type(err).__name__}: {err}"
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _listed(root):
    return [int(n[5:]) for n in os.listdir(root) if n.startswith("iter_")]


def test_fallback_agrees_on_versions_every_node_holds(tmp_path):
    """--ckpt-fallback-to-previous with a node-local level (in_memory, local): each node holds
    its own older versions, so the ranks try only versions every rank lists, newest first over
    both levels (the level's first on equal iterations), and every rank takes the same one or
    fails with the same error, never waiting on another's collective. Two gloo ranks, one
    "node" each, iteration 6 of the level damaged on rank 1 only."""
    from trainer_launch import free_port, spawn_ranks

    cases = {  # node 0's versions, node 1's, --save's; what is damaged (see _fallback_worker)
        "a": ([4, 5, 6], [3, 5, 6], [2, 4], ["1:node/6"]),  # 5 in memory on both: 5
        "b": ([4, 6], [5, 6], [2, 3, 4], ["1:node/6"]),  # nothing older on both: --save's 4
        "c": ([2, 6], [2, 6], [3], ["1:node/6"]),  # --save's 3 before memory's 2
        "d": ([4, 5, 6], [5, 6], [4], ["1:node/6", "*:node/5", "0:save/4"]),  # none intact
    }
    root = tmp_path / "cases"
    for name, (node0, node1, save, damaged) in cases.items():
        for sub, its in (("node0", node0), ("node1", node1), ("save", save)):
            for it in its:
                version = root / name / sub / f"iter_{it:07d}"
                version.mkdir(parents=True)
                (version / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        (root / name / "damaged.json").write_text(json.dumps(damaged))
    out = tmp_path / "out"
    out.mkdir()
    spawn_ranks(_fallback_worker, 2, (free_port(), str(root), str(out)), bound_s=60)
    got = [json.loads((out / f"r{r}.json").read_text()) for r in (0, 1)]
    assert [g["a"] for g in got] == [["node0", 5], ["node1", 5]], got
    assert [g["b"] for g in got] == [["save", 4]] * 2, got
    assert [g["c"] for g in got] == [["save", 3]] * 2, got
    for g in got:
        assert g["d"].startswith("CheckpointError: ") and "no intact checkpoint under" in g["d"] \
            and "iteration 6: " in g["d"] and "iteration 5: " in g["d"] \
            and f"iteration 4 of {root / 'd' / 'save'}: " in g["d"], g["d"]
