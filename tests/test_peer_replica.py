"""`--lazy-save-peer-replica`: every rank's shards held on its node and on the next node of a ring,
restored from there before --save.

Units first (the ring; the flags), then the restore plan on three gloo processes acting as three
nodes with hand-made copies (one node lost, one replica damaged), then the trainer on nodes of one
machine (torchrun agents): node 1 killed mid-run and its memory deleted, then restarts that read
0 shard bytes from --save and print the losses of a resume from --save at their layout: both
nodes (node 1's rank restores from node 0), node 0 alone at DP1 and at TP2, and, from three nodes,
the two survivors at DP2, each receiving what only the other holds (issue 31). Then the in-memory
level's replicas (issue 30): a lost node resumes from them, and memory restored in three gloo
processes (a damaged replica, a node whose commit a crash cut off).
"""
import json
import os
import re
import shutil
import time
import zlib

import pytest
import torch.multiprocessing as mp

from datastates import layout
from datastates.megatron_adapter import paths
from datastates.errors import CheckpointError
from datastates.megatron_adapter.levels.peer_replica import Ring

from trainer_launch import NO_DROPOUT, TINY_MODEL, Node, after, assert_close, free_port, launch


def test_ring_pairs_positions_across_nodes():
    ring = Ring.of([0, 0, 1, 1, 2, 2])  # ranks 0-1 on node 0, 2-3 on node 1, 4-5 on node 2
    assert [ring.successor(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [ring.predecessor(r) for r in range(6)] == [4, 5, 0, 1, 2, 3]
    # Node indices need not be contiguous rank blocks: ranks are ordered within their node.
    odd = Ring.of([1, 0, 1, 0])
    assert odd.nodes == ((1, 3), (0, 2)) and odd.successor(1) == 0 and odd.successor(0) == 1


@pytest.mark.parametrize("nodes,message", [
    ([0, 0], "all 2 rank(s) run on one node (node index 0)"),
    ([0, 0, 1], "needs the same number of ranks on every node; found node 0: 2, node 1: 1"),
])
def test_ring_refuses_what_it_cannot_pair(nodes, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        Ring.of(nodes)


def _config(extra):
    from megatron.training.arguments import build_run_config, parse_args

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --mock-data "
            "--vocab-size 255 --save /tmp/peer_save ")
    return build_run_config(parse_args((base + extra).split()), world_size=1).checkpoint


def test_flags_resolve_to_a_memory_level_holding_one_version():
    from megatron.training.arguments import ArgumentError

    ckpt = _config("--async-lazy-save --lazy-save-peer-replica")
    assert ckpt.lazy_save_peer_replica and ckpt.lazy_save_local_keep == 1
    assert ckpt.lazy_save_local_dir.startswith("/dev/shm/datastates-")
    assert ckpt.lazy_save_local_dir.endswith("/node{node}")
    given = _config("--async-lazy-save --lazy-save-peer-replica --lazy-save-local-dir /nvme/x "
                    "--lazy-save-local-keep 2 --lazy-save-peer-replica-mb 64")
    assert (given.lazy_save_local_dir, given.lazy_save_local_keep,
            given.lazy_save_peer_replica_mb) == ("/nvme/x", 2, 64)
    with pytest.raises(ArgumentError, match="configure --async-lazy-save, which is not on"):
        _config("--lazy-save-peer-replica")
    with pytest.raises(ArgumentError, match="bounds --lazy-save-peer-replica, which is not given"):
        _config("--async-lazy-save --lazy-save-peer-replica-mb 8")


def test_with_the_in_memory_level_its_versions_are_replicated_not_the_persistent_ones(tmp_path):
    """No node-local copy of --save is set up, and a load from --save asks no peer for one (a
    restart that loaded --save crashed on the missing directory before this test)."""
    from megatron.training.arguments import build_run_config, parse_args
    from megatron.training.checkpointing.lazy import restore_peer_copies

    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
             "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --mock-data "
             "--vocab-size 255 --save /tmp/peer_save --async-lazy-save --lazy-save-peer-replica "
             "--non-persistent-ckpt-type in_memory --non-persistent-save-interval 1")
    config = build_run_config(parse_args(flags.split()), world_size=1)
    assert config.checkpoint.lazy_save_local_dir is None
    version = tmp_path / "iter_0000004"
    version.mkdir()
    (version / "COMMIT.json").write_text(json.dumps({"world_size": 2}))
    assert restore_peer_copies(config, str(version), {}) is None


# -- the restore plan, three processes as three nodes --------------------------------------------

def _files(rank, step=3):
    shard = bytes([rank]) * (1000 + rank)
    index = json.dumps({"rank": rank}).encode()
    marker = dict(layout.format_header(), index=layout.index_file(rank),
                  index_crc32=zlib.crc32(index), step=step)
    return [shard, index, json.dumps(marker).encode()]


def _restore_worker(rank, port, root, out, needed):
    import torch.distributed as dist

    from datastates.megatron_adapter.levels.peer_replica import restore_before_load

    os.environ.update(GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    stats = restore_before_load(os.path.join(root, "save", "iter_0000003"),
                                os.path.join(root, f"node{rank}"), 3, needed[rank])
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump({"received": {str(k): list(v) for k, v in stats.received.items()},
                   "unavailable": stats.unavailable}, f)
    dist.barrier()
    # Leave without tearing gloo down: on a loaded machine its teardown at interpreter exit
    # aborted one worker once (SIGABRT, "terminate called without an active exception") after
    # every result was written; the results are what this test checks.
    os._exit(0)


def _run_restore(tmp_path, needed):
    out = tmp_path / "out"
    out.mkdir()
    mp.start_processes(_restore_worker, args=(free_port(), str(tmp_path), str(out), needed),
                       nprocs=3, start_method="spawn")
    return {r: json.loads((out / f"r{r}.json").read_text()) for r in range(3)}


def _senders(result):
    return {int(s): frm for s, (frm, _, _) in result["received"].items()}


def _holds(tmp_path, node, saved):
    directory = tmp_path / node / "iter_0000003"
    return all((directory / name).is_file() and (directory / name).read_bytes() == data
               for name, data in zip((layout.shard_file(saved), layout.index_file(saved),
                                      layout.rank_marker_file(saved)), _files(saved)))


class _Replicas:
    """Stands in for the in-memory level's PeerReplicator on one rank: the checkpointer's side
    (when it hands a version over) is under test, not the transfer."""

    def __init__(self):
        self.idle, self.handed = False, []

    def hand_off(self, iteration):
        self.handed.append(iteration)

    def close(self, timeout):
        pass


def test_a_version_committed_while_the_replicas_were_busy_is_sent_when_they_free_up(
        one_rank_megatron, tmp_path):
    """--non-persistent-save-interval 4: version 4 commits while the replica thread is busy,
    and 8 too: 4 is skipped (one line, counted); the first poll after the thread frees up hands
    8 over (latest wins at the network's pace), not the commit of 12, four iterations later;
    only once, and none while it is busy."""
    from test_save_offload import _Run

    run = _Run(tmp_path)
    ckpt, replicas = run.ckpt, _Replicas()
    ckpt.memory_replicator = replicas

    def poll(step):
        ckpt.poll(step)
        ckpt._join()  # a poll queued behind a steady save's job (on the save worker)

    def settle(step):  # the polls of `step` until the commit started before it settled
        deadline = time.time() + 60
        while True:
            poll(step)
            if ckpt.node_lane.publishing is None:
                return
            assert time.time() < deadline, "the commit thread never finished"
            time.sleep(0.05)

    run.iteration(4)  # saved, then the next step's hook starts its commit
    settle(5)  # 4 committed: the replicas are busy
    ckpt.before_optimizer_step()
    poll(6)
    run.iteration(8)
    settle(9)  # 8 committed, still busy: 4 will never be sent
    assert replicas.handed == [] and (ckpt.replicas_sent, ckpt.replicas_skipped) == (0, 1)
    said = [m for _, m in run.lines if "peer replicas" in m]
    assert said == ["in-memory peer replicas: iteration 4 is skipped (not sent to the next "
                    "node): the previous transfer was still running when it committed, and "
                    "iteration 8 has committed since (latest wins: the newest complete version "
                    "goes whenever the previous transfer is done; the versions skipped are "
                    "counted in the training summary)"], run.lines
    replicas.idle = True
    ckpt.before_optimizer_step()
    poll(10)  # the network freed up: 8 goes now
    assert replicas.handed == [8]
    run.iteration(12)
    settle(13)  # 12's commit, idle: handed over there
    assert replicas.handed == [8, 12] and (ckpt.replicas_sent, ckpt.replicas_skipped) == (2, 1)
    ckpt.finish()


def test_restore_plan_refills_both_holders_and_never_trusts_a_mismatch(tmp_path):
    from datastates.megatron_adapter.levels.peer_replica import _write_files

    shared = tmp_path / "save" / "iter_0000003"
    for r in range(3):
        _write_files(str(shared), r, _files(r))
    # Ring 0 -> 1 -> 2 -> 0: node n holds its rank and its predecessor's. Node 1 is lost (empty);
    # node 2's replica of rank 1 is of another save (its marker names step 2): not trusted.
    _write_files(str(tmp_path / "node0" / "iter_0000003"), 0, _files(0))
    _write_files(str(tmp_path / "node0" / "iter_0000003"), 2, _files(2))
    _write_files(str(tmp_path / "node2" / "iter_0000003"), 2, _files(2))
    _write_files(str(tmp_path / "node2" / "iter_0000003"), 1, _files(1, step=2))
    (tmp_path / "node1").mkdir()
    result = _run_restore(tmp_path, {0: [0, 1, 2], 1: [1], 2: [1, 2]})
    # Rank 0's own copy went back to node 1 (its replica holder); rank 1 has no intact copy.
    assert _senders(result[1]) == {0: 0} and result[1]["received"]["0"][1] == \
        sum(len(b) for b in _files(0))
    assert result[0]["received"] == {} and result[2]["received"] == {}
    assert all(result[r]["unavailable"] == [1] for r in range(3))
    assert _holds(tmp_path, "node1", 0) and not _holds(tmp_path, "node1", 1)
    assert not (tmp_path / "node1" / "iter_0000003" / layout.rank_marker_file(1)).exists()


def test_restore_brings_what_each_rank_reads_from_other_nodes(tmp_path):
    """Phase 2: with three nodes a node holds two ranks' files; a rank that reads a third's
    (replicated tensors written by a data-parallel peer elsewhere) gets them from a holder, once
    per node; a stale copy there is replaced, never used."""
    from datastates.megatron_adapter.levels.peer_replica import _write_files

    shared = tmp_path / "save" / "iter_0000003"
    for r in range(3):
        _write_files(str(shared), r, _files(r))
    _write_files(str(tmp_path / "node0" / "iter_0000003"), 0, _files(0))
    _write_files(str(tmp_path / "node0" / "iter_0000003"), 2, _files(2))
    _write_files(str(tmp_path / "node0" / "iter_0000003"), 1, _files(1, step=2))  # stale
    _write_files(str(tmp_path / "node2" / "iter_0000003"), 2, _files(2))
    _write_files(str(tmp_path / "node2" / "iter_0000003"), 1, _files(1))
    (tmp_path / "node1").mkdir()  # lost
    result = _run_restore(tmp_path, {0: [0, 1, 2], 1: [0, 1], 2: [0, 1, 2]})
    assert _senders(result[1]) == {0: 0, 1: 2}  # phase 1: both of node 1's copies come back
    # Phase 2: rank 0 reads saved rank 1's files, from a holder (rank 2, or rank 1 since phase 1).
    assert list(_senders(result[0])) == [1] and _senders(result[0])[1] in (1, 2)
    assert _senders(result[2]) == {0: 0}  # phase 2: rank 2 reads saved rank 0's files
    assert all(result[r]["unavailable"] == [] for r in range(3))
    for node in ("node0", "node1", "node2"):
        assert all(_holds(tmp_path, node, s) for s in (0, 1)), node
    assert _holds(tmp_path, "node0", 2) and _holds(tmp_path, "node2", 2)



def _memory_version(directory, rank, step, world=3, commit=True):
    """A hand-made in-memory version of the node of `rank` at `directory`: its files, its
    leader's common.pt and metadata.json, and the node's commit marker (`commit`) or, for a
    peer replica, the node's run_config.json that comes with it."""
    from datastates.megatron_adapter.levels.peer_replica import _write_files

    shard, index = bytes([rank, step]) * 600, json.dumps({"rank": rank, "step": step}).encode()
    marker = dict(layout.format_header(), index=layout.index_file(rank), rank=rank,
                  world_size=world, index_crc32=zlib.crc32(index), step=step)
    _write_files(str(directory), rank, [shard, index, json.dumps(marker).encode()])
    (directory / "common.pt").write_bytes(b"common %d" % step)
    (directory / "metadata.json").write_text("{}")
    if commit:
        assert layout.try_commit(str(directory), world, ranks=[rank])
    else:
        (directory / "run_config.json").write_text('{"node": %d}' % rank)
    return shard


def _memory_restore_worker(rank, port, root, out):
    import torch.distributed as dist

    from datastates.megatron_adapter.levels.in_memory_peers import restore_memory_from_peers

    os.environ.update(GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    results = []
    for case in ("lost", "uncommitted"):
        lines = []
        done = restore_memory_from_peers(os.path.join(root, case, f"node{rank}"), 3, rank,
                                         log=lines.append)
        results.append({"iteration": done.iteration, "restored": done.restored,
                        "dropped": done.dropped, "lines": lines})
    from datastates.megatron_adapter.levels.in_memory_relayout import assemble
    from datastates.megatron_adapter.levels.peer_replica import bring_needed

    lines = []
    assembled = assemble(os.path.join(root, "relayout", f"node{rank}"), rank, log=lines.append)
    version = os.path.join(assembled, "iter_0000007")
    stats = bring_needed(version, version, 4, {0: [1, 2], 1: [3], 2: [0, 1]}[rank])
    results.append({"root": assembled, "lines": lines,
                    "received": {str(s): v[0] for s, v in stats.received.items()}})
    # Node 1 replaced: hosts a, c and a new d are nodes 0, 1, 2 now; host c holds what it saved
    # as node 2. Each host has a directory of its own here (its /dev/shm).
    from datastates.megatron_adapter.levels.in_memory import adopt_left_memory
    from datastates.megatron_adapter.levels.in_memory_relayout import holds_other_ranks

    host = "acd"[rank]
    root = os.path.join(root, "renumbered", host, f"node{rank}")
    lines = []
    adopted = adopt_left_memory(root, rank, rank, host=host, log=lines.append)
    other = holds_other_ranks(root, rank, 3)
    assembled = assemble(root, rank, log=lines.append)
    version = os.path.join(assembled, "iter_0000006")
    stats = bring_needed(version, version, 3, [rank])
    results.append({"adopted": {str(k): v for k, v in adopted.items()}, "other": other,
                    "lines": lines, "root": assembled,
                    "received": {str(s): v[0] for s, v in stats.received.items()}})
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    os._exit(0)  # as _restore_worker


def test_memory_restore_takes_the_newest_version_every_rank_has_and_never_a_damaged_one(tmp_path):
    """Three nodes of one rank (ring 0 -> 1 -> 2 -> 0), in-memory versions 3 and 4 on each and
    replicas of the previous node's in peer/. Node 1 is lost; node 2's replica of its version 4
    is damaged (its index does not match its marker): rank 1 gets version 3 back from rank 2,
    with its node's small files; version 4, which rank 1 no longer has whole, goes from every
    node, and every node's tracker names 3. Second case: nothing lost, but the job ended after
    nodes 0 and 2 committed version 5 and before node 1 did: node 1 commits it (its files were
    durable: the agreement precedes every node's commit), with metadata.json from its version 4.
    Third case, a restart at another layout: version 7 saved by four nodes, node 2 lost, the
    three left assemble it (each gets the indexes it lacks; a damaged replica is never used;
    version 8, which only node 0 holds, is removed) and each node receives the shard files its
    rank reads and lacks, from a node that holds them. Fourth case, node indices given anew: of
    hosts a, b, c (nodes 0, 1, 2), b is replaced by d and the hosts are numbered a, c, d: host c
    takes over its node2 directory as node1 (one line; its reusable shard files go), the version
    is assembled at the same layout from what a and c hold, and d receives its rank's files."""
    from datastates.megatron_adapter.paths import tracked_iteration, write_tracker

    shards = {}
    for node in range(3):
        for step in (4, 5):
            root = tmp_path / "uncommitted" / f"node{node}"
            _memory_version(root / f"iter_000000{step}", node, step, commit=node != 1 or step == 4)
            (root / "run_config.json").write_text('{"node": %d}' % node)
            write_tracker(str(root), 5 if node != 1 else 4)
    os.unlink(tmp_path / "uncommitted" / "node1" / "iter_0000005" / "metadata.json")
    for node in range(3):
        root = tmp_path / "lost" / f"node{node}"
        for step in (3, 4):
            if node != 1:
                shards[node, step] = _memory_version(root / f"iter_000000{step}", node, step)
            pred = (node - 1) % 3
            shards[pred, step] = _memory_version(root / "peer" / f"iter_000000{step}", pred,
                                                 step, commit=False)
        if node != 1:
            (root / "run_config.json").write_text('{"node": %d}' % node)
            write_tracker(str(root), 4)
    shutil.rmtree(tmp_path / "lost" / "node1")
    (tmp_path / "lost" / "node1").mkdir()
    for current, saved in enumerate((0, 1, 3)):  # saved node 2 lost; saved node 3 is node 2 now
        root = tmp_path / "relayout" / f"node{current}"
        shards[saved, 7] = _memory_version(root / "iter_0000007", saved, 7, world=4)
        pred = (saved - 1) % 4
        shards[pred, 7] = _memory_version(root / "peer" / "iter_0000007", pred, 7, world=4,
                                          commit=False)
        (root / "run_config.json").write_text('{"node": %d}' % saved)
        write_tracker(str(root), 7)
    _memory_version(tmp_path / "relayout" / "node0" / "iter_0000008", 0, 8, world=4)
    for saved, host in ((0, "a"), (2, "c")):  # saved node 1 (host b) lost
        root = tmp_path / "renumbered" / host / f"node{saved}"
        shards[saved, 6] = _memory_version(root / "iter_0000006", saved, 6)
        pred = (saved - 1) % 3
        shards[pred, 6] = _memory_version(root / "peer" / "iter_0000006", pred, 6, commit=False)
        (root / "run_config.json").write_text('{"node": %d}' % saved)
        (root / ".datastates_slots").mkdir()
        (root / ".datastates_slots" / "r00002-0.bin").write_bytes(b"slot")
        (root / f".datastates_node_{saved}").write_text(str(saved))
        write_tracker(str(root), 6)
    (tmp_path / "relayout" / "node1" / "peer" / "iter_0000007" / layout.index_file(0)).write_text(
        "{}")
    (tmp_path / "lost" / "node2" / "peer" / "iter_0000004" / layout.index_file(1)).write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    mp.start_processes(_memory_restore_worker, args=(free_port(), str(tmp_path), str(out)),
                       nprocs=3, start_method="spawn")
    results = {r: json.loads((out / f"r{r}.json").read_text()) for r in range(3)}
    result = {r: results[r][0] for r in range(3)}
    assert all(result[r]["iteration"] == 3 and result[r]["restored"] == {"1": 2}
               and result[r]["dropped"] == [4] for r in range(3)), result
    assert "[rank 1] received its in-memory shards of iteration 3 from peer rank 2" in \
        result[1]["lines"][0]
    assert result[0]["lines"] == ["in-memory checkpoint of iteration 3: rank(s) 1 (from rank 2) "
                                  "restored from their peer replicas; newer, incomplete "
                                  "iteration(s) [4] removed (not every rank's part of them "
                                  "survived)"]
    lost = tmp_path / "lost" / "node1"
    assert (lost / "iter_0000003" / layout.shard_file(1)).read_bytes() == shards[1, 3]
    assert (lost / "iter_0000003" / "common.pt").read_bytes() == b"common 3"
    assert json.loads((lost / "run_config.json").read_text()) == {"node": 1}  # from its replica
    assert not (lost / "iter_0000003" / "run_config.json").exists()
    assert layout.is_committed(str(lost / "iter_0000003"))
    for node in range(3):
        root = tmp_path / "lost" / f"node{node}"
        assert tracked_iteration(str(root)) == 3 and not (root / "iter_0000004").exists(), node

    # A restart at another layout: four nodes saved (ring 0 -> 1 -> 2 -> 3 -> 0), node 2 lost;
    # the three left hold saved ranks {0, 3}, {1, 0} (a damaged replica of 0) and {3, 2}.
    relayout = {r: results[r][2] for r in range(3)}
    assert all(relayout[r]["root"] == str(tmp_path / "relayout" / f"node{r}" / "relayout")
               for r in range(3)), relayout
    assert relayout[0]["lines"][-1] == (
        "in-memory checkpoint of iteration 7 (saved by 4 ranks) assembled on every node for this "
        "run's layout from the memory of the nodes left; indexes of saved rank(s) [0, 1, 2, 3] "
        "came from other nodes")
    assert "[rank 0] in-memory checkpoints: removed iteration(s) [8]" in relayout[0]["lines"][0]
    assert {r: relayout[r]["received"] for r in range(3)} == {
        0: {"1": 1, "2": 2}, 1: {"3": 0}, 2: {"0": 0, "1": 1}}
    for current, reads in ((0, (0, 1, 2, 3)), (1, (1, 3)), (2, (0, 1, 2, 3))):
        version = tmp_path / "relayout" / f"node{current}" / "relayout" / "iter_0000007"
        assert layout.is_committed(str(version)) and all(
            (version / layout.index_file(s)).exists() for s in range(4)), current
        for s in reads:
            assert (version / layout.shard_file(s)).read_bytes() == shards[s, 7], (current, s)
    assert not (tmp_path / "relayout" / "node1" / "relayout" / "iter_0000007" /
                layout.shard_file(0)).exists()  # its damaged replica is never used
    assert not (tmp_path / "relayout" / "node0" / "iter_0000008").exists()

    # Renumbered: host c, node 2 when it saved, is node 1 now; the new host d is node 2.
    renumbered = {r: results[r][3] for r in range(3)}
    assert all(renumbered[r]["adopted"] == {"1": 2} for r in range(3)), renumbered
    assert renumbered[1]["lines"][0] == (
        "[rank 1] node 1 takes over the in-memory checkpoints that node 2 of an earlier launch "
        "left on this host (c): node indices are assigned anew at each launch")
    c = tmp_path / "renumbered" / "c"
    assert sorted(os.listdir(c)) == ["node1"] and not (c / "node1" / ".datastates_slots").exists()
    assert not (c / "node1" / ".datastates_node_2").exists()
    assert [renumbered[r]["other"] for r in range(3)] == [False, True, False]
    assert {r: renumbered[r]["received"] for r in range(3)} == {0: {}, 1: {}, 2: {"2": 0}}
    for r, host in enumerate("acd"):
        version = tmp_path / "renumbered" / host / f"node{r}" / "relayout" / "iter_0000006"
        assert layout.is_committed(str(version)), r
        assert (version / layout.shard_file(r)).read_bytes() == shards[r, 6], r

    second = {r: results[r][1] for r in range(3)}
    assert all(second[r]["iteration"] == 5 and second[r]["restored"] == {}
               and second[r]["dropped"] == [] for r in range(3)), second
    assert second[0]["lines"] == ["in-memory checkpoint of iteration 5: committed on node(s) [1] "
                                  "(every rank's files were there; the job ended before that "
                                  "node's commit marker)"]
    late = tmp_path / "uncommitted" / "node1"
    assert layout.is_committed(str(late / "iter_0000005")) and \
        tracked_iteration(str(late)) == 5
    assert (late / "iter_0000005" / "metadata.json").read_text() == "{}"


# -- the trainer, two nodes on one machine -------------------------------------------------------

ARGS = TINY_MODEL + NO_DROPOUT + ["--eval-interval", "0", "--use-distributed-optimizer",
                                  "--train-iters", "6"]


def _two_nodes(args, tmp_path, name, memory, env=None):
    port, logs = free_port(), tmp_path / name
    logs.mkdir()
    return [Node(r, 2, 1, port, args + ["--lazy-save-local-dir", str(memory / "node{node}")],
                 logs, extra_env=env) for r in (0, 1)]


def _restore_event(save):
    lines = (save / "datastates_checkpoints.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if '"restore"' in x][-1]


DISTOPT = ["--use-distributed-optimizer"]
ONE_RANK = TINY_MODEL + NO_DROPOUT + ["--train-iters", "2", "--async-lazy-save",
                                      "--save-interval", "1", "--lazy-save-peer-replica"]


def test_budget_below_one_ranks_checkpoint_is_refused_at_start(tmp_path):
    run = launch(1, ONE_RANK + ["--save", str(tmp_path / "save"),
                                "--lazy-save-peer-replica-mb", "1",
                                "--lazy-save-local-dir", str(tmp_path / "mem")])
    assert run.returncode == 2
    assert "--lazy-save-peer-replica-mb 1 is smaller than one rank's checkpoint: rank 0 holds " \
           "up to" in run.stderr, run.describe()
    assert " iteration " not in run.stdout


def test_a_failing_side_still_finishes_the_stream_and_never_leaves_a_trusted_copy(tmp_path):
    """A transfer must run to its end on both ranks (the other is mid-stream): a sender whose
    file vanished before the stream reached it sends zeros from there on (no valid marker
    arrives); a receiver that cannot write keeps receiving and raises at commit."""
    from datastates.megatron_adapter.levels.peer_replica import _Incoming, _outgoing, _write_files

    files = _files(3)
    _write_files(str(tmp_path / "src"), 3, files)
    assert _outgoing(str(tmp_path / "src"), 3).read(0, 1 << 20) == b"".join(files)
    out = _outgoing(str(tmp_path / "src"), 3)
    os.unlink(tmp_path / "src" / layout.index_file(3))  # gone before the stream reached it
    stream = out.read(0, 1 << 20)
    assert stream[:len(files[0])] == files[0] and stream[len(files[0]):] == \
        bytes(len(files[1]) + len(files[2]))
    (tmp_path / "a_file").write_text("")
    sink = _Incoming(str(tmp_path / "a_file" / "dir"), 3, [len(b) for b in files])
    sink.write(0, b"".join(files))  # dropped, no error yet
    with pytest.raises(OSError):
        sink.commit()


def test_in_memory_versions_replicate_to_the_next_node_and_a_lost_node_resumes_from_them(
        tmp_path):
    """--non-persistent-ckpt-type in_memory with --lazy-save-peer-replica on two nodes: every
    in-memory version that the network keeps up with is copied to the other node. Rank 1's copy
    of in-memory iteration 6 stalls (the job cannot go past it) and rank 0's receiving end of the
    second version node 1 sends it stops before the files are moved into place (which versions
    are sent depends on the machine's pace: latest wins), both nodes are killed and node 1's
    memory is deleted (a lost node): the restart brings rank 1's shards of the version node 0
    received whole, not of the half-received one, back from node 0, resumes from memory (not
    from --save, which holds nothing) and prints the losses of an uninterrupted run (the third
    run's, from scratch). Then node 1's memory as the kill left it,
    without its replica of node 0's, under a fresh --save: no version every rank has, so the run
    starts from scratch, and node 1's versions it would save again are removed first (one line),
    not rewritten. Then node 0's memory alone, at DP1; and node 0's memory under node 1's index
    (node 1 replaced by a machine numbered first): assembled at the same layout, bit-exact."""
    from megatron.training.config import shared_memory_dir

    save = tmp_path / "save"
    memory = shared_memory_dir(str(save), "in_memory")
    flags = ARGS + ["--async-lazy-save", "--lazy-save-peer-replica", "--save", str(save),
                    "--load", str(save), "--save-interval", "1000",
                    "--non-persistent-ckpt-type", "in_memory",
                    "--non-persistent-save-interval", "1"]

    first_flags = list(flags)

    def nodes(name, env=None):
        port, logs = free_port(), tmp_path / name
        logs.mkdir(exist_ok=True)
        return [Node(r, 2, 1, port, flags, logs, extra_env=env) for r in (0, 1)]

    def replicated():  # node 1's newest version that node 0 holds whole, if any
        peer = os.path.join(memory, "node0", "peer")
        done = [int(n[5:]) for n in (os.listdir(peer) if os.path.isdir(peer) else [])
                if n.startswith("iter_") and os.path.exists(
                    os.path.join(peer, n, layout.rank_marker_file(1)))]
        return max(done, default=None)

    def printed(text):
        return any(text in n.err_path.read_text() for n in first)

    try:
        # Rank 0 also stops receiving the second version node 1 sends once every byte arrived,
        # before the files are moved into place: the kill lands in the middle of that transfer.
        first = nodes("first", env={"DATASTATES_FAULT_DELAY_COPY": "120@6:1",
                                    "DATASTATES_FAULT_DELAY_REPLICA": "120#2:0"})
        deadline = time.time() + 240
        # A second version is always sent: each of versions 1-5 is handed off when it commits
        # (in the next iteration's save) if every rank's replica thread is idle then, and the
        # first one sent (at the latest 2, as nothing is in flight before it) has four
        # iterations to arrive before rank 1's copy of 6 holds both ranks (6 never commits).
        # Rounds go one at a time: once the second receipt stalls, the first arrived whole.
        stalled = re.compile(r"phase=replica step=(\d+) rank=0")
        while not (printed("phase=copy step=6 rank=1") and
                   stalled.search(first[0].err_path.read_text())):
            assert time.time() < deadline and first[0].proc.poll() is None, \
                first[0].result().describe() + first[1].result().describe()
            time.sleep(0.2)
        first[1].kill()
        first[0].kill()
        out = first[0].stdout()
        assert "DataStates peer replicas: the newest complete in-memory checkpoint" in out, out
        assert "and 2 of the previous node's (peer replicas)" in out, out
        held = replicated()
        cut = int(stalled.search(first[0].err_path.read_text()).group(1))
        partial = os.listdir(os.path.join(memory, "node0", "peer", f"iter_{cut:07d}"))
        assert held is not None and 1 <= held < cut <= 5, (held, cut)
        assert partial and all(n.endswith(".peer.tmp") for n in partial), partial
        assert not (save / "latest_checkpointed_iteration.txt").exists()
        shutil.copytree(os.path.join(memory, "node1"), tmp_path / "node1_memory")
        shutil.copytree(os.path.join(memory, "node0"), tmp_path / "node0_memory")
        shutil.rmtree(os.path.join(memory, "node1"))  # node 1 lost: its memory is gone

        second = [n.result(timeout=240) for n in nodes("second")]
        assert all(r.returncode == 0 for r in second), second[0].describe() + second[1].describe()
        m = re.search(r"loading the in-memory checkpoint of iteration (\d+) from ", second[0].stdout)
        assert m, second[0].describe()
        resumed = int(m.group(1))
        assert resumed == held, (resumed, held)  # never the half-received replica
        assert re.search(rf"\[rank 1\] received its in-memory shards of iteration {resumed} from "
                         r"peer rank 0: \d", second[1].stdout), second[1].describe()
        assert f"in-memory checkpoint of iteration {resumed}: rank(s) 1 (from rank 0) restored " \
               "from their peer replicas" in second[0].stdout, second[0].describe()
        assert re.search(r"; in-memory versions sent to the next node: [1-9]\d*, skipped there: "
                         r"\d+\) \|", second[0].stdout), second[0].describe()
        first_losses = {**first[0].result().losses(), **first[1].result().losses()}

        # Node 0 lost, and node 1 holds no replica of it: from scratch, node 1's stale versions
        # go first.
        fresh = tmp_path / "fresh"
        flags = [str(fresh) if f == str(save) else f for f in flags]
        stale = os.path.join(shared_memory_dir(str(fresh), "in_memory"), "node1")
        shutil.copytree(tmp_path / "node1_memory", stale, ignore=shutil.ignore_patterns("peer"))
        kept = sorted(n for n in os.listdir(stale) if n.startswith("iter_"))
        third = [n.result(timeout=240) for n in nodes("third")]
        assert all(r.returncode == 0 for r in third), third[0].describe() + third[1].describe()
        assert "training from iteration 0 to 6" in third[0].stdout
        assert f"[rank 1] in-memory checkpoints: removed iteration(s) " \
               f"{[int(n[5:]) for n in kept]} from {stale}: newer than iteration 0" \
               in third[1].stdout, third[1].describe()
        # From scratch, the third run is the uninterrupted reference: the first run printed the
        # same losses up to where it stalled, the restart from memory the same ones after it.
        reference = {**third[0].losses(), **third[1].losses()}
        assert sorted(reference) == [1, 2, 3, 4, 5, 6], reference
        assert first_losses and first_losses == {k: v for k, v in reference.items()
                                                 if k in first_losses}, first_losses
        losses = {**second[0].losses(), **second[1].losses()}
        assert losses == after(reference, resumed), (losses, reference)

        # Node 1 lost for good: the same command on node 0 alone (DP1) assembles the newest
        # version node 0 holds whole (its own files and node 1's replica) for its layout, reads
        # nothing from --save, and prints the losses of a resume at DP1 from a --save holding
        # that version (made here by hand from the same files).
        alone = tmp_path / "alone"
        alone_memory = shared_memory_dir(str(alone / "save"), "in_memory")
        shutil.copytree(tmp_path / "node0_memory", os.path.join(alone_memory, "node0"))
        # --save as the run that saved that memory left it at its start (no checkpoint yet; a
        # --save without that trace is one made anew, whose memory is an older run's).
        paths.prepare_root(str(alone / "save"))
        run = launch(1, [str(alone / "save") if f == str(save) else f for f in first_flags])
        assert run.returncode == 0, run.describe()
        # One node: nothing to replicate, so no memory is set aside for replicas.
        assert "(2 versions of its 1 rank(s)' checkpoints; " in run.stdout, run.describe()
        assert f"in-memory checkpoint of iteration {held} (saved by 2 ranks) assembled on every " \
               "node for this run's layout" in run.stdout, run.describe()
        assert f"loading the in-memory checkpoint of iteration {held} from " in run.stdout
        event = _restore_event(alone / "save")
        assert event["iteration"] == held and event["ranks"]["0"]["shared_bytes"] == 0 and \
            event["ranks"]["0"]["local_bytes"] > 0, event
        assert not os.path.exists(os.path.join(alone_memory, "node0", "relayout"))
        by_hand = tmp_path / "by_hand"
        version = by_hand / f"iter_{held:07d}"
        for source, ranks in (("", (0,)), ("peer", (1,))):
            d = tmp_path / "node0_memory" / source / f"iter_{held:07d}"
            for name in os.listdir(d):
                if name != layout.COMMIT_FILE and not name.endswith(".tmp") and (
                        not re.search(r"_r\d{5}\.", name) or
                        int(re.search(r"_r(\d{5})\.", name).group(1)) in ranks):
                    version.mkdir(parents=True, exist_ok=True)
                    if not (version / name).exists():
                        shutil.copy(d / name, version / name)
        assert layout.try_commit(str(version), 2)
        (by_hand / "latest_checkpointed_iteration.txt").write_text(str(held))
        ref = launch(1, ARGS + ["--load", str(by_hand)])
        assert ref.returncode == 0 and "format datastates" in ref.stdout, ref.describe()
        assert run.losses() == ref.losses() and len(ref.losses()) == 6 - held, run.stdout[-3000:]
        assert_close(run.losses(), after(reference, held))

        # Node 1 replaced by a machine that is numbered first: node 0's memory is under node 1's
        # index now (what `adopt_left_memory` makes of it on a real cluster) and node 0 holds
        # nothing. The restart assembles the version at the same layout from node 1's memory,
        # node 0 receives its rank's files from it, and the losses are the uninterrupted run's.
        moved = tmp_path / "moved" / "save"
        shutil.copytree(tmp_path / "node0_memory",
                        os.path.join(shared_memory_dir(str(moved), "in_memory"), "node1"),
                        ignore=shutil.ignore_patterns(".datastates_node_*", ".datastates_slots"))
        paths.prepare_root(str(moved))  # as its run left it at its start (see `alone`)
        flags = [str(moved) if f == str(save) else f for f in first_flags]
        fourth = [n.result(timeout=240) for n in nodes("moved")]
        assert all(r.returncode == 0 for r in fourth), fourth[0].describe() + fourth[1].describe()
        assert f"in-memory checkpoint of iteration {held} (saved by 2 ranks) assembled on every " \
               "node for this run's layout" in fourth[0].stdout, fourth[0].describe()
        assert f"loading the in-memory checkpoint of iteration {held} from " in fourth[0].stdout
        assert {**fourth[0].losses(), **fourth[1].losses()} == after(reference, held)
    finally:
        for root in (save, tmp_path / "fresh", tmp_path / "alone" / "save", tmp_path / "moved" /
                     "save"):
            shutil.rmtree(os.path.dirname(shared_memory_dir(str(root), "in_memory")),
                          ignore_errors=True)


# -- restarts on fewer nodes, at a new layout (issue 31) -----------------------------------------

def _lose_a_node(tmp_path, nnodes, extra=()):
    """`nnodes` agents of one rank (DP = nnodes; `extra` adds flags), saves at 3 and 6 with
    the last rank's copy of 6 held, so that 3 is the newest committed version while its
    replicas complete; then every node is killed and node 1's memory deleted. Returns (flags
    for a restart, --save, memory, the losses the killed run printed: iterations 1 to 6)."""
    save, memory = tmp_path / "save", tmp_path / "memory"
    flags = TINY_MODEL + NO_DROPOUT + ["--eval-interval", "0",
                                       "--train-iters", "6", "--global-batch-size", "12",
                                       "--async-lazy-save", "--lazy-save-peer-replica",
                                       "--save-interval", "3", *extra]
    port, logs = free_port(), tmp_path / "first"
    logs.mkdir()
    first = [Node(r, nnodes, 1, port, flags + ["--save", str(save), "--load", str(save),
                                               "--lazy-save-local-dir",
                                               str(memory / "node{node}")],
                  logs, extra_env={"DATASTATES_FAULT_DELAY_COPY": f"120@6:{nnodes - 1}"})
             for r in range(nnodes)]
    deadline = time.time() + 240
    done = [memory / f"node{n}" / "iter_0000003" / layout.rank_marker_file((n - 1) % nnodes)
            for n in range(nnodes)]
    while not (f"phase=copy step=6 rank={nnodes - 1}" in first[-1].err_path.read_text()
               and all(d.exists() for d in done)):
        assert time.time() < deadline and first[0].proc.poll() is None, \
            first[0].result().describe() + first[-1].result().describe()
        time.sleep(0.2)
    for node in first:
        node.kill()
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    shutil.rmtree(memory / "node1")  # node 1 lost: its memory is gone
    losses = first[-1].result().losses()  # the last rank prints them
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], losses
    return flags, save, memory, losses


def _resume(tmp_path, name, nproc, flags, save, memory, extra=(), nodes=1):
    """A restart from a copy of --save and of `memory` (None: no memory at all) on `nodes` agents
    of `nproc` ranks each; returns (runs, the restore event)."""
    root = tmp_path / name
    shutil.copytree(save, root / "save")
    if memory is not None:
        shutil.copytree(memory, root / "memory")
    args = flags + ["--save", str(root / "save"), "--load", str(root / "save"),
                    "--lazy-save-local-dir", str(root / "memory" / "node{node}"), *extra]
    if nodes == 1:
        runs = [launch(nproc, args)]
    else:
        port, logs = free_port(), root / "logs"
        logs.mkdir()
        runs = [n.result(timeout=240) for n in [Node(r, nodes, nproc, port, args, logs)
                                                 for r in range(nodes)]]
    assert all(r.returncode == 0 for r in runs), "".join(r.describe() for r in runs)
    return runs, _restore_event(root / "save")


def _losses(runs):
    out = {}
    for r in runs:
        out.update(r.losses())
    return out


def test_lost_node_restores_from_its_peer_and_the_node_left_reads_memory_at_dp1_and_tp2(
        tmp_path):
    """Two nodes at DP2 with megatron's plain optimizer (the three-node test below has the
    distributed one), node 1 killed mid-run and its memory deleted. Both nodes again: node 1's
    rank gets its shards back from node 0 and nothing is read from --save. The same command on
    node 0 alone, at DP1 and at TP2 on its two ranks, resumes from node 0's memory (its own
    shards and node 1's replica): 0 bytes from --save. Each prints the losses of a resume from
    --save (no memory anywhere) at its layout (TP2 against DP1's, to fp32 rounding)."""
    flags, save, memory, uninterrupted = _lose_a_node(tmp_path, 2)  # the plain optimizer
    held = sorted(os.listdir(memory / "node0" / "iter_0000003"))  # the node left holds both
    assert [n for n in held if n.startswith("done_")] == ["done_r00000.json",
                                                           "done_r00001.json"], held
    from_save = {}  # DP1's losses resumed from --save
    for name, nproc, nodes, extra in (("dp2", 1, 2, []), ("dp1", 1, 1, []),
                                      ("tp2", 2, 1, ["--tensor-model-parallel-size", "2"])):
        runs, event = _resume(tmp_path, name, nproc, flags, save, memory, extra, nodes=nodes)
        assert event["iteration"] == 3 and all(
            e["shared_bytes"] == 0 for e in event["ranks"].values()), (name, event)
        if nodes == 2:  # the saved layout: the killed run's own losses follow
            assert "[rank 1] received saved rank 1's shards from peer rank 0: " in runs[1].stdout
            assert event["ranks"]["1"]["peer_bytes"] > 0, event
            assert _losses(runs) == after(uninterrupted, 3)
            continue
        assert runs[0].stdout.count(f"WARNING: --lazy-save-peer-replica: all {nproc} rank(s) "
                                    "run on one node, so no checkpoint is replicated to another "
                                    "node in this run") == 1
        assert all(e["local_bytes"] > 0 for e in event["ranks"].values()), event
        if name == "tp2":  # against DP1's resume from --save (the test's budget): to fp32's last
            assert_close(_losses(runs), from_save)  # digits (TP reduces in another order)
            continue
        ref_runs, ref = _resume(tmp_path, name + "_from_save", nproc, flags, save, None, extra)
        assert all(e["shared_bytes"] > 0 and e["peer_bytes"] == 0
                   for e in ref["ranks"].values()), ref
        from_save = _losses(ref_runs)
        assert _losses(runs) == from_save and len(from_save) == 3, name


def test_restart_on_two_survivors_of_three_takes_what_each_lacks_from_the_other(tmp_path):
    """Three nodes at DP3 (ring 0 -> 1 -> 2 -> 0) with the distributed optimizer, node 1 lost
    (each survivor then reads its own ranges of the optimizer's state, at DP2, out of saved
    ranks' files that partly only the other survivor holds): the survivors hold saved ranks
    {0, 2} and {2, 1}. Restarted on the two at DP2 (the machine that was node 2 is node 1 now:
    its memory directory is renamed as a per-machine path would find it), each reads a saved rank
    only the other holds over the process group: 0 bytes from --save, the losses of a resume
    from --save at DP2."""
    flags, save, memory, _ = _lose_a_node(tmp_path, 3, DISTOPT)
    os.rename(memory / "node2", memory / "node1")
    runs, event = _resume(tmp_path, "dp2", 1, flags, save, memory, nodes=2)
    assert all(e["shared_bytes"] == 0 for e in event["ranks"].values()), event
    assert all(e["peer_bytes"] > 0 for e in event["ranks"].values()), event
    received = "".join(r.stdout for r in runs)
    assert re.search(r"\[rank 0\] received saved rank 1's shards from peer rank 1: ", received)
    assert re.search(r"\[rank 1\] received saved rank 0's shards from peer rank 0: ", received)
    ref_runs, ref = _resume(tmp_path, "dp2_from_save", 1, flags, save, None, nodes=2)
    assert all(e["shared_bytes"] > 0 for e in ref["ranks"].values()), ref
    assert _losses(runs) == _losses(ref_runs) and len(_losses(runs)) == 3
