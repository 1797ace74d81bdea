"""A real small filesystem for full-disk tests: a tmpfs mounted for the test's duration.

Sessions and CI run as root, where `mount -t tmpfs` works (docs/TESTING.md); elsewhere the test
is skipped with mount's own message.
"""
import contextlib
import subprocess

import pytest


@contextlib.contextmanager
def mounted_tmpfs(path, size: str):
    """Mount a tmpfs of `size` (e.g. "1m") at the new directory `path`; unmount on exit."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
