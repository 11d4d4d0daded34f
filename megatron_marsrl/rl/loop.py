"""The RL loop of `marsrl train`.

    marsrl train --recipe tiny_arithmetic            # the embedded CPU job (2 gloo ranks)
    torchrun --nproc-per-node 8 -m megatron_marsrl.cli train --recipe ... [key=value ...]

Each step: rollouts of every role -> agent rewards -> advantages -> policy update on
Megatron -> weight sync to the engines -> (periodic) evaluation and checkpoint.

How it differs from textbook GRPO:
  * several agents (Solver, Verifier, Corrector) with agent-specific rewards, advantages
    normalised within each agent's groups (GRPO / Dr. MAS / AT-GRPO / RLOO), one shared
    policy or one policy per role;
  * agentic pipeline (MarsRL): a step runs one stage of every open trajectory, so nothing
    waits for whole trajectories; stage inputs chosen in step t are answered in step t+1;
  * training overlaps generation: each problem's groups are packed into micro-batches and
    trained as soon as they are rewarded; gradients accumulate and sync once, by default with
    one optimizer step per policy per RL step, so every sample is on-policy (old log-probs
    equal the current ones; there is no separate recompute pass). With PPO mini-batches
    (policy.mini_batch_sequences) a policy also steps whenever enough of its sequences were
    trained, and the ratio is taken against the engine's log-probs (loss.old_logprobs=rollout);
  * the engines' own log-probs are kept: train/rollout mismatch is logged every step and can
    drive truncated importance sampling (loss.tis).
"""
from __future__ import annotations

import logging
import time

from megatron_marsrl.rl.config import TrainConfig

log = logging.getLogger(__name__)


def train(config: TrainConfig, *, resume: bool = False) -> dict:
    """Run `config`; returns the last step's metrics and the run's paths (on rank 0)."""
    from megatron_marsrl.rl.trainer import Trainer

    trainer = Trainer(config, resume=resume)
    observer = trainer.observer()
    last: dict = {}
    step = trainer.start_step
    from megatron_marsrl.rl.trainer import StepAborted

    try:
        if config.run.eval_every and step == 0:
            observer.log(0, trainer.evaluate(0))
        while step < config.run.steps:
            begin = time.perf_counter()
            trainer.start_rollouts(step)                              # rollouts (background)
            try:
                samples, metrics = trainer.train_while_generating(step)  # rewards -> advantages -> train
            except StepAborted as stopped:
                trainer.save(step, redo_step=True)  # a resume redoes this step (see Trainer.save)
                if not stopped.by_signal:
                    raise
                log.warning("stopped by signal during step %d; resume with --resume", step + 1)
                break
            metrics.update(trainer.optimizer_step())                 # (the last) update per policy
            metrics.update(trainer.sync_weights(step + 1, trainer.probe(samples)))  # -> engines
            step += 1
            metrics.update(trainer.rollout_metrics(samples, metrics, time.perf_counter() - begin))
            observer.log(step, metrics)
            if config.run.save_rollouts:
                observer.save_rollouts(step, samples)
            last = metrics
            if config.run.eval_every and step % config.run.eval_every == 0:
                observer.log(step, trainer.evaluate(step))
            stop = trainer.stop_requested()
            if stop or step == config.run.steps or (config.run.checkpoint_every
                                                    and step % config.run.checkpoint_every == 0):
                trainer.save(step)
            if stop:
                log.warning("stopped by signal after step %d; resume with --resume", step)
                break
    finally:
        observer.close()
        trainer.close()
    return {"step": step, "metrics": last, "run_dir": str(trainer.run_dir),
            "tensorboard": str(trainer.run_dir / "tensorboard"), "checkpoints": str(trainer.run_dir / "checkpoints")}
