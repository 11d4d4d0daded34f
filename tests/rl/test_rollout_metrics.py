"""Per-role rollout statistics on hand-made samples."""
from __future__ import annotations

import pytest

from megatron_marsrl.data_types import Sample
from megatron_marsrl.rl.rollout_metrics import role_metrics


def sample(i: int, role: str, group: str, reward: float) -> Sample:
    return Sample(sample_id=f"s{i}", role=role, stage=role, turn=0, problem_id="p", group_id=group, reward=reward)


def test_zero_std_group_fraction_per_role():
    rows = [("solver", "g0", 1.0), ("solver", "g0", 1.0), ("solver", "g1", 0.0), ("solver", "g1", 1.0),
            ("verifier", "g2", 0.0), ("verifier", "g2", 0.0), ("verifier", "g3", 1.0)]  # g3: one sample
    samples = [sample(i, role, g, r) for i, (role, g, r) in enumerate(rows)]
    out = role_metrics(samples, {s.sample_id: 0.0 for s in samples})
    assert out["solver/zero_std_group_fraction"] == pytest.approx(0.5)
    assert out["verifier/zero_std_group_fraction"] == pytest.approx(0.5)
    assert "solver/zero_std_group_fraction" not in role_metrics(samples)  # evaluation: no advantages
