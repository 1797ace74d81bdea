"""The levels of a checkpoint beyond the shared file system (`--save`), each at its own pace:

  local_tier.py     --lazy-save-local-dir (node-local storage): placeholders ({node}, {rank},
                    {local_rank}, {host}), the start-up probe every rank agrees on, pruning of this
                    rank's old local copies (the engine's level 3 writes and migrates them)
  node_local.py     node-local versions (Megatron-LM's `local` non-persistent checkpoints): nodes
                    and their leaders, every replica written per node, which version every node
                    holds
  peer_replica.py   --lazy-save-peer-replica (a peer node's copy): the ring over nodes, the thread
                    that sends each committed version to the next node, and the restore plan
                    before --load
  in_memory.py, in_memory_peers.py, in_memory_relayout.py
                    the in-memory level: its room and retention, a lost node's versions back from
                    its peer, and its newest version assembled for a restart at another layout

The level in host memory is the engine's cache (`datastates.cache`).
"""
