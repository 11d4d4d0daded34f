"""Advantage estimators against a slow python-loop reference, plus properties."""
from __future__ import annotations

import math
import random
import textwrap
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_marsrl.algorithms.advantages import (ESTIMATORS, AdvantageBatch, AdvantageConfig,
                                                   batch_from_samples, compute_advantages,
                                                   count_degenerate_groups, get_estimator)
from megatron_marsrl.data_types import Sample

# which key tuple each estimator groups by, spelled out independently of the implementation
KEYS = {
    "grpo": lambda s: s["group"],
    "grpo_pooled": lambda s: s["problem"],
    "drmas": lambda s: (s["problem"], s["agent"]),
    "at_grpo": lambda s: (s["problem"], s["turn"], s["agent"]),
    "rloo": lambda s: s["group"],
}


def reference(rows: list[dict], key, *, scale: bool, unbiased: bool, eps: float,
              leave_one_out: bool = False) -> list[float]:
    members = defaultdict(list)
    for i, row in enumerate(rows):
        members[key(row)].append(i)
    out = [0.0] * len(rows)
    for idx in members.values():
        vals = [rows[i]["reward"] for i in idx]
        if len(set(vals)) == 1:
            continue  # a singleton or an all-equal group carries no preference
        if leave_one_out:  # RLOO: each reward against the mean of the others, no std
            for i in idx:
                others = [rows[j]["reward"] for j in idx if j != i]
                out[i] = rows[i]["reward"] - sum(others) / len(others)
            continue
        mean = sum(vals) / len(vals)
        var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1 if unbiased else len(vals))
        std = math.sqrt(var)
        for i in idx:
            centered = rows[i]["reward"] - mean
            out[i] = centered / (std + eps) if scale and std > 0 else centered
    return out


def random_rollout(rng: random.Random) -> list[dict]:
    """Samples shaped like a multi-agent rollout: groups of varied size per (problem, turn, input).

    Agents recur over turns (Dr. MAS pools them) and, as in AT-GRPO, a second
    agent (3) may act in the same turn as another one.
    """
    rows = []
    binary = rng.random() < 0.5
    for problem in range(rng.randint(1, 4)):
        for turn in range(rng.randint(1, 5)):
            for inp in range(1 if turn == 0 else rng.randint(1, 3)):
                agent = 0 if turn == 0 else (3 if rng.random() < 0.3 else (1 if turn % 2 else 2))
                size = rng.choice([1, 2, 3, 8])
                constant = rng.random() < 0.2
                first = float(rng.randint(0, 1))
                for _ in range(size):
                    reward = first if constant else (float(rng.randint(0, 1)) if binary else rng.uniform(-2, 3))
                    rows.append({"problem": 10 * problem + 3, "turn": turn, "agent": agent,
                                 "group": (problem, turn, inp), "reward": reward})
    rng.shuffle(rows)
    return rows


def to_batch(rows: list[dict]) -> AdvantageBatch:
    groups = {g: i for i, g in enumerate(dict.fromkeys(r["group"] for r in rows))}
    return AdvantageBatch(
        rewards=torch.tensor([r["reward"] for r in rows], dtype=torch.float32),
        group_index=torch.tensor([groups[r["group"]] * 7 + 100 for r in rows]),  # ids need not be dense
        problem_index=torch.tensor([r["problem"] for r in rows]),
        agent_index=torch.tensor([r["agent"] for r in rows]),
        turn_index=torch.tensor([r["turn"] for r in rows]))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
@pytest.mark.parametrize("scale, unbiased", [(True, True), (True, False), (False, True)])
def test_matches_reference(seed, estimator, scale, unbiased):
    rows = random_rollout(random.Random(seed))
    for r in rows:  # float32 inputs, exactly as the tensor holds them
        r["reward"] = float(torch.tensor(r["reward"], dtype=torch.float32))
    config = AdvantageConfig(estimator=estimator, scale_by_std=scale, unbiased_std=unbiased, eps=1e-6)
    got = compute_advantages(to_batch(rows), config)
    want = reference(rows, KEYS[estimator], scale=scale, unbiased=unbiased, eps=1e-6,
                     leave_one_out=estimator == "rloo")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-5)


def test_estimators_differ_on_the_same_batch():
    rows = [{"problem": 0, "turn": t, "agent": 1, "group": (0, t, i), "reward": r}
            for t, i, r in [(1, 0, 1.0), (1, 0, 0.0), (1, 1, 1.0), (1, 1, 1.0), (3, 0, 0.0), (3, 0, 0.0)]]
    batch = to_batch(rows)
    grpo, drmas, at = (compute_advantages(batch, AdvantageConfig(estimator=e)) for e in ("grpo", "drmas", "at_grpo"))
    assert grpo[2] == 0 and grpo[4] == 0      # constant same-input groups carry no signal
    assert at[2] > 0 and at[4] == 0           # pooled over the turn's inputs, not over turns
    assert drmas[2] > 0 and drmas[4] < 0      # pooled over every call of the agent


def test_drmas_pools_the_calls_of_a_role_and_grpo_pooled_pools_the_roles():
    """Built from samples as the trainer builds them: Verifier1 and Verifier2 are one agent for
    Dr. MAS, two groups for AT-GRPO; the pooled baseline mixes the Solver in as well."""
    def s(i, stage, role, turn, reward):
        return Sample(sample_id=str(i), role=role, stage=stage, turn=turn, problem_id="p",
                      group_id=f"{stage}/g", reward=reward)

    samples = [s(0, "solver", "solver", 0, 1.0), s(1, "solver", "solver", 0, 1.0), s(2, "solver", "solver", 0, 0.0),
               s(3, "verifier1", "verifier", 1, 1.0), s(4, "verifier1", "verifier", 1, 1.0),
               s(5, "verifier2", "verifier", 3, 0.0), s(6, "verifier2", "verifier", 3, 0.0)]
    batch = batch_from_samples(samples)
    at, drmas, pooled = (compute_advantages(batch, AdvantageConfig(estimator=e, scale_by_std=False)).tolist()
                         for e in ("at_grpo", "drmas", "grpo_pooled"))
    assert at[3:] == [0.0] * 4                              # each verifier stage alone is constant
    assert drmas[3:] == pytest.approx([0.5, 0.5, -0.5, -0.5])  # one verifier agent: mean 0.5
    assert drmas[:3] == pytest.approx([1 / 3, 1 / 3, -2 / 3])
    mean = 4 / 7
    assert pooled == pytest.approx([r - mean for r in (1, 1, 0, 1, 1, 0, 0)])


def test_rloo_is_the_leave_one_out_baseline():
    rows = [{"problem": 0, "turn": 0, "agent": 0, "group": 0, "reward": r} for r in (1.0, 0.0, 0.0, 0.0)]
    got = compute_advantages(to_batch(rows), AdvantageConfig(estimator="rloo")).tolist()
    assert got == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])  # 1 - 0, 0 - 1/3: scale_by_std does not apply


def test_degenerate_groups_are_zero_and_finite():
    batch = AdvantageBatch(rewards=torch.tensor([1.0, 0.5, 0.5, 0.5]), group_index=torch.tensor([0, 1, 1, 1]),
                           problem_index=torch.tensor([0, 1, 1, 1]), agent_index=torch.tensor([0, 1, 1, 1]),
                           turn_index=torch.tensor([0, 1, 1, 1]))
    for estimator in ESTIMATORS:
        adv = compute_advantages(batch, AdvantageConfig(estimator=estimator))
        assert torch.equal(adv, torch.zeros(4)), estimator
    counts = count_degenerate_groups(batch.rewards, batch.group_index)
    assert counts == {"groups": 2, "singleton_groups": 1, "zero_std_groups": 1}
    # float64 rewards whose mean is not exact ((0.1 + 0.1 + 0.1) / 3 != 0.1), even with eps 0
    two = torch.tensor([0] * 3 + [1] * 7)  # two constant groups, on two problems so every estimator sees two
    inexact = AdvantageBatch(rewards=torch.tensor([0.1] * 3 + [0.7] * 7, dtype=torch.float64), group_index=two,
                             problem_index=two, agent_index=torch.zeros_like(two), turn_index=torch.zeros_like(two))
    for estimator in ESTIMATORS:
        for scale in (True, False):
            adv = compute_advantages(inexact, AdvantageConfig(estimator=estimator, scale_by_std=scale, eps=0.0))
            assert torch.equal(adv, torch.zeros(10, dtype=torch.float64)), (estimator, scale, adv)
    empty = AdvantageBatch(**{f: torch.zeros(0, dtype=torch.float32 if f == "rewards" else torch.int64)
                              for f in ("rewards", "group_index", "problem_index", "agent_index", "turn_index")})
    assert compute_advantages(empty, AdvantageConfig()).shape == (0,)


# ---- properties -----------------------------------------------------------------------------------------
row_strategy = st.fixed_dictionaries({
    "problem": st.integers(0, 2), "turn": st.integers(0, 3), "agent": st.integers(0, 2), "inp": st.integers(0, 1),
    "reward": st.one_of(st.sampled_from([0.0, 1.0]),
                        st.floats(-100, 100, allow_nan=False, allow_subnormal=False, width=32))})


def rows_from(draw_rows: list[dict]) -> list[dict]:
    return [{**r, "group": (r["problem"], r["turn"], r["agent"], r["inp"])} for r in draw_rows]


@settings(max_examples=60, deadline=None)
@given(st.lists(row_strategy, min_size=1, max_size=40), st.randoms(use_true_random=False),
       st.sampled_from(sorted(ESTIMATORS)), st.booleans())
def test_permuting_samples_permutes_advantages(raw, rnd, estimator, scale):
    rows = rows_from(raw)
    config = AdvantageConfig(estimator=estimator, scale_by_std=scale)
    perm = list(range(len(rows)))
    rnd.shuffle(perm)
    base = compute_advantages(to_batch(rows), config)
    permuted = compute_advantages(to_batch([rows[i] for i in perm]), config)
    torch.testing.assert_close(permuted, base[perm], rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.lists(row_strategy, min_size=1, max_size=40), st.sampled_from(sorted(ESTIMATORS)), st.booleans())
def test_each_groups_advantages_have_zero_mean(raw, estimator, scale):
    """Within each estimator's own groups (so, for the agent-wise ones, within each agent)."""
    rows = rows_from(raw)
    adv = compute_advantages(to_batch(rows), AdvantageConfig(estimator=estimator, scale_by_std=scale)).double()
    members = defaultdict(list)
    for i, row in enumerate(rows):
        members[KEYS[estimator](row)].append(i)
    for key, idx in members.items():
        values = adv[idx]
        assert abs(values.mean().item()) <= 1e-5 * (1 + values.abs().max().item()), (key, values)


# ---- plumbing and extension point -----------------------------------------------------------------------
def test_batch_from_samples_keys():
    def s(i, stage, role, turn, group, problem="p", reward=1.0):
        return Sample(sample_id=str(i), role=role, stage=stage, turn=turn, problem_id=problem, group_id=group,
                      reward=reward)

    samples = [s(0, "solver", "solver", 0, "g0"), s(1, "verifier1", "verifier", 1, "g1"),
               s(2, "verifier2", "verifier", 3, "g2", problem="q", reward=0.0)]
    batch = batch_from_samples(samples)
    assert batch.agent_index.tolist() == [0, 1, 1]  # the agent is the role
    assert batch.problem_index.tolist() == [0, 0, 1] and batch.turn_index.tolist() == [0, 1, 3]
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0]
    samples[0].reward = None
    with pytest.raises(ValueError, match=r"samples \['0'\] have no reward"):
        batch_from_samples(samples)


def test_batch_validation():
    ok = {f: torch.zeros(3, dtype=torch.int64) for f in ("group_index", "problem_index", "agent_index", "turn_index")}
    with pytest.raises(ValueError, match="rewards must be a 1-D float tensor"):
        AdvantageBatch(rewards=torch.zeros(3, dtype=torch.int64), **ok)
    with pytest.raises(ValueError, match="turn_index must be a 1-D integer tensor of length 3"):
        AdvantageBatch(rewards=torch.zeros(3), **{**ok, "turn_index": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(ValueError, match="eps must be >= 0"):
        AdvantageConfig(eps=-1)


def test_user_estimator_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_estimator_plugin.py").write_text(textwrap.dedent('''
        def centered_by_problem(batch, config):
            from megatron_marsrl.algorithms.advantages import group_ids, normalize_in_groups
            return normalize_in_groups(batch.rewards, group_ids(batch.problem_index), config)
        def wrong_shape(batch, config):
            return batch.rewards[:1]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = random_rollout(random.Random(3))
    adv = compute_advantages(to_batch(rows), AdvantageConfig(estimator="my_estimator_plugin:centered_by_problem",
                                                             scale_by_std=False))
    want = reference(rows, lambda r: r["problem"], scale=False, unbiased=True, eps=1e-6)
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="must return a tensor of shape"):
        compute_advantages(to_batch(rows), AdvantageConfig(estimator="my_estimator_plugin:wrong_shape"))
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        get_estimator("ppo")
    assert "my_estimator_plugin:centered_by_problem" not in ESTIMATORS
