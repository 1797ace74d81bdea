"""Process-group, model-parallel and RNG initialisation."""
from __future__ import annotations

import os
from typing import Optional
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from datastates import control_plane
from megatron.training.config import ParallelConfig
from megatron.training.cpu_compat import apply_cpu_patches, cuda_available


def backend_name() -> str:
    """nccl when CUDA is present, gloo otherwise."""
    return "nccl" if cuda_available() else "gloo"


def initialize_distributed(parallel: ParallelConfig,
                           control_timeout_s: Optional[float] = None) -> None:
    """1) patch megatron-core for CPU if needed; 2) init the default process group from the
    torchrun environment (a single process without torchrun gets a world of one);
    3) build megatron-core's TP/PP/DP groups; 4) checkpointing's control plane, whose
    collectives fail after `control_timeout_s` (`control_timeout`) instead of hanging."""
    from megatron.core import parallel_state

    apply_cpu_patches()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if cuda_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = timedelta(minutes=parallel.distributed_timeout_minutes)
        store = _attempt_store(world, timeout)
        if store is not None:
            dist.init_process_group(backend=backend_name(), store=store, rank=rank,
                                    world_size=world, timeout=timeout)
        else:
            # Without torchrun (one process) pick a free port, without touching os.environ:
            # child processes would inherit it and collide with a store that is still closing.
            init_method = "env://" if "MASTER_PORT" in os.environ else \
                f"tcp://127.0.0.1:{_free_port()}"
            dist.init_process_group(backend=backend_name(), init_method=init_method, rank=rank,
                                    world_size=world, timeout=timeout)
    if dist.get_world_size() != parallel.world_size:
        raise ValueError(f"config was built for world size {parallel.world_size} but "
                         f"torch.distributed has {dist.get_world_size()} ranks")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
            distributed_timeout_minutes=parallel.distributed_timeout_minutes,
        )
    control_plane.control_group(control_timeout_s)  # checkpointing's gloo group, every rank


def control_timeout(drain_timeout_s: float) -> float:
    """How long a checkpoint collective may wait for the slowest rank: --ckpt-drain-timeout plus
    a tenth and 10 s, so that a rank whose own bounded wait on its writers expires reports that
    (naming the stuck file) before the others give up on it."""
    return 1.1 * drain_timeout_s + 10.0


def _attempt_store(world: int, timeout: timedelta):
    """Under torchrun, whose agent hosts the store (TORCHELASTIC_USE_AGENT_STORE), that store
    seen through a prefix of its own per restart (TORCHELASTIC_RESTART_COUNT); None elsewhere.
    torch's env:// rendezvous uses the agent's store as it is, so after `torchrun
    --max-restarts` restarted the workers, a rank could read the previous attempt's addresses of
    the others (gloo, NCCL's unique id) and fail or hang connecting to processes that are gone
    (seen with torch 2.13: every restart of a 2-rank job failed in init_process_group,
    "connectFullMesh failed ... Connection refused"). The restart then resumes from the
    newest version on any level, memory's on the same nodes."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or \
            "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/datastates/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}",
                            store)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_random_seeds(seed: int) -> None:
    """Seed python, numpy and torch, then the tensor-parallel RNG tracker.

    As in Megatron-LM, each pipeline stage gets its own offset so stages do not share dropout
    streams; the tracker derives a per-TP-rank stream for dropout inside TP regions. Initial
    weights do not depend on these (see model.initialize_weights_layout_independent).
    """
    from megatron.core import parallel_state, tensor_parallel

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


#: How long an exit after an error waits for the process groups to shut down.
SHUTDOWN_AFTER_ERROR_S = 10.0


def shutdown_after_error(wait_s: float = SHUTDOWN_AFTER_ERROR_S) -> bool:
    """The process groups shut down on an exit after an error, as on a normal end: a process that
    leaves them to the interpreter's teardown can be aborted there by gloo's worker threads
    (SIGABRT, "terminate called without an active exception": seen once in our suite, exit
    status -6 instead of the error's 2). At most `wait_s`: a peer that is gone or stuck must not
    hold up the exit, which then goes on as before. Never raises. True when they were shut down
    (or none was up)."""
    import threading

    def shut_down() -> None:
        try:
            destroy_distributed()
        except Exception:  # noqa: BLE001 - the error being reported is the one that matters
            pass

    worker = threading.Thread(target=shut_down, name="shutdown-after-error", daemon=True)
    worker.start()
    worker.join(wait_s)
    return not worker.is_alive()
