"""Group-relative advantage estimators for multi-agent rollouts.

Every built-in estimator normalises each reward against the other rewards of its
group; they differ in what a group is, and RLOO in its baseline:

  grpo         same-input group (`group_index`): all samples answered the
               identical prompt. Textbook GRPO.
  grpo_pooled  problem: one normalisation over every agent's samples of the
               problem (the baseline Dr. MAS analyses: an agent whose rewards
               differ from the pooled ones gets inflated or starved gradients).
  drmas        (problem, agent): Dr. MAS agent-wise normalisation. Every call of
               an agent on a problem is pooled (Verifier1 and Verifier2 are one
               agent), so each agent is scaled by its own reward statistics.
  at_grpo      (problem, turn, agent): AT-GRPO. Prompts differ by turn and role,
               so a group never mixes turns or agents.
  rloo         same-input group, leave-one-out baseline: r_i minus the mean of
               the group's other rewards, never divided by a std (RLOO has none;
               `scale_by_std` does not apply).

`AdvantageConfig.scale_by_std=False` gives the mean-only variant (r - mean) of the
normalising estimators, which does not up-weight groups whose rewards barely vary.

Degenerate groups, handled explicitly rather than through eps:
  * a group of one sample has nothing to be compared with: advantage 0;
  * a group whose rewards are all equal (std 0) carries no preference:
    advantage exactly 0, with no division (equality is tested on the rewards,
    not on a computed std that rounding can leave slightly above 0).

Groups must be complete in the batch given (call this on the whole rollout
batch before it is sharded across data-parallel ranks).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_marsrl import plugins
from megatron_marsrl.data_types import Sample


@dataclass(frozen=True, kw_only=True)
class AdvantageBatch:
    """Per-sample rewards and the keys estimators group by; all 1-D of length N."""

    rewards: torch.Tensor
    """Scalar reward of each sample (float)."""
    group_index: torch.Tensor
    """Same-input group of each sample (integer ids, any values)."""
    problem_index: torch.Tensor
    """Problem of each sample (integer ids)."""
    agent_index: torch.Tensor
    """Agent (role) of each sample (integer ids): Verifier1 and Verifier2 are one agent."""
    turn_index: torch.Tensor
    """Stage position of each sample in its trajectory (0 = Solver)."""

    def __post_init__(self) -> None:
        if self.rewards.dim() != 1 or not self.rewards.is_floating_point():
            raise ValueError(f"rewards must be a 1-D float tensor, got shape {tuple(self.rewards.shape)} "
                             f"dtype {self.rewards.dtype}")
        n = self.rewards.shape[0]
        for name in ("group_index", "problem_index", "agent_index", "turn_index"):
            t = getattr(self, name)
            if t.shape != (n,) or t.is_floating_point():
                raise ValueError(f"{name} must be a 1-D integer tensor of length {n} (one per reward), "
                                 f"got shape {tuple(t.shape)} dtype {t.dtype}")


@dataclass(kw_only=True)
class AdvantageConfig:
    """How advantages are computed."""

    estimator: str = "grpo"
    """"grpo", "grpo_pooled", "drmas", "at_grpo", "rloo", or an import path "pkg.module:fn" to an
    `AdvantageEstimator`."""
    scale_by_std: bool = True
    """Divide by the group std; False gives the mean-only variant (r - mean)."""
    unbiased_std: bool = True
    """Use the sample std (divide by n-1), as torch.std and most GRPO code do; False: population std."""
    eps: float = 1e-6
    """Added to a non-zero std before dividing, so tiny stds do not explode."""

    def __post_init__(self) -> None:
        if not self.estimator:
            raise ValueError("estimator must be a name like 'grpo' or an import path 'pkg.module:fn'")
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")


class AdvantageEstimator(Protocol):
    """Extension point: maps a batch to one advantage per sample (shape [N], float)."""

    def __call__(self, batch: AdvantageBatch, config: AdvantageConfig) -> torch.Tensor: ...


def group_ids(*keys: torch.Tensor) -> torch.Tensor:
    """Dense ids 0..G-1 of the distinct key tuples (one row per sample)."""
    stacked = torch.stack([k.to(torch.int64) for k in keys], dim=1)
    _, inverse = torch.unique(stacked, dim=0, return_inverse=True)
    return inverse


def normalize_in_groups(rewards: torch.Tensor, groups: torch.Tensor, config: AdvantageConfig, *,
                        leave_one_out: bool = False) -> torch.Tensor:
    """(r - group mean) / (group std + eps), or r - group mean when not scaling; with
    `leave_one_out`, r - (mean of the other rewards of the group) = (r - mean) * n / (n - 1),
    never scaled (RLOO).

    `groups` holds dense ids 0..G-1. Singletons and groups whose rewards are all
    equal get exactly 0: equality is tested on the rewards themselves, because
    r - mean of equal float64 values can be a rounding residue ((0.1 + 0.1 +
    0.1) / 3 != 0.1) that a zero eps would blow up to about +-1.
    """
    num_groups = int(groups.max()) + 1 if groups.numel() else 0
    r = rewards.to(torch.float64)  # group sums over many samples; keep them exact
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, torch.ones_like(r))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, r) / count
    centered = r - mean[groups]
    lo, hi = _group_min_max(r, groups, num_groups)
    degenerate = (count < 2)[groups] | (lo == hi)[groups]
    if leave_one_out:
        centered = centered * (count / (count - 1).clamp(min=1))[groups]
    elif config.scale_by_std:
        sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, centered**2)
        dof = (count - 1) if config.unbiased_std else count
        std = (sq / dof.clamp(min=1)).sqrt()[groups]
        centered = torch.where(std > 0, centered / (std + config.eps), centered)
    centered = centered.masked_fill(degenerate, 0.0)
    return centered.to(rewards.dtype)


def _group_min_max(r: torch.Tensor, groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max of `r` (float64), indexed by dense group id."""
    lo = torch.full((num_groups,), float("inf"), dtype=torch.float64).scatter_reduce(0, groups, r, "amin")
    hi = torch.full((num_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(0, groups, r, "amax")
    return lo, hi


def grpo(batch: AdvantageBatch, config: AdvantageConfig) -> torch.Tensor:
    """GRPO: normalise within each same-input group."""
    return normalize_in_groups(batch.rewards, group_ids(batch.group_index), config)


def grpo_pooled(batch: AdvantageBatch, config: AdvantageConfig) -> torch.Tensor:
    """GRPO pooled over agents: normalise within each problem, every agent's samples together."""
    return normalize_in_groups(batch.rewards, group_ids(batch.problem_index), config)


def drmas(batch: AdvantageBatch, config: AdvantageConfig) -> torch.Tensor:
    """Dr. MAS: normalise within each (problem, agent), pooling every call of the agent."""
    return normalize_in_groups(batch.rewards, group_ids(batch.problem_index, batch.agent_index), config)


def at_grpo(batch: AdvantageBatch, config: AdvantageConfig) -> torch.Tensor:
    """AT-GRPO: normalise within each (problem, turn, agent)."""
    keys = group_ids(batch.problem_index, batch.turn_index, batch.agent_index)
    return normalize_in_groups(batch.rewards, keys, config)


def rloo(batch: AdvantageBatch, config: AdvantageConfig) -> torch.Tensor:
    """RLOO: within each same-input group, the reward minus the mean of the group's other rewards."""
    return normalize_in_groups(batch.rewards, group_ids(batch.group_index), config, leave_one_out=True)


ESTIMATORS: dict[str, AdvantageEstimator] = {"grpo": grpo, "grpo_pooled": grpo_pooled, "drmas": drmas,
                                             "at_grpo": at_grpo, "rloo": rloo}
POOL_ACROSS_STAGES = ("grpo_pooled", "drmas")
"""Built-in estimators whose groups span several stages of a problem's trajectory."""


def get_estimator(name: str) -> AdvantageEstimator:
    """A built-in estimator by name, or a user one by import path "pkg.module:fn"."""
    estimator = plugins.resolve(name, ESTIMATORS, what="advantage estimator")
    if not callable(estimator):
        raise TypeError(f"advantage estimator {name!r} resolved to {estimator!r}, which is not callable")
    return estimator


def compute_advantages(batch: AdvantageBatch, config: AdvantageConfig) -> torch.Tensor:
    """Run the configured estimator and check its output shape."""
    advantages = get_estimator(config.estimator)(batch, config)
    if not isinstance(advantages, torch.Tensor) or advantages.shape != batch.rewards.shape:
        raise ValueError(f"advantage estimator {config.estimator!r} must return a tensor of shape "
                         f"{tuple(batch.rewards.shape)}, got {getattr(advantages, 'shape', type(advantages))}")
    return advantages


def count_degenerate_groups(rewards: torch.Tensor, groups: torch.Tensor) -> dict[str, int]:
    """Numbers of groups, singleton groups and zero-std groups (logged per role as
    `{role}/zero_std_group_fraction`, rl/rollout_metrics.py)."""
    dense = group_ids(groups)
    num = int(dense.max()) + 1 if dense.numel() else 0
    count = torch.zeros(num, dtype=torch.int64).index_add_(0, dense, torch.ones_like(dense))
    lo, hi = _group_min_max(rewards.double(), dense, num)
    return {"groups": num, "singleton_groups": int((count == 1).sum()),
            "zero_std_groups": int(((lo == hi) & (count > 1)).sum())}


def batch_from_samples(samples: Sequence[Sample]) -> AdvantageBatch:
    """Build an `AdvantageBatch` from scored samples; the agent of a sample is its role, so
    every call of a role (Verifier1, Verifier2, ...) is one agent."""
    unscored = [s.sample_id for s in samples if s.reward is None]
    if unscored:
        raise ValueError(f"samples {unscored[:5]} have no reward; score them before computing advantages")

    def ids(values: list[object]) -> torch.Tensor:
        table: dict[object, int] = {}
        return torch.tensor([table.setdefault(v, len(table)) for v in values], dtype=torch.int64)

    return AdvantageBatch(
        rewards=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),  # type: ignore[arg-type]
        group_index=ids([s.group_id for s in samples]),
        problem_index=ids([s.problem_id for s in samples]),
        agent_index=ids([s.role for s in samples]),
        turn_index=torch.tensor([s.turn for s in samples], dtype=torch.int64),
    )
