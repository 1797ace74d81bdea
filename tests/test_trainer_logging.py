"""The logging people already use: TensorBoard, wandb, --log-throughput, Megatron's timers report.

Units first (the FLOP count against hand-computed values, the line formats, the start-up errors),
then two 2-rank PP2 launches whose printed lines are checked against the TensorBoard event files
and wandb's offline run files they wrote (rank 0 writes the checkpoint scalars, the last rank the
training ones).
"""
import glob
import gzip
import importlib.util
import json
import math
import os
import re
import struct

import pytest

from megatron.training.arguments import ArgumentError, build_run_config, parse_args
from megatron.training.flops import (
    TransformerShape,
    num_floating_point_operations,
    shape_of,
    throughput_tflops_per_gpu,
)
from megatron.training.log import min_max_time_lines, training_log_line
from megatron.training.metrics import CheckpointRecord

from trainer_launch import NO_DROPOUT, TINY_MODEL, _TRAIN, _VALID, launch

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --mock-data --vocab-size 255")


def config(extra=""):
    return build_run_config(parse_args((BASE + " " + extra).split()), world_size=1)


# -- the FLOP count ------------------------------------------------------------------------------

def test_flops_of_a_gpt2_shape_by_hand():
    # TINY_MODEL: L=4, h=64, 4 heads (MHA), ffn=4h=256, s=32, vocab 255 padded to 256, batch 8.
    # Per token, x6 (3 GEMMs fwd+bwd, 2 FLOPs per multiply-add):
    #   MLP      L*h*ffn*2       = 4*64*256*2        = 131072
    #   QKV+out  L*(h*3h + h*h)  = 4*(64*192 + 4096) =  65536
    #   logits   h*V             = 64*256            =  16384   -> 6 * 212992 = 1277952
    # tokens 8*32 = 256 -> 327155712; attention scores and values, causal half:
    #   tokens*s * 6*L*h*2/2 = 256*32*1536 = 12582912.  Total 339738624.
    shape = shape_of(config().model)
    assert shape == TransformerShape(num_layers=4, hidden_size=64, num_attention_heads=4,
                                     ffn_hidden_size=256, seq_length=32, padded_vocab_size=256)
    assert num_floating_point_operations(shape, 8) == 339738624
    # The usual closed form for GPT-2 with the causal half: 72 B s L h^2 (1 + s/12h + V/12Lh).
    assert 72 * 8 * 32 * 4 * 64 ** 2 * (1 + 32 / (12 * 64) + 256 / (12 * 4 * 64)) == 339738624
    llama = shape_of(config("--swiglu --group-query-attention --num-query-groups 2 "
                            "--position-embedding-type rope").model)
    assert llama.swiglu and llama.num_query_groups == 2 and llama.ffn_hidden_size == 128


def test_flops_with_grouped_query_attention_and_swiglu_by_hand():
    # L=2, h=64, 8 heads of 8, 2 KV groups, SwiGLU ffn 128, s=16, V=128, batch 4. Per token x6:
    #   MLP 2*64*128*3 = 49152; QKV 2*64*(64+2*2*8) = 12288; out 2*64*64 = 8192; logits 8192
    #   -> 6*77824 = 466944, x 64 tokens = 29884416; attention 64*16 * 6*2*64 = 786432.
    shape = TransformerShape(num_layers=2, hidden_size=64, num_attention_heads=8,
                             ffn_hidden_size=128, seq_length=16, padded_vocab_size=128,
                             num_query_groups=2, swiglu=True)
    assert num_floating_point_operations(shape, 4) == 29884416 + 786432
    mha = TransformerShape(**{**shape.__dict__, "num_query_groups": None, "swiglu": False})
    # GQA drops 2*64*(2*64 - 2*2*8) per layer and token, SwiGLU adds one ffn GEMM.
    assert num_floating_point_operations(shape, 4) - num_floating_point_operations(mha, 4) == \
        6 * 64 * 2 * (64 * 128 - 64 * 96)
    with pytest.raises(ValueError, match="num_query_groups must divide"):
        TransformerShape(**{**shape.__dict__, "num_query_groups": 3})


def test_throughput_is_megatrons_per_gpu_figure():
    assert throughput_tflops_per_gpu(6e12, 0.5, 4) == pytest.approx(3.0)
    assert throughput_tflops_per_gpu(6e12, 0.0, 4) == 0.0


# -- line formats --------------------------------------------------------------------------------

def test_throughput_field_sits_after_the_iteration_time_and_parsers_still_work():
    line = training_log_line(7, 100, 56, 123.45, 3e-4, 8, 5.123456789, 1.5, 0, 0,
                             throughput=12.345)
    assert " elapsed time per iteration (ms): 123.5 | throughput per GPU (TFLOP/s/GPU): 12.3 |" \
        " learning rate: 3.000000E-04 |" in line
    assert line.replace(" throughput per GPU (TFLOP/s/GPU): 12.3 |", "") == \
        training_log_line(7, 100, 56, 123.45, 3e-4, 8, 5.123456789, 1.5, 0, 0)
    m = _TRAIN.search(line)
    assert (m.group(1), m.group(3), m.group(4)) == ("7", "5.123457E+00", "1.500")


def test_timers_report_is_megatrons():
    assert min_max_time_lines({"save-checkpoint": (12.344, 15.666)}) == (
        "(min, max) time across ranks (ms):\n"
        "    save-checkpoint ................................: (12.34, 15.67)")


def test_a_rank_writes_each_line_whole(monkeypatch):
    """Ranks on one node share a stdout: a message (a timers report is two lines) and its
    newline go out in one write, or another rank's line can land between them (seen with
    PYTHONUNBUFFERED, where each of print's writes reaches the pipe by itself)."""
    import io
    import sys

    import pretrain_gpt
    from megatron.training.log import print_rank_0, print_rank_last

    class Recorder(io.StringIO):
        writes = []

        def write(self, s):
            self.writes.append(s)
            return super().write(s)

    monkeypatch.setattr(sys, "stdout", Recorder())
    monkeypatch.setattr(sys, "stderr", Recorder())
    report = min_max_time_lines({"save-checkpoint": (0.2, 0.3)})
    print_rank_last(report)
    print_rank_0(" checkpoint iteration 1 | committed: /x")
    pretrain_gpt._error_line("CheckpointError: the save failed")  # stderr, shared the same way
    assert Recorder.writes == [report + "\n", " checkpoint iteration 1 | committed: /x\n",
                               "pretrain_gpt.py: error: CheckpointError: the save failed\n"]
    assert sys.stderr.getvalue() == Recorder.writes[-1]


def test_checkpoint_record_from_the_lazy_telemetry_line():
    line = {"event": "checkpoint", "iteration": 4, "bytes": 3_000_000_000, "stall_ms": 12.5,
            "copy_ms": 40.0, "durable_s": 2.0, "gbps": 1.5, "ranks": 2}
    record = CheckpointRecord.from_telemetry(line)
    assert record.gbps == 1.5 and record.scalars()["checkpoint/copy-ms"] == 40.0
    assert "checkpoint/local-durable-s" not in record.scalars()
    assert "checkpoint/copy-start-ms" not in record.scalars()  # a line from before the field
    started = CheckpointRecord.from_telemetry(dict(line, copy_start_ms=7.5))
    assert started.scalars()["checkpoint/copy-start-ms"] == 7.5
    memory = CheckpointRecord.from_telemetry(dict(line, persistent=False), "in_memory")
    assert memory.scalars()["checkpoint-in_memory/stall-ms"] == 12.5  # apart from --save's
    assert not any(k.startswith("checkpoint/") for k in memory.scalars())


# -- start-up errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("extra,message", [
    ("--log-timers-to-tensorboard --no-log-loss-scale-to-tensorboard",
     "--no-log-loss-scale-to-tensorboard, --log-timers-to-tensorboard configure the "
     "TensorBoard/wandb scalars, which are off"),
    ("--tensorboard-dir /tmp/x --tensorboard-log-interval 0", "--tensorboard-log-interval must "
     "be > 0"),
    ("--wandb-exp-name run1", "--wandb-exp-name configure wandb, which is off"),
    ("--wandb-project p --wandb-save-dir /tmp/w", "--wandb-project needs --wandb-exp-name"),
    ("--wandb-project p --wandb-exp-name e", "--wandb-project needs a place for its local files"),
    ("--use-pytorch-profiler", "--use-pytorch-profiler needs --profile"),
    ("--profile --use-pytorch-profiler", "--use-pytorch-profiler writes its traces to "
     "<tensorboard-dir>/../torch_profile, as Megatron-LM: add --tensorboard-dir DIR"),
    ("--profile --profile-step-start 5 --profile-step-end 5", "--profile needs 0 <= "
     "--profile-step-start < --profile-step-end, got 5 and 5"),
])
def test_logging_flags_that_cannot_work_are_refused(extra, message):
    with pytest.raises(ArgumentError) as err:
        config(extra)
    assert message in str(err.value)


@pytest.mark.parametrize("package,flags", [
    ("tensorboard", "--tensorboard-dir /tmp/tb"),
    ("wandb", "--wandb-project p --wandb-exp-name e --wandb-save-dir /tmp/w"),
])
def test_a_missing_optional_package_is_one_clear_line(package, flags, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ArgumentError) as err:
        config(flags)
    flag = flags.split()[0]
    assert str(err.value) == (f"{flag} needs the {package} package, which is not installed: "
                              f"pip install {package}")


# -- two PP2 launches ----------------------------------------------------------------------------

_TIMER = re.compile(r"\(min, max\) time across ranks \(ms\):\n    (\S+) \.+: \(([\d.]+), ([\d.]+)\)")
_LOAD = re.compile(r" checkpoint load \| iteration\s+(\d+) \| bytes read: (\d+) \| time \(s\): "
                   r"([\d.]+) \| throughput \(GB/s\): ([\d.]+)")
_SAVED = re.compile(r"saved checkpoint at iteration\s+(\d+) to \S+ in ([\d.]+) ms")
_THROUGHPUT = re.compile(r" iteration\s+(\d+)/.*? elapsed time per iteration \(ms\): ([\d.]+) \| "
                         r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|")
FLOPS_TINY = 339738624  # test_flops_of_a_gpt2_shape_by_hand
HAVE_WANDB = importlib.util.find_spec("wandb") is not None


def _scalars(path):
    """{tag: {step: value}} of one event file or of every event file of a directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _wandb_history(run_file):
    """The `history` rows of a wandb offline run file (`run-<id>.wandb`: a 7-byte header, then
    LevelDB-log records in 32 KiB blocks, each a protobuf `Record`)."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B", run_file
    pos, chunk, rows = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in record.history.item})
    return rows


def _close(actual, printed, digits):
    """`actual` (float32 in TensorBoard) printed with `digits` significant digits is `printed`."""
    return abs(actual - float(printed)) <= 0.5 * 10 ** (math.floor(math.log10(abs(float(printed))))
                                                       - digits + 1) + 1e-6 * abs(actual)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("tensorboard")
    root = tmp_path_factory.mktemp("logging")
    save, tb = root / "ckpt", root / "tb"
    common = TINY_MODEL + NO_DROPOUT + [
        "--pipeline-model-parallel-size", "2", "--eval-interval", "2", "--eval-iters", "1",
        "--save", str(save), "--save-interval", "2", "--tensorboard-dir", str(tb),
        "--log-throughput", "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard"]
    if HAVE_WANDB:
        common += ["--wandb-project", "tests", "--wandb-exp-name", "pp2"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(root / "wbc"),
           "WANDB_CACHE_DIR": str(root / "wbc"), "WANDB_DATA_DIR": str(root / "wbc")}
    first = launch(2, common + ["--train-iters", "4", "--async-lazy-save", "--profile",
                                "--use-pytorch-profiler", "--profile-step-start", "2",
                                "--profile-step-end", "3", "--profile-ranks", "0"],
                   extra_env=env)
    assert first.returncode == 0, first.describe()
    files_first = set(glob.glob(str(tb / "events.out.tfevents.*")))
    # Resume with the synchronous torch_dist format: the load report, a stock-format record.
    second = launch(2, common + ["--train-iters", "6", "--load", str(save),
                                 "--override-opt_param-scheduler"], extra_env=env)
    assert second.returncode == 0, second.describe()
    return root, first, second, files_first


def test_tensorboard_holds_the_printed_training_values(runs):
    root, first, second, _ = runs
    tb = _scalars(root / "tb")
    printed = {**first.losses(), **second.losses()}
    assert sorted(printed) == [1, 2, 3, 4, 5, 6] and sorted(tb["lm loss"]) == [1, 2, 3, 4, 5, 6]
    for it, loss in printed.items():
        assert _close(tb["lm loss"][it], loss, 7), (it, tb["lm loss"][it], loss)
        assert tb["lm loss vs samples"][8 * it] == tb["lm loss"][it]
    grad = {**first.grad_norms(), **second.grad_norms()}
    assert all(abs(tb["grad-norm"][it] - float(g)) <= 5e-4 + 1e-6 for it, g in grad.items())
    lrs = dict(re.findall(r" iteration\s+(\d+)/.*? learning rate: (\S+) \|",
                          first.stdout + second.stdout))
    assert all(_close(tb["learning-rate"][int(it)], lr, 7) for it, lr in lrs.items())
    assert set(tb["batch-size"].values()) == {8.0} and set(tb["loss-scale"].values()) == {1.0}
    valid = {int(it): v for it, v in _VALID.findall(first.stdout + second.stdout)}
    assert sorted(valid) == [2, 4, 6] and sorted(tb["lm loss validation"]) == [2, 4, 6]
    for it, loss in valid.items():
        assert _close(tb["lm loss validation"][it], loss, 7)
        assert tb["lm loss validation ppl"][it] == pytest.approx(math.exp(float(loss)), rel=1e-6)


def test_pytorch_profiler_traces_the_iterations_and_ranks_asked_for(runs):
    """--profile --use-pytorch-profiler (Megatron-LM's): one chrome trace per profiled rank
    (--profile-ranks 0) in <tensorboard-dir>/../torch_profile, of iteration 3 (torch's step 2:
    after --profile-step-start 2, up to --profile-step-end 3)."""
    root, first, _, _ = runs
    assert sorted(os.listdir(root / "torch_profile")) == ["rank-0.json.gz"]
    with gzip.open(root / "torch_profile" / "rank-0.json.gz") as f:
        events = json.load(f)["traceEvents"]
    assert {e["name"] for e in events if str(e.get("name")).startswith("ProfilerStep#")} == \
        {"ProfilerStep#2"}
    assert any(e.get("name") == "aten::mm" for e in events)  # the iteration's own work


def test_throughput_field_follows_the_flop_count_and_the_iteration_time(runs):
    root, first, second, _ = runs
    tb = _scalars(root / "tb")
    lines = _THROUGHPUT.findall(first.stdout + second.stdout)
    assert [int(it) for it, _, _ in lines] == [1, 2, 3, 4, 5, 6]
    for it, elapsed_ms, tflops in lines:
        seconds = tb["iteration-time"][int(it)]
        assert f"{seconds * 1000:.1f}" == elapsed_ms
        expected = FLOPS_TINY / (seconds * 1e12 * 2)  # 2 ranks
        assert tb["throughput"][int(it)] == pytest.approx(expected, rel=1e-5)
        assert f"{tb['throughput'][int(it)]:.1f}" == tflops


def test_rank0_writes_one_record_per_committed_checkpoint(runs):
    root, first, second, files_first = runs
    # PP2: the last rank and rank 0 each wrote an event file per run; rank 0's holds only the
    # checkpoint scalars, so its tags never meet the training ones.
    assert len(files_first) == 2
    per_file = [_scalars(f) for f in sorted(files_first)]
    ckpt_file = [s for s in per_file if "checkpoint/bytes" in s]
    assert len(ckpt_file) == 1 and all(t.startswith("checkpoint/") for t in ckpt_file[0])
    tb = _scalars(root / "tb")
    # Lazy saves at 2 and 4: the values are the committed telemetry records, to float32.
    with open(root / "ckpt" / "datastates_checkpoints.jsonl") as f:
        records = [r for r in map(json.loads, f) if r["event"] == "checkpoint"]
    assert [r["iteration"] for r in records] == [2, 4]
    for r in records:
        it = r["iteration"]
        assert tb["checkpoint/bytes"][it] == pytest.approx(r["bytes"], rel=1e-7)
        for tag, key in (("stall-ms", "stall_ms"), ("copy-ms", "copy_ms"),
                         ("copy-start-ms", "copy_start_ms"), ("durable-s", "durable_s"),
                         ("GB-per-s", "gbps")):
            assert tb[f"checkpoint/{tag}"][it] == pytest.approx(r[key], rel=1e-6), tag
        assert f" checkpoint iteration {it:8d} | bytes: {r['bytes']} |" in first.stdout
    # The synchronous torch_dist save at 6: its save call and its files.
    (iteration, call_ms), = _SAVED.findall(second.stdout)
    assert iteration == "6"
    files = [os.path.join(top, n) for top, _, names in os.walk(root / "ckpt" / "iter_0000006")
             for n in names]
    assert tb["checkpoint/bytes"][6] == pytest.approx(sum(map(os.path.getsize, files)), rel=1e-7)
    assert abs(tb["checkpoint/stall-ms"][6] - float(call_ms)) <= 0.05 + 1e-4
    # Durable inside the call: the tracker moved before the call returned. Only the agreement
    # that follows the commit separates the two, and how long a collective waits depends on the
    # machine's load (6 ms once with the suite on two workers): an order, not a time, is checked.
    assert 0 < tb["checkpoint/durable-s"][6] * 1000 <= tb["checkpoint/stall-ms"][6] * (1 + 1e-6)
    assert 6 not in tb["checkpoint/copy-ms"]  # no background copy in a synchronous save


def test_timers_reports_after_each_save_and_the_load(runs):
    root, first, second, _ = runs
    tb = _scalars(root / "tb")
    saves = [t for t in _TIMER.findall(first.stdout) if t[0] == "save-checkpoint"]
    assert len(saves) == 2  # iterations 2 and 4
    resumed = _TIMER.findall(second.stdout)
    assert [t[0] for t in resumed] == ["load-checkpoint", "save-checkpoint"]
    for (name, low, high), it in zip(saves + resumed, [2, 4, 4, 6]):
        assert float(low) <= float(high)
        assert abs(tb[f"{name}-time"][it] * 1000 - float(high)) <= 0.005 + 1e-3
    # The resume's one line: bytes every rank read, the slowest rank's time, their ratio.
    (iteration, nbytes, seconds, gbps), = _LOAD.findall(second.stdout)
    assert iteration == "4"
    assert float(gbps) == pytest.approx(int(nbytes) / float(seconds) / 1e9, abs=1e-3 + 0.01 *
                                        float(gbps))
    files = [os.path.join(top, n) for top, _, names in os.walk(root / "ckpt" / "iter_0000004")
             for n in names]
    # PP=2 on 2 ranks: the ranks read the tensors of the shard files once (their bytes less
    # alignment padding), plus the tied word embeddings the last stage reads again (saved once),
    # and nothing else the processes read meanwhile (before, /proc's rchar: 10x too much).
    shards = sum(os.path.getsize(f) for f in files if f.endswith(".bin"))
    assert 0.97 * shards <= int(nbytes) <= 1.1 * shards, (nbytes, shards)
    assert tb["load-checkpoint/bytes"][4] == pytest.approx(int(nbytes), rel=1e-7)
    assert f"{tb['load-checkpoint/seconds'][4]:.3f}" == seconds


@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (pip install wandb)")
def test_wandb_offline_runs_hold_the_same_scalars(runs):
    root, first, _, _ = runs
    tb = _scalars(root / "tb")
    run_files = sorted(glob.glob(str(root / "ckpt" / "wandb" / "wandb" / "offline-run-*" /
                                     "run-*.wandb")))
    assert len(run_files) == 4, run_files  # two launches x (last rank, rank 0)
    rows = [row for f in run_files for row in _wandb_history(f)]
    losses = {row["_step"]: row["lm loss"] for row in rows if "lm loss" in row}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert all(losses[it] == pytest.approx(tb["lm loss"][it], rel=1e-6) for it in losses)
    ckpt = {row["checkpoint/iteration"]: row for row in rows if "checkpoint/iteration" in row}
    assert sorted(ckpt) == [2, 4, 6]
    assert all(ckpt[it]["checkpoint/bytes"] == pytest.approx(tb["checkpoint/bytes"][it],
                                                             rel=1e-7) for it in ckpt)
    throughput = {row["_step"]: row["throughput"] for row in rows if "throughput" in row}
    assert sorted(throughput) == [1, 2, 3, 4, 5, 6]
    assert all(throughput[it] == pytest.approx(tb["throughput"][it], rel=1e-6)
               for it in throughput)
