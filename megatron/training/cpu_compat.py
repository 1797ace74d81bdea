"""Every patch megatron-core 0.16.1 needs to train on a machine without CUDA, in one place.

``apply_cpu_patches()`` is a no-op when CUDA is available. On CPU it is called once, before the
model is built; each patch says which megatron-core call needs it (docs/TRAINER.md, "CPU
compatibility", lists them and how they were found). The patches only redirect CUDA-specific
calls to their CPU equivalents (and build the torch norms that sequence parallelism and
zero-centered weights need without apex/TE); they change no numerics. Fixes of megatron-core bugs that are not about the CPU
live in `mcore_fixes.py`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading

import torch

_APPLIED = False
_LOCK = threading.Lock()


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _redirect_device(factory):
    """Wrap a torch factory so a hard-coded ``device="cuda"`` lands on the CPU."""

    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    wrapper.__wrapped_cpu_compat__ = True
    return wrapper


# Tensor.type() is asked for the CUDA type name by a few megatron-core checks. Rather than changing
# Tensor.type() for everyone, those callers run inside this scope, where a CPU tensor answers with
# the name its CUDA twin would have.
_ORIGINAL_TENSOR_TYPE = torch.Tensor.type
_CUDA_NAMES = threading.local()


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and getattr(_CUDA_NAMES, "depth", 0) > 0:
        name = _ORIGINAL_TENSOR_TYPE(self)
        if self.device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
            return "torch.cuda." + name[len("torch."):]
        return name
    return _ORIGINAL_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def _cuda_type_names():
    _CUDA_NAMES.depth = getattr(_CUDA_NAMES, "depth", 0) + 1
    try:
        yield
    finally:
        _CUDA_NAMES.depth -= 1


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapper


def _patch_rng() -> None:
    """RNG tracker: `tensor_parallel.random.model_parallel_cuda_manual_seed` and the tracker's
    `add`/`fork` read and write CUDA generator states; back them by the CPU generator."""
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # The tracker's `fork` warns when the CPU generator moved inside a fork; here the forked
    # "CUDA" stream *is* the CPU generator, so it always moves. Drop only that message.
    logging.getLogger(mp_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage())


def _patch_devices() -> None:
    # DDP grad buffers (`param_and_grad_buffer`), the optimizer, TP mappings and p2p shape exchange
    # allocate with `device=torch.cuda.current_device()` (~170 call sites).
    torch.cuda.current_device = lambda: "cpu"
    # Hard-coded `device="cuda"`: optimizer `_scale`, `schedules` `total_num_tokens`,
    # `clip_grads` overflow buffer, `transformer.utils` causal mask.
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint"):
        factory = getattr(torch, name)
        if not getattr(factory, "__wrapped_cpu_compat__", False):
            setattr(torch, name, _redirect_device(factory))
    # PP with tied embeddings (`GPTModel.setup_embeddings_and_output_layer`: `weight.data.cuda()`)
    # and the grad scaler's `state_dict['scale'].cuda(...)`.
    torch.Tensor.cuda = lambda self, *a, **k: self
    # `p2p_communication` and DDP's `start_grad_sync` call `torch.cuda.synchronize()`.
    torch.cuda.synchronize = lambda *a, **k: None


def _patch_type_checks() -> None:
    """`clip_grads.get_grad_norm_fp32`/`clip_grad_by_total_norm_fp32`, the distributed optimizer's
    `_build_model_and_main_param_groups` and `Float16OptimizerWithFloat16Params.__init__` accept
    only `torch.cuda.*Tensor` type names."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    torch.Tensor.type = _tensor_type
    for fn_name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32"):
        setattr(clip_grads, fn_name, _with_cuda_type_names(getattr(clip_grads, fn_name)))
    # optimizer.py imported the clip functions by name before we wrapped them.
    for fn_name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32"):
        if hasattr(optimizer, fn_name):
            setattr(optimizer, fn_name, getattr(clip_grads, fn_name))
    # Both constructors build their param groups (and run the checks) inside __init__.
    for cls in (distrib_optimizer.DistributedOptimizer, optimizer.Float16OptimizerWithFloat16Params):
        cls.__init__ = _with_cuda_type_names(cls.__init__)


class _LayerNorm1p(torch.nn.LayerNorm):
    """LayerNorm scaled by 1 + weight (zero-centered weight, as megatron-core's fused norms)."""

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1,
                                              self.bias, self.eps)


class _RMSNorm1p(torch.nn.RMSNorm):
    """RMSNorm scaled by 1 + weight (zero-centered weight, as transformer-engine's)."""

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


_ONE_P = {torch.nn.LayerNorm: _LayerNorm1p, torch.nn.RMSNorm: _RMSNorm1p}


def _patch_norms() -> None:
    """Without apex/TE, `transformer.torch_norm.WrappedTorchNorm` asserts that sequence parallel
    and zero-centered weights (--apply-layernorm-1p) are off. Sequence parallel: a torch norm whose
    params carry `sequence_parallel=True` is what the fused norms do (DDP all-reduces those grads
    over the TP group). Zero-centered: the same norm with its weight at 0, scaling by 1 + weight
    (as megatron-core's FusedLayerNorm and TE's norms with `zero_centered_gamma`)."""
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
            normalization="LayerNorm"):
        sp, one_p = config.sequence_parallel, config.layernorm_zero_centered_gamma
        if not (sp or one_p):
            return original_new(cls, config, hidden_size, eps, persist_layer_norm,
                                zero_centered_gamma, normalization)
        plain = _shallow_copy(config, sequence_parallel=False,
                              layernorm_zero_centered_gamma=False)
        norm = original_new(cls, plain, hidden_size, eps, persist_layer_norm, False,
                            normalization)
        if one_p:
            norm.__class__ = _ONE_P[type(norm)]  # same parameters, its forward
            torch.nn.init.zeros_(norm.weight)
        for param in norm.parameters() if sp else ():
            setattr(param, "sequence_parallel", True)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


def _shallow_copy(config, **changes):
    import copy

    clone = copy.copy(config)
    for key, value in changes.items():
        object.__setattr__(clone, key, value)
    return clone


def apply_cpu_patches() -> bool:
    """Patch megatron-core for CPU training; returns True when patches were (or are) applied."""
    global _APPLIED
    if cuda_available():
        return False
    with _LOCK:
        if not _APPLIED:
            _patch_rng()
            _patch_devices()
            _patch_type_checks()
            _patch_norms()
            _APPLIED = True
    return True
