"""Dry run: models built on the meta device per (stage, TP rank) agree with the architecture
formula, for small GPT-2 and Llama layouts and the paper's five (Llama) models, and through
pretrain_gpt.py's parser; the paper's models fit a 40 GB GPU at the paper's layout."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from megatron.training.config import ModelConfig, Normalization, ParallelConfig, PositionEmbeddingType
from tools import dry_run as dry_run_cli
from tools.scale.architecture import (PAPER_MODELS, GPTArch, architecture_args, checkpoint_bytes_per_rank,
                                      rank_params, unique_parameters)
from tools.scale.dry_run import dry_run
from tools.scale.memory import A100_40GB_BYTES, RESERVE_FRACTION


def _configs(arch: GPTArch, tp: int, pp: int, dp: int = 1, bf16: bool = True):
    model = ModelConfig(num_layers=arch.num_layers, hidden_size=arch.hidden_size,
                        num_attention_heads=arch.num_attention_heads, ffn_hidden_size=arch.ffn,
                        seq_length=arch.seq_length, max_position_embeddings=arch.seq_length,
                        vocab_size=arch.vocab_size, padded_vocab_size=arch.padded_vocab(tp), bf16=bf16,
                        untie_embeddings_and_output_weights=arch.untie_embeddings_and_output_weights,
                        position_embedding_type=(PositionEmbeddingType.ROPE if arch.rope
                                                 else PositionEmbeddingType.LEARNED_ABSOLUTE),
                        normalization=Normalization.RMS_NORM if arch.rms_norm else Normalization.LAYER_NORM,
                        swiglu=arch.swiglu, num_query_groups=arch.num_query_groups,
                        add_bias_linear=arch.add_bias_linear)
    uneven = pp > 1 and arch.first_stage_layers is not None  # as pretrain_gpt.py's flags set them
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              use_distributed_optimizer=True, world_size=tp * pp * dp,
                              decoder_first_pipeline_num_layers=arch.first_stage_layers if uneven else None,
                              decoder_last_pipeline_num_layers=arch.last_stage_layers if uneven else None)
    return model, parallel


SMALL = GPTArch("small", num_layers=6, hidden_size=64, num_attention_heads=4, nodes=1, vocab_size=1000,
                seq_length=32, make_vocab_size_divisible_by=8)
# The paper models' family at a size that builds in milliseconds: rope, RMSNorm, SwiGLU (an FFN that
# is not 4h), no biases, untied, and 4 key/value heads for 8 query heads.
SMALL_LLAMA = dataclasses.replace(SMALL, name="small-llama", num_attention_heads=8, ffn_hidden_size=176,
                                  untie_embeddings_and_output_weights=True, rope=True, rms_norm=True, swiglu=True,
                                  num_query_groups=4, add_bias_linear=False)


@pytest.mark.parametrize("tp,pp,untie,first_last", [(1, 1, False, None), (2, 3, False, None), (4, 2, True, None),
                                                    (2, 2, False, None), (1, 4, False, 1), (2, 3, True, 1)])
def test_built_ranks_match_the_formula(tp, pp, untie, first_last):
    # first_last: an uneven split (--decoder-first/last-pipeline-num-layers), e.g. 1 + 2 + 2 + 1:
    # every middle stage holds its own layer count, not the first stage's.
    arch = dataclasses.replace(SMALL, untie_embeddings_and_output_weights=untie, first_stage_layers=first_last,
                               last_stage_layers=first_last)
    model, parallel = _configs(arch, tp, pp)
    report = dry_run(model, parallel, parallel.stage_layers(model.num_layers))
    assert list(report.stage_layers) == arch.stage_layers(pp)
    assert len(report.ranks) == tp * pp
    for count in report.ranks:
        expected = rank_params(arch, tp, pp, count.stage)
        assert (count.params, count.tp_replicated, count.embedding_copy) == (
            expected.total, expected.tp_replicated if tp > 1 else 0, expected.embedding_copy)
    assert report.unique_parameters() == unique_parameters(arch, tp, pp)
    assert [report.rank_bytes(c).total for c in report.ranks] == checkpoint_bytes_per_rank(arch, tp, pp)


def test_bytes_per_rank_follow_precision_and_data_parallel_sharding():
    model, parallel = _configs(SMALL, 2, 1, dp=4)
    report = dry_run(model, parallel)
    c = report.ranks[1]
    held = report.rank_bytes(c)
    assert (held.weights, held.main_params, held.adam_moments) == (2 * c.params, c.params * 4 // 4, c.params * 8 // 4)
    # torch_dist writes TP-replicated tensors once (TP rank 0) and weights once (DP rank 0).
    assert report.rank_bytes(c, unique_only=True, dp_rank=1).weights == 0
    assert report.rank_bytes(c, unique_only=True).weights == 2 * (c.params - c.tp_replicated)
    fp32 = dry_run(dataclasses.replace(model, bf16=False), parallel)
    assert fp32.rank_bytes(fp32.ranks[0]).main_params == 0  # fp32 weights are the main params
    assert fp32.rank_bytes(fp32.ranks[0]).weights == 4 * fp32.ranks[0].params
    # --fp16 keeps 16-bit weights and fp32 main params, as --bf16 does (it counted as fp32).
    fp16 = dry_run(dataclasses.replace(model, bf16=False, fp16=True), parallel)
    assert (fp16.precision, report.precision, fp32.precision) == ("fp16", "bf16", "fp32")
    assert fp16.rank_bytes(fp16.ranks[1]) == held


@pytest.mark.parametrize("tp,pp,groups,first_last", [(1, 1, 4, None), (2, 3, 4, None), (4, 2, 4, None),
                                                     (2, 1, 2, None), (4, 4, 8, 1), (2, 3, None, 1)])
def test_llama_ranks_built_match_the_formula(tp, pp, groups, first_last):
    # Rope has no position table, RMSNorm no bias, SwiGLU a 2 x ffn fc1, GQA narrower keys and
    # values, no linear biases: every count differs from the GPT-2 formula's.
    arch = dataclasses.replace(SMALL_LLAMA, num_query_groups=groups, first_stage_layers=first_last,
                               last_stage_layers=first_last)
    model, parallel = _configs(arch, tp, pp)
    report = dry_run(model, parallel, parallel.stage_layers(model.num_layers))
    for count in report.ranks:
        expected = rank_params(arch, tp, pp, count.stage)
        assert (count.params, count.tp_replicated, count.embedding_copy) == (
            expected.total, expected.tp_replicated if tp > 1 else 0, 0)
    assert report.unique_parameters() == unique_parameters(arch, tp, pp)
    assert [report.rank_bytes(c).total for c in report.ranks] == checkpoint_bytes_per_rank(arch, tp, pp)
    gpt2 = dataclasses.replace(arch, rope=False, rms_norm=False, swiglu=False, num_query_groups=None,
                               add_bias_linear=True)
    assert unique_parameters(arch, tp, pp) != unique_parameters(gpt2, tp, pp)


def test_paper_models_built_on_meta_match_the_formula_and_fit_40_gb(tmp_path, capsys):
    """The five Llama configurations through pretrain_gpt.py's parser (the flags the Slurm examples
    pass), built per (stage, TP rank) on the meta device: counts equal the formula the projection
    uses, and every rank's memory estimate fits an A100-40GB."""
    assert dry_run_cli.main(["--paper-models", "--json", str(tmp_path / "d.json")]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "d.json").read_text())
    budget = A100_40GB_BYTES * (1 - RESERVE_FRACTION)
    for arch in PAPER_MODELS:
        row = data[arch.name]
        assert row["unique_params"] == unique_parameters(arch, 4, arch.nodes)
        assert [r["held_bytes"] for r in row["ranks"]] == checkpoint_bytes_per_rank(arch, 4, arch.nodes)
        assert row["stage_layers"] == arch.stage_layers(arch.nodes)
        assert max(r["gpu_bytes"] for r in row["ranks"]) <= budget, arch.name
        assert "--swiglu" in row["launch"] and "--sequence-parallel" in row["launch"]
    # Llama-2's published sizes (vocabulary 32000 padded to 32256 at TP=4: +0.2% at 7B).
    assert data["7B"]["unique_params"] / 1e9 == pytest.approx(6.738, rel=1e-3)
    assert data["70B"]["unique_params"] / 1e9 == pytest.approx(68.98, rel=1e-3)
    assert data["70B"]["torch_gb"] == pytest.approx(965.8, rel=1e-3)
    table = out.split("paper B/param")[1]
    assert "70B" in table and "1065" in table and "965.8" in table and "0.91" in table
    assert out.count("fits a 40 GB A100") == 5 and "does NOT fit" not in out


def test_uneven_split_must_be_given_and_must_add_up():
    model, parallel = _configs(SMALL, 1, 4)
    with pytest.raises(ValueError, match="do not split evenly over 4 stages"):
        dry_run(model, parallel)
    with pytest.raises(ValueError, match="must be 4 counts summing to 6"):
        dry_run(model, parallel, [1, 1, 1, 1])
    assert [c.layers for c in dry_run(model, parallel, [1, 2, 2, 1]).ranks] == [1, 2, 2, 1]


def test_cli_validates_launch_arguments(capsys):
    launch = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--micro-batch-size", "2", "--train-iters", "1", "--tensor-model-parallel-size", "2",
              "--pipeline-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer", "--mock-data",
              "--vocab-size", "999"]
    assert dry_run_cli.main(["--world-size", "8", "--"] + launch) == 0
    out = capsys.readouterr().out
    assert "layer split per stage: [2, 2]  (TP=2, DP=2" in out
    assert dry_run_cli.main(["--world-size", "6", "--"] + launch) == 2
    assert "world size 6 is not divisible by TP*PP = 2*2 = 4" in capsys.readouterr().err
    assert dry_run_cli.main(["--"] + launch + ["--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    # An uneven split builds (8 layers: 2 + 4 + 2); a contradictory one is refused in one line.
    uneven = launch[:1] + ["8"] + launch[2:] + ["--pipeline-model-parallel-size", "3",
                                                 "--decoder-first-pipeline-num-layers", "2",
                                                 "--decoder-last-pipeline-num-layers", "2"]
    assert dry_run_cli.main(["--world-size", "6", "--lazy-cache-mb", "--"] + uneven) == 0
    out = capsys.readouterr().out
    assert "layer split per stage: [2, 4, 2]" in out and out.endswith("lazy cache per rank (MiB): 64\n")
    assert dry_run_cli.main(["--world-size", "6", "--"] + uneven[:-1] + ["7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must split evenly over the other 1 pipeline stage(s), got -1" in err, err


def test_lazy_cache_holds_the_largest_rank():
    assert dry_run_cli.lazy_cache_mb(1) == 64 and dry_run_cli.lazy_cache_mb(64 * 2**20) == 64
    assert dry_run_cli.lazy_cache_mb(64 * 2**20 + 1) == 128
    assert dry_run_cli.lazy_cache_mb(int(14.891e9)) == 14208  # 30B's middle stages


def test_cli_runs_as_a_script_on_a_llama_launch(tmp_path):
    """As the Slurm examples call it: a script, the family flags from architecture_args."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "dry_run.py")
    arch = dataclasses.replace(SMALL_LLAMA, dropout=0.0)
    launch = architecture_args(arch) + [
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "1", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "selective",
        "--bf16", "--use-distributed-optimizer", "--mock-data", "--vocab-size", "999",
        "--make-vocab-size-divisible-by", "8"]
    proc = subprocess.run([sys.executable, script, "--json", str(tmp_path / "d.json"), "--"] + launch,
                          capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "d.json").read_text())
    assert [r["held_bytes"] for r in data["ranks"]] == checkpoint_bytes_per_rank(arch, 2, 2)
    assert "fits a 40 GB A100" in proc.stdout


def test_in_memory_level_per_node_counts_what_the_start_up_check_counts(tmp_path, capsys):
    """TP2 x PP2 x DP2 on two nodes of 4 ranks: node 0 runs stage 0 (both DP replicas of each TP
    rank), node 1 stage 1. Keeping two versions with peer replicas, each node holds 2 + 1 + 2
    versions of its own ranks' checkpoints and 2 of the previous node's (the ring: node 0's
    previous is node 1)."""
    launch = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--micro-batch-size", "2", "--train-iters", "1", "--tensor-model-parallel-size", "2",
              "--pipeline-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer", "--mock-data",
              "--vocab-size", "999", "--async-lazy-save", "--save", str(tmp_path / "save"),
              "--non-persistent-ckpt-type", "in_memory", "--non-persistent-save-interval", "1",
              "--keep-last-n-non-persistent", "2", "--lazy-save-peer-replica"]
    out = tmp_path / "d.json"
    assert dry_run_cli.main(["--world-size", "8", "--ranks-per-node", "4", "--json", str(out), "--"] + launch) == 0
    data = json.loads(out.read_text())
    held = {(r["stage"], r["tp_rank"]): r["held_bytes"] for r in data["ranks"]}
    stage = [2 * (held[s, 0] + held[s, 1]) for s in (0, 1)]  # a node: one stage, DP 2
    level = data["memory_level"]
    assert (level["versions"], level["peer_versions"]) == (5, 2)
    assert level["node_bytes"] == [5 * stage[0] + 2 * stage[1], 5 * stage[1] + 2 * stage[0]]
    assert "(5 versions of its 4 ranks' checkpoints and 2 of the previous node's)" in capsys.readouterr().out
    # One node of 8 ranks: no peer replicas to hold (the trainer warns and replicates nothing).
    assert dry_run_cli.main(["--world-size", "8", "--json", str(out), "--"] + launch) == 0
    assert json.loads(out.read_text())["memory_level"]["node_bytes"] == [3 * sum(stage)]
    assert dry_run_cli.main(["--world-size", "8", "--ranks-per-node", "3", "--"] + launch) == 2
    assert "--ranks-per-node 3 does not divide the 8 ranks into whole nodes" in capsys.readouterr().err
