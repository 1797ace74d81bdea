"""Run Python snippets, each in its own process that has imported neither megatron nor datastates.

    python tests/import_orders.py SNIPPET [SNIPPET ...]   # prints {snippet: [exit status, output]}

Used by tests/test_lazy_save.py to import megatron-core and our adapter in every order. A fresh
interpreter per order spends ~6 s of CPU importing megatron-core, ~5 s of it in torch (inductor,
dynamo, DTensor), which neither package's import order touches. So torch is imported once here,
then each snippet runs in a child forked from this process: what it imports of megatron and
datastates, and in which order, is its own (checked before forking).
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

# What megatron-core's import spends most of its time on, none of it megatron's or ours.
for _module in ("torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.tensor",
                "torch.distributed.checkpoint"):
    importlib.import_module(_module)


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("megatron", "datastates")


def _child(snippet: str, fd: int) -> None:
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", closefd=False)
    sys.stderr = os.fdopen(2, "w", closefd=False)
    status = 0
    try:
        exec(compile(snippet, "<snippet>", "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(snippets) -> int:
    loaded = sorted(m for m in sys.modules if _ours(m))
    assert not loaded and not any(_ours(type(f).__module__) for f in sys.meta_path), loaded
    children = []
    for snippet in snippets:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _child(snippet, write)
        os.close(write)
        children.append((snippet, pid, read))
    results = {}
    for snippet, pid, read in children:
        with os.fdopen(read) as f:
            output = f.read()
        _, status = os.waitpid(pid, 0)
        results[snippet] = [os.waitstatus_to_exitcode(status), output]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
