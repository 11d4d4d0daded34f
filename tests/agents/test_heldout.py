"""The fixed held-out set (agents/heldout.py) and its figures with intervals."""
from __future__ import annotations

import asyncio
import re

import pytest

from megatron_marsrl.agents.heldout import check_roles, held_out_cases, near_miss, sample_held_out
from megatron_marsrl.agents.roles import RoleSet
from megatron_marsrl.agents.rollout import GroupedRollout, RolloutConfig
from megatron_marsrl.data_types import Problem
from megatron_marsrl.rl.rollout_metrics import held_out_figures

from .helpers import ScriptedGenerator, section


def _problems(n: int) -> list[Problem]:
    return [Problem(id=f"p{i}", problem=f"[p{i}] What is {i} + 1?", answer=str(i + 1)) for i in range(n)]


def test_near_miss_is_a_fixed_wrong_answer_close_to_the_right_one():
    problems = _problems(200) + [Problem(id="zero", problem="0 - 0", answer="0")]
    misses = [near_miss(p) for p in problems]
    assert misses == [near_miss(p) for p in problems]  # fixed
    for p, wrong in zip(problems, misses):
        assert wrong != p.answer and 0 <= int(wrong) and abs(int(wrong) - int(p.answer)) <= 3
    assert len({int(w) - int(p.answer) for p, w in zip(problems, misses)}) == 6  # every offset occurs
    assert near_miss(Problem(id="q", problem="x", answer="1/2")) is None


def _respond(role: str, prompt: str) -> str:
    """A Solver always right, a Verifier that accepts everything, a Corrector always right."""
    value = int(re.search(r"What is (\d+) \+ 1", prompt).group(1)) + 1
    if role == "verifier":
        assert re.search(r"\\boxed\{\d+\}", section(prompt, "Proposed solution:"))
        return "Verdict: Correct"
    return f"So \\boxed{{{value}}}"


def test_each_role_is_measured_on_its_fixed_cases_with_intervals():
    gen = ScriptedGenerator(respond=_respond)
    grouped = GroupedRollout(roles=RoleSet(), generators={s: gen for s in ("solver", "verifier", "corrector")},
                             config=RolloutConfig(group_size=3, seed=0))
    problems = _problems(40) + [Problem(id="frac", problem="[frac] What is 0 + 1?", answer="1/2")]
    cases = held_out_cases(problems)
    check_roles(grouped.roles, cases)
    samples = asyncio.run(sample_held_out(grouped, cases))
    by_role = {r: [s for s in samples if s.role == r] for r in ("solver", "verifier", "corrector")}
    # k=3 samples of the Solver per problem; of the Verifier on a right and a wrong solution and of
    # the Corrector on the wrong one, for the 40 problems with an integer answer
    assert [len(v) for v in by_role.values()] == [41 * 3, 40 * 2 * 3, 40 * 3]
    judged = sorted({s.inputs["solution"] for s in by_role["verifier"] if s.problem_id == "p4"})
    wrong = near_miss(problems[4])
    assert judged == sorted(["The final answer is \\boxed{5}.", f"The final answer is \\boxed{{{wrong}}}."])
    got = held_out_figures(samples, seed="t")
    assert got["verifier/balanced_accuracy"].value == 0.5  # accepting everything is chance, by design
    assert got["verifier/recall_correct"].value == 1.0 and got["verifier/recall"].value == 0.0
    assert got["corrector/fix_rate"].value == 1.0
    solver = got["solver/accuracy"]
    assert solver.n == 41 and solver.value == pytest.approx(120 / 123)  # the fraction problem is never right
    assert solver.low < solver.value <= solver.high == 1.0
    assert not any(k.endswith("/samples") for k in got)
    # the same samples give the same intervals (seeded); the cases are the same at every evaluation
    assert held_out_figures(samples, seed="t") == got and held_out_cases(problems) == cases


def test_a_role_set_whose_verifier_cannot_read_the_fixed_solutions_is_refused():
    cases = held_out_cases(_problems(3))
    with pytest.raises(ValueError, match="solution_text"):
        check_roles(RoleSet(solution_text=lambda answer: f"I think it is {answer}"), cases)
