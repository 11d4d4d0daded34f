"""CUDA-only extension packages that the SGLang install brings along, hidden on CPU machines.

megatron.core and SGLang guard their imports of these with `except ImportError` and take
their documented "not installed" path without them; on CPU nothing of theirs can run. Yet
importing them costs every process that does: flashinfer ~1.1-1.7 s (megatron.core imports it
in five modules, for MXFP8 inference and fused MoE kernels; SGLang in each of its server's
three processes), flash_attn 2.5-4.5 s (megatron.core's attention.py imports its FA4 `cute`
interface, which pulls in quack, CUTLASS's DSL and tvm_ffi), torch_memory_saver 0.6 s
(megatron.core's inference context; SGLang's memory saver, which this project starts only on a
GPU: rl/rollout_side.py memory_saver). flash_mla is worse: without libcuda.so loading its .so
raises OSError, which escapes the guards. Hidden from the Megatron ranks by
megatron/cpu_compat.py and from SGLang's processes by rollout/sglang_cpu_shim/sitecustomize.py
(this module needs nothing beyond the standard library, so both can import it first).
"""
from __future__ import annotations

import sys

MODULES = ("flash_mla", "flashinfer", "flash_attn", "torch_memory_saver")


def hide() -> None:
    """Make `import` of each of MODULES raise ImportError in this process (a None entry in
    sys.modules); a module already imported stays."""
    for name in MODULES:
        sys.modules.setdefault(name, None)
