"""One typed config for the parallel layout, its validation, and process-group set-up.

Layout terms follow Megatron: TP (tensor), PP (pipeline), EP (expert), ETP (expert-tensor),
DP (data, derived: world / (TP*PP)), sequence parallel, distributed optimizer, recompute.
"""
from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import torch

from megatron_marsrl.megatron.hf_config import ModelArch
from megatron_marsrl.net import free_port


class LayoutError(ValueError):
    """A parallel layout that does not fit the model or the world size."""


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """How one model is split over ranks."""

    tp: int = 1
    """Tensor-parallel size: attention heads, query groups, FFN and vocab are split TP ways."""
    pp: int = 1
    """Pipeline-parallel size: layers are split into PP contiguous stages (1F1B schedule)."""
    ep: int = 1
    """Expert-parallel size: each EP rank holds num_experts / EP experts."""
    etp: int | None = None
    """Expert-tensor-parallel size (each expert's FFN split ETP ways); None means 1 when EP>1
    (the usual MoE layout), otherwise TP."""
    sequence_parallel: bool = False
    """Split norms/dropout activations along the sequence over TP ranks (requires TP>1).
    Forced on for MoE with TP>1, as Megatron requires."""
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    recompute: str | None = None
    """Activation recompute: None, "full" (whole layers) or "selective" (core attention)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch in the pipeline schedule."""

    def __post_init__(self):
        for name in ("tp", "pp", "ep", "micro_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}={value!r}: must be a positive integer")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise LayoutError(f"etp={self.etp!r}: must be a positive integer or None")
        if self.recompute not in (None, "full", "selective"):
            raise LayoutError(f"recompute={self.recompute!r}: use None, 'full' or 'selective'")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("sequence_parallel=True needs tp > 1")

    @property
    def expert_tp(self) -> int:
        if self.etp is not None:
            return self.etp
        return 1 if self.ep > 1 else self.tp

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)

    def validate(self, arch: ModelArch, world_size: int) -> None:
        """Raise LayoutError naming the first way this layout does not divide the model/world."""
        model_par = self.tp * self.pp
        if world_size % model_par:
            raise LayoutError(f"world size {world_size} is not divisible by tp*pp = {self.tp}*{self.pp}")
        dp = world_size // model_par
        checks = [
            (arch.num_attention_heads % self.tp, f"num_attention_heads={arch.num_attention_heads} not divisible by tp={self.tp}"),
            (arch.num_key_value_heads % self.tp, f"num_key_value_heads={arch.num_key_value_heads} not divisible by tp={self.tp}"),
            (arch.ffn_hidden_size % self.tp, f"intermediate_size={arch.ffn_hidden_size} not divisible by tp={self.tp}"),
            (arch.num_layers % self.pp, f"num_hidden_layers={arch.num_layers} not divisible by pp={self.pp}"),
        ]
        if arch.is_moe:
            expert_world = self.ep * self.expert_tp
            checks += [
                (arch.num_experts % self.ep, f"num_experts={arch.num_experts} not divisible by ep={self.ep}"),
                (arch.moe_ffn_hidden_size % self.expert_tp, f"moe_intermediate_size={arch.moe_ffn_hidden_size} not divisible by etp={self.expert_tp}"),
                ((dp * self.tp) % expert_world, f"ep*etp={expert_world} must divide dp*tp={dp * self.tp} (world {world_size}, pp {self.pp})"),
            ]
        elif self.ep > 1 or (self.etp or 1) > 1:
            checks.append((1, f"ep={self.ep}/etp={self.etp} set for dense model {arch.model_type}: expert parallelism needs experts"))
        for failed, message in checks:
            if failed:
                raise LayoutError(f"layout tp={self.tp} pp={self.pp} ep={self.ep} etp={self.expert_tp}: {message}")

    def effective_sequence_parallel(self, arch: ModelArch) -> bool:
        # Megatron refuses MoE training with TP>1 unless sequence parallel is on.
        return self.sequence_parallel or (arch.is_moe and self.tp > 1)


def init_parallel(parallel: ParallelConfig, arch: ModelArch, *, seed: int = 1234) -> None:
    """Initialise torch.distributed (from torchrun env vars, or a single local rank) and
    Megatron's process groups for ``parallel``. On CPU this first applies the compatibility
    layer and uses gloo; on GPU it uses NCCL and never touches the compatibility layer."""
    import torch.distributed as dist

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from megatron_marsrl.megatron import cpu_compat

        cpu_compat.apply()
    else:
        torch.cuda.set_device(local_cuda_device())
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        dist.init_process_group("gloo" if on_cpu else "nccl", rank=rank, world_size=world,
                                timeout=timedelta(minutes=10))
    parallel.validate(arch, dist.get_world_size())
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def gather_data_parallel(value):
    """``value`` (any picklable object) from every data-parallel rank of this rank's group, in
    data-parallel rank order; every rank gets the list."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    parts = [None] * ps.get_data_parallel_world_size()
    dist.all_gather_object(parts, value, group=ps.get_data_parallel_group())
    return parts


def sum_data_parallel(values) -> list[float]:
    """The element-wise sum of ``values`` (numbers) over this rank's data-parallel group, on every
    rank: one all-reduce of a float64 tensor, not the two collectives and pickling of
    `gather_data_parallel`."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    total = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return total.tolist()


def local_cuda_device() -> int:
    """The CUDA device of this rank: LOCAL_RANK (set by torchrun and by ``launch``; 0 when
    absent). Raises LayoutError when the node has fewer visible devices than local ranks, where
    NCCL would otherwise fail later with a less helpful message."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise LayoutError(f"LOCAL_RANK={local_rank} but this node has {count} visible CUDA device(s): launch at most "
                          f"{count} rank(s) per node, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU")
    return local_rank
