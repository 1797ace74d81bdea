"""The README's commands, taken from README.md itself, run as written in a fresh shell after the
quickstart: each ```bash block in its own `bash -c`, in order, in a directory that holds the
repository's files (linked) and no `runs/`, with no virtual environment on PATH and Python's
default warning settings. Only the run is shortened: `--train-iters 40` becomes 3 (and the
`iter_0000040` names after it `iter_0000003`).

What is left on the terminal is checked too: no Python warning a user cannot act on (trainer,
converters, tools), and the figures the trainer prints agree with what is on disk.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from datastates.deepspeed_tags import tag_is_committed

REPO = Path(__file__).resolve().parent.parent
ITERS = 3
# "path:line: SomeWarning: text", as Python's warnings module prints it, and megatron-core's
# logged notice about the mock dataset's index cache.
PY_WARNING = re.compile(r"^\S+:\d+: \w*Warning: .*$|^.*Unable to save MockGPTDataset.*$", re.M)


def _blocks(text: str):
    """(heading, [command, ...]) of every ```bash block: continuation lines joined, comments
    and blank lines dropped."""
    out = []
    for m in re.finditer(r"```bash\n(.*?)```", text, re.S):
        heading = re.findall(r"^## (.*)$", text[:m.start()], re.M)[-1]
        commands, current = [], ""
        for line in m.group(1).splitlines():
            line = re.sub(r"\s+#.*$", "", line) if not line.lstrip().startswith("#") else ""
            if not line.strip() and not current:
                continue
            current += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") \
                else line.strip()
            if not line.rstrip().endswith("\\"):
                commands.append(current.strip())
                current = ""
        out.append((heading, [c for c in commands if c]))
    return out


def _fresh_shell_env():
    venv_bin = str(REPO / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONWARNINGS", "VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p != venv_bin and p != os.path.dirname(sys.executable))
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_readme_commands_run_as_written(tmp_path):
    blocks = _blocks((REPO / "README.md").read_text())
    # The first block is the two commands: the quickstart is the main job, the second this suite.
    assert blocks[0][1] == ["bash scripts/quickstart.sh", "bash scripts/test.sh"], blocks[0]
    work = tmp_path / "clone"
    work.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in ("runs", ".git", "__pycache__"):
            (work / entry.name).symlink_to(entry)
    env = _fresh_shell_env()
    outputs = {}
    train_block = next("\n".join(c) for h, c in blocks if h.startswith("Train"))
    # Beyond the README: the launch line loading the torch_dist copy the converters made (the
    # trainer's torch_dist load path; megatron-core and torch warn on every such load).
    resume = ("torch_dist load", train_block.replace("--save runs/demo --load runs/demo",
                                                     "--load runs/demo_torch_dist "
                                                     "--save runs/demo_resumed").split("\n"))
    # The other user paths, from what the README's commands made: the ways in, the dry run of a
    # launch line, data preparation. The same checks: rc 0, no warning left.
    launch_flags = train_block.split("pretrain_gpt.py", 1)[1].split("--save", 1)[0]
    others = ("other tools", [
        "source .venv/bin/activate",
        "python tools/convert_checkpoint.py from-hf runs/demo_hf runs/demo_from_hf",
        "python tools/convert_checkpoint.py from-torch-dist runs/demo_torch_dist runs/demo_u2",
        "python tools/convert_checkpoint.py upgrade-universal runs/demo_u2",
        f"python tools/dry_run.py --world-size 2 -- {launch_flags}",
        "printf '{\"text\": \"1 2 3 4 5\"}\\n{\"text\": \"6 7 8\"}\\n' > runs/docs.jsonl",
        "python tools/preprocess_data.py --input runs/docs.jsonl --output-prefix runs/docs "
        "--tokenizer-type NullTokenizer --vocab-size 16 --append-eod"])
    for heading, commands in blocks[1:] + [resume, others]:
        script = "\n".join(commands)
        script = script.replace("--train-iters 40", f"--train-iters {ITERS}")
        script = script.replace("iter_0000040", f"iter_{ITERS:07d}")
        assert "source .venv/bin/activate" in commands[0] or "python" not in script, \
            f"a block that needs .venv must activate it first ({heading})"
        out = subprocess.run(["bash", "-e", "-c", script], cwd=str(work), env=env,
                             capture_output=True, text=True, timeout=600)
        text = out.stdout + out.stderr
        assert out.returncode == 0, (heading, script, text[-4000:])
        noise = PY_WARNING.findall(text)
        assert not noise, (heading, noise[:5])
        outputs[heading] = text

    runs = work / "runs"
    # The launch line: trained, saved every iteration, kept 2, said so.
    train = next(t for h, t in outputs.items() if h.startswith("Train"))
    assert sorted(p.name for p in (runs / "demo").glob("iter_*")) == \
        ["iter_0000002", "iter_0000003"]
    assert (runs / "demo" / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)
    sizes = {int(i): int(b) for i, b in re.findall(r" checkpoint iteration\s+(\d+) \| bytes: (\d+)",
                                                    train)}
    assert sorted(sizes) == [1, 2, 3]
    on_disk = sum(f.stat().st_size for f in (runs / "demo" / "iter_0000003").iterdir()
                  if f.name.startswith("shard_"))
    assert 0.9 * on_disk <= sizes[3] <= on_disk, (sizes[3], on_disk)
    assert "final validation: running 5 iterations (40 samples; --eval-iters 5)" in train, \
        train[-3000:]
    # The converters and the picture.
    assert json.loads((runs / "demo_hf" / "config.json").read_text())["architectures"] == \
        ["GPT2LMHeadModel"]
    assert (runs / "demo_torch_dist" / "latest_checkpointed_iteration.txt").read_text() == \
        str(ITERS)
    assert (runs / "demo" / "timeline.png").stat().st_size > 10_000
    assert "sbatch" in next(t for h, t in outputs.items() if "Slurm" in h)
    assert f"(format torch_dist, iteration {ITERS};" in outputs["torch_dist load"], \
        outputs["torch_dist load"][-3000:]
    assert (runs / "demo_from_hf" / "manifest.json").is_file()
    # DeepSpeed's own engine class on ours, ZeRO-1: trained to 12, resumed from tag 8 to 12
    # bit-exactly; the first run's tag 12, newer than the tag resumed from, set aside whole (both
    # ranks save into tag 12 at once: rank 1 waits for rank 0 to move it) and saved anew.
    deepspeed = next(t for h, t in outputs.items() if h.startswith("DeepSpeed"))
    assert "resumed from runs/ds/global_step8/mp_rank_00_model_states.pt at step 8" in deepspeed
    first, second = deepspeed.split("resumed from", 1)
    losses = [re.findall(r"^step (\d+)/ 12 \| loss: (\S+)", t, re.M) for t in (first, second)]
    assert [s for s, _ in losses[0]] == [str(i) for i in range(1, 13)], deepspeed[-3000:]
    assert losses[1] == losses[0][8:], deepspeed[-3000:]
    assert re.search(r"set aside DeepSpeed tag\(s\) \['global_step12'\] of \S+/runs/ds: newer than "
                     r"tag 'global_step8'", second), second[-3000:]
    aside = [d for d in os.listdir(runs / "ds") if d.startswith("superseded-by-global_step8-")]
    assert len(aside) == 1 and tag_is_committed(str(runs / "ds" / aside[0] / "global_step12"))
    assert tag_is_committed(str(runs / "ds" / "global_step12"))
    assert (runs / "ds" / "latest").read_text() == "global_step12"
    assert (runs / "demo_u2").is_dir() and (runs / "docs_text_document.idx").is_file(), \
        outputs["other tools"][-3000:]
