"""Make the Megatron-LM checkpoint fixtures under tests/fixtures/megatron_lm/ with NVIDIA
Megatron-LM's own training loop (`pretrain_gpt.py` from its repository, tag core_v0.16.1, commit
55ac7082517c3878ae653c07c09c534b8aed49f6, run on CPU by tests/megatron_lm_harness.py).

    git --git-dir=<mirror of NVIDIA/Megatron-LM> archive core_v0.16.1 | tar -x -C /tmp/mlm
    python tests/megatron_lm_fixtures.py /tmp/mlm            # all fixtures
    python tests/megatron_lm_fixtures.py /tmp/mlm gpt2_adam  # one

Each fixture is one tiny model trained by Megatron-LM for SAVED iterations with a checkpoint at
SAVED (`--save-interval SAVED`, `--train-iters SAVED+1`, or SAVED+2 where the learning rates
are what is checked, or a --rampup-batch-size run of 7 iterations): `iter_000000S/` as Megatron-LM wrote it and a tracker naming it (its own
run goes on to save the last iteration at the end of training; that one is not kept), plus
`fixture.json` with the commit, the exact command, and the log line Megatron-LM printed for
iteration SAVED+1 in that same uninterrupted run (and the `lm loss` of every later iteration).
tests/test_megatron_lm_interop.py resumes each with our pretrain_gpt.py and the same flags and
expects those `lm loss` strings exactly.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainer_launch import REPO, launch  # noqa: E402

MEGATRON_LM_TAG = "core_v0.16.1"
MEGATRON_LM_COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"
MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"
FIXTURES = REPO / "tests" / "fixtures" / "megatron_lm"
HARNESS = str(REPO / "tests" / "megatron_lm_harness.py")
SAVED = 3

#: Megatron-LM flags that only make it run on CPU (our trainer takes none of them): gloo, the
#: local (torch) layer spec, CPU initialisation, every CUDA fusion off.
UPSTREAM_CPU_FLAGS = [
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--no-rope-fusion",
]
#: Flags both trainers take and mean the same by: a ~30K-parameter model on mock data.
TINY = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
    "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "32",
    "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(SAVED + 1),
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234",
]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
DISTOPT = ["--use-distributed-optimizer"]
#: Megatron-LM's separate rates for the embedding and output layer, and the iteration after the
#: next one (the first whose loss follows the resumed run's learning rates).
DECOUPLED_LR = ["--decoupled-lr", "4e-3", "--decoupled-min-lr", "2e-4"]


def _two_later(flags: list) -> list:
    i = flags.index("--train-iters")
    return flags[:i + 1] + [str(SAVED + 2)] + flags[i + 2:]


def _rampup(flags: list) -> list:
    """Sample-based, with Megatron-LM's --rampup-batch-size: global batches of 2, 2, 4 (saved
    after the third iteration), then 6 and 8, 8, 8 (iterations 4-7, 40 samples)."""
    out = list(flags)
    for flag in ("--train-iters", "--lr-warmup-iters"):
        i = out.index(flag)
        del out[i:i + 2]
    out[out.index("--global-batch-size") + 1] = "8"
    return out + ["--train-samples", "40", "--lr-warmup-samples", "4",
                  "--rampup-batch-size", "2", "2", "12"]

#: name -> (flags of both trainers, the distributed optimizer's sharding type or None)
VARIANTS = {
    "gpt2_adam": (TINY, None),
    "gpt2_distopt_dp_reshardable": (TINY + DISTOPT, "dp_reshardable"),
    "llama_adam": (TINY + LLAMA, None),
    "llama_distopt_fully_reshardable": (
        TINY + LLAMA + DISTOPT, "fully_reshardable"),
    "gpt2_distopt_decoupled_lr": (_two_later(TINY) + DISTOPT + DECOUPLED_LR, "dp_reshardable"),
    "gpt2_rampup_batch_size": (_rampup(TINY), None),
}
_UPSTREAM_ONLY = {"fully_reshardable": ["--dist-ckpt-optim-fully-reshardable"]}
_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|")


def upstream_flags(name: str) -> list:
    flags, sharding = VARIANTS[name]
    return UPSTREAM_CPU_FLAGS + flags + _UPSTREAM_ONLY.get(sharding, [])


def extract_tree(dest: str, mirror: str = MIRROR) -> str:
    """Megatron-LM's source at the tag, from a bare mirror (`git archive`)."""
    commit = subprocess.run(["git", f"--git-dir={mirror}", "rev-parse",
                             f"{MEGATRON_LM_TAG}^{{commit}}"], check=True, capture_output=True,
                            text=True).stdout.strip()
    if commit != MEGATRON_LM_COMMIT:
        raise SystemExit(f"{mirror}: {MEGATRON_LM_TAG} is {commit}, expected {MEGATRON_LM_COMMIT}")
    os.makedirs(dest, exist_ok=True)
    archive = subprocess.Popen(["git", f"--git-dir={mirror}", "archive", MEGATRON_LM_TAG],
                               stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive of {MEGATRON_LM_TAG} failed")
    # Compiled once, as an installed package would be: with PYTHONDONTWRITEBYTECODE set (as on
    # our machines) each process would compile the modules it imports from the tree again.
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", dest],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return dest


def run_upstream(tree: str, mode: str, flags: list, nproc: int = 1, timeout: float = 300.0,
                 imports: tuple = ()):
    """tests/megatron_lm_harness.py; `imports`: modules Megatron-LM's process imports first."""
    return launch(nproc, [tree, mode] + flags, timeout=timeout, entry=HARNESS,
                  extra_env={"MEGATRON_LM_IMPORT": ",".join(imports)})


def make(tree: str, name: str) -> dict:
    out = FIXTURES / name
    with tempfile.TemporaryDirectory() as tmp:
        save = os.path.join(tmp, "save")
        flags = upstream_flags(name) + ["--save", save, "--save-interval", str(SAVED)]
        run = run_upstream(tree, "pretrain", flags)
        lines = {int(m.group(1)): (m.group(0), m.group(2)) for m in _LINE.finditer(run.stdout)}
        if run.returncode != 0 or SAVED + 1 not in lines:
            raise SystemExit(f"Megatron-LM's run for {name} failed:\n{run.stdout[-3000:]}\n"
                             f"{run.stderr[-3000:]}")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        iter_dir = f"iter_{SAVED:07d}"
        shutil.copytree(os.path.join(save, iter_dir), out / iter_dir)
    (out / "latest_checkpointed_iteration.txt").write_text(f"{SAVED}\n")
    line, loss = lines[SAVED + 1]
    record = {
        "megatron_lm": {"repository": "https://github.com/NVIDIA/Megatron-LM",
                        "tag": MEGATRON_LM_TAG, "commit": MEGATRON_LM_COMMIT},
        "made_by": f"python tests/megatron_lm_fixtures.py MLM_TREE {name}",
        "command": "python tests/megatron_lm_harness.py MLM_TREE pretrain "
                   + " ".join(flags[:-4] + ["--save", "SAVE", "--save-interval", str(SAVED)]),
        "trainer_flags": VARIANTS[name][0],
        "distrib_optim_sharding_type": VARIANTS[name][1],
        "saved_iteration": SAVED,
        "next_iteration": SAVED + 1,
        "lm_loss": loss,
        "log_line": line.strip(),
        "later_losses": {str(it): lines[it][1] for it in sorted(lines) if it > SAVED},
    }
    (out / "fixture.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv) -> int:
    tree = os.path.abspath(argv[0])
    for name in argv[1:] or list(VARIANTS):
        record = make(tree, name)
        size = sum(f.stat().st_size for f in (FIXTURES / name).rglob("*") if f.is_file())
        print(f"{name}: iteration {record['next_iteration']} lm loss {record['lm_loss']} "
              f"({size // 1024} KiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
