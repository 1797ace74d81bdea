"""Run pretrain_gpt.py with collectives that refuse CPU tensors the way NCCL does.

Usage (like pretrain_gpt.py): torchrun --nproc_per_node N tests/nccl_like.py ARGS...

On a GPU run the default process group and megatron-core's groups are NCCL, which accepts only
CUDA tensors. On CPU they are all gloo, so a CPU tensor on the wrong group goes unnoticed. Here,
every tensor collective called from our code (datastates/, megatron/training/) on a group that was
not created with backend="gloo" raises if a tensor is on the CPU. Exempt: megatron/training/
training.py, the training loop, whose tensors live on the training device (CUDA on a GPU run).
megatron-core's own calls are not checked (they use the device on GPU runs). Barriers pass: NCCL
has them. At exit each rank prints `NCCL-LIKE rank=R checked=N` (N: our calls it checked), so a
test can tell the patch was active.
"""
import atexit
import functools
import os
import runpy
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = (os.path.join(REPO, "datastates") + os.sep, os.path.join(REPO, "megatron", "training") + os.sep)
EXEMPT = (os.path.join(REPO, "megatron", "training", "training.py"),)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter", "all_to_all",
               "all_to_all_single", "send", "recv", "isend", "irecv")

_gloo_groups = []  # groups created with backend="gloo" (kept alive, compared by identity)
_checked = [0]


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)


def _guard(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(OURS) and caller not in EXEMPT:
            _checked[0] += 1
            group = kwargs.get("group")
            if not any(group is g for g in _gloo_groups):
                cpu = [t for t in _tensors(list(args) + list(kwargs.values()))
                       if t.device.type == "cpu"]
                if cpu:
                    line = sys._getframe(1).f_lineno
                    raise RuntimeError(
                        f"NCCL-like: {name} of a CPU tensor on a non-gloo process group "
                        f"({'default group' if group is None else group}), called from "
                        f"{caller}:{line}; NCCL accepts only CUDA tensors")
        return fn(*args, **kwargs)
    return wrapper


def _install():
    for name in COLLECTIVES:
        fn = getattr(c10d, name)
        wrapped = _guard(name, fn)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    new_group = c10d.new_group

    @functools.wraps(new_group)
    def recording_new_group(*args, **kwargs):
        group = new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and str(backend).lower() == "gloo":
            _gloo_groups.append(group)
        return group

    c10d.new_group = dist.new_group = recording_new_group
    atexit.register(lambda: print(f"NCCL-LIKE rank={os.environ.get('RANK', '0')} "
                                  f"checked={_checked[0]}", flush=True))


if __name__ == "__main__":
    _install()
    entry = os.path.join(REPO, "pretrain_gpt.py")
    sys.argv = [entry] + sys.argv[1:]
    sys.path.insert(0, REPO)
    runpy.run_path(entry, run_name="__main__")
