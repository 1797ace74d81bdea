"""DataStates-LLM: lazy, asynchronous, multi-level checkpointing for a megatron-core GPT trainer."""
from setuptools import find_namespace_packages, setup

setup(
    name="datastates-llm",
    version="0.1.0",
    description="Megatron-style GPT trainer with DataStates lazy asynchronous checkpointing",
    python_requires=">=3.10",
    # `megatron` has no __init__.py of ours: it is a namespace package shared with the installed
    # megatron-core wheel, so only our `megatron.training` subpackage is ours to ship.
    # `tools` ships too, so `python tools/X.py` and `python -m tools.X` both find `tools.*`.
    packages=find_namespace_packages(include=["megatron.training*", "datastates*", "tools*"]),
    # tools.scale: the paper's inputs, read by tools/project_scale.py. datastates: the one-pass
    # copy + CRC-32C (datastates/copycrc.py), a plain C library that ctypes loads, built by
    # scripts/build_copycrc.sh (setup_venv.sh runs it). Not a Python extension, so the wheel
    # stays pure: where the library is missing or does not load (another CPU), the engine copies
    # with memmove and checksums in its writer thread, writing the same bytes and checksums.
    package_data={"tools.scale": ["*.json"], "datastates": ["_copycrc.c", "_copycrc.so"]},
    install_requires=["torch>=2.4", "megatron-core==0.16.1", "psutil", "numpy", "safetensors",
                      "crc32c"],
    extras_require={
        # NVIDIA Apex is not on PyPI (the PyPI "apex" is unrelated); build it from
        # https://github.com/NVIDIA/apex with CUDA. transformer-engine needs CUDA at install time.
        "gpu": ["transformer-engine[pytorch]"],
        "test": ["pytest", "pytest-xdist", "tensorboard", "wandb", "transformers==5.24.0"],
        "plot": ["matplotlib"],
        # --tensorboard-dir and --wandb-project; each flag is refused at start-up without its
        # package.
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
    },
)
