"""PyTorch DCP's file reader and load planner with `safe_load`'s reads swapped in: the `.metadata`
pickle read by `read_dcp_metadata`, saved objects by `SafeBytesMixin` (DCP's own unpickle both with
`pickle.load` / `weights_only=False`).

A module of its own because importing DCP costs ~1.2 s of CPU (it imports DTensor): the processes
that import `datastates` but never read a torch_dist checkpoint (merge workers, DeepSpeed's
engine, the converters of other formats) no longer pay it at start.
"""
from __future__ import annotations

from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from .safe_load import SafeBytesMixin, read_dcp_metadata

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner"]


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader whose `.metadata` is read by `read_dcp_metadata`."""

    def __init__(self, path, *args, allow_unsafe: bool = False, **kwargs):
        super().__init__(path, *args, **kwargs)
        self._directory = str(path)
        self._allow_unsafe = allow_unsafe
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            md = read_dcp_metadata(self._directory, allow_unsafe=self._allow_unsafe)
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            self._metadata = md
        return self._metadata


class SafeLoadPlanner(SafeBytesMixin, DefaultLoadPlanner):
    """DCP's default planner with `SafeBytesMixin`."""
