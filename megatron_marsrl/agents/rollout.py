"""Grouped agentic training rollouts (MarsRL).

A trajectory of one problem is a chain of stages:

    turn 0 solver -> 1 verifier1 -> 2 corrector1 -> 3 verifier2 -> 4 corrector2 -> 5 verifier2 ...

at most `max_stages` of them. The Solver samples one group of G. Every later
stage takes k outputs of the stage before it (chosen by a selection strategy)
and samples a group of G for each, so every group shares one identical input,
which is what GRPO compares within. The Corrector only receives reviews that
flagged an error ("wrong"); the Verifier only receives solutions with text to
judge (not cut off, not empty). No eligible input ends the trajectory early.
Every sample is scored by its role's reward as soon as its stage finishes
(selection needs the rewards).

Selection of the k inputs ("random", "balanced", "adaptive", or an import path
to a `Selector`):
  random    uniform without replacement;
  balanced  half reward-1, half reward-0, topped up from the other side;
  adaptive  the Verifier gets wrong solutions first; the Corrector gets reviews
            that rightly found an error (reward 1) first; topped up at random.

`GroupedRollout.stage` is one async step; `trajectory` chains the steps for
one problem; `next_stage` gives the `PendingStage` a stage leaves open, which
the trainer's driver (rl/rollout_driver.py) runs in the next training step,
GPipe-like: new problems enter the Solver stage while the outputs of the
previous step move on to their next stage.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from megatron_marsrl import plugins
from megatron_marsrl.agents.client import Generator, SamplingParams, render_plain
from megatron_marsrl.agents.parsing import ParseCounter
from megatron_marsrl.agents.roles import RoleOutput, RoleSet, call_role
from megatron_marsrl.data_types import Group, ParseStatus, Problem, Sample, Verdict
from megatron_marsrl.rewards.agent_rewards import with_format_penalty

_NO_TEXT = (ParseStatus.TRUNCATED, ParseStatus.UNCLOSED_THINK, ParseStatus.EMPTY)


def stage_of(turn: int) -> tuple[str, str]:
    """(slot, stage name) of a turn: 0 solver, 1 verifier1, 2 corrector1, 3+ verifier2 / corrector2."""
    if turn < 0:
        raise ValueError(f"turn must be >= 0, got {turn}")
    if turn == 0:
        return "solver", "solver"
    slot = "verifier" if turn % 2 == 1 else "corrector"
    return slot, f"{slot}{1 if turn <= 2 else 2}"


@dataclass(kw_only=True)
class RolloutConfig:
    """Shape of the grouped rollouts."""

    group_size: int = 8
    """G: samples per same-input group."""
    inputs_per_stage: int = 2
    """k: outputs of a stage that each move on to the next stage."""
    max_stages: int = 5
    """S: most stages per trajectory, the Solver stage included."""
    selection: str = "adaptive"
    """"random", "balanced", "adaptive", or an import path "pkg.module:fn" to a `Selector`."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.85, top_p=1.0,
                                                                            max_tokens=16384))
    """Rollout sampling (MarsRL training: temperature 0.85, top-p 1.0)."""
    seed: int = 0
    """Seed of the input selection (combined with the problem id and stage)."""
    format_penalty: float = 0.0
    """Subtracted from the reward of outputs that failed to parse (truncated, no answer, no verdict)."""

    def __post_init__(self) -> None:
        for name in ("group_size", "inputs_per_stage", "max_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.format_penalty < 0:
            raise ValueError(f"format_penalty must be >= 0 (it is subtracted), got {self.format_penalty}")


class Selector(Protocol):
    """Extension point: choose up to k of the eligible outputs to pass to `next_slot`."""

    def __call__(self, candidates: Sequence[Sample], k: int, *, next_slot: str,
                 rng: random.Random) -> list[Sample]: ...


def _positive(sample: Sample) -> bool:
    return (sample.reward or 0.0) >= 0.5


def _take(preferred: Sequence[Sample], rest: Sequence[Sample], k: int, rng: random.Random) -> list[Sample]:
    """Up to k from `preferred` (random order), topped up from `rest`."""
    first = rng.sample(list(preferred), min(k, len(preferred)))
    return first + rng.sample(list(rest), min(k - len(first), len(rest)))


def select_random(candidates: Sequence[Sample], k: int, *, next_slot: str, rng: random.Random) -> list[Sample]:
    return rng.sample(list(candidates), min(k, len(candidates)))


def select_balanced(candidates: Sequence[Sample], k: int, *, next_slot: str, rng: random.Random) -> list[Sample]:
    pos = [s for s in candidates if _positive(s)]
    neg = [s for s in candidates if not _positive(s)]
    chosen = rng.sample(pos, min(k // 2, len(pos))) + rng.sample(neg, min(k - k // 2, len(neg)))
    taken = {id(s) for s in chosen}
    left = [s for s in candidates if id(s) not in taken]
    return chosen + rng.sample(left, min(k - len(chosen), len(left)))


def select_adaptive(candidates: Sequence[Sample], k: int, *, next_slot: str, rng: random.Random) -> list[Sample]:
    if next_slot == "verifier":  # wrong solutions teach the verifier to find errors
        prefer = lambda s: not _positive(s)  # noqa: E731
    elif next_slot == "corrector":  # reviews that rightly flagged an error are useful bug reports
        prefer = _positive
    else:
        return select_random(candidates, k, next_slot=next_slot, rng=rng)
    return _take([s for s in candidates if prefer(s)], [s for s in candidates if not prefer(s)], k, rng)


SELECTORS: dict[str, Selector] = {"random": select_random, "balanced": select_balanced, "adaptive": select_adaptive}


def get_selector(spec: str) -> Selector:
    """A built-in selection strategy by name, or a user one by import path."""
    return plugins.resolve(spec, SELECTORS, what="input selection strategy")


def eligible_inputs(samples: Sequence[Sample], next_slot: str) -> list[Sample]:
    """Outputs that may feed `next_slot`: judgeable solutions, or reviews that said "wrong"."""
    if next_slot == "verifier":
        return [s for s in samples if s.parse_status not in _NO_TEXT and s.passed_on]
    if next_slot == "corrector":
        return [s for s in samples if s.parsed == Verdict.WRONG.value]
    raise ValueError(f"no stage takes inputs into slot {next_slot!r}")


@dataclass(kw_only=True)
class PendingStage:
    """Inputs selected for the next stage of one problem's trajectory."""

    problem: Problem
    turn: int
    inputs: list[Sample]


class GroupedRollout:
    """Samples stages of the training trajectories; `generators` maps slot -> `Generator`."""

    def __init__(self, *, roles: RoleSet, generators: Mapping[str, Generator], config: RolloutConfig,
                 counter: ParseCounter | None = None) -> None:
        missing = [s for s in ("solver", "verifier", "corrector") if s not in generators]
        if missing:
            raise ValueError(f"generators need an entry per slot; missing {missing}")
        self.roles, self.generators, self.config = roles, generators, config
        self.counter = counter if counter is not None else ParseCounter()
        self.selector = get_selector(config.selection)
        self.salt = ""
        """Mixed into group ids and sampling seeds (the trainer sets the step), so a resumed run
        samples exactly what an uninterrupted one would."""

    async def stage(self, problem: Problem, turn: int, inputs: Sequence[Sample] = ()) -> list[Group]:
        """One async step: a group of G for each input (the Solver: one group, no input)."""
        if turn == 0:
            return [await self._group(problem, 0, None, 0)]
        if not inputs:
            raise ValueError(f"stage {stage_of(turn)[1]} of problem {problem.id} needs at least one input")
        return list(await asyncio.gather(*(self._group(problem, turn, parent, i) for i, parent in enumerate(inputs))))

    def next_stage(self, problem: Problem, turn: int, groups: Sequence[Group]) -> PendingStage | None:
        """The inputs chosen from `groups` (stage `turn`) for stage turn+1, or None when the trajectory ends."""
        if turn + 1 >= self.config.max_stages:
            return None
        next_slot = stage_of(turn + 1)[0]
        candidates = eligible_inputs([s for g in groups for s in g.samples], next_slot)
        # One generator per (seed, problem, stage): the choice does not depend on which
        # concurrent trajectory happened to finish first.
        rng = random.Random(f"{self.config.seed}:{problem.id}:{turn + 1}")
        chosen = self.selector(candidates, self.config.inputs_per_stage, next_slot=next_slot, rng=rng)
        return PendingStage(problem=problem, turn=turn + 1, inputs=list(chosen)) if chosen else None

    async def trajectory(self, problem: Problem) -> list[Group]:
        """All stages of one problem, one after the other."""
        groups = await self.stage(problem, 0)
        out, pending = list(groups), self.next_stage(problem, 0, groups)
        while pending is not None:
            groups = await self.stage(problem, pending.turn, pending.inputs)
            out.extend(groups)
            pending = self.next_stage(problem, pending.turn, groups)
        return out

    async def rollout(self, problems: Sequence[Problem],
                      on_done: Callable[[list[Group]], None] | None = None) -> list[Group]:
        """Whole trajectories of all `problems`, concurrently. `on_done` gets each problem's
        groups as soon as its trajectory ends (the trainer starts training them then)."""
        async def one(problem: Problem) -> list[Group]:
            groups = await self.trajectory(problem)
            if on_done is not None:
                on_done(groups)
            return groups

        per_problem = await asyncio.gather(*(one(p) for p in problems))
        return [g for groups in per_problem for g in groups]

    async def _group(self, problem: Problem, turn: int, parent: Sample | None, index: int) -> Group:
        slot, stage = stage_of(turn)
        role = getattr(self.roles, slot)
        inputs = _inputs(problem, slot, parent)
        # Ids (and the seeds derived from them) depend only on what the group answers, never on
        # timing or on how many groups ran before: a resumed run names and samples the same.
        group_id = f"{problem.id}/{stage}/{self.salt}t{turn}g{index}"
        key = f"{self.config.seed}:{self.salt}:{problem.id}:{turn}:{parent.sample_id if parent else ''}"
        sampling = dataclasses.replace(self.config.sampling, seed=zlib.crc32(key.encode()))
        outputs = await call_role(role, self.generators[slot], inputs, sampling,
                                  n=self.config.group_size, counter=self.counter)
        group = Group(group_id=group_id, role=role.name, stage=stage, turn=turn, problem_id=problem.id,
                      input_sample_id=parent.sample_id if parent else None)
        reward = with_format_penalty(role.reward, self.config.format_penalty)
        for i, out in enumerate(outputs):
            sample = _sample(out, f"{group_id}/{i}", group, parent, inputs)
            sample.reward = float(reward(sample, problem.answer))
            group.samples.append(sample)
        return group


def _inputs(problem: Problem, slot: str, parent: Sample | None) -> dict[str, str]:
    if slot == "solver":
        return {"problem": problem.problem}
    assert parent is not None
    if slot == "verifier":
        return {"problem": problem.problem, "solution": parent.passed_on}
    return {"problem": problem.problem, "solution": parent.inputs["solution"], "report": parent.passed_on}


def _sample(out: RoleOutput, sample_id: str, group: Group, parent: Sample | None,
            inputs: dict[str, str]) -> Sample:
    c = out.completion
    return Sample(sample_id=sample_id, role=group.role, stage=group.stage, turn=group.turn,
                  problem_id=group.problem_id, group_id=group.group_id,
                  parent_id=parent.sample_id if parent else None, inputs=dict(inputs),
                  prompt=c.prompt or render_plain(out.messages), prompt_token_ids=c.prompt_token_ids,
                  response=c.text, response_token_ids=c.token_ids, rollout_logprobs=c.logprobs,
                  finish_reason=c.finish_reason, parse_status=out.parsed.status, parsed=out.parsed.value,
                  passed_on=out.parsed.passed_on,
                  # The parent's reward says whether this sample's input was right (a verifier's
                  # solution, or a corrector's report): the statistics need it.
                  metadata={**({"parent_reward": parent.reward} if parent is not None else {}),
                            **({"token_versions": c.token_versions} if c.token_versions else {}),
                            **({"routed_experts": c.routed_experts} if c.routed_experts is not None else {})})
