"""A checkpoint is untrusted input: file names read from its own metadata (index entries, rank
markers, the universal weight_map and manifest, trackers) never make a reader touch a path outside
the checkpoint directory. For every read path: a forged name with '..', an absolute path, and a
symlink to a file outside (a secret of known bytes) are refused with a CheckpointError naming the
file, and the secret's bytes come back nowhere. Checkpoints are written by the engine directly
(tier 1; no process group, no trainer)."""
import json
import os
import shutil
import zlib

import pytest
import torch

from datastates import (CheckpointEngine, CheckpointError, CheckpointReader, EngineConfig,
                        is_committed, latest_committed, step_dir, try_commit)
from datastates.fileio import read_iteration
from datastates.layout import COMMIT_FILE
from datastates.megatron_adapter import advance_tracker, open_source
from datastates.megatron_adapter.paths import resolve_checkpoint_dir
from datastates.universal import INDEX_FILE, MANIFEST_FILE, UniversalCheckpoint, write_universal
from universal_fixtures import global_tensors, reseal, write_datastates_checkpoint

TRACKER = "latest_checkpointed_iteration.txt"
INDEX, MARKER, SHARD = "index_r00000.json", "done_r00000.json", "shard_r00000.bin"


def state():
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(64, 8, generator=g), "b": torch.arange(256, dtype=torch.int32)}


def save(directory, **cfg):
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20, **cfg)) as eng:
        h = eng.save(state(), directory, step=3)
        eng.wait_for_snapshot()
        eng.wait_for_durable(h)
    assert is_committed(directory)
    return directory


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return save(str(tmp_path_factory.mktemp("engine") / "v"))


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A fresh copy of a committed engine checkpoint, and a secret file beside it (outside)."""
    d = shutil.copytree(pristine, str(tmp_path / "v"))
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"SECRET!!" * (os.path.getsize(os.path.join(d, SHARD)) // 8 + 1))
    return d, str(secret)


def _json(path):
    with open(path) as f:
        return json.load(f)


def _write(path, doc):
    with open(path, "w") as f:
        json.dump(doc, f)


def forge_index(d, edit):
    """Edit the index and fix the crc its rank marker records: a consistent forgery that only
    the path rule can stop."""
    index = _json(os.path.join(d, INDEX))
    edit(index)
    raw = json.dumps(index).encode()
    with open(os.path.join(d, INDEX), "wb") as f:
        f.write(raw)
    marker = _json(os.path.join(d, MARKER))
    marker["index_crc32"] = zlib.crc32(raw)
    _write(os.path.join(d, MARKER), marker)


def forge_marker(d, index_name):
    marker = _json(os.path.join(d, MARKER))
    marker["index"] = index_name
    _write(os.path.join(d, MARKER), marker)


def refused(fn, *needles, secret=None):
    """fn() raises CheckpointError naming every needle; the secret's bytes are not in it."""
    with pytest.raises(CheckpointError) as err:
        fn()
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    if secret is not None:
        assert b"SECRET" not in str(err.value).encode()
    return str(err.value)


def escaping_names(d, secret, link_name):
    """The three forgeries of a name: '..', absolute, and a symlink in `d` to `secret`."""
    os.symlink(secret, os.path.join(d, link_name))
    return [os.path.join("..", os.path.basename(secret)), secret, link_name]


# ------------------------------------------------------------------ DataStates engine reader
@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_index_entry_file_outside_is_refused(ckpt, kind):
    d, secret = ckpt
    name = dict(zip(["dotdot", "absolute", "symlink"], escaping_names(d, secret, "evil.bin")))[kind]

    def edit(index):
        for t in index["tensors"]:
            t["file"] = name
    forge_index(d, edit)
    msg = refused(lambda: CheckpointReader(d, verify=False).load_state(), repr(name),
                  secret=secret)
    assert ("plain file name" in msg) if kind != "symlink" else ("not inside" in msg)


def test_shard_file_that_is_a_symlink_outside_is_refused(ckpt):
    # No metadata edited at all: the shard itself is a link to the secret. verify=False, so
    # that the path rule, not a checksum, is what stops it.
    d, secret = ckpt
    os.replace(os.path.join(d, SHARD), os.path.join(d, "moved.bin"))
    os.symlink(secret, os.path.join(d, SHARD))
    refused(lambda: CheckpointReader(d, verify=False).load_state(), SHARD, secret=secret)


def test_shard_swapped_for_a_symlink_after_the_reader_opened_is_refused(ckpt):
    d, secret = ckpt
    reader = CheckpointReader(d, verify=False)  # names checked here; the shard is not open yet
    os.replace(os.path.join(d, SHARD), os.path.join(d, "moved.bin"))
    os.symlink(secret, os.path.join(d, SHARD))
    refused(lambda: reader.read("a"), SHARD, "not inside", secret=secret)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_rank_marker_index_name_outside_is_refused(ckpt, kind, tmp_path):
    d, _ = ckpt
    # The secret is a valid index with the right crc: without the rule it would be used.
    outside = str(tmp_path / "outside_index.json")
    shutil.copy(os.path.join(d, INDEX), outside)
    name = dict(zip(["dotdot", "absolute", "symlink"],
                    escaping_names(d, outside, "evil.json")))[kind]
    forge_marker(d, name)
    refused(lambda: CheckpointReader(d), repr(name))
    os.unlink(os.path.join(d, COMMIT_FILE))  # the commit path reads the same marker field
    refused(lambda: try_commit(d, 1), repr(name))


def test_index_and_markers_that_are_symlinks_outside_are_refused(ckpt, tmp_path):
    d, _ = ckpt
    for name in (INDEX, MARKER):
        copy = shutil.copytree(d, str(tmp_path / f"c_{name}"))
        outside = str(tmp_path / f"outside_{name}")
        os.replace(os.path.join(copy, name), outside)  # still valid, just moved out
        os.symlink(outside, os.path.join(copy, name))
        refused(lambda: CheckpointReader(copy), name, "not inside")


def test_node_local_copy_with_links_outside_is_refused(tmp_path):
    local_root = str(tmp_path / "local")
    d = save(str(tmp_path / "shared" / "v"), local_dir=local_root)
    local = os.path.join(local_root, "v")
    assert os.path.isfile(os.path.join(local, SHARD))
    assert CheckpointReader(d, local_dir=local_root).source(0) == local
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"SECRET!!" * (os.path.getsize(os.path.join(local, SHARD)) // 8 + 1))
    os.unlink(os.path.join(local, SHARD))
    os.symlink(str(secret), os.path.join(local, SHARD))
    refused(lambda: CheckpointReader(d, local_dir=local_root, verify=False).load_state(),
            os.path.join(local, SHARD), "not inside", secret=str(secret))


def test_links_inside_the_directory_and_a_linked_directory_still_load(ckpt, tmp_path):
    d, _ = ckpt
    os.symlink(SHARD, os.path.join(d, "alias.bin"))  # relative link to a file beside it

    def edit(index):
        for t in index["tensors"]:
            t["file"] = "alias.bin"
    forge_index(d, edit)
    os.symlink(d, str(tmp_path / "linked"))  # the checkpoint directory itself reached by a link
    loaded = CheckpointReader(str(tmp_path / "linked")).load_state()
    assert all(torch.equal(loaded[k], v) for k, v in state().items())


def test_latest_committed_skips_a_version_linked_from_outside(tmp_path):
    root = str(tmp_path / "root")
    save(step_dir(root, 10))
    elsewhere = save(str(tmp_path / "elsewhere" / "step_000000099"))
    os.symlink(elsewhere, step_dir(root, 99))
    assert latest_committed(root) == (10, step_dir(root, 10))


# ------------------------------------------------------------------ universal checkpoints
@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    base = tmp_path_factory.mktemp("universal")
    src = str(base / "iter_0000005")
    write_datastates_checkpoint(src, global_tensors())
    dst = str(base / "u")
    write_universal(open_source(src), dst, max_file_bytes=4096)
    return dst


@pytest.fixture
def ucopy(universal, tmp_path):
    """A copy of a universal checkpoint, the name and file of one tensor, and a secret outside:
    a real safetensors file holding that tensor, so that a reader which followed the forgery
    would return the secret's values."""
    from safetensors.torch import save_file

    d = shutil.copytree(universal, str(tmp_path / "u"))
    index = _json(os.path.join(d, INDEX_FILE))
    name = "decoder.final_layernorm.weight"
    secret = str(tmp_path / "secret.safetensors")
    save_file({name: torch.full((8,), 1234.5)}, secret)
    return d, name, index["weight_map"][name], secret


def forge_universal_file(d, name, file):
    """Point tensor `name` at `file` in both the weight_map and the manifest, and record their new
    checksums in the commit marker (a consistent forgery: only the file-name checks stop it)."""
    index = _json(os.path.join(d, INDEX_FILE))
    index["weight_map"][name] = file
    _write(os.path.join(d, INDEX_FILE), index)
    manifest = _json(os.path.join(d, MANIFEST_FILE))
    manifest["tensors"][name]["file"] = file
    _write(os.path.join(d, MANIFEST_FILE), manifest)
    reseal(d)


def read_one(d, name):
    with UniversalCheckpoint(d) as u:
        return u.read(name)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_universal_file_names_outside_are_refused(ucopy, kind):
    d, name, _, secret = ucopy
    file = dict(zip(["dotdot", "absolute", "symlink"],
                    escaping_names(d, secret, "evil.safetensors")))[kind]
    forge_universal_file(d, name, file)
    refused(lambda: read_one(d, name), repr(file))


def test_universal_shard_that_is_a_symlink_outside_is_refused(ucopy):
    d, name, file, secret = ucopy
    os.unlink(os.path.join(d, file))
    os.symlink(secret, os.path.join(d, file))
    refused(lambda: read_one(d, name), repr(file), "not inside")


def test_universal_shard_swapped_for_a_symlink_after_opening_is_refused(ucopy):
    d, name, file, secret = ucopy
    with UniversalCheckpoint(d) as u:
        os.unlink(os.path.join(d, file))
        os.symlink(secret, os.path.join(d, file))
        refused(lambda: u.read(name), repr(file), "not inside")


def test_universal_weight_map_that_disagrees_with_the_manifest_is_refused(ucopy):
    d, name, file, _ = ucopy
    index = _json(os.path.join(d, INDEX_FILE))
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != file)
    index["weight_map"][name] = other
    _write(os.path.join(d, INDEX_FILE), index)
    reseal(d)
    refused(lambda: UniversalCheckpoint(d), repr(other), repr(file), name, INDEX_FILE)


@pytest.mark.parametrize("meta", [INDEX_FILE, MANIFEST_FILE])
def test_universal_metadata_that_is_a_symlink_outside_is_refused(ucopy, meta, tmp_path):
    d, _, _, _ = ucopy
    outside = str(tmp_path / f"outside_{meta}")
    os.replace(os.path.join(d, meta), outside)
    os.symlink(outside, os.path.join(d, meta))
    refused(lambda: UniversalCheckpoint(d), meta, "not inside")


def test_universal_checkpoint_reached_through_a_link_still_loads(ucopy, tmp_path):
    d, name, _, _ = ucopy
    os.symlink(d, str(tmp_path / "linked"))
    assert torch.equal(read_one(str(tmp_path / "linked"), name), read_one(d, name))


# ------------------------------------------------------------------ trackers
BAD_TRACKERS = [" -5", "1_000", "\u0663", "+3", "3.0", "0x10", "release", "../../etc", "",
                "7" * 100]


def root_with(tmp_path, text, iteration=5):
    root = tmp_path / "root"
    (root / f"iter_{iteration:07d}").mkdir(parents=True)
    (root / TRACKER).write_bytes(text.encode())
    return str(root)


@pytest.mark.parametrize("text", BAD_TRACKERS)
def test_tracker_must_hold_a_plain_decimal(tmp_path, text):
    root = root_with(tmp_path, text)
    msg = refused(lambda: resolve_checkpoint_dir(root), TRACKER, "expected")
    if text == "release":
        assert "release checkpoints are not supported" in msg


def test_tracker_accepts_what_megatron_writes(tmp_path):
    root = root_with(tmp_path, "5\n")
    assert resolve_checkpoint_dir(root) == os.path.join(root, "iter_0000005")
    assert read_iteration(os.path.join(root, TRACKER)) == 5


def test_tracker_naming_a_directory_linked_from_outside_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / TRACKER).write_text("5")
    outside = tmp_path / "outside" / "iter_0000005"
    outside.mkdir(parents=True)
    os.symlink(str(outside), str(root / "iter_0000005"))
    refused(lambda: resolve_checkpoint_dir(str(root)), "iter_0000005", "not inside")


def test_tracker_that_is_a_symlink_outside_is_refused(tmp_path):
    root = tmp_path / "root"
    (root / "iter_0000005").mkdir(parents=True)
    (tmp_path / "secret.txt").write_text("5")
    os.symlink(str(tmp_path / "secret.txt"), str(root / TRACKER))
    refused(lambda: resolve_checkpoint_dir(str(root)), TRACKER, "not inside")


def test_merge_tracker_is_not_held_back_by_a_forged_number(tmp_path):
    # int() reads '1_000' as 1000, which would stop the merger from ever advancing past it.
    root = tmp_path / "u"
    root.mkdir()
    (root / TRACKER).write_text("1_000")
    advance_tracker(str(root), 5)
    assert (root / TRACKER).read_text() == "5"
    advance_tracker(str(root), 4)  # never backwards
    assert (root / TRACKER).read_text() == "5"


# The trainer's readers (megatron-core is imported: a few seconds, once).
@pytest.mark.parametrize("text", BAD_TRACKERS)
def test_trainer_read_tracker_refuses_forged_numbers(tmp_path, text):
    from megatron.training.checkpointing.contents import CheckpointError as TrainerError
    from megatron.training.checkpointing.loading import _read_tracker as read_tracker

    root = root_with(tmp_path, text)
    with pytest.raises(TrainerError) as err:
        read_tracker(root)
    assert TRACKER in str(err.value) and "expected" in str(err.value), str(err.value)


def test_trainer_read_tracker_refuses_an_iteration_linked_from_outside(tmp_path):
    from megatron.training.checkpointing.contents import CheckpointError as TrainerError
    from megatron.training.checkpointing.loading import _read_tracker as read_tracker

    root = root_with(tmp_path, "5", iteration=1)
    outside = tmp_path / "outside" / "iter_0000005"
    outside.mkdir(parents=True)
    os.symlink(str(outside), os.path.join(root, "iter_0000005"))
    with pytest.raises(TrainerError, match="iter_0000005.*not inside"):
        read_tracker(root)
    os.unlink(os.path.join(root, "iter_0000005"))
    os.symlink("iter_0000001", os.path.join(root, "iter_0000005"))  # a link inside: allowed
    assert read_tracker(root) == 5


def test_fallback_candidates_skip_links_outside_and_non_ascii_names(tmp_path):
    from datastates.megatron_adapter.paths import complete_iterations

    root = tmp_path / "root"
    for d in (root / "iter_0000001", root / "iter_\u0663", tmp_path / "outside" / "iter_0000009"):
        d.mkdir(parents=True)
        (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    os.symlink(str(tmp_path / "outside" / "iter_0000009"), str(root / "iter_0000009"))
    assert complete_iterations(str(root)) == [1]
