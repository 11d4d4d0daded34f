"""The CPU compatibility layer: active on CPU only, scoped to Megatron, invisible to others.

Each check runs in a fresh interpreter so the patches never leak into the test process.
"""
import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_noop_when_cuda_is_available():
    out = _run("""
        import torch
        torch.cuda.is_available = lambda: True
        before = (torch.cuda.get_rng_state, torch.Tensor.to, torch.Tensor.type, torch.cuda.Stream)
        from megatron_marsrl.megatron import cpu_compat
        cpu_compat.apply()
        after = (torch.cuda.get_rng_state, torch.Tensor.to, torch.Tensor.type, torch.cuda.Stream)
        print(before == after, cpu_compat._applied)
    """)
    assert out == "True False"


@pytest.mark.slow
def test_patches_are_scoped_to_megatron():
    out = _run("""
        import torch
        from megatron_marsrl.megatron import cpu_compat
        cpu_compat.apply()
        from megatron.core.transformer import utils as mutils
        mask = mutils.get_default_causal_mask(3)          # allocates with device="cuda" upstream
        with torch.device("meta"):                        # torch's own device context still works
            meta = torch.ones(2).device.type
        plain = torch.ones(2).type()                      # true type names outside the optimizer
        print(mask.device.type, meta, plain, torch.ones is not mutils.torch.ones)
    """)
    assert out == "cpu meta torch.FloatTensor True"


@pytest.mark.slow
def test_rng_tracker_forks_cpu_generator():
    out = _run("""
        import torch
        from megatron_marsrl.megatron import cpu_compat
        cpu_compat.apply()
        from megatron.core.tensor_parallel import random as mrandom
        tracker = mrandom.get_cuda_rng_tracker()
        tracker.add("model-parallel-rng", 1234)
        torch.manual_seed(0)
        outside = torch.get_rng_state().clone()
        with tracker.fork():
            a = torch.rand(3)
        restored = torch.equal(torch.get_rng_state(), outside)
        tracker2 = mrandom.CudaRNGStatesTracker(); tracker2.add("model-parallel-rng", 1234)
        with tracker2.fork():
            b = torch.rand(3)
        print(restored, torch.equal(a, b))
    """)
    assert out == "True True"


def test_cuda_only_extensions_import_as_missing():
    """flash_mla (its .so needs libcuda), flashinfer and flash_attn (1.7 and 2.5-4.5 s of each
    rank's start) are missing for Megatron on CPU, which then takes its "not installed" branches
    (attention.py's FA4 check among them)."""
    out = _run("""
        from megatron_marsrl.megatron import cpu_compat
        cpu_compat.apply()
        import sys
        from megatron.core.transformer import attention
        from megatron.core.transformer.moe import experts, moe_layer
        for name in ("flash_mla", "flashinfer", "flash_attn"):
            try:
                __import__(name)
                print("imported", end=" ")
            except ImportError:
                print("ImportError", end=" ")
        print(attention.HAVE_FA4, [m for m in ("quack", "cutlass", "tvm_ffi") if m in sys.modules])
    """)
    assert out == "ImportError ImportError ImportError False []"
