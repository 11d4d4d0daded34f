"""Wrap a Megatron model for data-parallel training and build its optimizer."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    """AdamW settings of one policy."""

    optimizer: str = "adam"
    """"adam" (AdamW, decoupled weight decay) or "sgd" (used by exact-parity tests: Adam's
    first step is sign(g)*lr, which turns float rounding noise in near-zero gradients into
    full-size updates)."""
    lr: float = 1e-6
    """Constant learning rate (MarsRL: 1e-6)."""
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    grad_reduce_in_fp32: bool = True
    """Gradient buffers in fp32 (Megatron's grad_reduce_in_fp32). False keeps them in the
    parameter dtype: with bf16 parameters that halves them (4 -> 2 B per parameter, ~7.5 GiB
    per GPU for Qwen3-30B-A3B on 8 H100), at a cost in accuracy: every micro-batch's gradient is
    added into the buffer, and the data-parallel sum is taken, with bf16's 8-bit mantissa, so
    contributions below ~1/256 of the running sum are lost. That bites in RL, where the
    micro-batches' gradients have advantages of both signs and largely cancel (measured on the
    tiny model: 0.3% relative L2 error of one 8-micro-batch step's gradient, EP2;
    tests/megatron/test_training_parity.py). No effect with fp32 parameters."""
    cpu_offload_fraction: float = 0.0
    """Share (0..1) of the optimizer state (fp32 main params, Adam moments) kept in host memory
    and updated there by Megatron's HybridDeviceOptimizer (its optimizer_cpu_offload with
    optimizer_offload_fraction). 0 keeps everything on the GPU. Needs the distributed optimizer
    (parallel.distributed_optimizer=true), optimizer "adam" and CUDA."""

    def __post_init__(self):
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer={self.optimizer!r}: use 'adam' or 'sgd'")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr}: must be > 0")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad={self.clip_grad}: must be >= 0")
        if not 0.0 <= self.cpu_offload_fraction <= 1.0:
            raise ValueError(f"cpu_offload_fraction={self.cpu_offload_fraction}: must be in [0, 1]")
        if self.cpu_offload_fraction > 0 and self.optimizer != "adam":
            # Megatron's offload runs on the precision-aware optimizer path, which is Adam-only.
            raise ValueError(f"cpu_offload_fraction={self.cpu_offload_fraction} needs optimizer='adam', "
                             f"not {self.optimizer!r}")


def wrap_ddp_and_optimizer(model, optim: OptimConfig, *, distributed_optimizer: bool = False):
    """Return ``(ddp_model, optimizer)``: gradients in contiguous buffers reduced once per
    step (the sync is deferred to the end of the accumulation), AdamW in fp32."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    offload = _offload_options(optim, distributed_optimizer)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=optim.grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    ddp_model = DistributedDataParallel(model.config, ddp_config, model)
    # The schedule defers the data-parallel gradient reduction to the end of the step and then
    # calls finalize_model_grads (DP all-reduce, TP reduction of sequence-parallel/qk-norm
    # grads, tied-embedding sync across PP). Without these hooks nothing is reduced.
    from megatron.core.distributed import finalize_model_grads

    model.config.no_sync_func = ddp_model.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(
        optimizer=optim.optimizer,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        use_distributed_optimizer=distributed_optimizer,
        bf16=model.config.bf16,
        params_dtype=model.config.params_dtype,
        **offload,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp_model])
    if not torch.cuda.is_available():
        _fuse_cpu_adam(optimizer)
    return ddp_model, optimizer


def dither_main_params(optimizer, *, seed: int = 0) -> int:
    """Spread each bf16/fp16 parameter's fp32 main copy uniformly over the values that round to
    it, and return how many elements were moved (0 for an fp32 model).

    Megatron makes the main copies from the low-precision parameters, so after a checkpoint load
    every one sits exactly on the bf16 grid. An update then changes the forward only once a
    parameter's accumulated updates exceed half its bf16 spacing (1/512 to 1/256 of its
    magnitude): at RL learning rates (Adam moves each weight by about lr per step) most weights
    stay frozen for several steps, and a run of a few tens of steps learns far less. A main copy
    anywhere inside its rounding cell makes the forward change by the update in expectation from
    the first step, while the forward at step 0 is bit-identical (every main copy still rounds
    to its parameter). Measured on SmolLM2-135M, Adam at lr 1e-5 on
    one fixed batch, 20 steps: loss 2.04 -> 0.45 in fp32, 2.03 -> 0.86 in bf16 with main copies
    on the grid, 2.03 -> 0.45 dithered. Draws depend on `seed` and the parameter order only, so
    data-parallel replicas of a parameter get the same main copy. A checkpoint load afterwards
    restores the saved main copies."""
    moved = 0
    for index, (low, main) in enumerate(_low_precision_main_params(optimizer)):
        gen = torch.Generator(device=main.device).manual_seed(seed + index)
        # In chunks: a grouped-expert parameter can hold ~10^8 elements and this is 6 temporaries.
        for part, out in zip(low.reshape(-1).split(1 << 22), main.view(-1).split(1 << 22)):
            up = torch.nextafter(part, torch.full_like(part, float("inf"))).float()
            down = torch.nextafter(part, torch.full_like(part, float("-inf"))).float()
            value = part.float()
            lo, hi = (value + down) / 2, (value + up) / 2  # the cell's edges (exact in fp32)
            # Stay off the edges: a value exactly on one rounds to even, maybe away from `part`.
            u = torch.rand(part.shape, generator=gen, device=main.device) * 0.998 + 0.001
            out.copy_(lo + (hi - lo) * u)
        moved += low.numel()
    return moved


def _low_precision_main_params(optimizer):
    """(low-precision model values, fp32 main copy) pairs of Megatron's mixed-precision
    optimizers: the whole parameter for the Float16 optimizer, this rank's shard of it for the
    distributed one (megatron-core 0.19 attribute names). None from the precision-aware
    optimizer (optimizer offload), which keeps its main copies inside its own Adam."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(sub.config, "use_precision_aware_optimizer", False):
            continue
        if hasattr(sub, "shard_fp32_from_float16_groups"):
            for models, mains in zip(sub.model_float16_groups, sub.shard_fp32_from_float16_groups):
                for model_param, main in zip(models, mains):
                    span = sub._get_model_param_range_map(model_param)["param"]
                    yield model_param.detach().view(-1)[span.start:span.end], main.data
        elif hasattr(sub, "fp32_from_float16_groups"):
            for models, mains in zip(sub.float16_groups, sub.fp32_from_float16_groups):
                for model_param, main in zip(models, mains):
                    yield model_param.detach(), main.data


def _fuse_cpu_adam(optimizer) -> None:
    """On CPU, without TE or Apex, Megatron builds torch's AdamW with its defaults, which on CPU
    are the per-tensor loop (one Python pass and ~10 elementwise kernels per parameter tensor).
    torch's fused kernel (CPU support since 2.4) does the same update in one pass over each
    tensor; it is read from the param group at every step, so set it before the first (the
    step's state tensors are then made for it). The same AdamW update; the training-parity and
    checkpoint tests run through it."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW) and not inner.state:
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)


def _offload_options(optim: OptimConfig, distributed_optimizer: bool) -> dict:
    """OptimizerConfig fields for optimizer CPU offload (megatron-core 0.19 names); {} without it."""
    fraction = optim.cpu_offload_fraction
    if fraction == 0:
        return {}
    if not distributed_optimizer:
        raise ValueError(f"optim.cpu_offload_fraction={fraction} needs parallel.distributed_optimizer=true "
                         "(Megatron offloads the distributed optimizer's shards)")
    if not torch.cuda.is_available():
        raise ValueError(f"optim.cpu_offload_fraction={fraction}: optimizer CPU offload moves state between "
                         "GPU and host and needs CUDA; set optim.cpu_offload_fraction=0 on a CPU-only machine")
    # Megatron's own argument check requires the precision-aware optimizer with offload: the
    # HybridDeviceOptimizer reuses that code path in the distributed optimizer.
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction, use_precision_aware_optimizer=True)

