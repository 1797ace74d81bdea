"""Llama-family flags without a process group: resolved config, Megatron-LM's defaults, one-line
errors for contradictions, the megatron-core configs they build, the architecture check on load,
and the loss scale in the log line."""
import importlib.util
import json
import re

import pytest
import torch

from megatron.training.arguments import ArgumentError, build_parser, build_run_config, parse_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --mock-data --vocab-size 255")
LLAMA = ("--swiglu --position-embedding-type rope --normalization RMSNorm --group-query-attention "
         "--num-query-groups 2 --untie-embeddings-and-output-weights --disable-bias-linear")


def config(extra="", world_size=1):
    return build_run_config(parse_args((BASE + " " + extra).split()), world_size=world_size)


def test_llama_flags_resolve_with_megatron_lm_defaults():
    m = config(LLAMA).model
    assert (m.position_embedding_type.value, m.normalization.value) == ("rope", "RMSNorm")
    assert m.swiglu and not m.add_bias_linear and m.untie_embeddings_and_output_weights
    assert m.num_query_groups == 2 and m.query_groups == 2
    assert (m.rotary_base, m.rotary_percent, m.norm_epsilon) == (10000, 1.0, 1e-5)
    assert m.ffn_hidden_size == 128  # int((4 * 64 * 2 / 3) / 64) * 64
    assert m.max_position_embeddings == 32  # rope: may be omitted
    saved = json.loads(config(LLAMA).to_json())["model"]
    assert saved["position_embedding_type"] == "rope" and saved["normalization"] == "RMSNorm"


def test_gpt2_stays_the_default():
    m = config().model
    assert (m.position_embedding_type.value, m.normalization.value) == ("learned_absolute",
                                                                        "LayerNorm")
    assert not m.swiglu and m.add_bias_linear and m.num_query_groups is None
    assert m.query_groups == 4 and m.ffn_hidden_size == 256 and not m.fp16
    assert m.recompute_granularity is None


@pytest.mark.parametrize("hidden,ffn", [(4096, 10880), (5120, 13632), (100, 256)])
def test_swiglu_default_mlp_width_is_megatron_lms_rule(hidden, ffn):
    m = config(f"--swiglu --hidden-size {hidden}").model
    assert m.ffn_hidden_size == ffn
    assert config(f"--swiglu --hidden-size {hidden} --ffn-hidden-size 64").model.ffn_hidden_size == 64


def test_group_query_attention_alone_means_one_group():
    assert config("--group-query-attention").model.num_query_groups == 1


def test_precision_recompute_and_warmup_flags_resolve():
    from megatron.training.training import schedule_steps

    c = config("--fp16 --initial-loss-scale 4096 --hysteresis 1 --recompute-granularity full "
               "--recompute-method uniform --recompute-num-layers 2 --lr-warmup-fraction 0.25 "
               "--train-iters 100")
    assert c.model.fp16 and c.optimizer.loss_scale is None
    assert (c.optimizer.initial_loss_scale, c.optimizer.min_loss_scale,
            c.optimizer.loss_scale_window, c.optimizer.hysteresis) == (4096, 1.0, 1000, 1)
    assert (c.model.recompute_granularity.value, c.model.recompute_method.value,
            c.model.recompute_num_layers) == ("full", "uniform", 2)
    uneven = config("--num-layers 6 --pipeline-model-parallel-size 2 --recompute-granularity full "
                    "--decoder-first-pipeline-num-layers 4 --recompute-method block "
                    "--recompute-num-layers 4", world_size=2)
    assert uneven.model.recompute_num_layers == 4  # the first stage holds 4 layers
    assert c.optimizer.lr_warmup_fraction == 0.25 and c.optimizer.lr_warmup_iters == 0
    # Megatron-LM: warm-up samples = fraction * decay samples (100 iterations of 8 samples).
    assert schedule_steps(c) == (200.0, 800, 800)
    assert schedule_steps(config("--lr-warmup-iters 3 --train-iters 100")) == (24, 800, 800)
    assert config("--fp16").optimizer.initial_loss_scale == 2.0 ** 32
    assert config("--bf16 --loss-scale 1024").optimizer.loss_scale == 1024


def test_llama_launch_line_flags_reach_megatron_core():
    """Flags of Megatron-LM's Llama launch lines: what each sets in megatron-core's configs, or
    what it is accepted as; the values this trainer does not build are refused by name."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.training.model import layer_spec, transformer_config

    c = config("--attention-backend local --calculate-per-token-loss --kv-channels 16 "
               "--context-parallel-size 1 --bf16 --grad-reduce-in-bf16 --data-cache-path /tmp/dc "
               "--no-mmap-bin-files --no-create-attention-mask-in-dataloader "
               "--empty-unused-memory-level 2")
    tc = transformer_config(c.model, c.parallel, "gloo")
    assert tc.attention_backend is AttnBackend.local and tc.calculate_per_token_loss
    fused = config("--cross-entropy-loss-fusion --tiktoken-pattern v2")
    tc = transformer_config(fused.model, fused.parallel, "gloo")
    assert tc.cross_entropy_loss_fusion and tc.cross_entropy_fusion_impl == "native"
    assert "TENorm" not in repr(layer_spec(c.model))  # local: megatron-core's own attention
    assert c.parallel.grad_reduce_in_bf16 and c.training.empty_unused_memory_level == 2
    assert (c.data.data_cache_path, c.data.mmap_bin_files) == ("/tmp/dc", False)
    default = config("")
    tc = transformer_config(default.model, default.parallel, "gloo")
    assert tc.attention_backend is AttnBackend.auto and not tc.calculate_per_token_loss
    assert not tc.cross_entropy_loss_fusion
    assert config("--no-create-attention-mask-in-dataloader --kv-channels 16 "
                  "--context-parallel-size 1 --tiktoken-pattern v2 --num-workers 1"
                  ) == default  # what they ask for is so here (or unused, as in Megatron-LM)
    for extra, message in (
            ("--kv-channels 8", "--kv-channels 8: only --hidden-size / --num-attention-heads = "
                                "16 is built here"),
            ("--context-parallel-size 2", "--context-parallel-size 2: context parallelism is "
                                          "not built here (1 only)"),
            ("--grad-reduce-in-bf16", "--grad-reduce-in-bf16 needs --bf16"),
            ("--empty-unused-memory-level 3", "invalid choice: 3"),
            ("--decoupled-min-lr 1e-5", "--decoupled-min-lr needs --decoupled-lr"),
            ("--num-workers -1", "--num-workers must be >= 0, got -1")) + ((
            ("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te",
             "--cross-entropy-fusion-impl te needs the transformer_engine package"),)
            if importlib.util.find_spec("transformer_engine") is None else ()):
        with pytest.raises(ArgumentError, match=re.escape(message)):
            config(extra)


def _by_samples(extra):
    argv = (BASE.replace("--train-iters 4", "") + " " + extra).split()
    return build_run_config(parse_args(argv), world_size=1)


def test_sample_based_training_counts_as_megatron_lm():
    from megatron.training.training import schedule_steps

    c = _by_samples("--train-samples 100 --lr-warmup-samples 12 --lr-decay-samples 90")
    assert (c.training.train_iters, c.training.train_samples) == (12, 100)  # 100 // 8
    assert schedule_steps(c) == (12, 90, 100)
    assert schedule_steps(_by_samples("--train-samples 100 --lr-warmup-fraction 0.1")) == \
        (10.0, 100, 100)
    # The same lengths in samples as in iterations make the same schedule.
    assert schedule_steps(_by_samples("--train-samples 48 --lr-warmup-samples 8")) == \
        schedule_steps(config("--train-iters 6 --lr-warmup-iters 1"))


@pytest.mark.parametrize("extra,message", [
    ("--train-iters 4 --train-samples 40", "pass one of --train-iters and --train-samples (the "
     "length of the run), got both"),
    ("", "pass one of --train-iters and --train-samples (the length of the run), got neither"),
    ("--train-iters 4 --lr-warmup-samples 8", "--lr-warmup-samples is for sample-based training "
     "(--train-samples); with --train-iters use --lr-decay-iters and --lr-warmup-iters"),
    ("--train-samples 40 --lr-decay-iters 3", "--lr-decay-iters is for iteration-based training "
     "(--train-iters); with --train-samples use --lr-decay-samples and --lr-warmup-samples"),
    ("--train-samples 40 --lr-warmup-samples 40", "--lr-warmup-samples must be >= 0 and smaller "
     "than the decay length (--lr-decay-samples, default --train-samples) 40, got 40"),
    ("--train-samples 40 --lr-warmup-samples 8 --lr-warmup-fraction 0.1",
     "--lr-warmup-fraction 0.1 and --lr-warmup-samples 8 both set the warm-up; pass one"),
])
def test_sample_and_iteration_flags_do_not_mix(extra, message):
    with pytest.raises(ArgumentError) as err:
        _by_samples(extra)
    assert message in str(err.value)


@pytest.mark.parametrize("extra,world,message", [
    ("--num-query-groups 2", 1,
     "--num-query-groups 2 needs --group-query-attention"),
    ("--group-query-attention --num-query-groups 3", 1,
     "--num-query-groups 3 must divide --num-attention-heads 4"),
    ("--group-query-attention --num-query-groups 3 --hidden-size 96 --num-attention-heads 6 "
     "--tensor-model-parallel-size 2", 2,
     "--num-query-groups 3 must be a multiple or a divisor of --tensor-model-parallel-size 2"),
    ("--fp16 --bf16", 1, "--fp16 and --bf16 are two model precisions; pass one"),
    ("--rotary-base 500000", 1, "--rotary-base configure rotary embeddings, but "
     "--position-embedding-type is learned_absolute"),
    ("--position-embedding-type learned_absolute --rotary-percent 0.5", 1,
     "--rotary-percent configure rotary embeddings"),
    ("--position-embedding-type rope --rotary-percent 0", 1, "--rotary-percent must be in (0, 1]"),
    ("--position-embedding-type rope --max-position-embeddings 16", 1,
     "--max-position-embeddings 16 is smaller than --seq-length 32"),
    ("--recompute-method uniform", 1,
     "--recompute-method uniform needs --recompute-granularity full, got "
     "--recompute-granularity (not given)"),
    ("--recompute-granularity selective --recompute-num-layers 1", 1,
     "--recompute-num-layers 1 needs --recompute-granularity full, got --recompute-granularity "
     "selective"),
    ("--recompute-granularity full", 1, "--recompute-granularity full needs --recompute-method"),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 3 "
     "--pipeline-model-parallel-size 2", 2,
     "--recompute-num-layers must be between 1 and the layers of a pipeline stage (2), got 3"),
    ("--lr-warmup-fraction 0.1 --lr-warmup-iters 2", 1,
     "--lr-warmup-fraction 0.1 and --lr-warmup-iters 2 both set the warm-up; pass one"),
    ("--lr-warmup-fraction 1.0", 1, "--lr-warmup-fraction must be >= 0 and < 1"),
    ("--loss-scale 128", 1, "--loss-scale 128.0 needs --fp16 or --bf16"),
    ("--hysteresis 3", 1, "--hysteresis configure dynamic loss scaling, which runs only with "
     "--fp16 and no --loss-scale; got no --fp16"),
    ("--fp16 --loss-scale 128 --initial-loss-scale 1024 --loss-scale-window 10", 1,
     "--initial-loss-scale, --loss-scale-window configure dynamic loss scaling"),
    ("--fp16 --min-loss-scale 8 --initial-loss-scale 4", 1,
     "--min-loss-scale 8.0 is above --initial-loss-scale 4.0"),
    ("--swiglu --hidden-size 16", 1, "--swiglu with --hidden-size 16 gives an MLP width of 0"),
    ("--ffn-hidden-size 250 --tensor-model-parallel-size 4", 4,
     "--ffn-hidden-size 250 must be >= 1 and divisible by --tensor-model-parallel-size 4"),
    ("--norm-epsilon 0", 1, "--norm-epsilon must be > 0, got 0.0"),
    ("--normalization L2Norm", 1, "argument --normalization: invalid choice: 'L2Norm'"),
    ("--position-embedding-type none", 1, "argument --position-embedding-type: invalid choice"),
])
def test_contradictory_model_flags_get_one_line(extra, world, message):
    with pytest.raises(ArgumentError) as err:
        config(extra, world)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_every_flag_has_help():
    parser = build_parser()
    missing = [a.option_strings for a in parser._actions
               if a.option_strings and a.option_strings != ["-h", "--help"] and not a.help]
    assert not missing
    text = parser.format_help()
    for flag in ("--position-embedding-type", "--swiglu", "--num-query-groups", "--fp16",
                 "--hysteresis", "--recompute-granularity", "--lr-warmup-fraction"):
        assert flag in text


@pytest.mark.parametrize("extra,world", [
    (LLAMA, 1),
    (LLAMA + " --tensor-model-parallel-size 4 --fp16", 4),  # 2 groups on 4 TP ranks
    ("--group-query-attention --tensor-model-parallel-size 2", 2),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 4", 1),
    ("--recompute-granularity selective --bf16", 1),
])
def test_accepted_flags_build_megatron_core_config(extra, world):
    """What the checks accept, megatron-core's TransformerConfig accepts too (its asserts would
    otherwise reach the user as a traceback), with the Llama parts where Megatron-LM puts them."""
    import torch.nn.functional as F

    from megatron.training.model import transformer_config
    from megatron.training.training import megatron_optimizer_config

    c = config(extra, world)
    t = transformer_config(c.model, c.parallel, "gloo")
    assert t.normalization == c.model.normalization.value
    assert t.gated_linear_unit == c.model.swiglu
    assert t.activation_func is (F.silu if c.model.swiglu else F.gelu)
    assert t.num_query_groups == c.model.query_groups
    assert t.add_bias_linear == c.model.add_bias_linear
    assert t.params_dtype == (torch.float16 if c.model.fp16 else
                              torch.bfloat16 if c.model.bf16 else torch.float32)
    o = megatron_optimizer_config(c)
    assert (o.fp16, o.bf16, o.loss_scale, o.initial_loss_scale, o.hysteresis) == (
        c.model.fp16, c.model.bf16, c.optimizer.loss_scale, c.optimizer.initial_loss_scale,
        c.optimizer.hysteresis)


def test_checkpoint_of_another_architecture_is_refused_and_old_ones_still_load():
    from megatron.training.checkpointing.contents import CheckpointError, check_model_shape

    gpt2, llama = config(), config(LLAMA + " --ffn-hidden-size 256")
    check_model_shape(llama.to_json(), llama, "ckpt")
    with pytest.raises(CheckpointError) as err:
        check_model_shape(llama.to_json(), gpt2, "ckpt")
    for diff in ("position_embedding_type: checkpoint 'rope', this run 'learned_absolute'",
                 "normalization: checkpoint 'RMSNorm', this run 'LayerNorm'",
                 "swiglu: checkpoint True, this run False",
                 "num_query_groups: checkpoint 2, this run 4",
                 "add_bias_linear: checkpoint False, this run True"):
        assert diff in str(err.value)
    with pytest.raises(CheckpointError, match="num_query_groups: checkpoint 2, this run 1"):
        check_model_shape(llama.to_json(), config(LLAMA.replace("2", "1") + " --ffn-hidden-size "
                                                  "256"), "ckpt")
    with pytest.raises(CheckpointError, match="rotary_base: checkpoint 10000, this run 500000"):
        check_model_shape(llama.to_json(), config(LLAMA + " --ffn-hidden-size 256 "
                                                  "--rotary-base 500000"), "ckpt")
    # Zero-centered norm weights mean another model: 0 there is a scale of 1.
    with pytest.raises(CheckpointError, match="apply_layernorm_1p: checkpoint False, this run True"):
        check_model_shape(llama.to_json(), config(LLAMA + " --ffn-hidden-size 256 "
                                                  "--apply-layernorm-1p"), "ckpt")
    # rope has no position table: another --max-position-embeddings loads.
    check_model_shape(llama.to_json(), config(LLAMA + " --ffn-hidden-size 256 "
                                              "--max-position-embeddings 64"), "ckpt")
    # A run config saved before these fields existed describes a GPT-2 style model.
    old = json.loads(gpt2.to_json())
    for k in ("position_embedding_type", "rotary_base", "rotary_percent", "normalization",
              "norm_epsilon", "swiglu", "num_query_groups", "add_bias_linear", "fp16",
              "recompute_granularity", "recompute_method", "recompute_num_layers",
              "apply_layernorm_1p"):
        del old["model"][k]
    check_model_shape(json.dumps(old), gpt2, "ckpt")
    with pytest.raises(CheckpointError, match="swiglu: checkpoint False, this run True"):
        check_model_shape(json.dumps(old), config("--swiglu --ffn-hidden-size 256"), "ckpt")


def test_log_line_has_megatron_lms_loss_scale_field():
    from trainer_launch import _TRAIN

    from megatron.training.log import training_log_line

    line = training_log_line(7, 100, 56, 123.45, 3e-4, 8, 5.123456789, 1.5, 0, 0,
                             loss_scale=65536.0)
    assert "| lm loss: 5.123457E+00 | loss scale: 65536.0 | grad norm: 1.500 |" in line
    assert " loss scale: 1.0 |" in training_log_line(1, 2, 8, 1.0, 1e-3, 8, 5.0, None, 1, 0)
    m = _TRAIN.search(line)
    assert (m.group(3), m.group(4)) == ("5.123457E+00", "1.500")
    assert re.search(r"global batch size:\s+8 \| lm loss", line)


def test_megatron_lm_checkpoint_args_describe_the_same_architecture():
    """A Megatron-LM checkpoint carries its argparse Namespace, not our run config; merged into a
    universal checkpoint its model config must pass the same architecture check."""
    from argparse import Namespace

    from datastates.megatron_adapter.merge.plan import _model_from_megatron_args

    from megatron.training.checkpointing.contents import CheckpointError, check_model_shape

    ours = config(LLAMA + " --ffn-hidden-size 256")
    args = Namespace(**{k: v for k, v in json.loads(ours.to_json())["model"].items()
                        if k != "num_query_groups"}, group_query_attention=True,
                     num_query_groups=2)
    check_model_shape(json.dumps({"model": _model_from_megatron_args(args)}), ours, "ckpt")
    args.group_query_attention = False  # Megatron-LM then ignores --num-query-groups
    with pytest.raises(CheckpointError, match="num_query_groups: checkpoint 4, this run 2"):
        check_model_shape(json.dumps({"model": _model_from_megatron_args(args)}), ours, "ckpt")


def test_universal_load_keeps_the_fp16_loss_scaler():
    """A universal checkpoint keeps megatron's common.pt; fp16's scaler state comes from there
    (measured: without it a resumed fp16 run restarts at --initial-loss-scale)."""
    from megatron.training.checkpointing.from_universal import _restore_grad_scaler

    saved = {"optimizer": {"grad_scaler": {"scale": torch.tensor([512.0]), "growth_tracker": 1,
                                           "hysteresis_tracker": 2}}}
    fresh = {"optimizer": {}, "grad_scaler": {"scale": torch.tensor([256.0]), "growth_tracker": 0,
                                              "hysteresis_tracker": 2}}
    _restore_grad_scaler(fresh, lambda: saved)
    assert fresh["grad_scaler"] is saved["optimizer"]["grad_scaler"]
    no_scaler = {"optimizer": {}, "grad_scaler": None}  # bf16 / fp32 runs: keep none

    def not_read():
        raise AssertionError("the common state is decoded only for a run with a scaler")

    _restore_grad_scaler(no_scaler, not_read)
    assert no_scaler["grad_scaler"] is None
    from_bf16 = dict(fresh)
    _restore_grad_scaler(from_bf16, lambda: {"optimizer": {"grad_scaler": None}})
    assert from_bf16["grad_scaler"] is fresh["grad_scaler"]
