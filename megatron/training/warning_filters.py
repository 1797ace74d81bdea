"""Hide the warnings a user of this trainer cannot act on; everything else still shows.

megatron-core and torch warn, on every rank, about things that are settled by the platform or by
megatron-core's own code, not by the user's flags. Each filter below names one such message and
why it is not actionable. Installed by the entry points before megatron-core is imported (its
import-time warnings are the loudest). A user who sets warning options (`-W ...` or
PYTHONWARNINGS) gets exactly those instead: nothing is installed then.
"""
from __future__ import annotations

import logging
import sys
import warnings

__all__ = ["install"]

#: (message regex, category, why it is hidden) for every machine.
_ALWAYS = (
    (r"full scope is deprecated", UserWarning,
     "megatron-core's own default for cuda_graph_scope triggers its deprecation warning"),
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor", UserWarning,
     "megatron-core's optimizer reads .grad of its own parameter views"),
    (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
     FutureWarning, "megatron-core's distributed optimizer and DDP call these collectives"),
    (r"`load_state_dict` is deprecated and will be removed", FutureWarning,
     "megatron-core's torch_dist load strategy calls torch.distributed.checkpoint's old name"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
     "megatron-core's torch_dist format is built on ShardedTensor; every torch_dist load warns"),
    (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
     r"load in a single process", UserWarning,
     "the converters read a torch_dist checkpoint in one process on purpose (from-torch-dist)"),
)
#: The same, only where CUDA is absent: Apex and Transformer Engine are GPU libraries, so on a
#: CPU machine there is nothing to install (on a GPU node the warnings stay: installing them is
#: the fix).
_CPU_ONLY = (
    (r"Transformer Engine and Apex are not installed", UserWarning, "GPU-only libraries"),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, "GPU-only library"),
    (r"recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS", UserWarning,
     "a CUDA scheduling knob (TP with sequence parallel or async all-reduce); no CUDA here"),
)


class _DropMockIndexNotice(logging.Filter):
    """megatron-core's mock dataset has no cache directory to save indexes to (--mock-data)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to save MockGPTDataset indexes" not in record.getMessage()


def install() -> None:
    """Install the filters (see module doc); idempotent."""
    if sys.warnoptions:
        return
    from megatron.training.cpu_compat import cuda_available

    rules = _ALWAYS + (() if cuda_available() else _CPU_ONLY)
    for message, category, _why in rules:
        warnings.filterwarnings("ignore", message=message, category=category)
    logger = logging.getLogger("megatron.core.datasets.gpt_dataset")
    if not any(isinstance(f, _DropMockIndexNotice) for f in logger.filters):
        logger.addFilter(_DropMockIndexNotice())
