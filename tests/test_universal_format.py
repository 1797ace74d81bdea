"""Universal format, merge, idempotence, kill safety, HF export, background policy (one process;
checkpoints written by the real engine with ranks simulated in-process)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from datastates import CheckpointError, CheckpointReader
from datastates.megatron_adapter import BackgroundMerger, MergerConfig, export_hf, open_source
from datastates.universal import (INDEX_FILE, MANIFEST_FILE, UniversalCheckpoint, decode_value,
                                  is_committed, write_universal)
from universal_fixtures import (H, L, common_state, global_tensors, source,  # noqa: F401
                                write_datastates_checkpoint)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _universal_name(key):
    return key.replace("optimizer.state.param.", "optimizer.state.fp32_param.")


def test_merge_writes_full_tensors_split_files_index_and_manifest(source, tmp_path):
    d, tensors = source
    dst = str(tmp_path / "u")
    result = write_universal(open_source(d), dst, max_file_bytes=4096)
    assert not result.skipped and result.iteration == 5 and is_committed(dst)
    assert result.bytes == sum(t.numel() * 4 for t in tensors.values())
    index = json.load(open(os.path.join(dst, INDEX_FILE)))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and index["metadata"]["total_size"] == result.bytes
    # Any safetensors reader: every tensor equals the gathered original, bit for bit.
    seen = set()
    for f in files:
        with safe_open(os.path.join(dst, f), framework="pt") as st:
            for name in st.keys():
                assert index["weight_map"][name] == f
                seen.add(name)
    assert seen == {_universal_name(k) for k in tensors}
    with UniversalCheckpoint(dst) as u:
        for key, t in tensors.items():
            assert torch.equal(u.read(_universal_name(key)), t), key
        w = tensors["decoder.layers.mlp.linear_fc1.weight"]
        assert torch.equal(u.read("decoder.layers.mlp.linear_fc1.weight", (1, 3, 2), (1, 5, 4)),
                           w[1:2, 3:8, 2:6])
        m = u.manifest
    assert m["iteration"] == 5 and m["consumed_train_samples"] == 40
    assert m["optimizer"]["flavor"] == "distributed" and m["optimizer"]["step"] == 5.0
    assert "step" not in m["optimizer"]["param_groups"][0]
    assert m["scheduler"] == {"num_steps": 40, "max_lr": 1e-3}
    assert m["model_config"]["hidden_size"] == H and m["source"]["layout"]["tp"] == 2
    assert m["tokenizer"]["tokenizer_type"] == "NullTokenizer"
    # Per-layer objects are kept, per-rank RNG streams are not.
    assert sorted(m["objects"]) == [f"decoder.layers.mlp.linear_fc1._extra_state/shard_{i}_{L}"
                                    for i in range(L)]
    assert decode_value(m["megatron_common"])["optimizer"] == common_state(5)["optimizer"]


def test_rerun_is_a_no_op_and_overwrite_rewrites(source, tmp_path):
    d, _ = source
    dst = str(tmp_path / "u")
    write_universal(open_source(d), dst)
    stamp = os.stat(os.path.join(dst, MANIFEST_FILE)).st_mtime_ns
    again = write_universal(open_source(d), dst)
    assert again.skipped and os.stat(os.path.join(dst, MANIFEST_FILE)).st_mtime_ns == stamp
    assert not write_universal(open_source(d), dst, overwrite=True).skipped
    assert sorted(os.listdir(tmp_path)) == ["u"]  # no temporary left behind


def test_fp32_weights_become_main_weights_for_the_local_optimizer(tmp_path):
    d = str(tmp_path / "iter_0000005")
    tensors = global_tensors(optimizer_state=("exp_avg", "exp_avg_sq"))
    write_datastates_checkpoint(d, tensors)
    with UniversalCheckpoint(write_universal(open_source(d), str(tmp_path / "u")).directory) as u:
        assert u.manifest["optimizer"]["flavor"] == "local"
        for key in ("decoder.final_layernorm.weight", "decoder.layers.mlp.linear_fc2.weight"):
            assert torch.equal(u.read("optimizer.state.fp32_param." + key), tensors[key])


def test_refuses_uncommitted_source_and_unknown_optimizer_state(tmp_path):
    d = str(tmp_path / "iter_0000005")
    write_datastates_checkpoint(d, {**global_tensors(optimizer_state=()),
                                    "optimizer.state.momentum_buffer.x": torch.ones(2, 2)})
    with pytest.raises(CheckpointError, match="momentum_buffer"):
        write_universal(open_source(d), str(tmp_path / "u"))
    flat = str(tmp_path / "iter_0000006")
    write_datastates_checkpoint(flat, {**global_tensors(optimizer_state=()),
                                       "optimizer.distributed.dp_group_idx_0.gp_0.param":
                                       torch.ones(4, 2)})
    with pytest.raises(CheckpointError, match="layout-specific"):
        write_universal(open_source(flat), str(tmp_path / "u"))
    os.remove(os.path.join(d, "COMMIT.json"))
    with pytest.raises(CheckpointError, match="not committed"):
        open_source(d)
    assert not os.path.exists(tmp_path / "u")
    with pytest.raises(CheckpointError, match="not a committed universal"):
        UniversalCheckpoint(str(tmp_path))


def test_killed_merge_leaves_previous_universal_and_source_intact(source, tmp_path):
    d, tensors = source
    root = str(tmp_path / "universal")
    previous = os.path.join(root, "iter_0000004")
    write_universal(open_source(d), previous)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("4")
    dst = os.path.join(root, "iter_0000005")
    total = sum(t.numel() * 4 for t in tensors.values())
    cmd = [sys.executable, "-m", "datastates.megatron_adapter.merge", "--source", d, "--output", dst,
           "--root", root, "--max-file-bytes", "4096", "--max-bytes-per-s", str(total / 20)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tmp = f"{dst}.tmp-{proc.pid}"
    deadline = time.time() + 120
    while not (os.path.isdir(tmp) and any(n.endswith(".safetensors") for n in os.listdir(tmp))):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # mid-merge: some files written, no manifest, no marker
    proc.wait()
    assert not os.path.exists(dst) and not os.path.exists(os.path.join(tmp, "UNIVERSAL_COMMIT.json"))
    with pytest.raises(CheckpointError):
        UniversalCheckpoint(tmp)
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == "4"
    with UniversalCheckpoint(previous) as u:
        assert torch.equal(u.read("decoder.layers.mlp.linear_fc1.weight"),
                           tensors["decoder.layers.mlp.linear_fc1.weight"])
    reader = CheckpointReader(d)  # the source is still committed and verifies
    assert torch.equal(reader.read("embedding.word_embeddings.weight"),
                       tensors["embedding.word_embeddings.weight"])
    # Rerunning finishes the job, removes the dead merge's temporary, and advances the tracker.
    out = subprocess.run(cmd[:-2], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " universal merge iteration        5 | bytes: " in out.stdout
    assert json.loads(out.stdout.splitlines()[-1])["iteration"] == 5
    assert sorted(os.listdir(root)) == ["iter_0000004", "iter_0000005",
                                        "latest_checkpointed_iteration.txt",
                                        "universal_merges.jsonl"]
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == "5"


def _gpt2_back(hf, name, i, heads=2):
    """Undo the HF mapping for layer i (test-side inverse)."""
    p = f"transformer.h.{i}."
    if name == "qkv":
        w = hf[p + "attn.c_attn.weight"].t()
        q, k, v = w.chunk(3)
        hd = H // heads
        return torch.stack([q.view(heads, hd, H), k.view(heads, hd, H), v.view(heads, hd, H)],
                           1).reshape(3 * H, H)
    raise KeyError(name)


def test_hf_export_opens_with_safetensors_and_matches(source, tmp_path):
    d, tensors = source
    u = write_universal(open_source(d), str(tmp_path / "u")).directory
    cfg = export_hf(u, str(tmp_path / "hf"))
    assert json.load(open(tmp_path / "hf" / "config.json")) == cfg
    assert cfg["model_type"] == "gpt2" and cfg["n_layer"] == L and cfg["n_embd"] == H
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        hf = {k: f.get_tensor(k) for k in f.keys()}
    assert len(hf) == 4 + 12 * L
    assert torch.equal(hf["transformer.wte.weight"], tensors["embedding.word_embeddings.weight"])
    for i in range(L):
        p = f"transformer.h.{i}."
        lay = lambda k: tensors["decoder.layers." + k][i]  # noqa: E731
        assert torch.equal(_gpt2_back(hf, "qkv", i), lay("self_attention.linear_qkv.weight"))
        assert torch.equal(hf[p + "mlp.c_fc.weight"], lay("mlp.linear_fc1.weight").t())
        assert torch.equal(hf[p + "attn.c_proj.weight"], lay("self_attention.linear_proj.weight").t())
        assert torch.equal(hf[p + "ln_2.bias"], lay("mlp.linear_fc1.layer_norm_bias"))
    # q of head 1 comes from rows [3*hd, 4*hd) of megatron's interleaved QKV
    hd = H // 2
    qkv = tensors["decoder.layers.self_attention.linear_qkv.weight"][0]
    assert torch.equal(hf["transformer.h.0.attn.c_attn.weight"][:, hd:2 * hd],
                       qkv[3 * hd:4 * hd].t())


def test_hf_export_refuses_what_does_not_map(tmp_path):
    d = str(tmp_path / "iter_0000005")
    tensors = {k: v for k, v in global_tensors(optimizer_state=()).items()
               if "position_embeddings" not in k}
    write_datastates_checkpoint(d, tensors)
    u = write_universal(open_source(d), str(tmp_path / "u")).directory
    with pytest.raises(CheckpointError, match="no learned position embeddings"):
        export_hf(u, str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")


def test_background_merger_runs_one_at_a_time_and_keeps_the_newest_waiting(source, tmp_path):
    d, _ = source
    root = str(tmp_path / "universal")
    lines = []
    merger = BackgroundMerger(MergerConfig(root=root, every_n=2), log=lines.append)
    for it in (1, 2, 3, 4, 5, 6):  # commits 2, 4, 6 are merged; 4 waits and is replaced by 6
        merger.on_commit(it, d)
    assert merger.running.iteration == 2 and merger.pending.iteration == 6
    assert merger.iterations_in_use() == [2, 6]  # what retention must keep meanwhile
    assert "skipped" in lines[0] and lines[0].startswith(" universal merge iteration        4")
    assert merger.workers[0].proc.args[:3] == ["nice", "-n", "19"]
    worker = merger.workers[0].proc
    merger.wait()
    assert merger.iterations_in_use() == []
    assert merger.worker_starts == 1 and worker.returncode == 0  # one worker, stopped by wait()
    assert [r["directory"] for r in merger.results] == [os.path.join(root, "iter_0000002"),
                                                        os.path.join(root, "iter_0000006")]
    assert all(is_committed(r["directory"]) for r in merger.results)
    records = [json.loads(x) for x in open(os.path.join(root, "universal_merges.jsonl"))]
    assert [r.get("skipped_for") for r in records if "skipped_for" in r] == [6]
    assert sum(1 for r in records if r.get("bytes")) == 2
