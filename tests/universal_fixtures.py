"""Synthetic megatron-layout checkpoints for the universal tests, written by the real engine
(several ranks simulated in one process), so format tests need no process group."""
import json
import os

import pytest
import torch

from datastates import CheckpointEngine, CommitPolicy, EngineConfig, TensorShard

L, H, F, V = 2, 8, 32, 16  # layers, hidden, ffn, vocab
MODEL = {"num_layers": L, "hidden_size": H, "num_attention_heads": 2, "ffn_hidden_size": F,
         "seq_length": 4, "max_position_embeddings": 4, "vocab_size": V, "padded_vocab_size": V,
         "untie_embeddings_and_output_weights": False, "bf16": False, "init_method_std": 0.02,
         "hidden_dropout": 0.0, "attention_dropout": 0.0}
SHAPES = {
    "embedding.word_embeddings.weight": (V, H),
    "embedding.position_embeddings.weight": (4, H),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, H),
    "decoder.layers.self_attention.linear_qkv.layer_norm_bias": (L, H),
    "decoder.layers.self_attention.linear_qkv.weight": (L, 3 * H, H),
    "decoder.layers.self_attention.linear_qkv.bias": (L, 3 * H),
    "decoder.layers.self_attention.linear_proj.weight": (L, H, H),
    "decoder.layers.self_attention.linear_proj.bias": (L, H),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, H),
    "decoder.layers.mlp.linear_fc1.layer_norm_bias": (L, H),
    "decoder.layers.mlp.linear_fc1.weight": (L, F, H),
    "decoder.layers.mlp.linear_fc1.bias": (L, F),
    "decoder.layers.mlp.linear_fc2.weight": (L, H, F),
    "decoder.layers.mlp.linear_fc2.bias": (L, H),
    "decoder.final_layernorm.weight": (H,),
    "decoder.final_layernorm.bias": (H,),
}


def global_tensors(seed: int = 0, optimizer_state=("param", "exp_avg", "exp_avg_sq")):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in SHAPES.items():
        out[key] = torch.randn(shape, generator=g)
        for kind in optimizer_state:
            out[f"optimizer.state.{kind}.{key}"] = torch.randn(shape, generator=g).abs()
    return out


def common_state(iteration: int) -> dict:
    groups = [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": w, "step": 5.0}
              for w in (0.01, 0.0)]
    return {"optimizer": {"optimizer": {"param_groups": groups},
                          "param_state_sharding_type": "fully_reshardable"},
            "opt_param_scheduler": {"num_steps": 40, "max_lr": 1e-3},
            "checkpoint_version": 3.0, "iteration": iteration, "consumed_train_samples": 8 * iteration,
            "consumed_valid_samples": 0,
            "run_config": json.dumps({"model": MODEL, "data": {"tokenizer_type": "NullTokenizer"},
                                      "parallel": {"tensor_model_parallel_size": 2,
                                                   "pipeline_model_parallel_size": 1,
                                                   "world_size": 2,
                                                   "use_distributed_optimizer": True}},
                                     indent=2, sort_keys=True),
            "content_metadata": {"distrib_optim_sharding_type": "fully_reshardable"}}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(iter_0000005 of a DataStates checkpoint with `global_tensors()`, those tensors), once per
    test module (import it into the module to use it)."""
    d = str(tmp_path_factory.mktemp("src") / "iter_0000005")
    tensors = global_tensors()
    write_datastates_checkpoint(d, tensors)
    return d, tensors


def write_datastates_checkpoint(directory: str, tensors: dict, iteration: int = 5,
                                world: int = 2) -> None:
    """Every tensor split over `world` ranks along its last dimension (as TP splits columns),
    committed, with megatron's common.pt and metadata.json next to it."""
    os.makedirs(directory, exist_ok=True)
    engines = [CheckpointEngine(EngineConfig(rank=r, world_size=world, host_cache_bytes=1 << 20,
                                             commit_policy=CommitPolicy.RANK0))
               for r in range(world)]
    try:
        handles = []
        for r, engine in enumerate(engines):
            shards = {}
            for key, t in tensors.items():
                n = t.shape[-1] // world
                off = (0,) * (t.dim() - 1) + (r * n,)
                shards[f"{key}@{r}"] = TensorShard(t[..., r * n:(r + 1) * n].clone(), key,
                                                   tuple(t.shape), off)
            objects = {f"decoder.layers.mlp.linear_fc1._extra_state/shard_{i}_{L}": None
                       for i in range(L)} if r == 0 else {}
            objects[f"rng_state/shard_0.{r}.0_1.{world}.1"] = {"seed": r}
            handles.append(engine.save({"tensors": shards, "objects": objects}, directory,
                                       step=iteration))
        for engine, h in zip(engines, handles):
            engine.wait_for_durable(h)
        assert engines[0].wait_for_commit(handles[0], timeout=60)
    finally:
        for e in engines:
            e.close()
    torch.save(common_state(iteration), os.path.join(directory, "common.pt"))
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "datastates", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)


# ----------------------------------------------------------------- universal files, by hand

def tensor_span(udir: str, name: str):
    """(safetensors file, absolute byte offset, nbytes) of universal tensor `name`, read from
    the file's own header (independently of the library's reader)."""
    import struct

    file = json.load(open(os.path.join(udir, "model.safetensors.index.json")))["weight_map"][name]
    path = os.path.join(udir, file)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        begin, end = json.loads(f.read(n))[name]["data_offsets"]
    return path, 8 + n + begin, end - begin


def flip_byte(path: str, offset: int, mask: int = 0x40) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def reseal(udir: str) -> None:
    """After a deliberate edit of manifest.json or the index (a forgery, not damage): record their
    new checksums in the commit marker, as a forger would."""
    import crc32c

    path = os.path.join(udir, "UNIVERSAL_COMMIT.json")
    commit = json.load(open(path))
    for field, name in (("manifest_crc32c", "manifest.json"),
                        ("index_crc32c", "model.safetensors.index.json")):
        if field in commit:
            commit[field] = crc32c.crc32c(open(os.path.join(udir, name), "rb").read())
    json.dump(commit, open(path, "w"))


def strip_checksums(udir: str) -> None:
    """Make `udir` look like a universal checkpoint written before checksums existed."""
    path = os.path.join(udir, "manifest.json")
    m = json.load(open(path))
    m.pop("checksum")
    for entry in m["tensors"].values():
        entry.pop("crc32c")
    json.dump(m, open(path, "w"), indent=1, sort_keys=True)
    path = os.path.join(udir, "UNIVERSAL_COMMIT.json")
    commit = json.load(open(path))
    commit.pop("manifest_crc32c")
    commit.pop("index_crc32c")
    json.dump(commit, open(path, "w"))
