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
    assert out["solver/reward_mean"] == 0.5 and out["verifier/reward_mean"] == 1.0
    # a role whose samples were not trained (evaluation) has no advantage statistics
    assert not any(k.startswith("verifier/advantage") for k in out)
    assert all(math.isfinite(v) for v in out.values())
