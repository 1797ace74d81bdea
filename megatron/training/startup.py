"""Start-up of every entry point (the trainer, the converters, the tools): megatron-core imported
once, quietly and without compiling anything it may never call.

`import megatron.core` decorates its fused kernels (bias + GeLU/GeGLU/SwiGLU, bias + dropout +
add, ...) with `torch.compile` at import time, which imports TorchDynamo and Inductor (with
sympy): 1.7 s of a 3.8 s import on our CPU machines, in every process, before the first flag is
read. torch.compile only compiles at a function's first call anyway; `import_megatron_core` hands
megatron-core a `torch.compile` that waits for that first call too, so the compiler is imported
when a fused kernel is first used (the `--bias-*-fusion` flags; none by default), and compiles
exactly what it compiled before. Nothing else changes: torch.compile is restored right after.
"""
from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable

import torch

__all__ = ["import_megatron_core"]


def import_megatron_core() -> None:
    """Import megatron-core with its warning filters (`warning_filters.install`) and its
    decorators' compilation deferred to first use; idempotent."""
    from megatron.training import warning_filters

    warning_filters.install()  # before the import: its import-time warnings are the loudest
    if "megatron.core" in sys.modules:
        return
    real = torch.compile
    torch.compile = _deferred(real)
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = real


def _deferred(compile_fn: Callable) -> Callable:
    def deferred_compile(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # @torch.compile(options...) used as a decorator factory
            return lambda fn: deferred_compile(fn, **kwargs)
        if not callable(model) or isinstance(model, torch.nn.Module) or isinstance(model, type):
            return compile_fn(model, **kwargs)  # what the decorators never pass: as before
        compiled: list = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kw: Any) -> Any:
            if not compiled:
                compiled.append(compile_fn(model, **kwargs))
            return compiled[0](*args, **kw)

        return first_call_compiles

    return deferred_compile
