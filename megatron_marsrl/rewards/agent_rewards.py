"""Agent-specific binary rewards (MarsRL) and the reward extension point.

Each agent is scored against the reference answer, never by how the whole
trajectory ended:
  * Solver / Corrector (`answer_reward`): 1 if the final answer parsed from
    its solution matches the reference, else 0;
  * Verifier (`verdict_reward`): 1 if its verdict is right about the solution
    it judged (flags a wrong one, passes a correct one), else 0. A missing
    verdict is never right.

A reward function is any callable `(sample, reference_answer) -> float`
(`RewardFn`); each role carries its own, so a user reward comes with a user role
(agents/roles.py, by import path). `with_format_penalty` subtracts a constant from
outputs that failed to parse.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from megatron_marsrl.agents.parsing import extract_answer
from megatron_marsrl.data_types import Sample, Verdict
from megatron_marsrl.rewards.math_match import answers_match


class RewardFn(Protocol):
    """Extension point: the reward of one parsed sample, given the reference answer."""

    def __call__(self, sample: Sample, reference_answer: str) -> float: ...


def answer_reward(sample: Sample, reference_answer: str) -> float:
    """Solver / Corrector: 1.0 when the parsed final answer matches the reference."""
    return 1.0 if answers_match(sample.parsed, reference_answer) else 0.0


def verdict_reward(sample: Sample, reference_answer: str, *,
                   extract: Callable[[str], str | None] = extract_answer) -> float:
    """Verifier: 1.0 when its verdict is right about `sample.inputs["solution"]`, whose final
    answer `extract` reads (the boxed answer of the math task by default)."""
    if "solution" not in sample.inputs:
        raise ValueError(f"verifier sample {sample.sample_id} has no 'solution' input; "
                         "verdict_reward needs the solution the verifier judged")
    if sample.parsed not in (Verdict.CORRECT.value, Verdict.WRONG.value):
        return 0.0
    solution_is_correct = answers_match(extract(sample.inputs["solution"]), reference_answer)
    said_correct = sample.parsed == Verdict.CORRECT.value
    return 1.0 if said_correct == solution_is_correct else 0.0


@dataclass(frozen=True)
class FormatPenalized:
    """A reward minus `penalty` whenever the sample's output failed to parse."""

    base: RewardFn
    penalty: float

    def __call__(self, sample: Sample, reference_answer: str) -> float:
        reward = self.base(sample, reference_answer)
        return reward - self.penalty if sample.parse_status.is_failure else reward


def with_format_penalty(base: RewardFn, penalty: float) -> RewardFn:
    """`base`, minus `penalty` (>= 0) for unparsable / truncated outputs; `base` itself if 0."""
    if penalty < 0:
        raise ValueError(f"format penalty must be >= 0 (it is subtracted), got {penalty}")
    return base if penalty == 0 else FormatPenalized(base, penalty)
