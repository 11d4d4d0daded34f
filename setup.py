"""megatron_marsrl: multi-agent RL (Solver / Verifier / Corrector) on Megatron-core + SGLang."""
import re
from pathlib import Path

from setuptools import find_packages, setup

_version = re.search(r'__version__ = "([^"]+)"', Path("megatron_marsrl/__init__.py").read_text()).group(1)

setup(
    name="megatron_marsrl",
    version=_version,
    description="Multi-agent reasoning RL (MarsRL) on Megatron-core with colocated SGLang rollouts",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_marsrl", "megatron_marsrl.*"]),
    # The CPU-only stand-in for SGLang's kernel package is data, not a package of ours: it is
    # put on SGLang's path only on CPU machines (rollout/sglang_engine.py).
    package_data={"megatron_marsrl.rollout": ["sglang_cpu_shim/sgl_kernel/*.py", "sglang_cpu_shim/*.py",
                                              "sglang_cpu_shim/*.dist-info/*"]},
    # CPU/CI pins live in requirements/*.txt (installed by scripts/env.sh). These are
    # the loose runtime requirements for users installing into their own stack (NGC).
    install_requires=[
        "torch>=2.6",
        "safetensors",
        "transformers>=4.51",
        "numpy",
        "pyyaml",
        "tqdm",
        "einops",
        "packaging>=24.2",
        "math-verify>=0.7",
        "tensorboard",
    ],
    extras_require={
        # megatron-core is listed separately: on Python 3.11 it must be installed with
        # --no-deps --ignore-requires-python (see README); NGC images ship it.
        "megatron": ["megatron-core==0.19.2"],
        "sglang": ["sglang==0.5.23"],
        # GPU-only accelerators; never required on CPU machines.
        "gpu": ["transformer-engine[pytorch]>=2.4", "apex", "nvidia-modelopt[torch]>=0.31"],
    },
    entry_points={"console_scripts": ["marsrl = megatron_marsrl.cli:main"]},
)
