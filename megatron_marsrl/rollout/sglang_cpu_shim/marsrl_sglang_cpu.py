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

Patch (two), only where the environment sets ``FORK_ENV`` (rollout/sglang_server.py does, for
the HTTP server processes it starts on CPU): the server's scheduler and detokenizer processes
are forked instead of spawned. ``sglang.srt.entrypoints.engine._set_envs_and_config`` sets the
start method to "spawn" (CUDA cannot be used in a forked child); an after-hook sets "fork". A
spawned child imports torch, transformers and SGLang again: on 2 cores a server was ready in
42-51 s using 60-70 core-seconds, forked in 26-28 s using 27-30 (measured side by side, two
starts each, the same checks passing). The server's main process has done nothing but import
and parse its arguments when it forks. In-process engines (rollout/sglang_engine.py) keep
"spawn": their process is a training rank, with threads and process groups a fork would copy.
Versions: sglang 0.5.23. Delete if SGLang's CPU path chooses "fork" itself.
"""
from __future__ import annotations

import os

_TARGET = "sglang.srt.mem_cache.pool_host.common._cuda_host_register"
_START_METHOD = "sglang.srt.entrypoints.engine._set_envs_and_config"
FORK_ENV = "MARSRL_SGLANG_FORK"


def _skip_host_register(buffer, registration_granularity_bytes=None) -> None:
    """No CUDA driver, no device: nothing to page-lock for."""


def _fork_children(result, *args, **kwargs) -> None:
    """After SGLang set its start method: "fork" (patch two)."""
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)


def register() -> None:
    import torch

    if torch.cuda.is_available():  # a GPU after all: keep SGLang's pinning and "spawn"
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_TARGET, _skip_host_register, HookType.REPLACE)
    if os.environ.get(FORK_ENV) == "1":
        HookRegistry.register(_START_METHOD, _fork_children, HookType.AFTER)
