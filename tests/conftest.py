"""Fixtures shared by several test modules."""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

import pytest

#: The temp directory of every process the tests start (see `pytest_configure`).
_CHILDREN_TMP: Optional[str] = None
#: The temp directory the session started with, handed to pytest-xdist's workers (which
#: inherit the controller's TMPDIR) so that the test processes themselves keep using it.
_ORIGINAL_TMP_VAR = "DATASTATES_TESTS_ORIGINAL_TMPDIR"


def pytest_configure(config):
    """Processes the tests start put their temp files in one directory of this process, removed
    at its end: torchrun's agent leaves a `torchelastic_*` directory per launch even after a clean
    exit (~330 per suite run). Short (`/tmp/dstest-XXXXXXXX`): multiprocessing's AF_UNIX sockets
    go there, 107 bytes at most; open to other users like /tmp (a Slurm job's munge user enters
    it). The test processes themselves (pytest's tmp_path, `tempfile` in a test) keep the temp
    directory the session started with."""
    global _CHILDREN_TMP
    original = os.environ.setdefault(_ORIGINAL_TMP_VAR, tempfile.gettempdir())
    tempfile.tempdir = original
    _CHILDREN_TMP = tempfile.mkdtemp(prefix="dstest-", dir=original)
    os.chmod(_CHILDREN_TMP, 0o755)
    os.environ["TMPDIR"] = _CHILDREN_TMP


def pytest_unconfigure(config):
    if _CHILDREN_TMP is not None:
        shutil.rmtree(_CHILDREN_TMP, ignore_errors=True)


#: The files that take 30 s or more, heaviest first (mean of three full runs' `--junitxml`,
#: 2026-12-07: 180 ... 32 s). scripts/test.sh hands them to its two workers in this order
#: (--no-loadscope-reorder; pytest-xdist's own order puts the files with the most tests first, so
#: the heavy files of one or a few tests came last). The gain is the idle tail: pytest's wall time
#: minus half the tests' summed time was 63, 63 and 73 s in three runs with xdist's order, 19 and
#: 13 s in two with this one. Wall times alone cannot show it: nearly the same code took 1030 to
#: 1314 s on this machine the same day (its CPU time varied as much).
HEAVY_FIRST = ("test_peer_replica.py", "test_trainer_checkpoint.py", "test_lazy_save.py",
               "test_universal_resume.py", "test_deepspeed_engine.py", "test_faults_matrix.py",
               "test_megatron_lm_interop.py", "test_in_memory_level.py", "test_slurm_real.py",
               "test_trainer_non_persistent.py", "test_gpu_check.py", "test_cluster_path.py",
               "test_universal_merge_workers.py", "test_trainer_parallel.py",
               "test_universal_merge_nodes.py", "test_trainer_llama.py", "test_readme.py",
               "test_benchmarks.py", "test_universal_convert.py", "test_hf_export.py",
               "test_hf_import.py", "test_faults_crash.py", "test_llama3_launch_line.py",
               "test_faults_signals.py")


def pytest_collection_modifyitems(items):
    rank = {name: k for k, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable


@pytest.fixture
def one_rank_group(tmp_path):
    """A default process group of one gloo rank (what the control plane's collectives need)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def one_rank_megatron(one_rank_group):
    """`one_rank_group` with megatron-core's parallel state over it (TP = PP = DP = 1)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """Every test starts without a default process group or megatron's microbatch calculator,
    whichever tests ran before it in this process (the suite runs its files on two workers, in no
    fixed order): a converter called in-process makes the one-process group it needs and, as the
    one-shot process it is written for, leaves it to the interpreter's exit; the trainer's
    `setup` (test_trainer_hooks, test_model_state_cache) makes the calculator."""
    yield
    import sys

    calculator = sys.modules.get("megatron.core.num_microbatches_calculator")
    if calculator is not None:
        # The trainer's `setup` run in-process makes it once per process, and refuses a second.
        calculator.destroy_num_microbatches_calculator()  # (None already: a no-op)
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from megatron.training.initialize import destroy_distributed

        destroy_distributed()
