"""Layer rules (.importlinter), checked with import-linter on the real tree, and shown to fail on a
copy of it that breaks each rule once.

1. `datastates` outside `datastates.megatron_adapter` imports no `megatron`;
2. `megatron.training` imports only datastates' public modules (`datastates`, `fileio`,
   `safe_load`, `universal`, `megatron_adapter`, `megatron_adapter.paths`);
3. no import cycles among the modules of either package or of their sub-packages;
4. inside the adapter, `save/` drives `levels/` and `merge/` (and `hf/` uses `resolve`), never the
   reverse; `paths` is below them all.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONWARNINGS="ignore")
    return subprocess.run([str(LINT), str(root / ".importlinter")], cwd=str(root), env=env,
                          capture_output=True, text=True, timeout=120)


pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed "
                                "(pip install -r requirements.txt)")


def test_layer_contracts_hold():
    out = _lint(REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "4 kept, 0 broken" in out.stdout, out.stdout[-2000:]


def test_each_contract_fails_when_broken(tmp_path):
    """A copy of the two packages with one violation of each rule: all four contracts break."""
    for name in ("datastates", os.path.join("megatron", "training")):
        shutil.copytree(REPO / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path)

    def append(rel, line):
        with open(tmp_path / rel, "a") as f:
            f.write("\n" + line + "\n")

    append("datastates/cache.py", "import megatron.core  # engine -> megatron")
    append("megatron/training/log.py", "from datastates.engine import CheckpointEngine  # private")
    append("megatron/training/log.py", "import megatron.training.training  # cycle")
    append("datastates/megatron_adapter/levels/local_tier.py",
           "from ..save import checkpointer  # a level -> the save path")
    out = _lint(tmp_path)
    assert out.returncode != 0, out.stdout[-3000:]
    assert "0 kept, 4 broken" in out.stdout, out.stdout[-3000:]
    for needle in ("datastates.cache -> megatron.core", "megatron.training.log -> datastates.engine",
                   "megatron.training.log",
                   "datastates.megatron_adapter.levels.local_tier -> "
                   "datastates.megatron_adapter.save.checkpointer"):
        assert needle in " ".join(out.stdout.split()), (needle, out.stdout[-3000:])


def test_architecture_map_names_every_module():
    """docs/ARCHITECTURE.md's map names every module of the packages, by its path inside its
    package's section (a new module must be placed), and the README's layout table every folder."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    missing = []
    for package in ("datastates", "datastates/universal", "datastates/megatron_adapter",
                    "megatron/training", "tools"):
        start = text.index(f"### `{package}/`")
        section = text[start:text.find("\n### ", start + 1)]
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO / package).as_posix()
            if path.name == "__init__.py" or (package == "datastates" and "/" in rel):
                continue
            if package == "tools" and rel.startswith("scale/"):
                rel = path.stem  # tools/scale's modules: named by stem in one row
            if f"`{rel}`" not in section and not (package == "tools" and f"`{rel}.py`" in section):
                missing.append(f"{package}/{rel}")
    assert not missing, f"docs/ARCHITECTURE.md's map does not name: {missing}"
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Layout"):]
    end = table.find("\n## ", 1)
    table = table if end < 0 else table[:end]
    folders = [p.relative_to(REPO).as_posix() for p in REPO.glob("datastates/**/__init__.py")]
    folders = sorted({os.path.dirname(p) for p in folders} | {"megatron/training/checkpointing"})
    unnamed = [f for f in folders if f"`{f}/`" not in table]
    assert not unnamed, f"README's layout table does not name: {unnamed}"


TENSOR_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                      "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter",
                      "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv"}
# The control plane itself, and the training loop (its tensors live on the training device).
COLLECTIVES_ALLOWED_IN = {"datastates/control_plane.py", "megatron/training/training.py"}


def test_checkpoint_collectives_go_through_the_control_plane():
    """A tensor collective issued directly by checkpoint code would run on the default group,
    NCCL on a GPU run, with a CPU tensor: it must use datastates.control_plane (gloo)."""
    import ast

    found = []
    for package in ("datastates", "megatron/training", "tools"):
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in COLLECTIVES_ALLOWED_IN:
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in TENSOR_COLLECTIVES
                        and ast.unparse(node.func.value) in ("dist", "torch.distributed")):
                    found.append(f"{rel}:{node.lineno} dist.{node.func.attr}")
    assert not found, found
