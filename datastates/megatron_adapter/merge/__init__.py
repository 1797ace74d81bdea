"""Megatron checkpoints -> universal checkpoints (`datastates.universal`), by hand
(``python -m datastates.megatron_adapter.merge``, `tools/convert_checkpoint.py merge`) or in a
low-priority background process after each commit:

  sources.py        what a merge reads: a DataStates or torch_dist checkpoint as a `MergeSource`
  plan.py           key mapping (megatron names -> universal entries) and manifest fields
  run.py            the merge process: merge, commit, advance the tracker, one log line
  background.py     `BackgroundMerger`: the nice/ionice merge process after each commit
  parallel.py       one merge split over worker processes (`merge_with_workers`)
  worker.py         such a worker (``python -m datastates.megatron_adapter.merge.worker``)
  nodes.py          a merge split over nodes: each node merges its part, the last one commits
"""
