"""CPU compatibility layer for megatron-core (applied only when CUDA is absent).

Covers megatron-core 0.19.2 with torch 2.14.1 (CUDA build without a driver, or CPU build).
Each patch says what it replaces and why; delete a patch when upstream stops calling CUDA on
that path. GPU runs never reach this module: parallel.init_parallel applies it only when
``torch.cuda.is_available()`` is False, and :func:`apply` re-checks.

Not patched: moe/paged_stash.py imports triton unconditionally, but our environment has
triton (SGLang depends on it), so that import succeeds on CPU; a triton-less CPU install would
need a stand-in here.
"""
from __future__ import annotations

import contextlib
import types

import torch

from megatron_marsrl import cuda_only

_applied = False


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: on CPU every op is already synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_torch_cuda_rng() -> None:
    # Megatron's RNG tracker (tensor_parallel/random.py: CudaRNGStatesTracker.add/fork,
    # model_parallel_cuda_manual_seed) saves, seeds and restores the *CUDA* generator so that
    # TP ranks draw different dropout masks. Without a driver those calls raise; route them to
    # the CPU generator, which is the one CPU kernels draw from.
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # (default_generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _patch_torch_cuda_streams() -> None:
    # MoE token dispatchers, the router and TP mappings create/wait on CUDA streams and events
    # and call synchronize()/current_device(); on CPU these are no-ops.
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullStream
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda"))


def _on_cpu(fn):
    """Wrap a torch factory so device='cuda'/pin_memory=True become a plain CPU tensor."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return wrapper


_FACTORIES = frozenset(("tensor", "as_tensor", "ones", "zeros", "empty", "full", "arange", "rand",
                        "randn", "randint", "eye", "linspace", "empty_strided"))

# Megatron modules that reach the code paths we run (model, schedules, optimizer, DDP,
# dist-checkpointing); imported up-front so their `torch` global can be redirected below.
_MEGATRON_MODULES = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing.serialization",
    "megatron.core.transformer.moe.token_dispatcher",
)


class _CpuTorch(types.ModuleType):
    """`torch` as Megatron modules see it on CPU: factories ignore device="cuda" and
    pin_memory=True; every other attribute is the real torch one."""

    def __init__(self):
        super().__init__("torch")
        self._factories = {name: _on_cpu(getattr(torch, name)) for name in _FACTORIES}

    def __getattr__(self, name):
        if name == "distributed":
            return _DIST
        return self._factories[name] if name in self._factories else getattr(torch, name)


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
    # tensor_parallel/mappings._AllToAll (MoE alltoall dispatch with EP>1) passes split sizes
    # as CPU tensors; gloo's all_to_all_single only accepts Python lists.
    if isinstance(output_split_sizes, torch.Tensor):
        output_split_sizes = output_split_sizes.tolist()
    if isinstance(input_split_sizes, torch.Tensor):
        input_split_sizes = input_split_sizes.tolist()
    return torch.distributed.all_to_all_single(output, input, output_split_sizes, input_split_sizes, **kwargs)


class _CpuDistributed(types.ModuleType):
    """`torch.distributed` as Megatron modules see it on CPU (gloo)."""

    def __getattr__(self, name):
        return _all_to_all_single if name == "all_to_all_single" else getattr(torch.distributed, name)


_DIST = _CpuDistributed("torch.distributed")


def _patch_hardcoded_cuda_devices() -> None:
    # Masks (transformer/utils.get_default_causal_mask), schedules (total_num_tokens), the
    # optimizer, clip_grads, dist-checkpointing and the MoE token dispatcher allocate with a
    # literal device="cuda", call .cuda() or pin host memory. We redirect the `torch` global of
    # megatron.core modules only (wrapping torch.* itself would break torch's own device
    # context manager, which recognises factories by identity, and with it transformers).
    import importlib
    import sys

    for name in _MEGATRON_MODULES:
        importlib.import_module(name)
    proxy = _CpuTorch()
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = proxy
    # Tensor methods cannot be redirected per module. Rewriting a CUDA target to the CPU only
    # changes calls that would otherwise raise for lack of a driver.
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            args = ("cpu",) + args[1:]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


def _patch_torch_norm_sequence_parallel() -> None:
    # WrappedTorchNorm (transformer/torch_norm.py, used when neither TE nor apex is installed)
    # asserts `not config.sequence_parallel`, yet Megatron requires sequence parallel for MoE
    # with TP>1. A norm is position-wise, so running it on a sequence shard is exact; the only
    # thing SP adds is that the weight's gradient must be summed over TP ranks, which
    # finalize_model_grads does for parameters marked `sequence_parallel` (as TE/apex mark them).
    import copy

    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original_new(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


def _patch_cuda_type_strings() -> None:
    # optimizer/optimizer.py (Float16OptimizerWithFloat16Params), optimizer/distrib_optimizer.py
    # and optimizer/clip_grads.py decide how to treat a parameter by comparing
    # `param.type()` with 'torch.cuda.FloatTensor' / 'torch.cuda.BFloat16Tensor' and raise on
    # anything else. For callers inside megatron.core.optimizer only, report CPU tensors under
    # their CUDA type name; everyone else sees the true name.
    import sys

    original_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and not self.is_cuda:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("megatron.core.optimizer"):
                return original_type(self).replace("torch.", "torch.cuda.", 1)
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


def apply() -> None:
    """Install all patches once. A no-op when CUDA is available."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    cuda_only.hide()  # before anything below imports megatron.core
    _patch_torch_cuda_rng()
    _patch_torch_cuda_streams()
    _patch_hardcoded_cuda_devices()
    _patch_torch_norm_sequence_parallel()
    _patch_cuda_type_strings()
    _applied = True
