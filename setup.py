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
    package_data={"tools.scale": ["*.json"]},  # the paper's inputs, read by tools/project_scale.py
    install_requires=["torch>=2.4", "megatron-core==0.16.1", "psutil", "numpy", "safetensors",
                      "crc32c"],
    extras_require={
        # NVIDIA Apex is not on PyPI (the PyPI "apex" is unrelated); build it from
        # https://github.com/NVIDIA/apex with CUDA. transformer-engine needs CUDA at install time.
        "gpu": ["transformer-engine[pytorch]"],
        "test": ["pytest", "tensorboard", "wandb", "transformers==5.24.0"],
        "plot": ["matplotlib"],
        # --tensorboard-dir and --wandb-project; each flag is refused at start-up without its
        # package.
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
    },
)
