"""Megatron-LM's own Llama 3 8B launch line (examples/llama/train_llama3_8b_h100_fp8.sh, its
mock-data branch, without the fp8 flags) with --async-lazy-save added: every flag it passes is
taken. Only the sizes are scaled down to run on 2 CPU ranks (layers, widths, heads, sequence,
batch, samples, vocabulary, eval iterations, save interval), and the paths are the test's. It
trains to the end and, resumed from iteration 4 (--ckpt-step), prints iterations 5-6 and the
final validation bit for bit: bf16 with bf16 gradient reduction, the distributed optimizer with
overlapped reduce and gather, zero-centered RMSNorm, grouped-query attention, the decoupled
learning rate, per-token loss, the fused cross entropy, sample-based schedule."""
import re

from trainer_launch import after, launch

# The script's flags in its order; (scaled) marks a value changed from the script's.
LLAMA3_8B = """
--use-mcore-models --num-layers 2 (scaled) --hidden-size 64 (scaled) --ffn-hidden-size 224 (scaled)
--num-attention-heads 4 (scaled) --group-query-attention --num-query-groups 2 (scaled)
--kv-channels 16 (scaled) --seq-length 64 (scaled) --max-position-embeddings 64 (scaled)
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
--hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134
--attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights
--disable-bias-linear
--micro-batch-size 1 --global-batch-size 4 (scaled) --train-samples 24 (scaled)
--lr-decay-samples 20 (scaled) --lr-warmup-samples 4 (scaled) --lr 0.00015 --min-lr 0.00001
--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1
--exit-duration-in-mins 235
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 (scaled) --data-cache-path {cache}
--tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader
--no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 2 (scaled) --eval-interval 3 (scaled) --save-interval 2 (scaled)
--log-throughput --profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist
--distributed-timeout-minutes 60 --save {ckpt} --load {ckpt} --tensorboard-dir {tb}
"""


def _argv(tmp_path):
    text = LLAMA3_8B.replace("(scaled)", "").format(
        cache=tmp_path / "cache", ckpt=tmp_path / "ckpt", tb=tmp_path / "tb")
    return text.split() + ["--async-lazy-save"]


def test_megatron_lms_llama3_launch_line_trains_saves_and_resumes_bit_exactly(tmp_path):
    argv = _argv(tmp_path)
    first = launch(2, argv)
    assert first.returncode == 0, first.describe()
    assert sorted(first.losses()) == [1, 2, 3, 4, 5, 6], first.describe()
    assert sorted(first.validation()) == [3, 6]
    assert re.search(r"\| learning rate: \S+ \| decoupled learning rate: \S+ \|", first.stdout)
    for line in ("WARNING: Disabling sequence parallelism because tensor model parallelism is "
                 "disabled", "WARNING: --num-workers 1: this trainer has no data-loader workers",
                 "--profile: no CUDA device, so nothing for nsys to capture"):
        assert line in first.stdout, line
    committed = re.findall(r"checkpoint iteration\s+(\d+) \|.*committed:", first.stdout)
    assert committed == ["2", "4", "6"], first.describe()
    resumed = launch(2, argv + ["--ckpt-step", "4"])
    assert resumed.returncode == 0, resumed.describe()
    assert resumed.losses() == after(first.losses(), 4)
    assert resumed.validation() == after(first.validation(), 4)


def test_the_unscaled_line_builds_llama3_8b(tmp_path, capsys):
    """The same line at its own sizes (world size 8, as the script's single node), through the
    dry run that builds every rank on the meta device: Llama 3 8B's 8.03 billion parameters
    (NullTokenizer's end-of-document id pads the 128256 ids to 128384 rows)."""
    from tools import dry_run as dry_run_cli

    scaled = dict(re.findall(r"(--[a-z-]+) (\S+) \(scaled\)", LLAMA3_8B))
    real = {"--num-layers": "32", "--hidden-size": "4096", "--ffn-hidden-size": "14336",
            "--num-attention-heads": "32", "--num-query-groups": "8", "--kv-channels": "128",
            "--seq-length": "8192", "--max-position-embeddings": "8192", "--global-batch-size": "128",
            "--train-samples": "1953125000", "--lr-decay-samples": "1949218748",
            "--lr-warmup-samples": "3906252", "--vocab-size": "128256", "--eval-iters": "32",
            "--eval-interval": "100", "--save-interval": "1000"}
    assert scaled.keys() == real.keys()
    argv = _argv(tmp_path)
    for i, item in enumerate(argv[:-1]):
        if item in real:
            argv[i + 1] = real[item]
    assert dry_run_cli.main(["--world-size", "8", "--"] + argv) == 0
    assert "unique parameters 8,031,309,824;" in capsys.readouterr().out
