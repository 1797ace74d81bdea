"""Every tool runs as a script (`python tools/X.py`) and as a module (`python -m tools.X`) from any
directory, with no sys.path manipulation: `tools` is a package of the project (setup.py)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOLS = sorted(p for p in (REPO / "tools").glob("*.py") if p.name != "__init__.py")


def _has_main(path: Path) -> bool:
    return 'if __name__ == "__main__"' in path.read_text()


def _touches_sys_path(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "path" and \
                isinstance(node.value, ast.Name) and node.value.id == "sys":
            return True
    return False


def test_no_tool_edits_sys_path():
    assert len(TOOLS) >= 8
    offenders = [p.name for p in TOOLS + sorted((REPO / "tools" / "scale").glob("*.py"))
                 if _touches_sys_path(p)]
    assert not offenders, offenders


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: p.stem)
def test_tool_runs_as_script_and_as_module(path, tmp_path):
    for cmd in ([sys.executable, str(path), "--help"],
                [sys.executable, "-m", f"tools.{path.stem}", "--help"]):
        out = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (cmd, out.stderr[-2000:])
        if _has_main(path):
            assert "usage:" in out.stdout, (cmd, out.stdout[-500:])
