"""Register our dist_checkpointing load strategy whenever megatron-core is (or gets) imported.

`import datastates` must be enough for stock `megatron.core.dist_checkpointing.load` to read our
checkpoints, but a plain PyTorch user must not pay megatron's multi-second import. So: if
megatron's dist_checkpointing is already imported, register now; otherwise wait for its import
to finish (a meta-path finder that wraps the package's loader) and register then.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

# The top-level package: its __init__ imports dist_checkpointing half-way through megatron.core.utils,
# so only once all of megatron.core has executed is it safe to import our adapter.
_TARGET = "megatron.core"


def _register() -> None:
    # Importing the adapter registers (its last line). When the adapter itself is what imported
    # megatron.core, this returns the half-initialised module and its own last line registers.
    from .megatron_adapter.save import strategies  # noqa: F401


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
