"""megatron.training.startup: megatron-core imported without importing the compiler up front, and
compiling exactly what it compiled before, at first use."""
import subprocess
import sys

import torch

from megatron.training.startup import _deferred


def test_deferred_compile_compiles_once_at_first_call_and_passes_modules_through():
    calls = []

    def fake_compile(model, **kwargs):
        calls.append((model, kwargs))
        return lambda *a, **k: ("compiled", model(*a, **k))

    deferred = _deferred(fake_compile)

    def add(a, b):
        return a + b

    wrapped = deferred(add)
    factory = deferred(mode="max-autotune")(add)
    assert calls == [] and wrapped.__name__ == "add"  # nothing compiled at decoration
    assert wrapped(1, 2) == ("compiled", 3) and wrapped(2, 2) == ("compiled", 4)
    assert factory(1, 1) == ("compiled", 2)
    assert calls == [(add, {}), (add, {"mode": "max-autotune"})]  # once each, same options
    module = torch.nn.Linear(1, 1)
    deferred(module)
    assert calls[-1] == (module, {})  # a module is compiled as before, at once


def test_megatron_core_imports_without_the_compiler_wandb_and_tensorboard():
    code = ("import sys, torch; real = torch.compile\n"
            "from megatron.training.startup import import_megatron_core\n"
            "import_megatron_core()\n"
            "import megatron.core.fusions.fused_bias_gelu as f\n"
            "assert torch.compile is real\n"
            "assert 'torch._inductor.compile_fx' not in sys.modules\n"
            "assert callable(f.bias_gelu_impl) or callable(f.bias_gelu)\n"
            "import megatron.core.timers as timers\n"
            "assert 'wandb' not in sys.modules and timers.wandb is None\n"
            "assert 'torch.utils.tensorboard' not in sys.modules\n"
            "assert timers.SummaryWriter is None\n"
            "import wandb  # our --wandb-project logging still imports it\n"
            "from torch.utils.tensorboard import SummaryWriter  # and --tensorboard-dir\n"
            "assert wandb.init is not None and SummaryWriter is not None\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
