"""The fixed held-out set the trainer's periodic evaluation measures each role on.

Per held-out problem, k samples (`task.eval_samples`) of each case:

    Solver     the problem;
    Verifier   two fixed solutions: the right answer and a near miss (`near_miss`), so half the
               solutions it judges are right and half wrong, the same ones at every evaluation
               (its balanced accuracy does not depend on what the Solver happens to produce);
    Corrector  the near miss with a fixed rejection (`RoleSet.rejection_report`).

The cases go through `GroupedRollout.stage` like training inputs, with stand-in parent samples
whose reward says whether the input is right: the statistics' rules (rl/rollout_metrics.py)
read them exactly as they read a training rollout. A problem whose answer is not an integer has
no near miss here: it is measured for the Solver only.
"""
from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_marsrl.agents.roles import RoleSet
from megatron_marsrl.agents.rollout import GroupedRollout
from megatron_marsrl.data_types import Problem, Sample, Verdict

NEAR_MISS_OFFSETS = (-3, -2, -1, 1, 2, 3)
"""How far a fixed wrong answer lies from the right one."""


def near_miss(problem: Problem) -> str | None:
    """A wrong integer answer within 3 of the right one, fixed by the problem id (never below 0
    when the right answer is not); None when the answer is not an integer."""
    try:
        right = int(problem.answer.strip())
    except ValueError:
        return None
    offset = NEAR_MISS_OFFSETS[zlib.crc32(f"near_miss:{problem.id}".encode()) % len(NEAR_MISS_OFFSETS)]
    wrong = right + offset
    return str(right + abs(offset) if right >= 0 > wrong else wrong)


@dataclass(frozen=True, kw_only=True)
class HeldOutCase:
    """One held-out problem's fixed inputs."""

    problem: Problem
    wrong_answer: str | None
    """The near miss the Verifier judges (next to the right answer) and the Corrector fixes;
    None: the Solver only."""


def held_out_cases(problems: Sequence[Problem]) -> list[HeldOutCase]:
    """The fixed case of each problem (the same at every evaluation and on every machine)."""
    return [HeldOutCase(problem=p, wrong_answer=near_miss(p)) for p in problems]


def _stand_in(problem: Problem, name: str, *, role: str, inputs: dict[str, str], passed_on: str,
              reward: float, parsed: str | None = None) -> Sample:
    """A parent sample that was never generated: the fixed input of a held-out case."""
    return Sample(sample_id=f"{problem.id}/heldout/{name}", role=role, stage="heldout", turn=-1,
                  problem_id=problem.id, group_id=f"{problem.id}/heldout", inputs=inputs,
                  passed_on=passed_on, parsed=parsed, reward=reward)


async def sample_case(grouped: GroupedRollout, case: HeldOutCase) -> list[Sample]:
    """The samples of one case: the Solver's group, the Verifier's two, the Corrector's one
    (each of `grouped.config.group_size`)."""
    problem, roles = case.problem, grouped.roles
    stages = [grouped.stage(problem, 0)]
    if case.wrong_answer is not None:
        right = roles.solution_text(problem.answer)
        wrong = roles.solution_text(case.wrong_answer)
        solutions = [_stand_in(problem, "right", role="solver", inputs={"problem": problem.problem},
                               passed_on=right, reward=1.0),
                     _stand_in(problem, "wrong", role="solver", inputs={"problem": problem.problem},
                               passed_on=wrong, reward=0.0)]
        rejection = _stand_in(problem, "rejection", role="verifier", inputs={"problem": problem.problem,
                                                                             "solution": wrong},
                              passed_on=roles.rejection_report, reward=1.0, parsed=Verdict.WRONG.value)
        stages += [grouped.stage(problem, 1, solutions), grouped.stage(problem, 2, [rejection])]
    groups = [g for stage in await asyncio.gather(*stages) for g in stage]
    return [s for g in groups for s in g.samples]


async def sample_held_out(grouped: GroupedRollout, cases: Sequence[HeldOutCase]) -> list[Sample]:
    """Every case's samples, concurrently (the engines batch them)."""
    per_case = await asyncio.gather(*(sample_case(grouped, c) for c in cases))
    return [s for samples in per_case for s in samples]


def check_roles(roles: RoleSet, cases: Sequence[HeldOutCase]) -> None:
    """Fail early when the Verifier's reward cannot tell the fixed solutions apart (a
    `RoleSet.solution_text` its reward does not read back)."""
    for case in cases:
        if case.wrong_answer is None:
            continue
        p = case.problem
        for answer, right in ((p.answer, True), (case.wrong_answer, False)):
            probe = Sample(sample_id="probe", role="verifier", stage="verifier1", turn=1, problem_id=p.id,
                           group_id="probe", inputs={"problem": p.problem, "solution": roles.solution_text(answer)},
                           parsed=Verdict.CORRECT.value)
            if (roles.verifier.reward(probe, p.answer) >= 0.5) != right:
                raise ValueError(f"held-out set: the Verifier's reward does not read the answer {answer!r} back "
                                 f"from RoleSet.solution_text({answer!r}) = {roles.solution_text(answer)!r}; "
                                 "give the role set a solution_text its Verifier reward parses")
        return
