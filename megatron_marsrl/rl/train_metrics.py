"""Train metrics of a step: each micro-batch's values, each with the weight it is averaged by.

A step's train/<name> is the mean over its micro-batches (on every data-parallel rank) of
each micro-batch's value, weighted by the sequences that value averaged over: the micro-batch's
trained sequences, or for the per-role metrics (train/<role>/<name>, `ROLE_METRICS`) the role's
sequences in it. The weight travels with the value (`Weighted`); which metrics a role's
sequences weigh is declared here (`ROLE_METRICS`), not carried by companion count entries.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from megatron_marsrl.algorithms.losses import k3_kl
from megatron_marsrl.rl.config import ROLES


@dataclass(frozen=True)
class Weighted:
    """One micro-batch's value of a metric and its weight in the step's mean."""

    value: float
    weight: float
    """Sequences the value averaged over (0: it does not count)."""


ROLE_METRICS = ("mismatch_abs", "mismatch_k3", "entropy")
"""Metrics also reported per role, as `role_metric(role, name)`, each weighted by the role's
sequences in the micro-batch (not by all of them)."""


def role_metric(role: str, name: str) -> str:
    """The name of a `ROLE_METRICS` metric of one role (train/<role>/<name> once logged)."""
    return f"{role}/{name}"


def mismatch_metrics(logp: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, role_index: torch.Tensor,
                     entropy: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Train/rollout log-prob mismatch (|diff| and k3 KL) and entropy per response token, over
    the micro-batch and per role present (`role_metric` names); weights come from `weigh`."""
    out = _per_token_means(logp, rollout, mask, entropy)
    for i, role in enumerate(ROLES):
        rows = role_index == i
        if rows.any():
            role_mask = mask & rows[:, None].to(mask.device)
            role_means = _per_token_means(logp, rollout, role_mask, entropy)
            out.update({role_metric(role, k): v for k, v in role_means.items()})
    return out


def _per_token_means(logp: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                     entropy: torch.Tensor | None) -> dict[str, torch.Tensor]:
    n = mask.sum().clamp(min=1)
    zeros = torch.zeros_like(logp)
    out = {"mismatch_abs": torch.where(mask, (logp - rollout).abs(), zeros).sum() / n,
           "mismatch_k3": torch.where(mask, k3_kl(rollout, logp), zeros).sum() / n}
    if entropy is not None:
        out["entropy"] = torch.where(mask, entropy.detach(), zeros).sum() / n
    return out


def weigh(metrics: dict[str, float], response_mask: torch.Tensor, role_index: torch.Tensor) -> dict[str, Weighted]:
    """One micro-batch's metrics with their weights: a role's `ROLE_METRICS` by that role's
    sequences, every other metric by the sequences with a trained token."""
    trained = float(response_mask.any(-1).sum())
    by_role = {}
    for i, role in enumerate(ROLES):
        n = float((role_index == i).sum())
        by_role.update({role_metric(role, name): n for name in ROLE_METRICS})
    return {k: Weighted(float(v), by_role.get(k, trained)) for k, v in metrics.items()}


class MetricSums:
    """A step's weighted sums of train metrics, and its loss units per policy; picklable,
    gathered over data-parallel ranks and merged."""

    def __init__(self):
        self.sums: defaultdict[str, float] = defaultdict(float)
        self.weights: defaultdict[str, float] = defaultdict(float)
        self.nonfinite = 0.0
        """Values that were NaN/inf: counted (train/nonfinite_metrics), never averaged in."""
        self.units: defaultdict[str, float] = defaultdict(float)
        """Per policy: the loss aggregation units of the step (the optimizer step's normaliser)."""
        self.losses: defaultdict[str, float] = defaultdict(float)
        """Per policy: the summed (unnormalised) loss of its micro-batches."""
        self.applied: defaultdict[str, float] = defaultdict(float)
        """Per policy: the units already stepped on by the step's PPO mini-batch updates."""
        self.entropy: defaultdict[str, float] = defaultdict(float)
        """Per policy: summed token entropy of the trained tokens (DMMPT's gate)."""
        self.entropy_tokens: defaultdict[str, float] = defaultdict(float)
        """Per policy: the tokens `entropy` summed over."""

    def add(self, metrics: dict[str, Weighted]) -> None:
        """One micro-batch's metrics (`weigh`)."""
        for k, m in metrics.items():
            if not math.isfinite(m.value):  # a NaN must not hide in a mean
                self.nonfinite += 1.0
                continue
            self.sums[k] += m.value * m.weight
            self.weights[k] += m.weight

    def add_units(self, policy: str, units: float, loss: float) -> None:
        """One micro-batch's loss aggregation units and summed loss."""
        self.units[policy] += units
        self.losses[policy] += loss

    def add_entropy(self, policy: str, mean: float, tokens: float) -> None:
        """One micro-batch's mean token entropy over its `tokens` trained tokens."""
        if math.isfinite(mean):
            self.entropy[policy] += mean * tokens
            self.entropy_tokens[policy] += tokens

    def policy_entropy(self) -> dict[str, float]:
        """Each policy's mean token entropy over the tokens it trained."""
        return {p: self.entropy[p] / n for p, n in self.entropy_tokens.items() if n > 0}

    @classmethod
    def merged(cls, parts: list[MetricSums]) -> MetricSums:
        out = cls()
        for part in parts:
            for mine, theirs in ((out.sums, part.sums), (out.weights, part.weights),
                                 (out.units, part.units), (out.losses, part.losses), (out.applied, part.applied),
                                 (out.entropy, part.entropy), (out.entropy_tokens, part.entropy_tokens)):
                for k, v in theirs.items():
                    mine[k] += v
            out.nonfinite += part.nonfinite
        return out

    def means(self) -> dict[str, float]:
        """The weighted mean of each metric that had a finite value with a positive weight."""
        return {k: s / self.weights[k] for k, s in self.sums.items() if self.weights[k] > 0}
