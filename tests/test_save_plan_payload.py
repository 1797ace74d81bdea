"""The engine payload refilled from a cached plan (`megatron_adapter.payload.PayloadPlan`) is
exactly what flattening the payload from scratch gives, and any change in what the plan holds
makes it plan again. Pure unit tests: no process group, no engine."""
import random

import numpy as np
import pytest
import torch

from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

from datastates.flatten import TensorShard, decode_skeleton, flatten_state
from datastates.megatron_adapter.save.payload import PayloadPlan, engine_payload

ENTRY_FIELDS = ("key", "global_shape", "global_offset", "is_shard", "dtype", "shape", "nbytes")


def _tensor(key, data, prepend=0, replica=0, offset=None):
    shape = tuple(data.shape)
    gshape = (2,) * prepend + shape
    goff = offset if offset is not None else (1,) * prepend + (0,) * len(shape)
    return ShardedTensor(key, data, data.dtype, shape, gshape, goff,
                         (1,) * (prepend + len(shape)), replica_id=replica,
                         prepend_axis_num=prepend)


def _state(step, b_shape=(3, 4), b_dtype=torch.float32, b_key="b", b_prepend=1):
    """A sharded state dict like a trainer's: prepended layer axes, a replica this rank does not
    write, a parameter that requires grad, objects with an RNG state and a tensor."""
    gen = torch.Generator().manual_seed(step)
    w = torch.nn.Parameter(torch.randn(4, 2, generator=gen))
    rng = random.Random(step)
    return {
        "w": _tensor("w", w),
        "layers": [_tensor(b_key, torch.randn(b_shape, generator=gen).to(b_dtype),
                           prepend=b_prepend),
                   _tensor("c", torch.randn(5, generator=gen), prepend=1, replica=(0, 1))],
        "opt": {"exp_avg": _tensor("exp_avg.w", torch.randn(4, 2, generator=gen))},
        "rng": ShardedObject("rng", {"random": rng.getstate(), "np": np.arange(step, step + 3),
                                     "torch": torch.randint(0, 255, (8,), generator=gen,
                                                            dtype=torch.uint8),
                                     "inf": [1.0, float("inf"), True, None, "s"]},
                             (1,), (0,), replica_id=0),
        "extra_obj": ShardedObject("other", step, (1,), (0,), replica_id=1),
    }


def _extra(step):
    return [TensorShard(torch.full((2, 3), float(step)), "distopt", (4, 3), (2, 0))]


def _bytes(t):
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def _assert_same_as_scratch(flat, sd, extra):
    skeleton, entries = flatten_state(engine_payload(sd, extra), allow_pickle=False)
    assert flat.skeleton == skeleton
    assert len(flat.entries) == len(entries)
    for got, want in zip(flat.entries, entries):
        assert all(getattr(got, f) == getattr(want, f) for f in ENTRY_FIELDS), got.key
        assert torch.equal(_bytes(got.tensor), _bytes(want.tensor)), got.key
        assert got.tensor.data_ptr() == want.tensor.data_ptr()  # the live tensor: nothing copied


def test_refilled_payload_equals_the_payload_flattened_from_scratch():
    plan = PayloadPlan()
    for step in (1, 2, 3):
        sd, extra = _state(step), _extra(step)
        _assert_same_as_scratch(plan.flatten(sd, extra, allow_pickle=False), sd, extra)
    assert (plan.built, plan.refilled) == (1, 2)
    # The objects are encoded anew each save: step 3's RNG state decodes back as it was.
    flat = plan.flatten(_state(3), _extra(3), allow_pickle=False)
    objects = decode_skeleton(flat.skeleton, [e.tensor for e in flat.entries], False)["objects"]
    rng = objects[_state(3)["rng"].unique_key]
    assert rng["random"] == random.Random(3).getstate()
    assert rng["inf"] == [1.0, float("inf"), True, None, "s"]


@pytest.mark.parametrize("change", [
    dict(b_shape=(3, 5)), dict(b_dtype=torch.bfloat16), dict(b_key="renamed"),
    dict(b_prepend=0), dict(extra=False), dict(extra_offset=True), dict(drop_c_replica=True)])
def test_any_change_the_plan_holds_plans_again(change):
    change = dict(change)
    plan = PayloadPlan()
    plan.flatten(_state(1), _extra(1), allow_pickle=False)
    extra = [] if change.pop("extra", True) is False else _extra(2)
    if change.pop("extra_offset", False):
        extra = [TensorShard(extra[0].data, "distopt", (4, 3), (0, 0))]
    drop = change.pop("drop_c_replica", False)
    sd = _state(2, **change)
    if drop:  # the tensor this rank did not write becomes one it writes
        sd["layers"][1].replica_id = 0
    flat = plan.flatten(sd, extra, allow_pickle=False)
    assert (plan.built, plan.refilled) == (2, 0)
    _assert_same_as_scratch(flat, sd, extra)
    plan.flatten(sd, extra, allow_pickle=False)  # the new plan holds the new structure
    assert plan.refilled == 1


def test_engine_saves_refilled_parameters_as_they_were_at_the_save_call(tmp_path):
    """Refilled entries hold live tensors, parameters included (the copy threads detach them):
    a transposed (non-contiguous) parameter and a contiguous one round-trip bit-exactly, and
    their update after `wait_for_snapshot` does not reach the checkpoint."""
    from datastates import CheckpointEngine, CheckpointReader, EngineConfig

    plan = PayloadPlan()
    with CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20)) as eng:
        for step in (1, 2):
            p = torch.nn.Parameter(torch.randn(6, 5, generator=torch.Generator().manual_seed(step)))
            sd = {"p": _tensor("p", p), "pt": _tensor("pt", p.t())}
            want = {k: v.data.detach().clone() for k, v in sd.items()}
            h = eng.save(plan.flatten(sd, [], allow_pickle=False), str(tmp_path / f"{step}"), step)
            eng.wait_for_snapshot()
            with torch.no_grad():
                p.add_(1.0)
            eng.wait_for_durable(h)
            reader = CheckpointReader(str(tmp_path / f"{step}"))
            for key, value in want.items():
                assert torch.equal(reader.read(key, (0, 0), tuple(value.shape)), value), key
            reader.close()
    assert (plan.built, plan.refilled) == (1, 1)


def test_colliding_names_are_never_planned():
    """Two shards named alike: the payload's dict keeps the last one; no plan is made from it
    (its entries and the tensors would not line up)."""
    plan = PayloadPlan()
    for step in (1, 2):
        sd = _state(step)
        extra = [TensorShard(torch.zeros(4, 2), "w", (4, 2), (0, 0))]  # also "w@0,0"
        _assert_same_as_scratch(plan.flatten(sd, extra, allow_pickle=False), sd, extra)
    assert (plan.built, plan.refilled) == (2, 0)


def test_plain_sequences_encode_as_before():
    """The encoder's shortcut for lists and tuples of plain values gives what encoding each item
    gives: themselves, except non-finite floats, subclasses and containers."""
    skeleton, _ = flatten_state({"t": (1, "a", None, False, 2.5), "l": [3, 4],
                                 "nan": [float("nan")], "np": [np.int64(7)], "mixed": [1, [2]]},
                                allow_pickle=False)
    items = dict(skeleton["items"])
    assert items["t"] == {"__t__": "tuple", "items": [1, "a", None, False, 2.5]}
    assert items["l"] == [3, 4] and items["mixed"] == [1, [2]]
    assert items["nan"] == [{"__t__": "float", "v": "nan"}]
    assert items["np"][0]["__t__"] == "npscalar"


def test_checked_refill_takes_the_tensors_without_comparing_them():
    """`checked` (the plan check proved the structure unchanged): the refill equals flattening
    from scratch; a count that differs from the plan's still plans again."""
    plan = PayloadPlan()
    plan.flatten(_state(1), _extra(1), allow_pickle=False)
    for step in (2, 3):
        sd, extra = _state(step), _extra(step)
        _assert_same_as_scratch(plan.flatten(sd, extra, False, checked=True), sd, extra)
    assert (plan.built, plan.refilled) == (1, 2)
    sd, extra = _state(4), _extra(4)
    sd["layers"][1].replica_id = 0  # one tensor more to write than the plan holds
    _assert_same_as_scratch(plan.flatten(sd, extra, False, checked=True), sd, extra)
    assert (plan.built, plan.refilled) == (2, 2)


def test_engine_lays_out_again_when_an_object_tensor_changes_size(tmp_path):
    """Refilled saves share their plan's layout (`FlatState.layouts`) only while every entry
    keeps its size: a tensor inside an object (the plan holds none of those) that grows gets a
    layout of its own, and every tensor and object reads back as saved."""
    from datastates import CheckpointEngine, CheckpointReader, EngineConfig

    plan = PayloadPlan()
    eng = CheckpointEngine(EngineConfig(host_cache_bytes=1 << 20))
    try:
        for step, n in ((1, 3), (2, 3), (3, 700), (4, 700)):
            sd = _state(step)
            sd["rng"].data["torch"] = ((torch.arange(n) + step) % 251).to(torch.uint8)
            flat = plan.flatten(sd, _extra(step), allow_pickle=False, checked=step > 1)
            directory = str(tmp_path / f"{step}")
            eng.wait_for_durable(eng.save(flat, directory, step), timeout=60)
            reader = CheckpointReader(directory)
            objects = reader.load_objects()["objects"]
            assert torch.equal(objects[sd["rng"].unique_key]["torch"], sd["rng"].data["torch"])
            for name, at, want in (("w", (0, 0), sd["w"].data),
                                   ("distopt", (2, 0), _extra(step)[0].data)):
                got = reader.read(name, at, tuple(want.shape))
                assert torch.equal(got, want.detach()), (step, name)
            reader.close()
    finally:
        eng.close(timeout=10)
    assert (plan.built, plan.refilled) == (1, 3)
