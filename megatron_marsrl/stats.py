"""95% intervals for held-out figures (no Megatron or SGLang).

Two rules, one per kind of figure:
  * `wilson_interval`: a plain proportion of independent trials (one trial per problem);
  * `bootstrap_figures`: anything else - several samples per problem, ratios, the mean of two
    recalls - resampling *problems* (the unit that was drawn), so the k samples of one problem
    never count as k independent draws. A figure is computed from additive per-problem counts
    (a `Tally`: samples, right answers, verdicts, ...), so a resample is a sum of rows and the
    figure's rule is written once, where the counts are made (rl/rollout_metrics.py).

The bootstrap is seeded and sums integer counts exactly: the same outcomes give the same
interval on every machine.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

Z95 = 1.959963984540054
"""The standard normal's 97.5% quantile."""
BOOTSTRAP_RESAMPLES = 2000
"""Resamples per bootstrap interval (the percentile error at 2.5% is ~0.35% of the spread)."""

Tally = Counter
"""Additive counts of one unit (a problem), keyed by any hashable name, e.g. ("solver", "right")."""


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """A figure with its 95% interval."""

    value: float
    """The point estimate (of all units)."""
    low: float
    """Lower end of the 95% interval."""
    high: float
    """Upper end of the 95% interval."""
    n: int
    """Units (problems) it was computed from."""

    def scalars(self, key: str) -> dict[str, float]:
        """``{key: value, key/ci_low: low, key/ci_high: high}`` (the logged form)."""
        return {key: self.value, f"{key}/ci_low": self.low, f"{key}/ci_high": self.high}


def wilson_interval(successes: int, trials: int) -> Estimate:
    """Wilson score interval of `successes` out of `trials` independent trials."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"wilson_interval needs 0 <= successes <= trials and trials >= 1, "
                         f"got {successes} of {trials}")
    p = successes / trials
    denom = 1 + Z95 ** 2 / trials
    centre = (p + Z95 ** 2 / (2 * trials)) / denom
    half = Z95 * math.sqrt(p * (1 - p) / trials + Z95 ** 2 / (4 * trials ** 2)) / denom
    return Estimate(value=p, low=max(0.0, centre - half), high=min(1.0, centre + half), n=trials)


def bootstrap_figures(units: Sequence[Mapping[Hashable, float]],
                      figures: Callable[[Mapping[Hashable, float]], Mapping[str, float]], *,
                      seed: str = "", resamples: int = BOOTSTRAP_RESAMPLES) -> dict[str, Estimate]:
    """Percentile bootstrap over `units` (per-problem tallies, resampled with replacement) of
    every figure `figures` computes from the tallies' sum. A figure a resample leaves undefined
    (e.g. a recall with no wrong solution drawn) is left out of that resample's draws."""
    if resamples < 1:
        raise ValueError(f"bootstrap_figures: resamples={resamples} must be >= 1")
    if not units:
        return {}
    keys = sorted({k for u in units for k in u}, key=repr)
    rows = torch.tensor([[float(u.get(k, 0.0)) for k in keys] for u in units], dtype=torch.float64)
    point = figures(dict(zip(keys, rows.sum(0).tolist())))
    rng = random.Random(f"bootstrap:{seed}:{len(units)}")  # the same indices on every machine
    index = torch.tensor([[rng.randrange(len(units)) for _ in units] for _ in range(resamples)])
    times_drawn = torch.zeros(resamples, len(units), dtype=torch.float64).scatter_add_(
        1, index, torch.ones(index.shape, dtype=torch.float64))
    draws: dict[str, list[float]] = {name: [] for name in point}
    for sums in (times_drawn @ rows).tolist():
        for name, value in figures(dict(zip(keys, sums))).items():
            if name in draws and math.isfinite(value):
                draws[name].append(value)
    out = {}
    for name, value in point.items():
        got = sorted(draws[name])
        low = got[int(0.025 * (len(got) - 1))] if got else value
        high = got[math.ceil(0.975 * (len(got) - 1))] if got else value
        out[name] = Estimate(value=value, low=min(low, value), high=max(high, value), n=len(units))
    return out


def logged(estimates: Mapping[str, Estimate], prefix: str = "") -> dict[str, float]:
    """The scalars of several estimates: ``prefix + name`` and its ``/ci_low``, ``/ci_high``."""
    return {k: v for name, e in estimates.items() for k, v in e.scalars(prefix + name).items()}
