"""`marsrl train --dry-run`: check a resolved `TrainConfig` against a cluster without a GPU.

Reads the model architecture (model.path/config.json when it exists, else model.arch, or the
embedded task's tiny model), validates the parallel layout and the engine placement for
nodes x gpus_per_node ranks, and estimates per-GPU memory with
`megatron_marsrl.megatron.memory`. Nothing is built or started: no Megatron initialisation,
no engine, no checkpoint read beyond config.json.

How this trainer maps onto the estimate, and why the verdict adds a third figure:
  * SGLang servers ("sglang_server") start on every node (each node's first rank starts its
    node's), the in-process "sglang" engines on the first node only. Colocated, each engine rank
    sits next to a trainer rank, and the per-GPU figures are those of an engine GPU, the
    fullest. Split (engine.placement=split), each node's GPUs 0..base_gpu_id-1 train and the
    engines have the rest: the trainer's figures are those of a train-only GPU, and an
    engine-only GPU is counted on its own line (weights, the KV pool, runtime and context).
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
from megatron_marsrl.megatron.memory import (GIB, ColocatedRollout, MemoryBudgetError, MemoryConfig, MemoryEstimate,
                                             check_fits, engine_weights_gib, estimate_memory, format_report,
                                             kv_bytes_per_token, static_pool_gib)
from megatron_marsrl.megatron.parallel import LayoutError
from megatron_marsrl.rl.config import TrainConfig
from megatron_marsrl.rl.projection import format_table, project
from megatron_marsrl.net import is_loopback

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


def _check_engine_placement(config: TrainConfig, nodes: int, gpus_per_node: int) -> list[str]:
    """Raise LayoutError when the engines do not fit a node; describe where they start otherwise."""
    eng = config.engine
    if eng.kind not in GPU_ENGINES:
        return [f"engine {eng.kind!r}: not on the GPUs, outside this estimate"]
    policies = len(config.policy_names())
    end = eng.base_gpu_id + eng.num_engines * eng.tp_size * policies
    if end > gpus_per_node:
        raise LayoutError(f"engine: {eng.num_engines} engine(s) x tp_size {eng.tp_size}"
                          f"{f' x {policies} policies' if policies > 1 else ''} from GPU {eng.base_gpu_id} need "
                          f"GPUs {eng.base_gpu_id}..{end - 1} of a node, which has {gpus_per_node}")
    if eng.tp_size % eng.ep_size or eng.tp_size % eng.dp_size:
        raise LayoutError(f"engine: ep_size={eng.ep_size} and dp_size={eng.dp_size} must divide tp_size={eng.tp_size}")
    if eng.placement == "split" and eng.base_gpu_id < 1:
        raise LayoutError("engine.placement=split with engine.base_gpu_id=0 leaves no GPU of a node to train: each "
                          "node's GPUs 0..base_gpu_id-1 train, the engines take the GPUs from base_gpu_id on")
    engines = f"{eng.num_engines} x TP{eng.tp_size}{f' per policy' if policies > 1 else ''} on GPUs " \
              f"{eng.base_gpu_id}..{end - 1}"
    if not eng.on_every_node:
        return [f"engine {eng.kind}: {engines} of the first node (in-process engines live in rank 0's process; the "
                "other nodes' GPUs train only)"]
    lines = [f"engine sglang_server: {engines} of each of the {nodes} node(s), {nodes * eng.num_engines} engine(s) "
             "per policy in all (each node's first rank starts its node's)"]
    if eng.placement == "split":
        lines[0] += (f"; split: GPUs 0..{eng.base_gpu_id - 1} of each node train (torchrun --nproc-per-node "
                     f"{eng.base_gpu_id}), the engines take weights by broadcast")
    if nodes > 1 and is_loopback(eng.host):
        lines.append("note: rank 0 reaches the other nodes' engines over the network: launch with "
                     "engine.host=0.0.0.0 and the same secret in MARSRL_SGLANG_API_KEY on every node")
    return lines


def _engine_only_gib(config: TrainConfig, arch: ModelArch, gpu_memory_gib: float) -> tuple[float, int]:
    """Per-GPU memory of an engine-only GPU (split placement) and its KV pool in tokens: weights,
    the pool (max_total_tokens, capped by what mem_fraction_static leaves), runtime and context."""
    eng = config.engine
    rollout = ColocatedRollout.of_engine(eng, kv_cache_tokens=eng.max_total_tokens)
    weights, per_token = engine_weights_gib(arch, rollout), kv_bytes_per_token(arch, rollout) / GIB
    tokens = eng.max_total_tokens
    if eng.mem_fraction_static is not None:  # the GPU is the engine's alone
        by_fraction = ColocatedRollout.of_engine(eng, mem_fraction_static=eng.mem_fraction_static)
        tokens = min(tokens, int(static_pool_gib(arch, by_fraction, gpu_memory_gib) / per_token))
    return weights + tokens * per_token + rollout.runtime_gib + rollout.context_gib, tokens


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
    if eng.kind in GPU_ENGINES and eng.placement == "colocated":
        if kv_cache_tokens is None and eng.mem_fraction_static is None:
            kv_cache_tokens = eng.max_total_tokens
        rollout = ColocatedRollout.of_engine(eng, kv_cache_tokens=kv_cache_tokens,
                                             mem_fraction_static=None if kv_cache_tokens else eng.mem_fraction_static)
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
    arch, source = model_arch(config)
    placement = _check_engine_placement(config, nodes, gpus_per_node)
    eng = config.engine
    split = eng.kind in GPU_ENGINES and eng.placement == "split"
    world = nodes * (eng.base_gpu_id if split else gpus_per_node)  # the trainer's ranks
    est = estimate(config, arch, world)
    policies = len(config.policy_names())
    lines = [f"model: {source}", f"world: {nodes} node(s) x {gpus_per_node} GPUs = {nodes * gpus_per_node}"
             + (f", {world} of them train" if split else ""), *placement, format_report(est)]
    problems = []
    try:
        check_fits(est)
    except MemoryBudgetError as exc:
        problems.append(str(exc))
    peak = est.peak_gib
    if split:
        engine_gib, tokens = _engine_only_gib(config, arch, est.gpu_memory_gib)
        lines.append(f"engine-only GPUs (split): {engine_gib:.2f} GiB per GPU, KV pool {tokens} tokens per engine, "
                     f"headroom {est.gpu_memory_gib - engine_gib:.2f}")
        if engine_gib > est.usable_gib:
            problems.append(f"an engine-only GPU needs {engine_gib:.1f} GiB, more than the {est.usable_text}: lower "
                            "engine.max_total_tokens or engine.mem_fraction_static, or widen engine.tp_size")
        peak = max(peak, engine_gib)
    elif est.colocated and config.pipeline.time_shared:
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
    if with_projection and eng.kind in GPU_ENGINES:
        lines.append(format_table(_projection(config, arch, nodes, gpus_per_node, est, peak)))
    peak = max(peak, est.peak_gib)
    return DryRun(report="\n".join(lines), peak_gib=peak, headroom_gib=est.gpu_memory_gib - peak,
                  reserve_gib=est.reserve_gib, problems=problems)


def _projection(config: TrainConfig, arch: ModelArch, nodes: int, gpus_per_node: int, est: MemoryEstimate,
                peak: float):
    """The projection's table; its first row is the config's engines colocated and resident on the
    whole cluster, whatever this config chose (reusing the dry run's own estimate when it is that)."""
    world = nodes * gpus_per_node
    resident_config = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, placement="colocated", base_gpu_id=0),
        pipeline=dataclasses.replace(config.pipeline, time_shared=False))
    if resident_config != config:
        est = estimate(resident_config, arch, world)
        peak = train_and_generate_gib(est, len(config.policy_names()))
    return project(config, arch, memory_config(resident_config, arch, world, kv_cache_tokens=1), est, peak,
                   nodes=nodes)
