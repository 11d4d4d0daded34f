"""SGLang general plugin for the CPU torch-native path (loaded in every SGLang process).

SGLang 0.5.23 discovers plugins through the ``sglang.srt.plugins`` entry-point group and runs
them first thing in the engine, scheduler and detokenizer processes. The ``.dist-info`` next to
this file registers :func:`register`; this directory is on SGLang's path only on CPU machines
(rollout/sglang_engine.py), so GPU runs never load it.

Patch (one): ``sglang.srt.mem_cache.pool_host.common._cuda_host_register``.
What it replaces: page-locking a host buffer with cudaHostRegister. SGLang pins the host cache
of the routed-experts capturer (``--enable-return-routed-experts``, state_capturer/base.py
BaseHostCache, pin_memory=True) even when the model runs on CPU, and torch.cuda.cudart() raises
"Found no NVIDIA driver" there, so the engine died at start-up. Pinning only speeds up
device-to-host copies; with the model on CPU there is no device, so skipping it is exact.
Versions: sglang 0.5.23. Delete when SGLang skips host registration for device="cpu".
"""
from __future__ import annotations

_TARGET = "sglang.srt.mem_cache.pool_host.common._cuda_host_register"


def _skip_host_register(buffer, registration_granularity_bytes=None) -> None:
    """No CUDA driver, no device: nothing to page-lock for."""


def register() -> None:
    import torch

    if torch.cuda.is_available():  # a GPU after all: keep SGLang's pinning
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_TARGET, _skip_host_register, HookType.REPLACE)
