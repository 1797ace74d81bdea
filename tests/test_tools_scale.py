"""Scale tools: architecture formula, the projection model, its agreement with the paper, CLI."""
import dataclasses
import json
import math

import pytest

from tools import project_scale
from tools.scale.architecture import (PAPER_MODELS, GPTArch, WeightsWriter, checkpoint_bytes_per_rank,
                                      layer_split, rank_params, unique_parameters)
from tools.scale.compare import dp_scaling_rows, end_to_end_checks, throughput_checks
from tools.scale.inputs import load_inputs
from tools.scale.paper import calibrate, derive_paper_phases
from tools.scale.projection import Phases, Platform, ScaleCase, Variant, predict

PAPER_INPUTS = project_scale.DEFAULT_INPUTS
TINY = GPTArch("tiny", num_layers=4, hidden_size=8, num_attention_heads=2, nodes=1, vocab_size=100,
               seq_length=16, make_vocab_size_divisible_by=8)


def test_parameter_formula_matches_a_hand_count():
    h, f, v, s, layers = 8, 32, 104, 16, 4  # vocab 100 padded to a multiple of 8 (TP 1)
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (f * h + f) + (h * f + h) + 2 * (2 * h)
    assert unique_parameters(TINY) == v * h + s * h + layers * per_layer + 2 * h
    # Splitting over TP and PP keeps every unique parameter exactly once...
    # (TP 2 pads the vocabulary to a multiple of 8 * 2 = 112.)
    assert unique_parameters(TINY, tp=2, pp=2) == unique_parameters(dataclasses.replace(TINY, vocab_size=112))
    # ...while TP-replicated tensors and the last stage's embedding copy are written more than once.
    per_rank = checkpoint_bytes_per_rank(TINY, tp=2, pp=2)
    replicated = sum(rank_params(TINY, 2, 2, st).tp_replicated for st in range(2))
    copy = rank_params(TINY, 2, 2, 1).embedding_copy
    assert copy == 112 * 8 // 2  # padded to a multiple of 8*2
    assert sum(per_rank) == 14 * (unique_parameters(TINY, 2, 2) + replicated + 2 * copy)


def test_data_parallel_layouts_conserve_bytes():
    arch = PAPER_MODELS[2]
    one = checkpoint_bytes_per_rank(arch, 4, 4, dp=1)
    first = checkpoint_bytes_per_rank(arch, 4, 4, dp=4, writer=WeightsWriter.FIRST_REPLICA)
    spread = checkpoint_bytes_per_rank(arch, 4, 4, dp=4, writer=WeightsWriter.SPREAD_OVER_DP)
    assert abs(sum(first) - sum(one)) <= len(first) and abs(sum(spread) - sum(one)) <= len(spread)
    assert max(first) > max(spread) == pytest.approx(max(one) / 4, rel=1e-6)


def test_layer_splits_and_errors():
    assert layer_split(60, 8, first=6, last=6) == [6] + [8] * 6 + [6]
    assert layer_split(80, 20) == [4] * 20
    with pytest.raises(ValueError, match="cannot be split over 8"):
        layer_split(60, 8)
    assert [a.stage_layers(a.nodes) for a in PAPER_MODELS][3] == [6, 8, 8, 8, 8, 8, 8, 6]


def _case(gb=10.0, ranks=4, phases=Phases(1.0, 2.0, 0.5), iterations=5, interval=1, mp=4):
    return ScaleCase("t", (int(gb * 1e9),) * ranks, mp, phases, iterations, interval)


PLAIN = Platform(gpus_per_node=4, d2h_gbps=20.0, staging_gbps=2.0, write_stream_gbps=1.0, node_write_gbps=100.0,
                 fs_aggregate_gbps=1000.0, host_cache_gb_per_node=400.0, dist_streams=2, coordination_s=0.5,
                 coordination_s_per_mp_rank=0.0)


def test_synchronous_variants_block_for_staging_and_writing():
    p = predict(_case(), PLAIN, Variant.TORCH_SAVE)
    assert p.stall_per_checkpoint_s == pytest.approx(0.5 + 10 / 2 + 10 / 1)
    assert p.checkpoint_throughput_gbps == pytest.approx(40 / 15.5)
    assert predict(_case(), PLAIN, Variant.TORCH_DIST).stall_per_checkpoint_s == pytest.approx(0.5 + 5 + 5)
    # The job's share of the file system caps each writer: 1000 ranks share 1000 GB/s.
    many = predict(_case(ranks=1000), PLAIN, Variant.TORCH_DIST)
    assert many.stall_per_checkpoint_s == pytest.approx(0.5 + 5 + 10 / 1.0)


def test_copy_then_flush_waits_for_the_previous_flush():
    # Flush 10 GB at 2 GB/s = 5 s; an iteration is 3.5 s: from the second save on, the save first
    # waits for the previous flush to end.
    p = predict(_case(), PLAIN, Variant.TORCH_DIST_ASYNC)
    assert p.breakdown["staging"] == pytest.approx(5.0)
    assert p.breakdown["back_pressure"] > 0
    long_iterations = predict(_case(phases=Phases(3, 6, 1)), PLAIN, Variant.TORCH_DIST_ASYNC)
    assert long_iterations.breakdown["back_pressure"] == 0
    assert long_iterations.stall_per_checkpoint_s == pytest.approx(0.5 + 5.0)
    assert long_iterations.final_drain_s == pytest.approx(5.0)


def test_lazy_copy_hides_behind_forward_backward_until_it_cannot():
    hidden = predict(_case(phases=Phases(3, 6, 1)), PLAIN, Variant.DATASTATES_LAZY)
    assert hidden.stall_per_checkpoint_s == pytest.approx(0.5)  # copy 0.5 s < 9 s of forward/backward
    slow_pcie = dataclasses.replace(PLAIN, d2h_gbps=1.0)  # copy 10 s vs 9 s window: 1 s wait per save
    p = predict(_case(phases=Phases(3, 6, 1), iterations=4), slow_pcie, Variant.DATASTATES_LAZY)
    # Saves after iterations 1-3 each make the next update wait 1 s; the last one is drained.
    assert p.breakdown["d2h_wait"] * 4 == pytest.approx(3.0)


def test_lazy_back_pressure_when_the_host_cache_is_full():
    # One 10 GB snapshot fits per rank (40 GB / 4 ranks); flushing takes 10 s, iterations 3.5 s:
    # in steady state a snapshot can only be copied once the previous one is flushed, so every
    # iteration stretches to the 10 s flush (the copy wait lands before the update).
    small_cache = dataclasses.replace(PLAIN, host_cache_gb_per_node=40.0)
    runs = [predict(_case(iterations=n), small_cache, Variant.DATASTATES_LAZY) for n in (40, 80)]
    assert runs[1].end_to_end_s - runs[0].end_to_end_s == pytest.approx(40 * 10.0)
    assert runs[1].breakdown["d2h_wait"] > 5
    roomy = predict(_case(iterations=5), PLAIN, Variant.DATASTATES_LAZY)  # 10 slots: no wait in 5
    assert roomy.stall_per_checkpoint_s == pytest.approx(0.5)
    assert roomy.final_drain_s > 30  # but the run's end waits for the flushes


def test_in_memory_level_keeps_a_slow_file_system_off_the_loop_latest_wins():
    """datastates_memory, a version every iteration and one to storage every 2: a 10 s flush
    against 4 s iterations cannot keep up, so storage takes the newest version whenever the
    previous one is durable (14 of the 20 due, the last one at the end of training) and training
    never waits for it, where datastates_lazy's cache fills and every iteration waits."""
    case = _case(iterations=40)
    memory = predict(case, PLAIN, Variant.DATASTATES_MEMORY, persistent_every=2)
    lazy = predict(case, PLAIN, Variant.DATASTATES_LAZY)
    assert memory.storage_saves == 14 and lazy.storage_saves == 40
    assert memory.breakdown["d2h_wait"] == 0 and lazy.breakdown["d2h_wait"] > 3
    # Only the end of training waits for the flush in flight (2 s) before its own save.
    assert memory.breakdown["back_pressure"] * 40 == pytest.approx(2.0)
    assert memory.breakdown["coordination"] * 40 == pytest.approx(40 * 0.5 + 0.5)
    # Storage fast enough: every save due is made, and the last one is the end of training's.
    fast = predict(case, dataclasses.replace(PLAIN, write_stream_gbps=100.0),
                   Variant.DATASTATES_MEMORY, persistent_every=2)
    assert fast.storage_saves == 20 and fast.stall_per_checkpoint_s == pytest.approx(0.5)
    with pytest.raises(ValueError, match="persistent_every"):
        predict(case, PLAIN, Variant.DATASTATES_MEMORY, persistent_every=0)


def test_paper_inputs_are_the_documented_derivation_and_calibration():
    inputs = load_inputs(PAPER_INPUTS)
    derived = derive_paper_phases()
    for name, phases in inputs.phases.items():
        for field in ("forward", "backward", "update"):
            assert getattr(phases, field) == pytest.approx(getattr(derived[name], field), rel=1e-3)
    p = inputs.platform
    start = dataclasses.replace(p, staging_gbps=p.staging_gbps * 1.5, write_stream_gbps=p.write_stream_gbps / 1.5,
                                coordination_s=p.coordination_s * 2, coordination_s_per_mp_rank=0.0)
    fitted = calibrate(start, derived)
    for field in ("staging_gbps", "write_stream_gbps", "coordination_s", "coordination_s_per_mp_rank"):
        assert getattr(inputs.platform, field) == pytest.approx(getattr(fitted, field), rel=2e-3), field


def test_projection_reproduces_the_shape_of_the_papers_results():
    inputs = load_inputs(PAPER_INPUTS)
    checks = throughput_checks(inputs.platform, inputs.phases) + end_to_end_checks(inputs.platform, inputs.phases)
    bad = [c for c in checks if not c.ok]
    assert not bad, bad
    assert sum(not c.calibrated for c in checks) >= 15  # most points are predictions, not fits
    # And it is not vacuous: the paper's own 13B torch.save point is far from the 7B one per rank.
    assert any(abs(math.log(c.predicted / c.paper)) > math.log(1.3) for c in checks)


def test_cli_writes_json_and_reports_bad_inputs(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert project_scale.main(["--models", "7B", "13B", "--experiment", "e2e", "--checkpoint-interval", "10", "1",
                               "--json", str(out), "--compare-paper"]) == 0
    text = capsys.readouterr().out
    assert "7B end-to-end torch/datastates" in text and "OUT OF TOLERANCE" not in text
    data = json.loads(out.read_text())
    assert len(data["predictions"]) == 2 * 2 * 4
    row = next(r for r in data["predictions"] if r["case"] == "7B dp1 every1" and r["variant"] == "torch")
    assert row["end_to_end_s"] > row["end_to_end_no_checkpoint_s"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"platform": {"d2h_gbps": 25,\n "warp_speed": 9}}')
    assert project_scale.main(["--inputs", str(bad)]) == 2
    assert "unknown platform fields ['warp_speed']" in capsys.readouterr().err
    bad.write_text('{"platform": \n{,}}')
    assert project_scale.main(["--inputs", str(bad)]) == 2
    assert "bad.json:2: invalid JSON" in capsys.readouterr().err
    assert project_scale.main(["--models", "9B"]) == 2
    assert "unknown paper model '9B'" in capsys.readouterr().err


def test_custom_measured_case_from_the_inputs_file(tmp_path, capsys):
    inputs = tmp_path / "node.json"
    inputs.write_text(json.dumps({
        "platform": {"gpus_per_node": 2, "d2h_gbps": 10, "staging_gbps": 1, "write_stream_gbps": 0.5,
                     "node_write_gbps": 10, "fs_aggregate_gbps": 10, "coordination_s": 0.1,
                     "coordination_s_per_mp_rank": 0},
        "cases": [{"name": "mynode", "bytes_per_rank_gb": [1.0, 1.0], "phases": {"forward": 1, "backward": 2,
                                                                               "update": 0.1}}]}))
    out = tmp_path / "o.json"
    # Paper models need phase times, which this file does not give: a clear error.
    assert project_scale.main(["--inputs", str(inputs), "--models", "7B"]) == 2
    assert "no phase times for '7B'" in capsys.readouterr().err
    assert project_scale.main(["--inputs", str(inputs), "--models", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["predictions"]
    torch_row = next(r for r in rows if r["variant"] == "torch")
    assert torch_row["case"] == "mynode every1"
    assert torch_row["stall_per_checkpoint_s"] == pytest.approx(0.1 + 1 / 1 + 1 / 0.5)
    lazy = next(r for r in rows if r["variant"] == "datastates_lazy")
    assert lazy["stall_per_checkpoint_s"] == pytest.approx(0.1)


def test_weights_writer_spreads_weight_bytes_over_replicas(tmp_path):
    out = tmp_path / "o.json"
    project_scale.main(["--models", "13B", "--dp", "4", "--json", str(out)])
    first = json.loads(out.read_text())["predictions"][0]["max_rank_gb"]
    project_scale.main(["--models", "13B", "--dp", "4", "--weights-writer", "spread_over_dp", "--json", str(out)])
    spread = json.loads(out.read_text())["predictions"][0]["max_rank_gb"]
    assert spread == pytest.approx(first * (14 / 4) / (2 + 12 / 4), rel=1e-6)


def test_dp16_disagreement_is_both_legs_as_docs_scale_md_says():
    # docs/SCALE.md "Data-parallel scaling": the paper's 48x at 30B DP=16 is torch.save 4x slower
    # and DataStates 2.2x faster than the model predicts; spreading the baseline's weight bytes
    # over the replicas (the other writer layout) moves torch.save the wrong way.
    inputs = load_inputs(PAPER_INPUTS)
    torch_row, lazy_row, ratio = dp_scaling_rows(inputs.platform, inputs.phases)
    assert (torch_row.paper, lazy_row.paper) == (25, 1201)
    assert torch_row.predicted == pytest.approx(102.8, rel=0.01) and lazy_row.predicted == pytest.approx(537.8, rel=0.01)
    assert ratio.predicted == pytest.approx(5.23, rel=0.01) and ratio.paper == pytest.approx(48.04, rel=0.01)
    from tools.scale.architecture import paper_model
    from tools.scale.paper import paper_case
    spread = paper_case(paper_model("30B"), inputs.phases["30B"], 5, 1, dp=16, writer=WeightsWriter.SPREAD_OVER_DP)
    assert predict(spread, inputs.platform, Variant.TORCH_SAVE).checkpoint_throughput_gbps == pytest.approx(228.0, rel=0.01)
    assert predict(spread, inputs.platform, Variant.DATASTATES_LAZY).checkpoint_throughput_gbps == pytest.approx(
        lazy_row.predicted)


def test_slurm_time_limit_covers_the_projection_with_a_margin(capsys, tmp_path):
    assert project_scale.slurm_time_limit([0.0]) == "00:30:00"  # at least half an hour
    assert project_scale.slurm_time_limit([3600.0, 3600.0]) == "02:45:00"  # 2 x (1.25 h + 5 min), rounded up
    assert project_scale.main(["--slurm-time", "--experiment", "e2e", "--models", "70B"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("slurm time limit: 06:00:00\n")  # 4.24 h projected for the 8 runs
    # The variants a job runs (examples/slurm's ONLY_VARIANTS): the in-memory level's two runs.
    assert project_scale.main(["--slurm-time", "--experiment", "e2e", "--models", "70B",
                               "--variants", "datastates_memory", "--persistent-every", "5"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[3] for line in out.splitlines()[1:3]] == ["datastates_memory"] * 2
    assert out.endswith("slurm time limit: 01:30:00\n")
    assert project_scale.main(["--experiment", "e2e", "--models", "7B", "--variants",
                               "datastates_memory", "--json", str(tmp_path / "p.json")]) == 0
    rows = json.loads((tmp_path / "p.json").read_text())["predictions"]
    assert [r["storage_saves"] for r in rows] == [1, 5]  # every 10 of 50: the end; every 1: 5
    with pytest.raises(SystemExit):
        project_scale.main(["--persistent-every", "0"])
    assert "--persistent-every must be >= 1, got 0" in capsys.readouterr().err


def _shape(**kw):
    from tools.scale.memory import ActivationShape
    base = dict(seq_length=2048, micro_batch_size=4, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
                kv_width=1024, swiglu=False, dropout=True, padded_vocab_size=51200, tp=4, sequence_parallel=False)
    return ActivationShape(**{**base, **kw})


def test_activation_estimate_is_the_published_gpt_formula_and_follows_the_flags():
    from tools.scale.memory import activation_bytes
    s, b, h, a, t = 2048, 4, 1024, 16, 4
    layer = lambda **kw: activation_bytes(_shape(**kw), 1, last_stage=False)  # noqa: E731
    # Korthikanti et al.: sbh(10 + 24/t + 5as/(ht)) without SP, sbh/t (34 + 5as/h) with it,
    # sbh/t x 34 with selective recomputation as well.
    assert layer() == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert layer(sequence_parallel=True) == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    assert layer(sequence_parallel=True, recompute_granularity="selective") == pytest.approx(s * b * h / t * 34)
    # Llama: no dropout masks, SwiGLU (fc1 2f wide), 4 key/value heads of 64: 12h + 4kv + 6f.
    llama = dict(sequence_parallel=True, recompute_granularity="selective", dropout=False, swiglu=True,
                 ffn_hidden_size=2816, kv_width=256)
    assert layer(**llama) == pytest.approx(s * b / t * (12 * h + 4 * 256 + 6 * 2816))
    # Full recomputation: 2h per chunk input (over TP with SP) + one chunk rerun; block keeps the rest.
    full = dict(sequence_parallel=True, recompute_granularity="full", recompute_method="uniform")
    chunk = activation_bytes(_shape(**full, recompute_num_layers=2), 8, last_stage=False)
    assert chunk == pytest.approx(4 * 2 * s * b * h / t + 2 * layer(sequence_parallel=True))
    block = activation_bytes(_shape(**full | {"recompute_method": "block"}, recompute_num_layers=6), 8, False)
    assert block == pytest.approx(6 * 2 * s * b * h / t + 3 * layer(sequence_parallel=True))
    # The last stage adds its logits (bf16 + the fp32 softmax of its vocabulary shard).
    assert activation_bytes(_shape(), 1, True) - layer() == pytest.approx(6 * s * b * 51200 / t)


def test_gpu_memory_counts_state_and_in_flight_micro_batches():
    from tools.scale.memory import activation_bytes, fits, gpu_memory
    shape = _shape(sequence_parallel=True)
    m = gpu_memory(10**9, True, 2, shape, layers=3, stage=1, pp=4, microbatches=8)
    assert (m.weights, m.gradients, m.optimizer) == (2e9, 4e9, 6e9)  # 2 + 4 + 12/DP bytes per parameter
    assert m.activations == pytest.approx(3 * activation_bytes(shape, 3, last_stage=False))  # 1F1B: PP - stage
    assert gpu_memory(10**9, True, 1, shape, 3, 1, 4, microbatches=1).activations == pytest.approx(m.activations / 3)
    assert fits(gpu_memory(2 * 10**9, True, 1, shape, 0, 0, 2)) and not fits(gpu_memory(3 * 10**9, True, 1, shape, 0, 0, 2))


def test_model_flags_parse_into_the_counted_architecture():
    """Each model's flags (what the Slurm examples and the dry run pass) give pretrain_gpt.py's
    parser the model the formula counts; the paper's models need their memory settings to fit."""
    from megatron.training.arguments import build_run_config, parse_args
    from tools.scale.architecture import MODELS, architecture_args, memory_args
    from tools.scale.memory import ActivationShape, fits, gpu_memory
    for arch in MODELS:
        launch = architecture_args(arch) + memory_args(arch, arch.tp) + [
            "--seq-length", str(arch.seq_length), "--tensor-model-parallel-size", str(arch.tp),
            "--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--vocab-size", str(arch.vocab_size - 1)]
        m = build_run_config(parse_args(launch), world_size=arch.tp).model
        assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.query_groups,
                m.padded_vocab_size) == (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.ffn,
                                         arch.query_groups, arch.padded_vocab(arch.tp)), arch.name
        assert (m.position_embedding_type.value == "rope", m.normalization.value == "RMSNorm", m.swiglu,
                m.add_bias_linear, m.untie_embeddings_and_output_weights) == (
            arch.rope, arch.rms_norm, arch.swiglu, arch.add_bias_linear, arch.untie_embeddings_and_output_weights)
    # Without selective recomputation 3B, 7B, 13B and 30B would not fit a 40 GB A100 (70B would).
    over = []
    for arch in PAPER_MODELS:
        shape = ActivationShape(arch.seq_length, arch.micro_batch_size, arch.hidden_size, arch.ffn,
                                arch.num_attention_heads, arch.kv_width, True, False, arch.padded_vocab(4), 4, True)
        pp = arch.nodes
        if not all(fits(gpu_memory(rank_params(arch, 4, pp, st).total, True, 1, shape, arch.stage_layers(pp)[st],
                                   st, pp)) for st in range(pp)):
            over.append(arch.name)
    assert over == ["3B", "7B", "13B", "30B"]


def test_merge_projection_scales_with_workers_and_is_capped_by_the_platform(tmp_path, capsys):
    from tools.scale.merge import UNIVERSAL_BYTES_PER_PARAM, project_merge

    platform = load_inputs(PAPER_INPUTS).platform
    phases = Phases(forward=1.0, backward=2.0, update=1.0)  # 40 s per 10-iteration interval
    arch = dataclasses.replace(PAPER_MODELS[1], nodes=2)
    gb = unique_parameters(arch, arch.tp, 2) * UNIVERSAL_BYTES_PER_PARAM / 1e9
    one = project_merge(arch, phases, platform, 0.5)
    assert one.workers == 2 and one.merge_gbps == 1.0 and one.merge_s == pytest.approx(gb)
    assert one.interval_s == 40.0 and one.fits == (gb <= 40.0)
    assert one.every_nth == math.ceil(gb / 40.0)
    many = project_merge(arch, phases, platform, 100.0, workers_per_node=8)  # node links cap it
    assert many.merge_gbps == 2 * platform.node_write_gbps and many.fits and many.every_nth == 1
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"summary": {"merge_vs_dd": {"merge_gbps_1w": 0.25}}}))
    assert project_scale.main(["--models", "3B", "70B", "--merge-bench", str(bench)]) == 0
    out = capsys.readouterr().out
    assert "universal merge at 0.250 GB/s per worker" in out and "\n70B       20      20" in out
    bench.write_text("{}")
    assert project_scale.main(["--merge-bench", str(bench)]) == 2
    assert "merge_gbps_1w" in capsys.readouterr().err
