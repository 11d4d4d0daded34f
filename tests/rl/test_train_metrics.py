"""Train metric weighting (rl/train_metrics.py) against a serial reference."""
from __future__ import annotations

import math
import pickle

import pytest
import torch

from megatron_marsrl.rl.config import ROLES
from megatron_marsrl.rl.train_metrics import MetricSums, Weighted, mismatch_metrics, role_metric, weigh

SOLVER, VERIFIER = ROLES.index("solver"), ROLES.index("verifier")


def test_role_metrics_weigh_by_the_roles_sequences_and_the_rest_by_trained_ones():
    mask = torch.tensor([[True, True], [True, False], [False, False]])  # the third trains nothing
    roles = torch.tensor([SOLVER, SOLVER, VERIFIER])
    logp, rollout = torch.zeros(3, 2), torch.tensor([[0.1, 0.3], [0.2, 9.0], [5.0, 5.0]])
    metrics = {k: float(v) for k, v in mismatch_metrics(logp, rollout, mask, roles, None).items()}
    assert metrics["mismatch_abs"] == pytest.approx(0.2)  # per trained token: (0.1 + 0.3 + 0.2) / 3
    assert metrics[role_metric("solver", "mismatch_abs")] == pytest.approx(0.2)
    assert metrics[role_metric("verifier", "mismatch_abs")] == 0.0  # no trained token
    assert role_metric("corrector", "mismatch_abs") not in metrics  # absent role
    weighted = weigh({**metrics, "pg_loss": 1.0}, mask, roles)
    assert weighted["pg_loss"] == Weighted(1.0, 2.0) and weighted["mismatch_abs"].weight == 2.0
    assert weighted[role_metric("solver", "mismatch_k3")].weight == 2.0
    assert weighted[role_metric("verifier", "mismatch_abs")].weight == 1.0


def test_step_means_over_micro_batches_and_ranks_match_the_serial_reference():
    batches = [  # (rank, {name: (value, weight)})
        (0, {"pg_loss": (1.0, 2.0), "solver/entropy": (0.5, 2.0)}),
        (0, {"pg_loss": (4.0, 1.0), "solver/entropy": (2.0, 1.0), "verifier/entropy": (3.0, 1.0)}),
        (1, {"pg_loss": (float("nan"), 3.0), "solver/entropy": (1.0, 0.0)}),
        (1, {"pg_loss": (7.0, 3.0)}),
    ]
    parts = [MetricSums(), MetricSums()]
    for rank, metrics in batches:
        parts[rank].add({k: Weighted(v, w) for k, (v, w) in metrics.items()})
    parts[0].add_units("shared", 4.0, 2.0)
    parts[1].add_units("shared", 6.0, 1.0)
    total = MetricSums.merged([pickle.loads(pickle.dumps(p)) for p in parts])  # as all_gather_object does
    means = total.means()
    assert means["pg_loss"] == pytest.approx((1.0 * 2 + 4.0 * 1 + 7.0 * 3) / 6)
    assert means["solver/entropy"] == pytest.approx((0.5 * 2 + 2.0 * 1) / 3)  # weight 0 does not count
    assert means["verifier/entropy"] == 3.0
    assert total.nonfinite == 1.0 and all(math.isfinite(v) for v in means.values())
    assert total.units["shared"] == 10.0 and total.losses["shared"] == 3.0
