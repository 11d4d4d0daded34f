"""Rank 0's rollout side of a run: engines (its node's, plus the other nodes' SGLang servers
attached by URL: rl/node_engines.py), the agents and their data, evaluation.

Everything here is on the agents' side of the boundary (no Megatron import): the trainer
gets finished groups from `driver`, and pushes weights into `pools`.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from megatron_marsrl.agents.heldout import check_roles, held_out_cases, sample_held_out
from megatron_marsrl.agents.parsing import ParseCounter
from megatron_marsrl.agents.rollout import GroupedRollout
from megatron_marsrl.data_types import Sample
from megatron_marsrl.rl.config import ROLES, TrainConfig
from megatron_marsrl.rl.data import ProblemStream, dataset_from_spec
from megatron_marsrl.rl.rollout_driver import RolloutDriver, StepGate
from megatron_marsrl.rl.rollout_metrics import held_out_figures, role_metrics
from megatron_marsrl.stats import Estimate, bootstrap_figures, logged, wilson_interval

log = logging.getLogger(__name__)


def role_set(task: str):
    """The agents of a task."""
    if task in ("arithmetic", "arithmetic_chat"):
        from megatron_marsrl.agents import arithmetic

        return arithmetic.ROLES if task == "arithmetic" else arithmetic.CHAT_ROLES
    from megatron_marsrl.agents.roles import RoleSet

    return RoleSet()


class RolloutSide:
    """Engines (one pool per policy), agents, problems and the background driver."""

    def __init__(self, config: TrainConfig, hf_dir: str, *, dtype: torch.dtype = torch.float32):
        from megatron_marsrl.rollout.chat import EngineChatGenerator, load_tokenizer
        from megatron_marsrl.rollout.factory import start_engines

        self.config = config
        self.version = 0
        self.tokenizer = load_tokenizer(hf_dir)
        self.pools = {}
        try:
            for i, name in enumerate(config.policy_names()):
                self.pools[name] = start_engines(engines_of_policy(config, i), hf_dir, dtype=dtype,
                                                 memory_saver=memory_saver(config))
        except BaseException:
            self.close()
            raise
        gate = StepGate()
        segment = config.pipeline.segment_tokens
        generators = {role: EngineChatGenerator(self.pools[config.policy_of(role)], self.tokenizer,
                                                segment_tokens=segment, gate=gate if segment else None,
                                                routed_experts=config.engine.routed_experts)
                      for role in ROLES}
        # Evaluation generates whole outputs: nothing waits for a next step there.
        self.eval_generators = {role: EngineChatGenerator(self.pools[config.policy_of(role)], self.tokenizer)
                                for role in ROLES}
        self.roles = role_set(config.task.name)
        self.counter = ParseCounter()
        self.grouped = GroupedRollout(roles=self.roles, generators=generators, config=config.rollout,
                                      counter=self.counter)
        self.driver = RolloutDriver(self.grouped, mode=config.pipeline.mode, gate=gate)
        train = dataset_from_spec(config.task.train)
        self.stream = ProblemStream(train, problems_per_step=min(config.pipeline.problems_per_step, len(train)),
                                    seed=config.run.seed)
        self.eval_problems = dataset_from_spec(config.task.eval)[: config.task.eval_size] if config.task.eval else []
        self.eval_cases = held_out_cases(self.eval_problems)
        check_roles(self.roles, self.eval_cases)
        solver_only = sum(c.wrong_answer is None for c in self.eval_cases)
        if solver_only:
            log.warning("held-out set: %d of %d problems have no integer answer to build a wrong solution from; "
                        "they measure the Solver only", solver_only, len(self.eval_cases))
        self._snapshot = self.state_dict()
        self._served: list[int] = []

    def attach_remote(self, urls: dict[str, list[str]], hf_dir: str) -> None:
        """Add the other nodes' SGLang servers (rl/node_engines.py) to each policy's pool; they
        take weights by broadcast. Before the first step."""
        from megatron_marsrl.rollout.factory import attach_engines

        for i, name in enumerate(self.config.policy_names()):
            if urls.get(name):
                engines = attach_engines(engines_of_policy(self.config, i), hf_dir, urls[name])
                self.pools[name].add_engines(engines, by_broadcast=True)
                log.info("policy %s: %d engine(s) on other nodes joined its pool: %s", name, len(engines),
                         ", ".join(urls[name]))

    def engines_serving(self) -> int:
        """Engines (of every policy) that answered a request since the last call."""
        now = [n for pool in self.pools.values() for n in pool.served()]
        before = self._served + [0] * (len(now) - len(self._served))
        self._served = now
        return sum(a > b for a, b in zip(now, before))

    def start_step(self, step: int) -> None:
        """Take the step's problems and start generating (the state before is kept so that a
        step that fails can be redone after a resume)."""
        self._snapshot = self.state_dict()
        self.driver.start_step(step, self.stream.next_step())

    def evaluate(self, step: int) -> dict[str, float]:
        """Per-role figures on the fixed held-out set (agents/heldout.py: the Solver on each
        problem, the Verifier on a right and a wrong solution, the Corrector on a rejected wrong
        one; k samples each, nothing trained) and, with `task.system`, the V-C inference loop's
        accuracy next to its runs' first answers; every figure with its 95% interval."""
        if not self.eval_problems:
            return {}
        config = dataclasses.replace(self.config.rollout, group_size=self.config.task.eval_samples)
        grouped = GroupedRollout(roles=self.roles, generators=self.eval_generators, config=config)
        grouped.salt = f"eval{step}."
        samples = self.driver.run_eval(sample_held_out(grouped, self.eval_cases))
        out = logged(held_out_figures(samples, seed=f"eval{step}"), "eval/")
        if self.config.task.system is not None:
            out.update(logged(self._evaluate_system(step), "eval/system/"))
        return out

    def _evaluate_system(self, step: int) -> dict[str, Estimate]:
        import asyncio

        from megatron_marsrl.agents.system import SLOTS, ReasoningSystem, system_figures, system_tally

        system = ReasoningSystem(roles=self.roles, generators=self.eval_generators,
                                 sampling={slot: self.config.rollout.sampling for slot in SLOTS},
                                 config=self.config.task.system)

        async def solve_all():
            return await asyncio.gather(*(system.solve(p.id, p.problem) for p in self.eval_problems))

        results = self.driver.run_eval(solve_all())
        units = [system_tally(r, p.answer) for r, p in zip(results, self.eval_problems, strict=True)]
        estimates = bootstrap_figures(units, system_figures, seed=f"system{step}")
        if all(u["system", "runs"] == 1 for u in units):  # one run per problem: plain proportions
            for name, count in (("accuracy", "right"), ("solver_accuracy", "solver_right")):
                estimates[name] = wilson_interval(sum(u["system", count] for u in units), len(units))
        return estimates

    def probe_sequences(self, samples: list[Sample], per_policy: int = 2,
                        max_tokens: int = 128) -> dict[str, list[list[int]]]:
        """A few generated sequences per policy for the post-sync check, each cut to its last
        ``max_tokens`` tokens (a few hundred tokens in all: the probe runs every step)."""
        out: dict[str, list[list[int]]] = {}
        for s in samples:
            seqs = out.setdefault(self.config.policy_of(s.role), [])
            if len(seqs) < per_policy and s.response_token_ids:
                seqs.append((list(s.prompt_token_ids or []) + list(s.response_token_ids))[-max_tokens:])
        return out

    def state_dict(self, *, step_start: bool = False) -> dict:
        """What a resumed run needs from this side: now (at a step boundary), or as of the start
        of the running step (`step_start`: to redo a step that failed)."""
        if step_start:
            return self._snapshot
        return {"data": self.stream.state_dict(), "driver": self.driver.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["data"])
        self.driver.load_state_dict(state["driver"])

    def abort(self) -> None:
        """Cancel the running step's requests (on the rollout thread, which owns them)."""
        self.driver.call_soon(lambda: [pool.abort() for pool in self.pools.values()])

    def close(self) -> None:
        if getattr(self, "driver", None) is not None:
            self.driver.close()
        for pool in self.pools.values():
            pool.shutdown()


def memory_saver(config: TrainConfig) -> bool:
    """Time-shared colocation: SGLang must be able to release its memory (GPU only)."""
    return config.pipeline.time_shared and torch.cuda.is_available()


def _engine_gpus(engine) -> int:
    return 0 if engine.kind == "hf" else engine.num_engines * engine.tp_size


def engines_of_policy(config: TrainConfig, index: int):
    """Per-role policies get their own engines on the next GPUs (never the same ones)."""
    import dataclasses

    engine = config.engine
    if index == 0 or engine.kind == "hf":
        return engine
    return dataclasses.replace(engine, base_gpu_id=engine.base_gpu_id + index * _engine_gpus(engine))


def sample_metrics(samples: list[Sample]) -> dict[str, float]:
    """Rollout statistics of a step under "rollout/"; `engine_version_min/max`: the weight
    versions the engines reported for the step's tokens (the step's own version unless
    segment rollout carried samples over from earlier steps)."""
    out = {f"rollout/{k}": v for k, v in role_metrics(samples).items()}
    versions = [v for s in samples for v in s.metadata.get("token_versions") or ()]
    if versions:
        out["rollout/engine_version_min"], out["rollout/engine_version_max"] = min(versions), max(versions)
    return out

