"""DataStates: lazy, asynchronous, multi-level checkpointing for PyTorch (no Megatron imports).

Typical use, per rank::

    engine = CheckpointEngine(EngineConfig(rank=r, world_size=n, host_cache_bytes=1 << 30))
    handle = engine.save(state, step_dir("ckpt", step), step=step)   # returns at once
    ...forward/backward (reads the state)...
    engine.wait_for_snapshot()                                        # before optimizer.step()
    records = engine.poll()                                           # finished saves, errors
    engine.close()                                                    # drains

    reader = CheckpointReader(step_dir("ckpt", step))                 # committed versions only
    state = reader.load_state(rank=r)

DeepSpeed's own DataStatesCheckpointEngine (its "datastates_ckpt" config section) calls
`CheckpointEngine(deepspeed_config, rank)`: that builds the DeepSpeed-facing engine of
`datastates.deepspeed_engine` on top of this one (docs/DEEPSPEED.md).
"""
from .config import Checksum, CommitPolicy, EngineConfig, WriteMode
from .engine import CheckpointEngine, SaveHandle
from .errors import CheckpointError
from .layout import FORMAT_VERSION, is_committed, latest_committed, step_dir, try_commit
from .reader import CheckpointReader, TensorMeta
from .flatten import TensorShard
from .telemetry import SaveRecord

__all__ = ["Checksum", "CheckpointEngine", "CheckpointError", "CheckpointReader", "CommitPolicy",
           "EngineConfig", "FORMAT_VERSION", "SaveHandle", "SaveRecord", "TensorMeta",
           "TensorShard", "WriteMode", "is_committed", "latest_committed", "step_dir",
           "try_commit"]

from . import _megatron_hook

_megatron_hook.install()
