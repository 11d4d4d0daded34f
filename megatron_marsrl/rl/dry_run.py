"""`marsrl train --dry-run`: check a resolved `TrainConfig` against a cluster without a GPU.

Reads the model architecture (model.path/config.json when it exists, else model.arch, or the
embedded task's tiny model), validates the parallel layout and the engine placement for
nodes x gpus_per_node ranks, and estimates per-GPU memory with
`megatron_marsrl.megatron.memory`. Nothing is built or started: no Megatron initialisation,
no engine, no checkpoint read beyond config.json.

How this trainer maps onto the estimate, and why the verdict adds a third figure:
  * SGLang engines ("sglang", "sglang_server") start on the first node only (rank 0's
    RolloutSide), each engine rank next to a trainer rank; other GPUs only train. The per-GPU
    figures are those of an engine GPU, the fullest.
  * By default the trainer does not release the engines' memory while it trains, and trains
    while they generate (scheduler.overlap), so the engines' weights, KV pool and runtime stay
    resident during the train phase. The binding figure is then "train + generate at once":
    the rollout phase plus the train phase's transient memory (activations, logits, buffers).
    memory.py's two-phase peak (engines released during training) is printed as well, and it
    is the binding one with pipeline.time_shared (the trainer offloaded during rollout, the
    engines released during training: rl/time_share.py).
  * The train phase's activations and logits are those of the largest micro-batch, counted as
    the scheduler counts it: the sum of its sequences' lengths (the trainer packs them into one
    row; rl/scheduler.micro_batch_tokens), at most scheduler.token_budget, or one longer
    sequence alone (SchedulerConfig.max_micro_batch_tokens), rounded up to a multiple of TP
    under sequence parallel as the trainer pads the row. The longest sequence is taken as
    rollout.sampling.max_tokens: prompts have no configured bound, so a budget with a prompt
    allowance (as the Qwen3 recipes set) is what covers them.
  * A plan fits when it leaves memory.py's reserve free (6 GiB of an 80 GiB GPU), the binding
    "train + generate at once" figure included.
  * SGLang's pool is the smaller of what mem_fraction_static leaves and engine.max_total_tokens.
  * engine.quantization="fp8" halves the engine's weights (FP8 scales ignored).
  * policy.sharing="per_role": each policy has its own trainer state and its own engines on
    the same GPUs; training runs one policy at a time (one set of activations).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_marsrl import gguf
from megatron_marsrl.megatron.hf_config import ModelArch
from megatron_marsrl.megatron.memory import (ColocatedRollout, MemoryBudgetError, MemoryConfig, MemoryEstimate,
                                             check_fits, estimate_memory, format_report)
from megatron_marsrl.megatron.parallel import LayoutError
from megatron_marsrl.rl.config import TrainConfig
from megatron_marsrl.rl.projection import format_table, project

GPU_ENGINES = ("sglang", "sglang_server")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DryRun:
    """What `plan` found."""

    report: str
    """format_report of the estimate plus the lines this module adds."""
    peak_gib: float
    """The binding per-GPU peak (train + generate at once when engines share the GPUs)."""
    headroom_gib: float
    """GPU memory left free at that peak."""
    reserve_gib: float
    """The least headroom a plan must leave (memory.py's reserve)."""
    problems: list[str]
    """Why the plan does not fit; empty when it does."""

    @property
    def verdict(self) -> str:
        if self.problems:
            return f"verdict: does NOT fit ({len(self.problems)} problem(s), see the error below)"
        return (f"verdict: fits, peak {self.peak_gib:.1f} GiB per GPU, headroom {self.headroom_gib:.1f} "
                f"(at least {self.reserve_gib:.1f} required)")


def model_arch(config: TrainConfig) -> tuple[ModelArch, str]:
    """The architecture the run would train, and where it was read from."""
    path = config.model.path
    if path == "task":
        return _task_arch(config), f"task {config.task.name!r} tiny model (not built)"
    if gguf.is_gguf(path):
        return ModelArch.from_hf_dict(gguf.read_gguf_config(path), source=path), f"{path} (GGUF metadata)"
    cfg_file = Path(path) / "config.json"
    if cfg_file.is_file():
        return ModelArch.from_hf_dir(path), str(cfg_file)
    if config.model.arch:
        return ModelArch.from_hf_dict(config.model.arch, source="model.arch"), \
            f"model.arch (no {cfg_file} here)"
    raise FileNotFoundError(f"model.path={path!r} has no config.json and the config embeds no model.arch: "
                            "give a local HF checkpoint directory or model.arch={...config.json values...}")


def _task_arch(config: TrainConfig) -> ModelArch:
    # What agents.arithmetic.build_model would write, without writing it: the tiny Qwen3-MoE
    # family, the task's vocabulary and context, then the run's task.tiny_model overrides.
    from megatron_marsrl.agents import arithmetic
    from megatron_marsrl.megatron.tiny import FAMILIES

    if config.task.name != "arithmetic":
        raise ValueError(f"model.path='task' needs task.name='arithmetic', not {config.task.name!r}")
    hf = {"model_type": "qwen3_moe", **FAMILIES["qwen3_moe"], "vocab_size": arithmetic.MODEL_VOCAB,
          "max_position_embeddings": 256, **config.task.tiny_model}
    return ModelArch.from_hf_dict(hf, source="task.tiny_model")


def _check_engine_placement(config: TrainConfig, gpus_per_node: int) -> str:
    """Raise LayoutError when the engines do not fit the first node; describe them otherwise."""
    eng = config.engine
    if eng.kind not in GPU_ENGINES:
        return f"engine {eng.kind!r}: not on the GPUs, outside this estimate"
    end = eng.base_gpu_id + eng.num_engines * eng.tp_size
    if end > gpus_per_node:
        raise LayoutError(f"engine: {eng.num_engines} engine(s) x tp_size {eng.tp_size} from GPU {eng.base_gpu_id} "
                          f"need GPUs {eng.base_gpu_id}..{end - 1} of the first node, which has {gpus_per_node}")
    if eng.tp_size % eng.ep_size or eng.tp_size % eng.dp_size:
        raise LayoutError(f"engine: ep_size={eng.ep_size} and dp_size={eng.dp_size} must divide tp_size={eng.tp_size}")
    return (f"engine {eng.kind}: {eng.num_engines} x TP{eng.tp_size} on GPUs {eng.base_gpu_id}..{end - 1} of the "
            f"first node (the trainer starts engines there only; the other GPUs train only)")


def _micro_batch_tokens(config: TrainConfig, arch: ModelArch) -> int:
    """Tokens of the largest micro-batch the scheduler can release (module docstring), rounded
    up to a multiple of TP under sequence parallel, as the trainer pads its packed row."""
    tokens = config.scheduler.max_micro_batch_tokens(config.rollout.sampling.max_tokens)
    multiple = config.parallel.tp if config.parallel.effective_sequence_parallel(arch) else 1
    return -(-tokens // multiple) * multiple


def memory_config(config: TrainConfig, arch: ModelArch, world_size: int, *,
                  kv_cache_tokens: int | None = None) -> MemoryConfig:
    """The estimate's inputs for `config` on `world_size` GPUs (kv_cache_tokens: a pool size that
    replaces mem_fraction_static, for SGLang's max_total_tokens cap)."""
    eng = config.engine
    rollout = None
    if eng.kind in GPU_ENGINES:
        if kv_cache_tokens is None and eng.mem_fraction_static is None:
            kv_cache_tokens = eng.max_total_tokens
        rollout = ColocatedRollout(engine_tp=eng.tp_size, kv_cache_tokens=kv_cache_tokens,
                                   mem_fraction_static=None if kv_cache_tokens else eng.mem_fraction_static,
                                   weight_bytes=1.0 if eng.quantization == "fp8" else 2.0)
    fp32 = config.model.dtype == "float32"
    return MemoryConfig(world_size=world_size, micro_batch_tokens=_micro_batch_tokens(config, arch),
                        param_bytes=4 if fp32 else 2, grad_bytes=4 if fp32 or config.optim.grad_reduce_in_fp32 else 2,
                        optimizer_offload_fraction=config.optim.cpu_offload_fraction,
                        offload_trainer_in_rollout=config.pipeline.time_shared, rollout=rollout)


def estimate(config: TrainConfig, arch: ModelArch, world_size: int) -> MemoryEstimate:
    """memory.estimate_memory for `config`, with SGLang's max_total_tokens cap applied."""
    est = estimate_memory(arch, config.parallel, memory_config(config, arch, world_size))
    eng = config.engine
    if est.colocated and eng.mem_fraction_static is not None and est.kv_cache_tokens > eng.max_total_tokens:
        capped = memory_config(config, arch, world_size, kv_cache_tokens=eng.max_total_tokens)
        est = estimate_memory(arch, config.parallel, capped)
    return est


def train_and_generate_gib(est: MemoryEstimate, policies: int = 1) -> float:
    """Per-GPU memory while training runs next to resident, generating engines."""
    state = est.params_gib + est.grads_gib + est.optimizer_gib
    engine = est.engine_weights_gib + est.kv_cache_gib + est.engine_other_gib
    transient = est.activations_gib + est.logits_gib + est.buffers_gib
    return est.framework_gib + policies * (state + engine) + transient


def plan(config: TrainConfig, *, nodes: int, gpus_per_node: int, with_projection: bool = False) -> DryRun:
    """Validate `config` on nodes x gpus_per_node GPUs and estimate its per-GPU memory; with
    `with_projection` (what `marsrl train --dry-run` does; ~10-40 s of simulation), add the
    projected step time of every mode x placement (rl/projection.py) for SGLang engines on the
    GPUs. Raises LayoutError (a ValueError) for layouts that cannot run at all."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"--nodes={nodes}, GPUs per node={gpus_per_node}: both must be >= 1")
    world = nodes * gpus_per_node
    arch, source = model_arch(config)
    placement = _check_engine_placement(config, gpus_per_node)
    est = estimate(config, arch, world)
    policies = len(config.policy_names())
    lines = [f"model: {source}", f"world: {nodes} node(s) x {gpus_per_node} GPUs = {world}", placement,
             format_report(est)]
    problems = []
    try:
        check_fits(est)
    except MemoryBudgetError as exc:
        problems.append(str(exc))
    peak = est.peak_gib
    if est.colocated and config.pipeline.time_shared:
        lines.append("time-shared (pipeline.time_shared): the trainer's state is in host memory while the engines "
                     "generate and the engines release theirs while it trains, so the peak is the larger phase")
    elif est.colocated:
        peak = train_and_generate_gib(est, policies)
        per = f" ({policies} policies, each with its own state and engines)" if policies > 1 else ""
        lines.append(f"train + generate at once (engines stay resident){per}: {peak:.2f} GiB, "
                     f"headroom {est.gpu_memory_gib - peak:.2f}")
        if peak > est.usable_gib:
            problems.append(f"training next to resident SGLang engines needs {peak:.1f} GiB per GPU, more than the "
                            f"{est.usable_text}; the trainer does not release engine memory while it trains: "
                            "lower engine.mem_fraction_static or engine.max_total_tokens, or the token budget, "
                            "or set pipeline.time_shared=true")
    if est.colocated:
        longest = config.rollout.sampling.max_tokens
        if 0 < est.kv_cache_tokens < longest:
            problems.append(f"the SGLang KV pool ({est.kv_cache_tokens} tokens per engine) is smaller than one "
                            f"max-length output (rollout.sampling.max_tokens={longest})")
        if with_projection:
            # the projection's first row is the resident placement, whatever this config chose
            resident = est if not config.pipeline.time_shared else estimate(
                dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, time_shared=False)),
                arch, world)
            resident_peak = peak if resident is est else train_and_generate_gib(resident, policies)
            lines.append(format_table(project(config, arch, memory_config(config, arch, world, kv_cache_tokens=1),
                                              resident, resident_peak)))
    peak = max(peak, est.peak_gib)
    return DryRun(report="\n".join(lines), peak_gib=peak, headroom_gib=est.gpu_memory_gib - peak,
                  reserve_gib=est.reserve_gib, problems=problems)
