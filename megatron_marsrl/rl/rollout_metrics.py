"""Per-role statistics of one step's samples (no Megatron; logged to TensorBoard).

    {role}/reward_mean, {role}/accuracy (reward >= 0.5), {role}/response_len, {role}/samples,
    {role}/advantage_mean, {role}/advantage_std, {role}/advantage_abs_mean, {role}/parse_fail
    {role}/truncated_fraction             outputs that hit the token limit (finish reason "length")
    {role}/zero_std_group_fraction        groups of >= 2 samples with one reward: no signal
    {role}/advantage_second_moment        mean A^2 over the role's samples: Dr. MAS's measure of
                                          how large the role's gradients are (~1 per role when
                                          each is normalised by its own statistics)
    {role}/advantage_share                the role's share of the step's sum of A^2 (of its
                                          weight in the update, before token counts)
    verifier/precision, verifier/recall   flagging wrong solutions ("no" on a wrong one)
    verifier/recall_correct               passing right solutions ("yes" on a right one)
    verifier/balanced_accuracy            mean of the two recalls (a verdict-less review counts
                                          as a miss on either side): 0.5 for any constant verdict
    corrector/fix_rate                    wrong input solution -> right answer

A sample's input correctness comes from its parent's reward (`metadata["parent_reward"]`):
a verifier's parent is the judged solution (reward 1 = right); a corrector's parent is the
review that said "wrong" (reward 1 = the solution really was wrong).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from megatron_marsrl.algorithms.advantages import count_degenerate_groups
from megatron_marsrl.data_types import Sample, Verdict


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def role_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Statistics per role; the advantage ones over the samples that have one (trained)."""
    by_role: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_role[s.role].append(s)
    out: dict[str, float] = {}
    total_sq = sum(s.advantage ** 2 for s in samples if s.advantage is not None)
    for role, group in sorted(by_role.items()):
        rewards = [float(s.reward or 0.0) for s in group]
        out[f"{role}/samples"] = len(group)
        out[f"{role}/reward_mean"] = _mean(rewards)
        out[f"{role}/accuracy"] = _mean([1.0 if r >= 0.5 else 0.0 for r in rewards])
        out[f"{role}/response_len"] = _mean([len(s.response_token_ids or []) for s in group])
        out[f"{role}/truncated_fraction"] = _mean([1.0 if s.finish_reason == "length" else 0.0 for s in group])
        out[f"{role}/parse_fail"] = _mean([1.0 if s.parse_status.is_failure else 0.0 for s in group])
        adv = [s.advantage for s in group if s.advantage is not None]
        if adv:
            mean = _mean(adv)
            out[f"{role}/advantage_mean"] = mean
            out[f"{role}/advantage_std"] = math.sqrt(_mean([(a - mean) ** 2 for a in adv]))
            out[f"{role}/advantage_abs_mean"] = _mean([abs(a) for a in adv])
            out[f"{role}/advantage_second_moment"] = _mean([a * a for a in adv])
            out[f"{role}/advantage_share"] = sum(a * a for a in adv) / total_sq if total_sq else 0.0
            out[f"{role}/zero_std_group_fraction"] = _zero_std_fraction(group)
    out.update(_verifier(by_role.get("verifier", [])))
    out.update(_corrector(by_role.get("corrector", [])))
    return out


def _zero_std_fraction(samples: Sequence[Sample]) -> float:
    """Share of the GRPO groups whose rewards are all equal (their advantages are 0)."""
    ids: dict[str, int] = {}
    counts = count_degenerate_groups(torch.tensor([float(s.reward or 0.0) for s in samples]),
                                     torch.tensor([ids.setdefault(s.group_id, len(ids)) for s in samples]))
    return counts["zero_std_groups"] / counts["groups"]


def _verifier(samples: Sequence[Sample]) -> dict[str, float]:
    tp = fp = fn = 0
    hits = {True: [], False: []}  # solution wrong? -> the review got it right?
    for s in samples:
        parent = s.metadata.get("parent_reward")
        if parent is None:
            continue
        solution_wrong = parent < 0.5
        hits[solution_wrong].append(s.parsed == (Verdict.WRONG if solution_wrong else Verdict.CORRECT).value)
        if s.parsed is None:
            continue
        flagged = s.parsed == Verdict.WRONG.value
        tp += flagged and solution_wrong
        fp += flagged and not solution_wrong
        fn += (not flagged) and solution_wrong
    out = {}
    if tp + fp:
        out["verifier/precision"] = tp / (tp + fp)
    if tp + fn:
        out["verifier/recall"] = tp / (tp + fn)
    if hits[False]:
        out["verifier/recall_correct"] = _mean(hits[False])
    if hits[True] and hits[False]:
        out["verifier/balanced_accuracy"] = (_mean(hits[True]) + _mean(hits[False])) / 2
    return out


def _corrector(samples: Sequence[Sample]) -> dict[str, float]:
    fixed = [float(s.reward or 0.0) >= 0.5 for s in samples if (s.metadata.get("parent_reward") or 0.0) >= 0.5]
    return {"corrector/fix_rate": _mean(fixed)} if fixed else {}
