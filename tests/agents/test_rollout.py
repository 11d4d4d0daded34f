"""Grouped agentic training rollouts with a scripted generator."""
from __future__ import annotations

import asyncio
import itertools
import random
import re
import textwrap

import pytest

from megatron_marsrl.agents.roles import RoleSet
from megatron_marsrl.agents.rollout import (SELECTORS, GroupedRollout, RolloutConfig, eligible_inputs, get_selector,
                                            select_adaptive, select_balanced, stage_of)
from megatron_marsrl.data_types import ParseStatus, Problem, Sample

from .helpers import ScriptedGenerator, section

PROBLEM = Problem(id="p0", problem="[p0] What is 2+3?", answer="5")
WRONG_REVIEW = "Findings:\n1. Step 2 is wrong.\nVerdict: Wrong"


def mixed_respond():
    """Half the solutions right; the verifier right 3 times in 4; the corrector right 2 times in 3."""
    counter = itertools.count()

    def respond(role: str, prompt: str) -> str:
        i = next(counter)
        if role == "solver":
            return f"Adding.\n\\boxed{{{5 if i % 2 == 0 else 6}}}"
        if role == "corrector":
            return "\\boxed{5}" if i % 3 else "\\boxed{7}"
        judged = re.findall(r"\\boxed\{(\d+)\}", section(prompt, "Proposed solution:"))[-1]
        says_correct = (judged == "5") == (i % 4 != 0)
        return "Verdict: Correct" if says_correct else WRONG_REVIEW
    return respond


def expected_reward(s: Sample) -> float:
    """The MarsRL reward of a sample of `mixed_respond` on PROBLEM (2+3), from its own text."""
    if s.role == "verifier":
        judged_right = re.findall(r"\\boxed\{(\d+)\}", s.inputs["solution"])[-1] == "5"
        said_right = {"Verdict: Correct": True, WRONG_REVIEW: False}[s.response]
        return 1.0 if said_right == judged_right else 0.0
    return 1.0 if re.fullmatch(r".*\\boxed\{5\}", s.response, re.S) else 0.0


def rollout(respond=None, **cfg) -> tuple[GroupedRollout, ScriptedGenerator]:
    gen = ScriptedGenerator(respond=respond or mixed_respond())
    config = RolloutConfig(**{"group_size": 4, "inputs_per_stage": 2, "max_stages": 5, "seed": 0, **cfg})
    return GroupedRollout(roles=RoleSet(), generators={s: gen for s in ("solver", "verifier", "corrector")},
                          config=config), gen


def test_stage_names():
    assert [stage_of(t) for t in range(7)] == [
        ("solver", "solver"), ("verifier", "verifier1"), ("corrector", "corrector1"), ("verifier", "verifier2"),
        ("corrector", "corrector2"), ("verifier", "verifier2"), ("corrector", "corrector2")]


def test_trajectory_structure_and_links():
    ro, gen = rollout()
    groups = asyncio.run(ro.trajectory(PROBLEM))
    assert [g.stage for g in groups][:3] == ["solver", "verifier1", "verifier1"]
    assert max(g.turn for g in groups) == 4  # ran to the stage limit with this script
    by_id = {s.sample_id: s for g in groups for s in g.samples}
    assert len(by_id) == sum(len(g.samples) for g in groups)  # ids are unique
    for g in groups:
        assert len(g.samples) == 4 and len({s.prompt for s in g.samples}) == 1  # one input per group
        assert all(s.group_id == g.group_id and s.turn == g.turn for s in g.samples)
        # each sample's reward, worked out from what the script made it say (answer 5 is right)
        assert [s.reward for s in g.samples] == [expected_reward(s) for s in g.samples]
        assert len([x for x in groups if x.turn == g.turn]) <= (2 if g.turn else 1)  # k inputs per stage
        if g.turn == 0:
            continue
        parent = by_id[g.input_sample_id]
        assert parent.turn == g.turn - 1 and all(s.parent_id == parent.sample_id for s in g.samples)
        inputs = g.samples[0].inputs
        if g.role == "verifier":
            assert inputs["solution"] == parent.passed_on
        else:  # the corrector gets the judged solution and the review that flagged it
            assert parent.parsed == "wrong" and inputs["report"] == parent.passed_on
            assert inputs["solution"] == parent.inputs["solution"]
    assert {s.reward for g in groups for s in g.samples} == {0.0, 1.0}  # both outcomes were scored
    assert len(gen.requests) == len(groups) and all(r.n == 4 for _, r in gen.requests)


def test_rewards_are_agent_specific():
    ro, _ = rollout()
    groups = asyncio.run(ro.trajectory(PROBLEM))
    for s in (s for g in groups for s in g.samples):
        if s.role in ("solver", "corrector"):
            assert s.reward == float(s.parsed == "5")
        else:
            judged_right = s.inputs["solution"].endswith("\\boxed{5}")
            assert s.reward == float((s.parsed == "correct") == judged_right)


def test_no_flagged_error_ends_the_trajectory_before_the_corrector():
    ro, gen = rollout(respond=lambda role, prompt: "\\boxed{5}" if role == "solver" else "Verdict: Correct")
    groups = asyncio.run(ro.trajectory(PROBLEM))
    assert [g.stage for g in groups] == ["solver", "verifier1", "verifier1"]
    assert "corrector" not in gen.roles_called()


def test_stage_limit_and_repeated_stage_names():
    ro, _ = rollout(respond=lambda role, prompt: WRONG_REVIEW if role == "verifier" else "\\boxed{6}",
                    max_stages=7, inputs_per_stage=1)
    groups = asyncio.run(ro.trajectory(PROBLEM))
    assert [(g.turn, g.stage) for g in groups] == [
        (0, "solver"), (1, "verifier1"), (2, "corrector1"), (3, "verifier2"), (4, "corrector2"),
        (5, "verifier2"), (6, "corrector2")]
    ro3, _ = rollout(max_stages=3)
    assert max(g.turn for g in asyncio.run(ro3.trajectory(PROBLEM))) <= 2


def test_truncated_solutions_are_not_sent_to_the_verifier():
    ro, gen = rollout(respond=lambda role, prompt: ("\\boxed{5", "length") if role == "solver" else "x")
    groups = asyncio.run(ro.trajectory(PROBLEM))
    assert [g.stage for g in groups] == ["solver"]
    assert all(s.parse_status is ParseStatus.TRUNCATED and s.reward == 0.0 for s in groups[0].samples)
    assert ro.counter.count("solver", ParseStatus.TRUNCATED) == 4
    penalized, _ = rollout(respond=lambda role, prompt: ("\\boxed{5", "length") if role == "solver" else "x",
                           format_penalty=0.1)
    assert {s.reward for s in asyncio.run(penalized.trajectory(PROBLEM))[0].samples} == {-0.1}


def sample(i: int, reward: float, parsed: str | None = None) -> Sample:
    return Sample(sample_id=f"s{i}", role="r", stage="r", turn=0, problem_id="p", group_id="g", reward=reward,
                  parsed=parsed, passed_on="text")


@pytest.mark.parametrize("seed", range(5))
def test_selectors(seed):
    rng = random.Random(seed)
    pool = [sample(i, float(i % 2)) for i in range(8)]  # 4 positive, 4 negative
    for name, selector in SELECTORS.items():
        chosen = selector(pool, 3, next_slot="verifier", rng=rng)
        assert len(chosen) == 3 and len({s.sample_id for s in chosen}) == 3, name
        assert len(selector(pool[:2], 5, next_slot="corrector", rng=rng)) == 2, name  # fewer than k: all
    balanced = select_balanced(pool, 4, next_slot="verifier", rng=rng)
    assert sorted(s.reward for s in balanced) == [0.0, 0.0, 1.0, 1.0]
    one_sided = select_balanced([s for s in pool if s.reward == 0.0], 2, next_slot="verifier", rng=rng)
    assert [s.reward for s in one_sided] == [0.0, 0.0]  # topped up from the only side there is
    assert all(s.reward == 0.0 for s in select_adaptive(pool, 4, next_slot="verifier", rng=rng))
    assert all(s.reward == 1.0 for s in select_adaptive(pool, 4, next_slot="corrector", rng=rng))
    topped = select_adaptive(pool[:3], 3, next_slot="corrector", rng=rng)  # one preferred, two others
    assert sorted(s.reward for s in topped) == [0.0, 0.0, 1.0]


def test_eligible_inputs():
    sols = [sample(0, 1.0), sample(1, 0.0)]
    sols[1].parse_status = ParseStatus.TRUNCATED
    assert [s.sample_id for s in eligible_inputs(sols, "verifier")] == ["s0"]
    reviews = [sample(2, 1.0, "wrong"), sample(3, 1.0, "correct"), sample(4, 0.0, None)]
    assert [s.sample_id for s in eligible_inputs(reviews, "corrector")] == ["s2"]
    with pytest.raises(ValueError, match="no stage takes inputs into slot 'solver'"):
        eligible_inputs(sols, "solver")


def test_user_selector_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_selector_plugin.py").write_text(textwrap.dedent('''
        def first_k(candidates, k, *, next_slot, rng):
            return list(candidates)[:k]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_selector("my_selector_plugin:first_k")([sample(i, 0.0) for i in range(4)], 2,
                                                      next_slot="verifier", rng=random.Random(0))[1].sample_id == "s1"
    ro, _ = rollout(selection="my_selector_plugin:first_k")
    groups = asyncio.run(ro.trajectory(PROBLEM))
    solver_ids = [s.sample_id for s in groups[0].samples]
    assert [g.input_sample_id for g in groups if g.turn == 1] == solver_ids[:2]
    with pytest.raises(ValueError, match="unknown input selection strategy 'best'"):
        rollout(selection="best")


def test_config_validation():
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        RolloutConfig(group_size=0)


def test_selection_is_reproducible_and_seeded():
    def chosen(seed):
        ro, _ = rollout(respond=lambda role, prompt: "\\boxed{5}" if role == "solver" else "Verdict: Correct",
                        seed=seed, selection="random")
        groups = asyncio.run(ro.trajectory(PROBLEM))
        return [int(g.input_sample_id.rsplit("/", 1)[1]) for g in groups if g.turn == 1]

    assert chosen(0) == chosen(0)
    assert len({tuple(chosen(s)) for s in range(6)}) > 1
