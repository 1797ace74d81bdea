"""CI check: no code of ours deserializes pickles outside `datastates/safe_load.py`'s opt-in paths.

Reads every Python file of the repository with `ast` (never imports it) and fails on:
- `torch.load(...)` without a literal `weights_only=True`;
- any `weights_only=False`;
- `pickle.load`, `pickle.loads`, `pickle.Unpickler`, `numpy.load(..., allow_pickle=True)`;
- PyTorch DCP's `FileSystemReader(...)` (its `read_metadata` is a plain `pickle.load`: use
  `datastates.safe_dcp.SafeFileSystemReader`).
The allowed places are listed by (file, function) below; each is the body of an explicit opt-in.
"""
import ast
import os
from pathlib import Path
from typing import Dict, List, Set, Tuple

REPO = Path(__file__).resolve().parent.parent
# runs/, data/, checkpoints/: what the README's commands write (DeepSpeed copies its own
# zero_to_fp32.py into every save directory), not our code.
SKIP_DIRS = {".venv", ".git", "__pycache__", "build", "dist", ".eggs", "runs", "data",
             "checkpoints"}
# (path relative to the repo, enclosing function) -> why it may deserialize a pickle
ALLOWED: Dict[Tuple[str, str], str] = {
    ("datastates/safe_load.py", "torch_load"): "--allow-unsafe-pickle opt-in",
    ("datastates/safe_load.py", "opt_in_pickle_loads"): "EngineConfig(allow_pickle=True) opt-in",
    ("datastates/safe_load.py", "read_dcp_metadata"): "--allow-unsafe-pickle opt-in",
    ("datastates/safe_load.py", "_MetadataUnpickler"): "the restricted unpickler itself",
}


def _dotted(node: ast.AST, aliases: Dict[str, str]) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _kw(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_const(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


class _Checker(ast.NodeVisitor):
    def __init__(self, rel: str):
        self.rel = rel
        self.aliases: Dict[str, str] = {}
        self.scope: List[str] = []
        self.problems: List[str] = []

    def _allowed(self) -> bool:
        return any((self.rel, s) in ALLOWED for s in self.scope)

    def _flag(self, node: ast.AST, what: str) -> None:
        if not self._allowed():
            self.problems.append(f"{self.rel}:{node.lineno}: {what}")

    def visit_Import(self, node):
        for a in node.names:
            self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def visit_ImportFrom(self, node):
        for a in node.names:
            self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def _scoped(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node: ast.Call):
        name = _dotted(node.func, self.aliases)
        wo = _kw(node, "weights_only")
        if wo is not None and _is_const(wo, False):
            self._flag(node, f"{name}(weights_only=False)")
        if name in ("torch.load", "torch.serialization.load") and not _is_const(wo, True):
            self._flag(node, f"{name} without weights_only=True")
        if name in ("pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load",
                    "_pickle.loads", "dill.load", "dill.loads", "cloudpickle.load",
                    "cloudpickle.loads"):
            self._flag(node, name)
        if name in ("numpy.load", "np.load") and _is_const(_kw(node, "allow_pickle"), True):
            self._flag(node, f"{name}(allow_pickle=True)")
        if name.endswith("FileSystemReader") and name.split(".")[-1] == "FileSystemReader":
            self._flag(node, f"{name}(...) reads .metadata with pickle.load; use "
                             "datastates.safe_dcp.SafeFileSystemReader")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute):
        # `pickle.Unpickler` as a base class or passed around, `torch.load` passed as a callable.
        name = _dotted(node, self.aliases)
        if name == "pickle.Unpickler" and not self._allowed():
            self.problems.append(f"{self.rel}:{node.lineno}: pickle.Unpickler")
        self.generic_visit(node)


def check_source(text: str, rel: str) -> List[str]:
    checker = _Checker(rel)
    checker.visit(ast.parse(text, filename=rel))
    return sorted(set(checker.problems))


def _python_files() -> List[Path]:
    out = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        out += [Path(root) / f for f in files if f.endswith(".py")]
    return sorted(out)


def test_no_unsafe_deserialization_outside_the_opt_in_paths():
    problems: List[str] = []
    files = _python_files()
    assert len(files) > 50 and any(p.name == "safe_load.py" for p in files)
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        problems += check_source(path.read_text(), rel)
    assert not problems, "unsafe deserialization outside datastates/safe_load.py's opt-in " \
                         "paths (read checkpoints with datastates.safe_load):\n" + "\n".join(problems)


def test_the_allowed_places_exist():
    """An entry of ALLOWED that no longer names a function would silently allow nothing; keep
    the list honest."""
    found: Set[Tuple[str, str]] = set()
    for rel, _ in ALLOWED:
        tree = ast.parse((REPO / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found.add((rel, node.name))
    assert set(ALLOWED) <= found, set(ALLOWED) - found


def test_checker_catches_each_pattern():
    bad = '''
import pickle, torch
import numpy as np
from pickle import loads as L
from torch.distributed.checkpoint import FileSystemReader
torch.load(f)
torch.load(f, weights_only=False)
torch.load(f, weights_only=flag)
pickle.load(f)
L(b)
np.load(f, allow_pickle=True)
FileSystemReader(d).read_metadata()
class U(pickle.Unpickler):
    pass
'''
    problems = check_source(bad, "tools/x.py")
    lines = {int(p.split(":")[1]) for p in problems}
    assert lines == {6, 7, 8, 9, 10, 11, 12, 13}, problems
    good = "import torch\ntorch.load(f, map_location='cpu', weights_only=True)\n"
    assert check_source(good, "tools/x.py") == []
    # The same call inside an allowed function is the opt-in, and only there.
    opt_in = "import torch\ndef torch_load(s):\n    return torch.load(s, weights_only=False)\n"
    assert check_source(opt_in, "datastates/safe_load.py") == []
    assert check_source(opt_in, "datastates/other.py") != []
