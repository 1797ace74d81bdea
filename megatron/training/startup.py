"""Start-up of every entry point (the trainer, the converters, the tools): megatron-core imported
once, quietly and without compiling anything it may never call.

`import megatron.core` decorates its fused kernels (bias + GeLU/GeGLU/SwiGLU, bias + dropout +
add, ...) with `torch.compile` at import time, which imports TorchDynamo and Inductor (with
sympy): 1.7 s of a 3.8 s import on our CPU machines, in every process, before the first flag is
read. torch.compile only compiles at a function's first call anyway; `import_megatron_core` hands
megatron-core a `torch.compile` that waits for that first call too, so the compiler is imported
when a fused kernel is first used (the `--bias-*-fusion` flags; none by default), and compiles
exactly what it compiled before. Nothing else changes: torch.compile is restored right after.

It also imports `wandb` and `torch.utils.tensorboard` (0.3 s and 0.2 s, in every process) only to
compare a timer writer with them and to log its inference engine's metrics, neither of which this
trainer uses: during the import they fail to import there, as if not installed. Our own
`--wandb-project` and `--tensorboard-dir` logging imports them for real when asked (`metrics.py`).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from typing import Any, Callable, Iterator

import torch

__all__ = ["compile_deferred", "exit_without_final_gc", "import_megatron_core",
           "unused_imports_skipped"]


def import_megatron_core() -> None:
    """Import megatron-core with its warning filters (`warning_filters.install`) and its
    decorators' compilation deferred to first use; idempotent."""
    from megatron.training import warning_filters

    warning_filters.install()  # before the import: its import-time warnings are the loudest
    if "megatron.core" in sys.modules:
        return
    with compile_deferred(), unused_imports_skipped():
        importlib.import_module("megatron.core")


@contextlib.contextmanager
def compile_deferred() -> Iterator[None]:
    """While inside, `torch.compile(fn)` returns a function that compiles `fn` at its first call
    (what torch.compile does anyway, without importing the compiler now). For a tool that may
    import megatron-core deep inside a command (e.g. to read a checkpoint's saved `args`)."""
    real = torch.compile
    torch.compile = _deferred(real)
    try:
        yield
    finally:
        torch.compile = real


#: What megatron-core imports but this trainer does not use from it (see the module doc).
UNUSED_BY_MEGATRON = ("wandb", "torch.utils.tensorboard")


@contextlib.contextmanager
def unused_imports_skipped(names=UNUSED_BY_MEGATRON) -> Iterator[None]:
    """While inside, importing one of `names` raises ImportError (unless it is imported already);
    after, they import as usual."""
    skipped = [n for n in names if n not in sys.modules]
    for name in skipped:
        sys.modules[name] = None  # the import system's "not importable" marker
    try:
        yield
    finally:
        for name in skipped:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def exit_without_final_gc(code: int) -> None:
    """Exit with `code`, without the interpreter's final garbage collection over every object
    torch and megatron-core created (about 1 s per process on our CPU machines, after the last
    line is printed): they are frozen out of it (`gc.freeze`). Everything else of a normal exit
    still runs (atexit handlers, joins, flushes); checkpoint files are closed and made durable
    before this, never by a finalizer."""
    import gc

    gc.freeze()
    sys.exit(code)


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
