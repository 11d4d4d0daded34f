"""The rollout driver's pipeline mode with scripted agents (no engine, no Megatron)."""
from __future__ import annotations

from megatron_marsrl.data_types import Group, Problem
from megatron_marsrl.rl.rollout_driver import RolloutDriver

from ..agents.test_rollout import PROBLEM, rollout


def run_step(driver: RolloutDriver, step: int, problems: list[Problem]) -> list[Group]:
    driver.start_step(step, problems)
    groups = []
    while (unit := driver.next_unit(timeout=60)) is not None:
        groups += unit
    return groups


def test_pipelined_steps_advance_every_trajectory_by_one_stage():
    ro, _ = rollout()
    driver = RolloutDriver(ro, mode="pipeline")
    a, b = PROBLEM, Problem(id="p1", problem="[p1] What is 2+3?", answer="5")
    try:
        step1 = run_step(driver, 0, [a])
        assert [(g.problem_id, g.turn) for g in step1] == [("p0", 0)]
        step2 = run_step(driver, 1, [b])
        assert sorted({(g.problem_id, g.turn) for g in step2}) == [("p0", 1), ("p1", 0)]
        seen = step1 + step2
        for step in range(2, 12):
            if not driver.pending:
                break
            seen += run_step(driver, step, [])
    finally:
        driver.close()
    assert not driver.pending and max(g.turn for g in seen) <= 4
    assert {g.problem_id for g in seen if g.turn == 1} == {"p0", "p1"}
