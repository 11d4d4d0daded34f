"""The full typed configuration of a training run.

A run is one `TrainConfig`: a tree of per-component dataclasses (each owns its validation).
Recipes (`megatron_marsrl.rl.recipes`) are functions returning a complete `TrainConfig`; the
command line and YAML files only override fields (`megatron_marsrl.rl.overrides`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatron_marsrl import gguf
from megatron_marsrl.agents.rollout import RolloutConfig
from megatron_marsrl.agents.system import SystemConfig
from megatron_marsrl.algorithms.advantages import POOL_ACROSS_STAGES, AdvantageConfig
from megatron_marsrl.algorithms.losses import PolicyLossConfig
from megatron_marsrl.megatron.optim import OptimConfig
from megatron_marsrl.megatron.parallel import ParallelConfig
from megatron_marsrl.rl.data import check_arithmetic_splits
from megatron_marsrl.rl.scheduler import SchedulerConfig
from megatron_marsrl.rollout.factory import RolloutEngineConfig

PIPELINE_MODES = ("pipeline", "sync")
POLICY_SHARING = ("shared", "per_role")
ROLES = ("solver", "verifier", "corrector")


@dataclass(kw_only=True)
class ModelConfig:
    """The policy's starting weights and tokenizer."""

    path: str = ""
    """Local HF checkpoint directory, or a .gguf file (converted at start-up with transformers'
    GGUF loader into run_dir/initial_model, as `marsrl convert gguf-to-hf` does). "task" uses the
    task's own tiny model (built at start-up under the run directory, see `TaskConfig`)."""
    dtype: str = "auto"
    """"auto", "float32" or "bfloat16". "auto" is bfloat16 (Megatron's mixed precision: fp32 main
    parameters and Adam state) on a GPU and on a CPU with bf16 matrix instructions (AMX or
    AVX-512 bf16), float32 on other CPUs (precision.py `choose_dtype`). The embedded engine
    generates in the same dtype; the run's config.json records the resolved one."""
    moe_aux_loss_coeff: float = 0.0
    """Megatron's MoE load-balancing loss weight (MarsRL trains without one: 0)."""
    arch: dict = field(default_factory=dict)
    """The model's HF config.json values, for planning without the checkpoint: `marsrl train
    --dry-run` reads the architecture from model.path/config.json when that file exists, else
    from this mapping (recipes for large models embed it); training always reads the file."""

    @property
    def built_at_start(self) -> bool:
        """True when the run writes its starting HF checkpoint to run_dir/initial_model."""
        return self.path == "task" or gguf.is_gguf(self.path)

    def start_checkpoint(self, run_dir: str | Path) -> Path:
        """The HF checkpoint directory a run in ``run_dir`` starts from."""
        return Path(run_dir) / "initial_model" if self.built_at_start else Path(self.path)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"model.dtype={self.dtype!r}: use auto, float32 or bfloat16")
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff}: must be >= 0")


@dataclass(kw_only=True)
class WarmStartConfig:
    """Supervised fine-tuning before RL, on the run's own ranks (`marsrl sft`'s loop), as real
    RL runs start from an instruct model. Written to run_dir/warm_start (hf/, settings.json,
    summary.json, metrics.jsonl, tensorboard/) and reused by any run whose run_dir/warm_start
    holds one with the same settings: a resumed or repeated run, or another run directory it
    was copied into (`marsrl bench learning` trains one per seed and copies it)."""

    data: str = "task"
    """"task": the task's demonstrations of its training problems (the arithmetic tasks: each
    role answering right, `agents/arithmetic.demonstrations`, each problem in both of the
    generator's wordings, `rl/data.arithmetic_phrasings`); else a JSONL file of conversations
    (`marsrl sft` data)."""
    epochs: int = 1
    """Passes over the data."""
    batch_sequences: int = 32
    """Conversations per optimizer step."""
    lr: float = 1e-5
    """Learning rate (Adam, the run's optim.clip_grad)."""

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("warm_start.data is empty: use 'task' or a JSONL file of conversations")
        if self.epochs < 1 or self.batch_sequences < 1:
            raise ValueError(f"warm_start epochs={self.epochs} and batch_sequences={self.batch_sequences}: "
                             "must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"warm_start.lr={self.lr}: must be > 0")


@dataclass(kw_only=True)
class TaskConfig:
    """What the agents work on: the roles, the data, and (for the embedded job) a tiny model."""

    name: str = "math"
    """"math": the MarsRL roles (megatron_marsrl.agents.roles) on a JSONL dataset;
    "arithmetic": the embedded CPU task (compact roles, a word-level tokenizer and a tiny
    Qwen3-MoE built for it, see megatron_marsrl.agents.arithmetic); "arithmetic_chat": the same
    problems for a pretrained instruct model (plain-English roles in its chat template)."""
    train: str = ""
    """Training problems: a JSONL path or a generator spec such as "arithmetic:train?n=256"."""
    eval: str = ""
    """Held-out problems for periodic evaluation (same forms); "" disables evaluation."""
    eval_size: int = 64
    """At most this many held-out problems per evaluation."""
    eval_samples: int = 4
    """k: samples of each role on each held-out case (agents/heldout.py); the intervals
    resample problems, so k sharpens a problem's figure without counting as k problems."""
    tiny_model: dict = field(default_factory=dict)
    """Overrides of the tiny model's HF config when model.path == "task" (e.g. hidden_size)."""
    system: SystemConfig | None = None
    """At each evaluation, also run the V-C inference loop (`agents/system.py`) with these
    limits on the held-out problems, on the training engines: eval/system/accuracy (each run's
    answer) next to eval/system/solver_accuracy (the same runs' first solutions, the Solver
    alone) and their paired difference eval/system/gain; None: not run."""

    def __post_init__(self) -> None:
        if self.name not in ("math", "arithmetic", "arithmetic_chat"):
            raise ValueError(f"task.name={self.name!r}: use 'math', 'arithmetic' or 'arithmetic_chat'")
        if not self.train:
            raise ValueError("task.train is empty: give a JSONL file or a generator spec like 'arithmetic:train'")
        if self.eval_size < 1:
            raise ValueError(f"task.eval_size={self.eval_size}: must be >= 1")
        if self.eval_samples < 1:
            raise ValueError(f"task.eval_samples={self.eval_samples}: must be >= 1 (samples per held-out case)")
        check_arithmetic_splits(self.train, self.eval)


@dataclass(kw_only=True)
class PipelineConfig:
    """How rollouts and training interleave."""

    mode: str = "pipeline"
    """"pipeline": MarsRL agentic pipeline (each step advances every open trajectory by one
    stage; new problems enter the Solver); "sync": whole trajectories, then train."""
    problems_per_step: int = 8
    """New problems entering the Solver stage per step."""
    segment_tokens: int | None = None
    """Segment rollout: generate at most this many tokens per step and continue unfinished
    samples at the next step (their earlier tokens come from older weights: see
    `segment_old_tokens`). None: generate whole outputs."""
    segment_old_tokens: str = "mask"
    """What training does with tokens a continued sample got from older weights: "mask" (no
    gradient) or "tis" (trained, importance-corrected by the rollout log-probs)."""
    time_shared: bool = False
    """Time-shared colocation (rl/time_share.py): the trainer's parameters, gradients and
    optimizer state leave the GPU while the engines generate, and SGLang engines (started with
    their memory saver) release weights, KV cache and CUDA graphs while it trains, so each
    side gets the whole GPU in its phase. Needs scheduler.overlap=false. The moves are GPU-only:
    on CPU the phases run in the same order and are logged, moving nothing."""

    def __post_init__(self) -> None:
        if self.mode not in PIPELINE_MODES:
            raise ValueError(f"pipeline.mode={self.mode!r}: use one of {PIPELINE_MODES}")
        if self.problems_per_step < 1:
            raise ValueError(f"pipeline.problems_per_step={self.problems_per_step}: must be >= 1")
        if self.segment_tokens is not None and self.segment_tokens < 1:
            raise ValueError(f"pipeline.segment_tokens={self.segment_tokens}: must be >= 1 or None")
        if self.segment_tokens is not None and self.mode != "pipeline":
            raise ValueError("pipeline.segment_tokens needs pipeline.mode=pipeline (a sync step generates "
                             "whole trajectories)")
        if self.segment_old_tokens not in ("mask", "tis"):
            raise ValueError(f"pipeline.segment_old_tokens={self.segment_old_tokens!r}: use 'mask' or 'tis'")


@dataclass(kw_only=True)
class PolicyConfig:
    """Which model each role uses."""

    sharing: str = "shared"
    """"shared": one policy for all roles (default); "per_role": a separate Megatron model,
    optimizer and rollout engine per role."""
    reference: bool = False
    """Keep a frozen copy of the initial policy for the KL term (loss.kl_coef > 0 needs it)."""
    max_grad_norm: float | None = None
    """Skip the update (and log it) when the gradient norm is above this (a spike) or not
    finite; None skips only non-finite norms."""
    mini_batch_sequences: int | None = None
    """PPO mini-batches (verl's ppo_mini_batch_size, counted in sequences): an optimizer step
    each time at least this many of a policy's sequences were trained while the step's
    rollouts go on, and one at the end of the step for the rest. Needs
    loss.old_logprobs=rollout, so that the later mini-batches' ratios measure the earlier
    updates. None: one optimizer step per policy per RL step."""

    def __post_init__(self) -> None:
        if self.mini_batch_sequences is not None and self.mini_batch_sequences < 1:
            raise ValueError(f"policy.mini_batch_sequences={self.mini_batch_sequences}: must be >= 1 or None")
        if self.sharing not in POLICY_SHARING:
            raise ValueError(f"policy.sharing={self.sharing!r}: use one of {POLICY_SHARING}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"policy.max_grad_norm={self.max_grad_norm}: must be > 0 or None")


@dataclass(kw_only=True)
class RunConfig:
    """Length, outputs, logging and checkpoints of the run."""

    steps: int = 100
    """RL steps (one optimizer step per policy per RL step, or several: policy.mini_batch_sequences)."""
    output_dir: str = "outputs/run"
    """Run directory: checkpoints/, tensorboard/, resolved config.json, eval results."""
    seed: int = 1234
    """Seeds model init order, data order, input selection and sampling."""
    checkpoint_every: int = 10
    """Save every N steps (and at exit on SIGTERM/SIGINT); 0: only at exit."""
    keep_checkpoints: int = 2
    """Newest complete checkpoints kept; older ones are deleted after a successful save."""
    eval_every: int = 0
    """Evaluate on task.eval every N steps (and before the first step); 0: never."""
    sync_probe: bool = True
    """After each weight sync, check on a few tokens that the engine matches Megatron."""
    progress: bool = True
    """Progress bar with the key figures, when the console is a terminal (a line per step is
    printed either way)."""
    save_rollouts: bool = False
    """Write each step's samples to run_dir/rollouts/step_NNNNNN.jsonl (rank 0), one JSON line
    per model call: role, stage, ids, prompt and response (text and token ids), the engine's
    log-probs, parse status, reward and advantage. To read what the policy wrote; `marsrl bench
    throughput` replays them as one engine batch."""

    def __post_init__(self) -> None:
        for name in ("steps", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"run.{name}={getattr(self, name)}: must be >= 1")
        for name in ("checkpoint_every", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"run.{name}={getattr(self, name)}: must be >= 0")


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a training run needs."""

    run: RunConfig = field(default_factory=RunConfig)
    """Length, outputs, checkpoints, logging."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Starting weights."""
    warm_start: WarmStartConfig | None = None
    """Supervised fine-tuning of the starting weights before the first RL step; None: none."""
    task: TaskConfig
    """Roles and data."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron layout of each policy (world size = number of launched ranks)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer of each policy."""
    engine: RolloutEngineConfig = field(default_factory=RolloutEngineConfig)
    """Rollout engines (per policy when policy.sharing == "per_role")."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Group size G, inputs per stage k, max stages S, selection, sampling."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Agentic pipeline or synchronous mode."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Micro-batch packing and overlap with generation."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Shared or per-role policies, reference model, update guards."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Advantage estimator."""
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy loss terms."""

    def __post_init__(self) -> None:
        if self.loss.kl_coef > 0 and not self.policy.reference:
            raise ValueError("loss.kl_coef > 0 needs a reference model: set policy.reference=true")
        if self.warm_start is not None and self.warm_start.data == "task" and \
                self.task.name not in ("arithmetic", "arithmetic_chat"):
            raise ValueError(f"warm_start.data=task has demonstrations for the arithmetic tasks only, not "
                             f"task.name={self.task.name}: give warm_start.data a JSONL file of conversations")
        if self.advantage.estimator in POOL_ACROSS_STAGES and self.pipeline.mode == "pipeline":
            raise ValueError(f"advantage.estimator={self.advantage.estimator} pools the stages of a problem's "
                             "trajectory, but pipeline mode trains one stage of each problem per step, so its "
                             "groups would be AT-GRPO's: use pipeline.mode=sync, or advantage.estimator=at_grpo")
        if self.loss.ratio == "sequence" and self.loss.old_logprobs != "rollout":
            raise ValueError("loss.ratio=sequence (GSPO) needs loss.old_logprobs=rollout: against the trainer's own "
                             "log-probs every sequence ratio is 1 and GSPO is plain PPO")
        if self.policy.mini_batch_sequences is not None and self.loss.old_logprobs != "rollout":
            raise ValueError("policy.mini_batch_sequences needs loss.old_logprobs=rollout: after the step's first "
                             "update the trainer's own log-probs are no longer those of the policy that generated")
        if self.pipeline.time_shared and self.engine.placement == "split":
            raise ValueError("pipeline.time_shared with engine.placement=split: split engines have GPUs of their own, "
                             "so there is nothing to time-share; use one or the other")
        if self.pipeline.time_shared and self.scheduler.overlap:
            raise ValueError("pipeline.time_shared needs scheduler.overlap=false: training and generation take "
                             "turns on the GPU, so nothing trains while the engines generate")
        if self.loss.tis is None and self.pipeline.segment_tokens and self.pipeline.segment_old_tokens == "tis":
            raise ValueError("pipeline.segment_old_tokens='tis' needs loss.tis (set loss.tis={} for the defaults)")

    def policy_names(self) -> tuple[str, ...]:
        """The models trained: ("shared",) or one per role."""
        return ("shared",) if self.policy.sharing == "shared" else ROLES

    def policy_of(self, role: str) -> str:
        """Which policy trains (and generates for) `role`."""
        return "shared" if self.policy.sharing == "shared" else role
