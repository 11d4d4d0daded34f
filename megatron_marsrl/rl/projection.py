"""Projected RL step time of every mode x placement that fits in GPU memory: the second table
of `marsrl train --dry-run` for configs with SGLang engines on the GPUs.

One model of time and memory. The memory planner (megatron/memory.py, as rl/dry_run.py applies
it to the config) gives each placement its SGLang KV pool per engine; the pool divided by the
KV a decoding sequence holds on average over time (the prompt plus
`LengthModel.decoding_context`) gives the sequences an engine decodes at once; the
discrete-event simulator (rl/simulate.py) turns that into step time.

Placements:
  colocated, resident     engines on the GPUs the config gives them (engine.num_engines x
                          engine.tp_size per node: on every node for SGLang servers, on the
                          first node for in-process engines), every GPU trains, the engines stay
                          resident while training runs, with the config's KV pool. All three modes.
  colocated, time-shared  engines on every GPU; the trainer's parameters and optimizer state
                          leave the GPU while the engines generate (its gradients are freed),
                          and the engines release weights and KV while it trains: the KV pool
                          is what the rollout phase leaves. No overlap (training and generation
                          never hold the GPU together); every step pays the swap both ways at
                          SWAP_GIB_PER_S plus ENGINE_RESUME_S. The trainer runs it with SGLang
                          servers (pipeline.time_shared, engines covering each node's GPUs).
  split R+T               R GPUs only generate (the KV pool is what an engine-only GPU leaves),
                          T GPUs only train, with the config's layout (expert parallelism
                          reduced to divide T where needed). The trainer splits inside each
                          node (engine.placement=split: the first GPUs of a node train, the rest
                          hold whole engines); where no such split exists (engines as wide as a
                          node), whole nodes are split, which the trainer cannot launch.
Every row fits: its peak leaves memory.py's reserve free (6 GiB of 80).

Memory is counted for one policy: with policy.sharing=per_role every GPU holds one trainer
state and one engine per role, which the time-shared and split rows do not count.
Speeds, output lengths and the weight-sync time are the simulator's defaults (Qwen3-30B-A3B on
H100; see SimConfig), so for other models the times are relative figures only. The config gives
the rest: problems per step, G, k, S, the output cap, segments, the token budget, the layout.
"""
from __future__ import annotations

import dataclasses
import math

from megatron_marsrl.megatron.hf_config import ModelArch
from megatron_marsrl.megatron.memory import (GIB, ColocatedRollout, MemoryConfig, MemoryEstimate, engine_weights_gib,
                                             estimate_memory, kv_bytes_per_token)
from megatron_marsrl.megatron.parallel import LayoutError
from megatron_marsrl.rl.config import TrainConfig
from megatron_marsrl.rl.simulate import MODES, SimConfig, simulate

PROJECTION_STEPS = 3
"""Steps the simulator measures per mode (after the pipeline warm-up)."""
MAX_SEQUENCES_PER_GPU = 32
"""Most sequences an engine decodes at once, per GPU of the engine: SimConfig's per-sequence
decode speed assumes this load (128 sequences per 4-GPU engine); beyond it a decode step is no
longer bound by reading the weights and the speed would drop."""
SWAP_GIB_PER_S = 20.0
"""Host <-> GPU copy rate per GPU for the time-shared trainer's state (pinned memory over PCIe 5)."""
ENGINE_RESUME_S = 5.0
"""SGLang resuming its memory (re-allocating the KV pool, re-capturing nothing) per step."""
SPLIT_FRACTIONS = (0.5, 0.625, 0.75)
"""Shares of the GPUs tried as generation-only in the split placement."""

RESIDENT, TIME_SHARED = "colocated, resident", "colocated, time-shared"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Projection:
    """One placement's memory and projected step time per mode."""

    placement: str
    """RESIDENT, TIME_SHARED or "split R+T"."""
    engine_gpus: int
    """GPUs hosting SGLang engines."""
    train_gpus: int
    """GPUs training."""
    kv_tokens: int
    """KV pool of one engine, tokens."""
    sequences_per_engine: int
    """Sequences one engine decodes at once (KV pool / a decoding sequence's KV, capped)."""
    peak_gib: float
    """Per-GPU peak of the fullest GPU."""
    step_s: dict[str, float]
    """Median projected step time per mode this placement can run."""
    in_trainer: bool
    """Whether the trainer runs this placement today."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProjectionTable:
    """Every placement that fits, and those that do not with the reason."""

    rows: list[Projection]
    skipped: list[str]
    """'placement: why', for placements left out."""
    config_mode: str
    """The config's own mode (pipeline.mode, scheduler.overlap) in MODES terms, and its placement."""
    context_tokens: int
    """KV of one decoding sequence, time-weighted (prompt + decoding_context)."""

    def fastest(self, *, in_trainer: bool = False) -> tuple[Projection, str] | None:
        """(row, mode) of the least step time (among what the trainer runs, with in_trainer)."""
        options = [(row.step_s[m], row, m) for row in self.rows if row.in_trainer or not in_trainer
                   for m in row.step_s]
        return min(options, key=lambda o: o[0])[1:] if options else None


def config_mode(config: TrainConfig) -> str:
    """The config's mode in the simulator's names, and its placement."""
    mode = "sync" if config.pipeline.mode == "sync" else \
        "pipeline+overlap" if config.scheduler.overlap else "pipeline"
    where = "every node" if config.engine.on_every_node else "the first node"
    if config.engine.placement == "split":
        return f"{mode} (split: engines on GPUs of their own on {where})"
    sharing = "time-shared" if config.pipeline.time_shared else "resident"
    return f"{mode} ({sharing} colocated engines on {where})"


def engine_gpus_started(config: TrainConfig, nodes: int) -> int:
    """GPUs one policy's engines take: each node's for SGLang servers, the first node's otherwise."""
    eng = config.engine
    return eng.num_engines * eng.tp_size * (nodes if eng.on_every_node else 1)


def project(config: TrainConfig, arch: ModelArch, memory: MemoryConfig, resident: MemoryEstimate,
            resident_peak_gib: float, *, nodes: int = 1) -> ProjectionTable:
    """Project every placement for `config` on `nodes` nodes. `memory` holds the estimate's
    inputs for the config's engines colocated on the whole cluster (their KV pool is replaced
    here), `resident` the dry run's estimate of them colocated and resident, `resident_peak_gib`
    its binding peak (training next to resident, generating engines)."""
    eng, par, world = config.engine, config.parallel, memory.world_size
    servers = eng.on_every_node
    base = _sim_config(config, world)
    context = math.ceil(base.prompt_tokens + base.length_model().decoding_context())
    rollout = ColocatedRollout.of_engine(eng, kv_cache_tokens=1)
    kv_token_gib = kv_bytes_per_token(arch, rollout) / GIB
    engine_fixed = engine_weights_gib(arch, rollout) + rollout.runtime_gib + rollout.context_gib
    rows, skipped = [], []

    def add(placement: str, *, kv: int, peak: float, engine_gpus: int, train_gpus: int, sim: SimConfig,
            modes: tuple[str, ...], in_trainer: bool) -> None:
        seqs = min(MAX_SEQUENCES_PER_GPU * eng.tp_size, kv // context)
        if seqs < 1:
            skipped.append(f"{placement}: its KV pool ({kv} tokens) holds less than one decoding sequence "
                           f"(~{context} tokens)")
            return
        result = simulate(dataclasses.replace(sim, engine_concurrency=seqs), modes)
        rows.append(Projection(placement=placement, engine_gpus=engine_gpus, train_gpus=train_gpus, kv_tokens=kv,
                               sequences_per_engine=seqs, peak_gib=peak, in_trainer=in_trainer,
                               step_s={m: r.median_step_s for m, r in result.modes.items()}))

    started = engine_gpus_started(config, nodes)
    if resident_peak_gib > resident.usable_gib:
        skipped.append(f"{RESIDENT}: training next to resident engines needs {resident_peak_gib:.1f} GiB per GPU")
    else:
        add(RESIDENT, kv=resident.kv_cache_tokens, peak=resident_peak_gib, engine_gpus=started, train_gpus=world,
            sim=dataclasses.replace(base, engine_gpus=started), modes=MODES, in_trainer=True)

    fill = int((resident.usable_gib - memory.framework_gib - engine_fixed) / kv_token_gib)
    shared = estimate_memory(arch, par, dataclasses.replace(
        memory, offload_trainer_in_rollout=True,
        rollout=dataclasses.replace(memory.rollout, kv_cache_tokens=max(fill, 1))))
    if fill < 1 or shared.train_gib > shared.usable_gib:
        skipped.append(f"{TIME_SHARED}: training alone needs {shared.train_gib:.1f} GiB per GPU" if fill >= 1 else
                       f"{TIME_SHARED}: the engine's weights and runtime leave no KV pool")
    else:
        swap_s = 2 * (shared.params_gib + shared.optimizer_gib) / SWAP_GIB_PER_S + ENGINE_RESUME_S
        add(TIME_SHARED, kv=fill, peak=shared.peak_gib, engine_gpus=world, train_gpus=world,
            sim=dataclasses.replace(base, weight_sync_s=base.weight_sync_s + swap_s), modes=("sync", "pipeline"),
            in_trainer=servers)

    engine_only = int((resident.usable_gib - engine_fixed) / kv_token_gib)
    per_node = _split_candidates(world // nodes, eng.tp_size)
    in_nodes = bool(per_node) and servers
    for gen in [g * nodes for g in per_node] if per_node else _split_candidates(world, eng.tp_size):
        name = f"split {gen}+{world - gen}"
        train = _train_alone(config, arch, world - gen, memory)
        if isinstance(train, str):
            skipped.append(f"{name}: {train}")
            continue
        peak = max(train.train_gib, engine_fixed + engine_only * kv_token_gib)
        add(name, kv=engine_only, peak=peak, engine_gpus=gen, train_gpus=world - gen,
            sim=dataclasses.replace(base, rollout_gpus=gen), modes=MODES, in_trainer=in_nodes)
    return ProjectionTable(rows=rows, skipped=skipped, config_mode=config_mode(config), context_tokens=context)


def _sim_config(config: TrainConfig, world: int) -> SimConfig:
    """The simulator's cluster and recipe from `config` (its speeds stay SimConfig's)."""
    defaults, cap = SimConfig(), config.rollout.sampling.max_tokens
    return SimConfig(measured_steps=PROJECTION_STEPS, problems_per_step=config.pipeline.problems_per_step,
                     group_size=config.rollout.group_size, inputs_per_stage=config.rollout.inputs_per_stage,
                     max_stages=config.rollout.max_stages, max_tokens=cap,
                     mean_tokens=min(defaults.mean_tokens, max(1, cap // 3)),
                     segment_tokens=config.pipeline.segment_tokens, num_gpus=world,
                     gpus_per_engine=config.engine.tp_size,
                     train_gpus_per_replica=config.parallel.tp * config.parallel.pp,
                     token_budget=config.scheduler.token_budget,
                     separate_policies=len(config.policy_names()) > 1)


def _split_candidates(world: int, engine_tp: int) -> list[int]:
    """Generation GPU counts tried for the split placement (of a node, or of the cluster): whole
    engines, some GPUs left to train."""
    counts = {round(world * f / engine_tp) * engine_tp for f in SPLIT_FRACTIONS}
    return sorted(c for c in counts if 0 < c < world)


def _train_alone(config: TrainConfig, arch: ModelArch, gpus: int, memory: MemoryConfig) -> MemoryEstimate | str:
    """The train-only estimate on `gpus` GPUs (expert parallelism reduced to divide them), or why
    it cannot run there."""
    par = config.parallel
    ep = math.gcd(par.ep, max(1, gpus // (par.pp * par.etp)))
    try:
        est = estimate_memory(arch, dataclasses.replace(par, ep=ep),
                              dataclasses.replace(memory, world_size=gpus, rollout=None))
    except LayoutError as exc:
        return f"the layout does not fit {gpus} training GPUs ({exc})"
    if est.train_gib > est.usable_gib:
        return f"training on {gpus} GPUs (EP{ep}) needs {est.train_gib:.1f} GiB per GPU"
    return est


def format_table(table: ProjectionTable) -> str:
    """The table, the fastest row and mode, and the fastest the trainer runs today."""
    head = f"{'placement':24}{'GPUs gen/train':>16}{'KV/engine':>11}{'seqs':>6}{'peak GiB':>10}" + \
        "".join(f"{m + ' s':>20}" for m in MODES)
    lines = ["projected step time per mode x placement (rl/projection.py; simulator speeds for Qwen3-30B-A3B on "
             f"H100; a decoding sequence holds ~{table.context_tokens} KV tokens):", head]
    for row in table.rows:
        cells = "".join(f"{row.step_s[m]:>20.0f}" if m in row.step_s else f"{'-':>20}" for m in MODES)
        mark = "" if row.in_trainer else " (not in trainer)"
        lines.append(f"{row.placement:24}{f'{row.engine_gpus}/{row.train_gpus}':>16}{row.kv_tokens:>11}"
                     f"{row.sequences_per_engine:>6}{row.peak_gib:>10.1f}{cells}{mark}")
    lines += [f"left out: {why}" for why in table.skipped]
    best = table.fastest()
    if best:
        row, mode = best
        lines.append(f"fastest: {row.placement}, {mode}: {row.step_s[mode]:.0f} s/step, "
                     f"{row.step_s['sync'] / row.step_s[mode]:.2f}x over sync in that placement")
    today = table.fastest(in_trainer=True)
    if today:
        row, mode = today
        lines.append(f"fastest the trainer runs today: {row.placement}, {mode} ({row.step_s[mode]:.0f} s/step); "
                     f"this config runs {table.config_mode}")
    return "\n".join(lines)
