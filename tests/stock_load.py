"""Load every tensor of two checkpoints with stock `megatron.core.dist_checkpointing.load` (one
process, world size 1) and report whether they are bit-identical.

Usage: python tests/stock_load.py DIR_A DIR_B   -> prints "MATCH <n>" or "DIFF <keys>"; exit 0/1.
`import datastates` is the only thing done for our backend: it registers the load strategy.
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist


def load_all(directory):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    meta = dist_checkpointing.load_tensors_metadata(directory)
    request = {k: ShardedTensor.from_rank_offsets(k, torch.empty(v.global_shape, dtype=v.dtype))
               for k, v in meta.items()}
    loaded = dist_checkpointing.load(request, directory)
    return {k: loaded[k] for k in request}


def main(a, b):
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    import datastates  # noqa: F401 - registers our load strategy; nothing else is needed

    ta, tb = load_all(a), load_all(b)
    diff = sorted(set(ta) ^ set(tb))
    diff += [k for k in sorted(set(ta) & set(tb))
             if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    print(f"MATCH {len(ta)}" if not diff else f"DIFF {diff[:10]}")
    dist.destroy_process_group()
    return 0 if not diff else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
