"""95% intervals (megatron_marsrl/stats.py) against plain references."""
from __future__ import annotations

import math
import random

import pytest

from megatron_marsrl.stats import Estimate, bootstrap_figures, logged, wilson_interval


@pytest.mark.parametrize(("successes", "trials", "low", "high"), [
    # Wilson score intervals at z = 1.96, worked by hand from the textbook formula
    (8, 10, 0.4902, 0.9433),
    (0, 10, 0.0, 0.2775),
    (10, 10, 0.7225, 1.0),
    (50, 100, 0.4038, 0.5962),
])
def test_wilson_matches_the_textbook_values(successes, trials, low, high):
    got = wilson_interval(successes, trials)
    assert got.value == successes / trials and got.n == trials
    assert (got.low, got.high) == (pytest.approx(low, abs=1e-4), pytest.approx(high, abs=1e-4))


@pytest.mark.parametrize(("successes", "trials"), [(1, 0), (-1, 3), (4, 3)])
def test_wilson_refuses_impossible_counts(successes, trials):
    with pytest.raises(ValueError, match="successes <= trials"):
        wilson_interval(successes, trials)


def _plain_bootstrap(values: list[float], resamples: int, seed: int) -> tuple[float, float]:
    """The textbook percentile bootstrap of a mean, one loop per resample."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(values) for _ in values) / len(values) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples)]


def test_bootstrap_of_a_mean_matches_a_plain_bootstrap():
    rng = random.Random(0)
    values = [rng.random() ** 2 for _ in range(120)]
    got = bootstrap_figures([{"x": v} for v in values], lambda t: {"mean": t["x"] / len(values)}, seed="t",
                            resamples=4000)["mean"]
    low, high = _plain_bootstrap(values, 4000, seed=1)
    assert got.value == pytest.approx(sum(values) / len(values))
    assert got.n == 120
    # two independent bootstraps of 4000 resamples agree to well under the interval's width
    assert got.low == pytest.approx(low, abs=0.01) and got.high == pytest.approx(high, abs=0.01)
    # and both are close to the normal approximation for a mean of 120 values
    sd = math.sqrt(sum((v - got.value) ** 2 for v in values) / (len(values) - 1) / len(values))
    assert got.high - got.low == pytest.approx(2 * 1.96 * sd, rel=0.15)


def test_bootstrap_resamples_problems_not_samples():
    """Ten problems, four samples each, each problem all right or all wrong: the interval is as
    wide as ten independent draws allow, not forty."""
    units = [{"right": 4 * (i < 5), "samples": 4} for i in range(10)]
    got = bootstrap_figures(units, lambda t: {"accuracy": t["right"] / t["samples"]}, seed="x")["accuracy"]
    ten, forty = wilson_interval(5, 10), wilson_interval(20, 40)
    assert got.value == 0.5
    assert got.high - got.low > forty.high - forty.low
    assert got.high - got.low == pytest.approx(ten.high - ten.low, rel=0.25)


def test_bootstrap_is_seeded_and_skips_undefined_figures():
    units = [{"hit_wrong": 1, "on_wrong": 1}] + [{"hit_right": i % 2, "on_right": 1} for i in range(30)]

    def figures(t):
        out = {"recall_right": t["hit_right"] / t["on_right"]}
        if t["on_wrong"]:  # undefined in the resamples that draw no wrong solution
            out["recall_wrong"] = t["hit_wrong"] / t["on_wrong"]
        return out

    first, again = (bootstrap_figures(units, figures, seed="s") for _ in range(2))
    assert first == again
    assert first != bootstrap_figures(units, figures, seed="other")
    assert first["recall_wrong"] == Estimate(value=1.0, low=1.0, high=1.0, n=31)
    assert first["recall_right"].low < 0.5 < first["recall_right"].high
    assert bootstrap_figures([], figures) == {}
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_figures(units, figures, resamples=0)


def test_logged_names_the_interval_ends():
    e = Estimate(value=0.5, low=0.4, high=0.6, n=10)
    assert logged({"solver/accuracy": e}, "eval/") == {"eval/solver/accuracy": 0.5, "eval/solver/accuracy/ci_low": 0.4,
                                                      "eval/solver/accuracy/ci_high": 0.6}
