"""Per-role rollout statistics (rl/rollout_metrics.py): advantages are read from the samples."""
from __future__ import annotations

import math

import pytest

from megatron_marsrl.data_types import Sample
from megatron_marsrl.rl.rollout_metrics import role_metrics


def _sample(i: int, role: str, reward: float, advantage: float | None) -> Sample:
    return Sample(sample_id=f"p0/{role}/{i}", role=role, stage=role, turn=0, problem_id="p0", group_id=f"p0/{role}",
                  response_token_ids=[1, 2, 3], reward=reward, advantage=advantage)


def test_advantage_statistics_come_from_each_samples_advantage():
    samples = [_sample(0, "solver", 1.0, 0.5), _sample(1, "solver", 0.0, -1.5), _sample(2, "verifier", 1.0, None)]
    out = role_metrics(samples)
    assert out["solver/advantage_mean"] == pytest.approx(-0.5)
    assert out["solver/advantage_std"] == pytest.approx(1.0)
    assert out["solver/advantage_abs_mean"] == pytest.approx(1.0)
    assert out["solver/advantage_second_moment"] == pytest.approx((0.25 + 2.25) / 2)
    assert out["solver/reward_mean"] == 0.5 and out["verifier/reward_mean"] == 1.0
    # a role whose samples were not trained (evaluation) has no advantage statistics
    assert not any(k.startswith("verifier/advantage") for k in out)
    assert all(math.isfinite(v) for v in out.values())


def test_advantage_share_shows_the_imbalance_dr_mas_removes():
    """Pooled normalisation gives a role with a different reward level larger advantages; the
    per-role share of the summed A^2 makes that visible."""
    big = [_sample(i, "solver", 0.0, a) for i, a in enumerate((2.0, -2.0))]
    small = [_sample(i, "verifier", 1.0, a) for i, a in enumerate((0.5, -0.5, 0.5, -0.5))]
    out = role_metrics(big + small)
    assert out["solver/advantage_share"] == pytest.approx(8 / 9)
    assert out["verifier/advantage_share"] == pytest.approx(1 / 9)
    assert out["solver/advantage_second_moment"] == pytest.approx(4.0)
    assert out["verifier/advantage_second_moment"] == pytest.approx(0.25)


def _grouped(i: int, role: str, group: str, reward: float, advantage: float | None) -> Sample:
    return Sample(sample_id=f"s{i}", role=role, stage=role, turn=0, problem_id="p", group_id=group, reward=reward,
                  advantage=advantage)


def test_zero_std_group_fraction_per_role():
    rows = [("solver", "g0", 1.0), ("solver", "g0", 1.0), ("solver", "g1", 0.0), ("solver", "g1", 1.0),
            ("verifier", "g2", 0.0), ("verifier", "g2", 0.0), ("verifier", "g3", 1.0)]  # g3: one sample
    out = role_metrics([_grouped(i, role, g, r, 0.0) for i, (role, g, r) in enumerate(rows)])
    assert out["solver/zero_std_group_fraction"] == pytest.approx(0.5)
    assert out["verifier/zero_std_group_fraction"] == pytest.approx(0.5)
    evaluated = [_grouped(i, role, g, r, None) for i, (role, g, r) in enumerate(rows)]
    assert "solver/zero_std_group_fraction" not in role_metrics(evaluated)  # evaluation: no advantages


def _review(i: int, solution_right: bool, verdict: str | None) -> Sample:
    return Sample(sample_id=f"v{i}", role="verifier", stage="verifier1", turn=1, problem_id="p", group_id="g",
                  reward=0.0, parsed=verdict, metadata={"parent_reward": 1.0 if solution_right else 0.0})


def test_verifier_balanced_accuracy_gives_a_constant_verdict_one_half():
    always_no = [_review(i, right, "wrong") for i, right in enumerate([True] + [False] * 9)]
    out = role_metrics(always_no)
    assert out["verifier/recall"] == 1.0 and out["verifier/recall_correct"] == 0.0
    assert out["verifier/balanced_accuracy"] == 0.5  # its plain accuracy would be 0.9
    mixed = [_review(0, True, "correct"), _review(1, True, None), _review(2, False, "wrong"), _review(3, False, "wrong"),
             _review(4, False, "correct"), _review(5, False, None)]
    out = role_metrics(mixed)
    assert out["verifier/recall_correct"] == 0.5  # a missing verdict is a miss
    assert out["verifier/balanced_accuracy"] == pytest.approx((0.5 + 2 / 4) / 2)
    assert out["verifier/recall"] == pytest.approx(2 / 3)  # parsed verdicts only, as before
    assert "verifier/balanced_accuracy" not in role_metrics([_review(0, True, "correct")])  # one class only


def test_truncated_fraction_counts_outputs_that_hit_the_token_limit():
    samples = [_sample(i, "solver", 0.0, None) for i in range(4)]
    for s, reason in zip(samples, ("length", "stop", "length", "")):
        s.finish_reason = reason
    assert role_metrics(samples)["solver/truncated_fraction"] == 0.5
