"""Cached save plans (`datastates.megatron_adapter.save.plan`): megatron-core's validation is
skipped only while the sharded structure is unchanged, and a changed structure is validated,
saved and loaded back correctly. One process on a one-rank gloo group, no trainer (two gloo
processes where the ranks differ)."""

import pytest
import torch

from megatron.core.dist_checkpointing import ShardedTensor, load, state_dict_utils
from megatron.core.dist_checkpointing.core import CheckpointingException


@pytest.fixture
def one_rank(one_rank_megatron, monkeypatch):
    calls = []
    real = state_dict_utils.validate_sharding_integrity
    monkeypatch.setattr(state_dict_utils, "validate_sharding_integrity",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    yield calls


def _state(shapes, step, global_shapes=None):
    """{name: ShardedTensor} holding step-dependent values (one rank holds whole tensors unless
    `global_shapes` says otherwise)."""
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        data = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        data += 1000 * step + i
        gshape = (global_shapes or {}).get(name, shape)
        out[name] = ShardedTensor(name, data, data.dtype, tuple(shape), tuple(gshape),
                                  (0,) * len(shape), tuple(g // s for g, s in zip(gshape, shape)))
    out["iteration"] = step
    return out


def _checkpointer(root, policy):
    from datastates.megatron_adapter import LazyCheckpointer, LazySaveConfig, StructurePolicy

    return LazyCheckpointer(LazySaveConfig(root=str(root), cache_bytes=1 << 20,
                                           structure_policy=StructurePolicy(policy)),
                            log=lambda _msg: None)


def _save(ckpt, step, state):
    ckpt.save(step, state)
    ckpt.before_optimizer_step()
    ckpt.poll(step)


def _load_and_check(root, step, shapes, expected=None):
    """Iteration `step` under `root` loads back as `expected` (default: `_state(shapes, step)`,
    one rank's), every tensor and nothing more."""
    import datastates  # noqa: F401  (registers our load strategy)

    expected = expected or _state(shapes, step)
    empty = {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v.data))
             for k, v in expected.items() if isinstance(v, ShardedTensor)}
    loaded = load(empty, str(root / f"iter_{step:07d}"))
    for name in shapes:
        assert torch.equal(loaded[name], expected[name].data), (step, name)
    assert set(loaded) == set(shapes) | {"iteration"} and loaded["iteration"] == step


def test_plan_reused_while_unchanged_and_rebuilt_when_the_structure_changes(tmp_path, one_rank):
    old = {"a": (4, 4), "b": (8,)}
    new = {"a": (4, 4), "b": (16,), "c": (3, 2)}  # one tensor resized, one added
    ckpt = _checkpointer(tmp_path / "ckpt", "check")
    for step, shapes in ((1, old), (2, old), (3, new), (4, new), (5, old)):
        _save(ckpt, step, _state(shapes, step))
    ckpt.finish()
    assert (ckpt.plans.rebuilt, ckpt.plans.reused) == (3, 2)
    assert len(one_rank) == 3  # megatron validated saves 1, 3 and 5 only
    assert (ckpt.payloads.built, ckpt.payloads.refilled) == (3, 2)  # the engine payload too
    for step, shapes in ((1, old), (2, old), (3, new), (4, new), (5, old)):
        _load_and_check(tmp_path / "ckpt", step, shapes)


def test_a_reused_plan_skips_megatrons_save_call_and_writes_what_it_writes(tmp_path, one_rank,
                                                                            monkeypatch):
    """While the plan is reused, the save is made from `preprocess.split`'s one walk instead of
    megatron's `dist_checkpointing.save`: common.pt, metadata.json and the shards come out as
    that call makes them (a second run whose every save goes through megatron's call)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject

    from datastates.megatron_adapter.save.plan import SavePlanCache

    calls = []
    real = dist_checkpointing.save
    monkeypatch.setattr(dist_checkpointing, "save", lambda *a, **k: (calls.append(1),
                                                                     real(*a, **k))[1])
    shapes = {"a": (4, 4), "b": (8,)}

    def state(step):
        sd = _state(shapes, step)
        sd["optimizer"] = {"param_groups": [{"lr": 0.5 / step, "params": LocalNonpersistentObject(
            [0, 1])}], "empty": {}, "rng": ShardedObject("rng", [step], (1,), (0,))}
        return sd

    roots = {"steady": tmp_path / "steady", "megatron": tmp_path / "megatron"}
    for run, root in roots.items():
        if run == "megatron":  # every save through megatron's call, as before the steady path
            monkeypatch.setattr(SavePlanCache, "confirm", SavePlanCache.forget)
        calls.clear()
        ckpt = _checkpointer(root, "check")
        for step in (1, 2, 3):
            ckpt.save(step, state(step), content_metadata={"format": "test", "step": step})
            ckpt.before_optimizer_step()
            ckpt.poll(step)
        ckpt.finish()
        assert len(calls) == (1 if run == "steady" else 3), run
    for step in (1, 2, 3):
        for name in ("common.pt", "metadata.json"):
            a, b = (root / f"iter_{step:07d}" / name for root in roots.values())
            assert a.read_bytes() == b.read_bytes(), (step, name)
        expected = state(step)
        want = {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(expected[k].data))
                for k in shapes}
        want["rng"] = ShardedObject("rng", None, (1,), (0,))
        loaded = load(want, str(roots["steady"] / f"iter_{step:07d}"))
        assert all(torch.equal(loaded[k], expected[k].data) for k in shapes)
        assert loaded["rng"] == [step] and loaded["iteration"] == step
    common = torch.load(roots["steady"] / "iter_0000003" / "common.pt", weights_only=True)
    assert common["optimizer"] == {"param_groups": [{"lr": 0.5 / 3}], "empty": {}}
    assert common["content_metadata"] == {"format": "test", "step": 3}


def test_a_changed_invalid_structure_is_still_validated(tmp_path, one_rank):
    """A stale plan would let this save through: the second save's tensor covers half of its
    global shape and no rank holds the rest."""
    ckpt = _checkpointer(tmp_path / "ckpt", "check")
    _save(ckpt, 1, _state({"a": (4,)}, 1))
    with pytest.raises(CheckpointingException, match="Invalid access pattern"):
        ckpt.save(2, _state({"a": (4,)}, 2, global_shapes={"a": (8,)}))
    ckpt.finish()


def test_assume_constant_structure_validates_the_first_save_only(tmp_path, one_rank):
    ckpt = _checkpointer(tmp_path / "ckpt", "assume_constant")
    shapes = {"a": (4, 4), "b": (8,)}
    for step in (1, 2, 3):
        _save(ckpt, step, _state(shapes, step))
    ckpt.finish()
    assert len(one_rank) == 1 and (ckpt.plans.rebuilt, ckpt.plans.reused) == (1, 2)
    _load_and_check(tmp_path / "ckpt", 3, shapes)


def test_assume_constant_structure_never_writes_a_stale_payload(tmp_path, one_rank):
    """Under the flag megatron's validation is skipped after the first save, but the engine
    payload's plan checks every tensor against itself: a resized and an added tensor are planned
    again and saved as they are."""
    ckpt = _checkpointer(tmp_path / "ckpt", "assume_constant")
    old, new = {"a": (4, 4), "b": (8,)}, {"a": (4, 4), "b": (16,), "c": (3, 2)}
    for step, shapes in ((1, old), (2, old), (3, new)):
        _save(ckpt, step, _state(shapes, step))
    ckpt.finish()
    assert (ckpt.payloads.built, ckpt.payloads.refilled) == (2, 1)
    _load_and_check(tmp_path / "ckpt", 2, old)
    _load_and_check(tmp_path / "ckpt", 3, new)


def _along_worker(rank, store, out):
    import torch.distributed as dist

    from datastates.megatron_adapter.save.plan import SavePlanCache, StructurePolicy

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        seen = []
        for policy in StructurePolicy:
            cache = SavePlanCache(policy)
            for step in (1, 2):  # the second save reuses the plan: no collective of its own
                shapes = {"a": (4, 4)}
                plan = cache.prepare(_state(shapes, step), along=(rank, step * (1 - rank), 0))
                cache.confirm()
                seen.append((policy.value, step, plan.along, plan.reuse_distribution))
        torch.save(seen, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_values_along_the_plan_check_are_reduced_over_every_rank_under_both_policies(tmp_path):
    """`prepare(along=...)` carries the caller's values in the plan check's all-reduce (the
    in-memory level settles its previous commit there: one round over every rank instead of
    two); each comes back as the maximum over the ranks, under ASSUME_CONSTANT too, where a
    reused plan has no all-reduce of its own. Two gloo processes."""
    import torch.multiprocessing as mp

    mp.spawn(_along_worker, args=(str(tmp_path / "store"), str(tmp_path / "seen")), nprocs=2)
    seen = [torch.load(f"{tmp_path / 'seen'}.{r}", weights_only=True) for r in (0, 1)]
    assert seen[0] == seen[1] == [
        ("check", 1, (1, 1, 0), False), ("check", 2, (1, 2, 0), True),
        ("assume_constant", 1, (1, 1, 0), False), ("assume_constant", 2, (1, 2, 0), True)]


def _deferred_worker(rank, store, roots, out):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from datastates.errors import CheckpointError

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel()
    try:
        seen = {}
        for root, first in zip(roots, (1, 11)):  # rank 0's directory of step 13 cannot be made
            ckpt = _checkpointer(root, "check")
            seen[root] = runs = []
            for step in range(first, first + 4):
                # Each rank holds its own tensor; rank 1 adds one from the third save on.
                shapes = {f"w{rank}": (4, 4),
                          **({"x1": (8,)} if rank == 1 and step >= first + 2 else {})}
                try:
                    _save(ckpt, step, _state(shapes, step))
                    runs.append((step, "saved"))
                except CheckpointError as err:
                    runs.append((step, str(err)))
                    break
            try:
                ckpt.finish()
            except CheckpointError as err:
                runs.append(("finish", str(err)))
            runs.append(("plans", ckpt.plans.rebuilt, ckpt.plans.reused))
        torch.save(seen, f"{out}.{rank}")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_a_deferred_directory_is_made_before_megatrons_call_when_another_rank_changed(
        tmp_path, monkeypatch, one_rank):
    """Rank 0 makes the version directory of a save it takes to be steady on its files thread
    (`_defers_prepare`). At the third save only rank 1's structure changes: megatron's call,
    which lists the directory on rank 0, follows, so rank 0 makes it in the call after all, and
    every rank learns whether that failed before megatron's collectives. Two runs in the same
    two gloo processes: in the first every save commits and loads back; in the second rank 0
    cannot make that directory, and both ranks stop with the same error naming rank 0's
    failure, neither hangs."""
    from trainer_launch import spawn_ranks

    # Read by the spawned processes at import: rank 0's directory of step 13 (the second run's).
    monkeypatch.setenv("DATASTATES_FAULT_FAIL_PREPARE", "eacces@13:0")
    ok, failing = tmp_path / "ok", tmp_path / "failing"
    spawn_ranks(_deferred_worker, 2, (str(tmp_path / "store2"), (str(ok), str(failing)),
                                      str(tmp_path / "seen")))
    seen = [torch.load(f"{tmp_path / 'seen'}.{r}", weights_only=True) for r in (0, 1)]

    def check(root, step, changed):  # each rank's own tensors, as `_deferred_worker` saves them
        ranks = [{"w0": (4, 4)}, {"w1": (4, 4), **({"x1": (8,)} if changed else {})}]
        expected = {k: v for shapes in ranks for k, v in _state(shapes, step).items()}
        _load_and_check(root, step, {**ranks[0], **ranks[1]}, expected=expected)

    assert seen[0][str(ok)] == seen[1][str(ok)] == [(s, "saved") for s in (1, 2, 3, 4)] + [
        ("plans", 2, 2)]
    for step in (1, 2, 3, 4):
        check(ok, step, changed=step >= 3)
    # The same agreed error on both ranks (each names itself first), naming rank 0's failure.
    errors = [[e[1].split("] ", 1)[1] for e in s[str(failing)]
               if isinstance(e[1], str) and e[1] != "saved"] for s in seen]
    assert errors[0] == errors[1] and len(errors[0]) == 1, seen
    assert "save of iteration 13 failed on rank(s) [0]: [Errno 13] Permission denied" in \
        errors[0][0], seen
    assert not (failing / "iter_0000013" / "COMMIT.json").exists()
    check(failing, 12, changed=False)
