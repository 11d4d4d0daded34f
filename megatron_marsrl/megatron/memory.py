"""Per-GPU memory estimate of one training layout with colocated SGLang rollout engines.

Pure arithmetic over ``ModelArch`` and ``ParallelConfig``: no GPU, no Megatron import.
Two phases share each GPU. In the train phase SGLang has released its weights, KV cache and
CUDA graphs (``release_memory_occupation``, which needs servers started with the memory
saver) and keeps only its process context; in the rollout phase the trainer keeps whatever it
does not offload. The peak is the larger phase. This is the model of a trainer that releases
its engines around training (``pipeline.time_shared``, rl/time_share.py); without it the
engines stay resident and ``rl/dry_run.py`` adds the figure that binds (training next to
resident engines).

Train phase, per GPU, on the worst pipeline stage (the first holds ``pp`` micro-batches in
flight under 1F1B, the last holds the logits):

* parameters: bf16. Dense weights (attention, dense MLP, embeddings) are split over TP and
  PP; norms and the router are replicated over TP; experts are split over EP x ETP (and PP).
* gradients: main-grad buffers, fp32 (``optim.grad_reduce_in_fp32``, the default) or in the
  parameter dtype, one per local parameter; the distributed optimizer does not shard them.
* optimizer: fp32 main params + Adam m and v (12 B/param; 8 B when params are fp32), sharded
  over DP x CP for dense and over expert-DP = world / (EP x ETP x PP) for expert weights by
  the distributed optimizer; a fraction of it may live in host memory (CPU offload).
* activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models" (sbh(34/t + 5as/(ht)) bytes per layer under TP+SP), re-derived for this
  model family. Bf16 elements saved per token and layer, t = TP, p = TP if sequence parallel
  else 1, etp = expert TP:
    norms        4h/p            inputs and outputs of the two RMSNorms (no dropout masks)
    attention    (2nq + 3nkv)d/t q, k (after RoPE) and v, plus q and k before their qk-norm;
                 + nq d/t        the attention output (linear_proj input)
                 + 2nq/t         flash-attention softmax statistics (fp32) -- the 5as^2b
                                 score/softmax term of the paper does not exist with flash
                                 attention, and selective (core-attention) recompute drops
                                 only these statistics
    dense MLP    3F/t            SwiGLU gate|up output and its product (fc2 input)
    MoE          4E/p            fp32 router logits and probabilities
                 + k etp/p (2h + 3Fm/etp)   per routed copy: the expert input, its gate|up
                                 output and product, and the expert output (kept for the
                                 gradient of the routing weight); EP moves tokens, it does
                                 not reduce them: each GPU receives ~k copies of its tokens
  Full recompute keeps only each layer's input, h/p. Every term is per token of the GPU's
  share, micro_batch_tokens / CP.
* buffers (transient, one at a time): logits of a micro-batch on the last stage,
  T/CP x vocab/TP x LOGIT_COPIES x the parameter bytes (the logits, kept for backward, and
  their gradient, plus one layout copy: Megatron's [s, b] -> [b, s] transpose in forward, its
  gradient's in backward), plus the fp32 temporaries of one chunk of forward.token_stats
  (LOGIT_CHUNK_ELEMENTS x 4 B x LOGIT_CHUNK_TEMPORARIES; no full fp32 copy of the logits
  exists); the MoE all-to-all send and receive
  buffers (2 x routed copies x h, bf16); one layer's activations as the backward working set
  (two with full recompute: the recomputed forward and its gradients); CP ring K/V chunks.

Rollout phase: SGLang weights split over the engine's TP (KV heads replicated beyond their
count), KV cache (2 x layers x KV heads per GPU x head_dim per token), engine runtime and
context, plus the trainer's state unless offloaded. With ``mem_fraction_static`` SGLang's KV
pool is f x GPU minus all memory in use when it starts (its weights included): this assumes
the trainer already holds its rollout-phase residency then.
Not modelled: interleaved pipeline schedules, FP8 training, a reference model, activation
offload; fewer micro-batches than PP stages (the estimate assumes at least PP). What the model
misses in the allocator, NCCL and the engine processes is covered by a reserve instead:
``check_fits`` requires ``reserve_fraction`` of the GPU (6 GiB of 80) to stay free.
"""
from __future__ import annotations

import dataclasses
import math

from megatron_marsrl.megatron.hf_config import ModelArch
from megatron_marsrl.megatron.hf_mapping import padded_vocab_size
from megatron_marsrl.megatron.parallel import LayoutError, ParallelConfig

GIB = 2**30
LOGIT_COPIES = 3
"""Logit-sized tensors in the parameter dtype at the peak of the loss path (module docstring)."""
LOGIT_CHUNK_ELEMENTS = 2**24
"""Logit elements per chunk of forward.token_stats (64 MiB per fp32 temporary)."""
LOGIT_CHUNK_TEMPORARIES = 4
"""fp32 chunk-sized tensors alive at once in token_stats (the chunk, its shifted and
exponentiated copies, one product)."""


class MemoryBudgetError(ValueError):
    """The estimated peak does not fit in GPU memory."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColocatedRollout:
    """SGLang engines sharing the training GPUs (one engine rank per GPU)."""

    engine_tp: int
    """Tensor-parallel size of each engine; world_size / engine_tp engines."""
    mem_fraction_static: float | None = None
    """SGLang's mem_fraction_static: weights + KV pool (+ what is already resident) take this
    fraction of GPU memory. Give this or kv_cache_tokens."""
    kv_cache_tokens: int | None = None
    """Explicit KV pool size in tokens per engine (SGLang max_total_tokens)."""
    weight_bytes: float = 2.0
    """Bytes per engine weight: 2 for bf16, 1 for FP8 rollout (scales ignored)."""
    kv_bytes: float = 2.0
    """Bytes per KV-cache element: 2 for bf16, 1 for an FP8 KV cache."""
    runtime_gib: float = 4.0
    """Engine memory outside its static pool: CUDA graphs, forward activations, sampling."""
    context_gib: float = 1.0
    """What a released engine still holds: its CUDA context and NCCL communicators."""

    def __post_init__(self):
        if (self.mem_fraction_static is None) == (self.kv_cache_tokens is None):
            raise LayoutError("give exactly one of mem_fraction_static and kv_cache_tokens")
        if self.engine_tp < 1 or (self.kv_cache_tokens is not None and self.kv_cache_tokens < 1):
            raise LayoutError(f"engine_tp={self.engine_tp}, kv_cache_tokens={self.kv_cache_tokens}: must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise LayoutError(f"mem_fraction_static={self.mem_fraction_static}: must be in (0, 1)")

    @classmethod
    def of_engine(cls, engine, *, kv_cache_tokens: int | None = None,
                  mem_fraction_static: float | None = None) -> ColocatedRollout:
        """The engines of an engine config (`rollout.factory.RolloutEngineConfig`: its TP, and
        one byte per weight under FP8 rollout) with the pool given (one of the two)."""
        return cls(engine_tp=engine.tp_size, kv_cache_tokens=kv_cache_tokens, mem_fraction_static=mem_fraction_static,
                   weight_bytes=1.0 if engine.quantization == "fp8" else 2.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """What the memory estimate needs beyond the model and the parallel layout."""

    world_size: int
    """Number of GPUs training the policy (and hosting its engines when colocated)."""
    micro_batch_tokens: int
    """Tokens of the largest micro-batch one model replica runs, padding included: the trainer
    packs its sequences into one row, so they take the sum of their lengths (the budget the RL
    scheduler packs to), padded to a multiple of TP under sequence parallel. Each CP rank
    holds micro_batch_tokens / cp of them.
    ParallelConfig.micro_batch_size is not used."""
    cp: int = 1
    """Context-parallel size: every sequence is split over cp ranks (ring attention)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU (H100-80GB: 80; nvidia-smi reports 79.6 of it as usable)."""
    param_bytes: int = 2
    """Bytes per model parameter: 2 for bf16 training, 4 for fp32."""
    grad_bytes: int = 4
    """Bytes per gradient element: 4 with fp32 grad buffers (optim.grad_reduce_in_fp32, the
    default), 2 with bf16 ones."""
    optimizer_offload_fraction: float = 0.0
    """Fraction of optimizer state (main params and moments) kept in host memory (Megatron
    optimizer_cpu_offload; requires the distributed optimizer)."""
    offload_trainer_in_rollout: bool = False
    """Move the trainer's parameters, gradients and optimizer state to host memory while the
    engines generate; False keeps them on the GPU in the rollout phase."""
    framework_gib: float = 2.5
    """Trainer process overhead: CUDA context, NCCL communicators, cuBLAS workspaces and
    allocator fragmentation (typically 2-4 GiB)."""
    reserve_fraction: float = 0.075
    """Share of GPU memory a plan must leave free (6 GiB of 80): what the estimate cannot see
    (fragmentation of the caching allocator under varying micro-batch shapes, NCCL buffers of
    the MoE all-to-all and the weight-sync broadcast, the CUDA/IPC contexts of the engine
    processes) grows with what is allocated, so it scales with the GPU."""
    rollout: ColocatedRollout | None = None
    """Colocated SGLang engines; None for training alone."""

    def __post_init__(self):
        for name in ("world_size", "micro_batch_tokens", "cp", "param_bytes", "grad_bytes"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)}: must be >= 1")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise LayoutError(f"optimizer_offload_fraction={self.optimizer_offload_fraction}: must be in [0, 1]")
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise LayoutError(f"reserve_fraction={self.reserve_fraction}: must be in [0, 1)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamCounts:
    """Whole-model parameter counts (as HF counts them: tied embeddings once)."""

    total: int
    """All parameters."""
    active: int
    """Parameters one token uses: all but the experts it is not routed to."""
    expert: int
    """Parameters of all routed experts."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Per-GPU memory of one layout, in GiB unless named otherwise."""

    model: str
    """Model family and size, for the report header."""
    layout: str
    """The layout in one line, for the report header."""
    stage: int
    """Pipeline stage the train-phase figures belong to (the worst one)."""
    dense_params: int
    """Non-expert parameters held by one GPU of that stage."""
    expert_params: int
    """Expert parameters held by one GPU of that stage."""
    params_gib: float
    """Trainer parameters."""
    grads_gib: float
    """Trainer gradient buffers."""
    optimizer_gib: float
    """Optimizer state on the GPU (main params + moments, after sharding and offload)."""
    activations_gib: float
    """Activations saved for backward over all micro-batches in flight."""
    logits_gib: float
    """Logits and softmax of one micro-batch (last stage only)."""
    buffers_gib: float
    """Other transient buffers: MoE all-to-all, backward working set, CP ring chunks."""
    framework_gib: float
    """Trainer CUDA context, NCCL, workspaces, fragmentation."""
    engine_released_gib: float
    """What released SGLang engines keep during training (their context); 0 without them."""
    train_gib: float
    """Train-phase total."""
    colocated: bool
    """Whether SGLang engines share the GPUs."""
    trainer_resident_gib: float = 0.0
    """Trainer state left on the GPU during rollout."""
    engine_weights_gib: float = 0.0
    """SGLang weights per GPU."""
    kv_cache_gib: float = 0.0
    """SGLang KV pool per GPU."""
    kv_cache_tokens: int = 0
    """Tokens the KV pool of one engine holds (0: the static budget leaves no room)."""
    engine_other_gib: float = 0.0
    """SGLang runtime (CUDA graphs, activations) and process context."""
    rollout_gib: float = 0.0
    """Rollout-phase total."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU."""
    reserve_gib: float = 0.0
    """Memory a plan must leave free (MemoryConfig.reserve_fraction of the GPU)."""

    @property
    def peak_gib(self) -> float:
        return max(self.train_gib, self.rollout_gib)

    @property
    def headroom_gib(self) -> float:
        return self.gpu_memory_gib - self.peak_gib

    @property
    def usable_gib(self) -> float:
        """What a plan may use: the GPU less the reserve."""
        return self.gpu_memory_gib - self.reserve_gib

    @property
    def usable_text(self) -> str:
        """'74.0 GiB usable (80.0 less a 6.0 GiB reserve)', for messages about the limit."""
        return f"{self.usable_gib:.1f} GiB usable ({self.gpu_memory_gib:.1f} less a {self.reserve_gib:.1f} GiB reserve)"


def _layer_params(arch: ModelArch, moe: bool) -> tuple[int, int, int]:
    """(TP-split, TP-replicated, expert) parameters of one decoder layer."""
    h, d = arch.hidden_size, arch.head_dim
    attn = h * (arch.num_attention_heads + 2 * arch.num_key_value_heads) * d + arch.num_attention_heads * d * h
    replicated = 2 * h + (2 * d if arch.qk_norm else 0)
    if moe:
        return attn, replicated + h * arch.num_experts, arch.num_experts * 3 * h * arch.moe_ffn_hidden_size
    return attn + 3 * h * arch.ffn_hidden_size, replicated, 0


def _is_moe(arch: ModelArch, layer: int) -> bool:
    return arch.is_moe and arch.layer_is_moe(layer)


def count_params(arch: ModelArch) -> ParamCounts:
    """Parameter counts of the whole model, matching transformers' ``numel`` sums."""
    embed = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    total, expert, active = embed + arch.hidden_size, 0, embed + arch.hidden_size
    for layer in range(arch.num_layers):
        split, repl, exp = _layer_params(arch, _is_moe(arch, layer))
        total, expert = total + split + repl + exp, expert + exp
        active += split + repl + (exp * arch.moe_topk // arch.num_experts if exp else 0)
    return ParamCounts(total=total, active=active, expert=expert)


def model_flops_per_token(arch: ModelArch, *, seq_len: float, causal: bool = True) -> float:
    """Training FLOPs (forward + backward) per token, for MFU.

    6 x N + 12 x L x nq x d x seq_len (x 1/2 when causal). N counts the matmul weights one
    token uses: attention projections, the router and only its top-k routed experts (or the
    dense MLP), and the output layer (tied or not); the embedding lookup and norms do no
    matmuls. The second term is QK^T and PV: 2 x 2 x s x nq x d forward per layer, times 3 for
    forward + backward, halved by the causal mask. ``seq_len`` is the attended length; for
    packed sequences of lengths s_i pass sum(s_i^2) / sum(s_i).
    """
    n = arch.vocab_size * arch.hidden_size
    for layer in range(arch.num_layers):
        split, _, exp = _layer_params(arch, _is_moe(arch, layer))
        n += split + (arch.hidden_size * arch.num_experts + exp * arch.moe_topk // arch.num_experts if exp else 0)
    attn = 12 * arch.num_layers * arch.num_attention_heads * arch.head_dim * seq_len
    return 6.0 * n + attn * (0.5 if causal else 1.0)


def _stage_layers(arch: ModelArch, pp: int, stage: int) -> range:
    per = arch.num_layers // pp
    return range(stage * per, (stage + 1) * per)


def _stage_params(arch: ModelArch, par: ParallelConfig, stage: int) -> tuple[float, int]:
    """(dense, expert) parameters one GPU of ``stage`` holds."""
    vocab_rows = padded_vocab_size(arch.vocab_size, par.tp) // par.tp * arch.hidden_size
    dense = vocab_rows if stage == 0 else 0
    if stage == par.pp - 1:  # output layer (a shared copy when tied and pp > 1) and final norm
        dense += arch.hidden_size + (vocab_rows if par.pp > 1 or not arch.tie_word_embeddings else 0)
    expert = 0
    for layer in _stage_layers(arch, par.pp, stage):
        split, repl, exp = _layer_params(arch, _is_moe(arch, layer))
        dense += split / par.tp + repl
        expert += exp // (par.ep * par.expert_tp)
    return dense, expert


def _layer_activation_elems(arch: ModelArch, moe: bool, par: ParallelConfig, p: int) -> float:
    """Bf16 elements one layer saves for backward per token of this GPU's share (no recompute
    beyond ``par.recompute``); see the module docstring for each term."""
    h, d, t = arch.hidden_size, arch.head_dim, par.tp
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    if par.recompute == "full":
        return h / p
    elems = 4 * h / p + (nq + 2 * nkv) * d / t + nq * d / t
    elems += (nq + nkv) * d / t if arch.qk_norm else 0
    elems += 2 * nq / t if par.recompute != "selective" else 0
    if not moe:
        return elems + 3 * arch.ffn_hidden_size / t
    etp = par.expert_tp
    routed = arch.moe_topk * etp / p * (2 * h + 3 * arch.moe_ffn_hidden_size / etp)
    return elems + 4 * arch.num_experts / p + routed


def _activations(arch: ModelArch, par: ParallelConfig, cfg: MemoryConfig, stage: int) -> tuple[float, float, float]:
    """(saved activations, logits, other buffers) in bytes for one GPU of ``stage``."""
    p = par.tp if par.effective_sequence_parallel(arch) else 1
    tokens = cfg.micro_batch_tokens / cfg.cp
    layers = _stage_layers(arch, par.pp, stage)
    per_mb = sum(_layer_activation_elems(arch, _is_moe(arch, i), par, p) for i in layers)
    last = stage == par.pp - 1
    per_mb += 2 * arch.hidden_size / p if last else 0  # final norm input and output
    saved = 2 * tokens * per_mb * (par.pp - stage)  # 1F1B: pp - stage micro-batches in flight
    no_recompute = dataclasses.replace(par, recompute=None)
    working = max(_layer_activation_elems(arch, _is_moe(arch, i), no_recompute, p) for i in layers)
    buffers = 2 * tokens * working * (2 if par.recompute == "full" else 1)
    if any(_is_moe(arch, i) for i in layers):
        buffers += 4 * tokens * arch.moe_topk * par.expert_tp / p * arch.hidden_size
    if cfg.cp > 1:
        buffers += 2 * 2 * tokens * 2 * arch.num_key_value_heads * arch.head_dim / par.tp
    logits = 0.0
    if last:
        elements = tokens * padded_vocab_size(arch.vocab_size, par.tp) / par.tp
        chunk_temporaries = min(elements, LOGIT_CHUNK_ELEMENTS) * 4 * LOGIT_CHUNK_TEMPORARIES
        logits = elements * LOGIT_COPIES * cfg.param_bytes + chunk_temporaries
    return saved, logits, buffers


def _validate(arch: ModelArch, par: ParallelConfig, cfg: MemoryConfig) -> None:
    par.validate(arch, cfg.world_size)
    if cfg.world_size % (par.tp * par.pp * cfg.cp):
        raise LayoutError(f"world size {cfg.world_size} is not divisible by tp*pp*cp = {par.tp}*{par.pp}*{cfg.cp}")
    multiple = (2 * cfg.cp if cfg.cp > 1 else 1) * (par.tp if par.effective_sequence_parallel(arch) else 1)
    if cfg.micro_batch_tokens % multiple:
        raise LayoutError(f"micro_batch_tokens={cfg.micro_batch_tokens} must be a multiple of {multiple} "
                          "(2*cp load-balanced chunks, times tp under sequence parallel)")
    if cfg.optimizer_offload_fraction > 0 and not par.distributed_optimizer:
        raise LayoutError("optimizer_offload_fraction > 0 needs distributed_optimizer=True "
                          "(Megatron's CPU offload runs in the precision-aware distributed optimizer)")
    eng = cfg.rollout
    if eng is not None:
        tp, heads, kv = eng.engine_tp, arch.num_attention_heads, arch.num_key_value_heads
        if cfg.world_size % tp or heads % tp or (kv % tp and tp % kv):
            raise LayoutError(f"engine_tp={tp} must divide world size {cfg.world_size} and "
                              f"{heads} attention heads, and divide or be a multiple of {kv} KV heads")
        if arch.is_moe and arch.moe_ffn_hidden_size % tp:
            raise LayoutError(f"engine_tp={tp} does not divide moe_intermediate_size={arch.moe_ffn_hidden_size}")


def _train_phase(arch: ModelArch, par: ParallelConfig, cfg: MemoryConfig, stage: int) -> dict:
    dense, expert = _stage_params(arch, par, stage)
    dp = cfg.world_size // (par.tp * par.pp)  # data x context parallel: the dense optimizer shard group
    edp = cfg.world_size // (par.ep * par.expert_tp * par.pp)
    opt_bytes = (4 if cfg.param_bytes < 4 else 0) + 8
    shards = (dp, edp) if par.distributed_optimizer else (1, 1)
    optimizer = opt_bytes * (dense / shards[0] + expert / shards[1]) * (1 - cfg.optimizer_offload_fraction)
    saved, logits, buffers = _activations(arch, par, cfg, stage)
    parts = dict(dense_params=round(dense), expert_params=expert,
                 params_gib=cfg.param_bytes * (dense + expert) / GIB, grads_gib=cfg.grad_bytes * (dense + expert) / GIB,
                 optimizer_gib=optimizer / GIB, activations_gib=saved / GIB, logits_gib=logits / GIB,
                 buffers_gib=buffers / GIB, framework_gib=cfg.framework_gib,
                 engine_released_gib=cfg.rollout.context_gib if cfg.rollout else 0.0)
    parts["train_gib"] = sum(v for k, v in parts.items() if k.endswith("_gib"))
    return parts


def _engine_weights(arch: ModelArch, tp: int) -> float:
    """Parameters one GPU of an SGLang engine holds (KV heads replicated beyond their count)."""
    h, d = arch.hidden_size, arch.head_dim
    kv_per_gpu = math.ceil(arch.num_key_value_heads / tp)
    total = padded_vocab_size(arch.vocab_size, tp) // tp * h * (1 if arch.tie_word_embeddings else 2) + h
    for layer in range(arch.num_layers):
        split, repl, exp = _layer_params(arch, _is_moe(arch, layer))
        kv = 2 * h * arch.num_key_value_heads * d
        total += (split - kv + exp) / tp + 2 * h * kv_per_gpu * d + repl
    return total


def engine_weights_gib(arch: ModelArch, rollout: ColocatedRollout) -> float:
    """SGLang weights on one GPU of an engine."""
    return _engine_weights(arch, rollout.engine_tp) * rollout.weight_bytes / GIB


def kv_bytes_per_token(arch: ModelArch, rollout: ColocatedRollout) -> float:
    """KV-cache bytes one token takes on one GPU of an engine (K and V of every layer, the GPU's
    share of the KV heads, replicated beyond their count)."""
    heads = math.ceil(arch.num_key_value_heads / rollout.engine_tp)
    return 2 * arch.num_layers * heads * arch.head_dim * rollout.kv_bytes


def static_pool_gib(arch: ModelArch, rollout: ColocatedRollout, gpu_memory_gib: float, *,
                    taken_gib: float = 0.0) -> float:
    """SGLang's KV pool under mem_fraction_static: that fraction of the GPU less what is taken
    when the engine sizes it (``taken_gib`` held by others, then the engine's CUDA context and
    weights)."""
    taken = taken_gib + rollout.context_gib + engine_weights_gib(arch, rollout)
    return max(0.0, rollout.mem_fraction_static * gpu_memory_gib - taken)


def _rollout_phase(arch: ModelArch, cfg: MemoryConfig, train: dict) -> dict:
    eng = cfg.rollout
    resident = 0.0 if cfg.offload_trainer_in_rollout else (
        train["params_gib"] + train["grads_gib"] + train["optimizer_gib"])
    weights = engine_weights_gib(arch, eng)
    kv_token = kv_bytes_per_token(arch, eng)
    if eng.kv_cache_tokens is not None:
        kv = eng.kv_cache_tokens * kv_token / GIB
    else:
        kv = static_pool_gib(arch, eng, cfg.gpu_memory_gib, taken_gib=cfg.framework_gib + resident)
    other = eng.runtime_gib + eng.context_gib
    return dict(trainer_resident_gib=resident, engine_weights_gib=weights, kv_cache_gib=kv,
                kv_cache_tokens=int(kv * GIB // kv_token), engine_other_gib=other,
                rollout_gib=cfg.framework_gib + resident + weights + kv + other)


def _layout_line(arch: ModelArch, par: ParallelConfig, cfg: MemoryConfig) -> str:
    dp, edp = cfg.world_size // (par.tp * par.pp * cfg.cp), cfg.world_size // (par.ep * par.expert_tp * par.pp)
    line = (f"{cfg.world_size} GPUs: TP{par.tp} PP{par.pp} EP{par.ep} ETP{par.expert_tp} CP{cfg.cp} DP{dp} "
            f"EDP{edp}, "
            f"SP {'on' if par.effective_sequence_parallel(arch) else 'off'}, recompute {par.recompute or 'none'}, "
            f"{'distributed' if par.distributed_optimizer else 'replicated'} optimizer, "
            f"offload {cfg.optimizer_offload_fraction:.0%}, {cfg.micro_batch_tokens} tokens/micro-batch")
    if cfg.rollout:
        eng = cfg.rollout
        size = (f"mem_fraction_static {eng.mem_fraction_static}" if eng.kv_cache_tokens is None
                else f"{eng.kv_cache_tokens} KV tokens")
        line += (f"; SGLang TP{eng.engine_tp} x {cfg.world_size // eng.engine_tp} engines, {size}, "
                 f"trainer {'offloaded' if cfg.offload_trainer_in_rollout else 'resident'} during rollout")
    return line


def estimate_memory(arch: ModelArch, parallel: ParallelConfig, config: MemoryConfig) -> MemoryEstimate:
    """Per-GPU estimate of ``parallel`` for ``arch``; raises LayoutError (a ValueError) when the
    layout does not divide the model or the world. Fitting is checked by ``check_fits``."""
    _validate(arch, parallel, config)
    stages = sorted({0, parallel.pp - 1})
    trains = {s: _train_phase(arch, parallel, config, s) for s in stages}
    phases = {s: (t, _rollout_phase(arch, config, t) if config.rollout else {}) for s, t in trains.items()}
    # the stage with the highest peak; among equal peaks (the rollout phase) the fuller train phase
    stage = max(stages, key=lambda s: (max(phases[s][0]["train_gib"], phases[s][1].get("rollout_gib", 0.0)),
                                       phases[s][0]["train_gib"]))
    counts = count_params(arch)
    model = f"{arch.model_type} {counts.total / 1e9:.2f}B params ({counts.active / 1e9:.2f}B active)"
    return MemoryEstimate(model=model, layout=_layout_line(arch, parallel, config), stage=stage,
                          colocated=config.rollout is not None, gpu_memory_gib=config.gpu_memory_gib,
                          reserve_gib=config.reserve_fraction * config.gpu_memory_gib,
                          **phases[stage][0], **phases[stage][1])


_TRAIN_HINT = ("try more GPUs for EP/TP/PP, the distributed optimizer, optimizer offload, full recompute "
               "or fewer micro-batch tokens")


def check_fits(estimate: MemoryEstimate) -> None:
    """Raise MemoryBudgetError naming the phase, the overrun and the largest parts. A plan fits
    when its peak leaves the reserve free (``usable_gib``), not merely when it is below the GPU's
    memory: the reserve is what the estimate does not model (``MemoryConfig.reserve_fraction``)."""
    problems = []
    if estimate.peak_gib > estimate.usable_gib:
        phase = "train" if estimate.train_gib >= estimate.rollout_gib else "rollout"
        parts = {"parameters": estimate.params_gib, "gradients": estimate.grads_gib,
                 "optimizer": estimate.optimizer_gib, "activations": estimate.activations_gib,
                 "logits": estimate.logits_gib, "SGLang KV cache": estimate.kv_cache_gib,
                 "SGLang weights": estimate.engine_weights_gib}
        top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3])
        hint = (_TRAIN_HINT if phase == "train" else "lower mem_fraction_static or kv_cache_tokens, offload "
                "the trainer during rollout, or use FP8 engine weights")
        problems.append(f"{phase}-phase peak {estimate.peak_gib:.1f} GiB exceeds the {estimate.usable_text} by "
                        f"{estimate.peak_gib - estimate.usable_gib:.1f} GiB (largest: {top}); {hint}")
    if estimate.colocated and estimate.kv_cache_tokens == 0:
        problems.append("SGLang's static budget does not cover its weights plus what is already resident: "
                        "no room for a KV cache (raise mem_fraction_static or offload the trainer during rollout)")
    if problems:
        raise MemoryBudgetError(f"{estimate.layout}: " + "; ".join(problems))


def format_report(estimate: MemoryEstimate) -> str:
    """A readable per-GPU table of both phases (rollout column only when colocated)."""
    e = estimate
    kept = e.trainer_resident_gib > 0
    rows = [("parameters", e.params_gib, e.params_gib * kept), ("gradients", e.grads_gib, e.grads_gib * kept),
            ("optimizer state", e.optimizer_gib, e.optimizer_gib * kept), ("activations", e.activations_gib, 0.0),
            ("logits", e.logits_gib, 0.0), ("other buffers", e.buffers_gib, 0.0),
            ("trainer CUDA/NCCL", e.framework_gib, e.framework_gib)]
    if e.colocated:
        rows += [("SGLang weights", 0.0, e.engine_weights_gib), ("SGLang KV cache", 0.0, e.kv_cache_gib),
                 ("SGLang runtime+context", e.engine_released_gib, e.engine_other_gib)]
    rows.append(("total", e.train_gib, e.rollout_gib))
    cols = 2 if e.colocated else 1
    lines = [e.model, e.layout,
             f"per GPU, GiB (pipeline stage {e.stage}: {e.dense_params / 1e6:.0f}M dense + "
             f"{e.expert_params / 1e6:.0f}M expert params)",
             f"{'':24}{'train':>9}" + (f"{'rollout':>9}" if e.colocated else "")]
    lines += [f"{name:24}" + "".join(f"{v:9.2f}" for v in values[:cols]) for name, *values in rows]
    tail = (f"peak {e.peak_gib:.2f} of {e.gpu_memory_gib:.2f} GiB, headroom {e.headroom_gib:.2f} "
            f"(reserve: at least {e.reserve_gib:.2f} kept free)")
    if e.colocated:
        tail += f"; KV pool {e.kv_cache_tokens} tokens per engine"
    return "\n".join(lines + [tail])
