"""Per-role statistics of one step's samples (no Megatron; logged to TensorBoard).

    {role}/reward_mean, {role}/accuracy (reward >= 0.5), {role}/response_len, {role}/samples,
    {role}/accuracy_parsed                accuracy among the outputs that parse (format aside)
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

Every figure but the advantage statistics is a ratio of additive counts (`tally`), so the
held-out evaluation (`held_out_figures`) gets each one's 95% interval by resampling problems.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

import torch

from megatron_marsrl.algorithms.advantages import count_degenerate_groups
from megatron_marsrl.data_types import Sample, Verdict
from megatron_marsrl.stats import Estimate, Tally, bootstrap_figures


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def tally(samples: Iterable[Sample]) -> Tally:
    """Additive counts behind `figures`, keyed (role, count): summed over problems, they give
    the figures of those problems (the held-out bootstrap resamples problems this way)."""
    t: Tally = Counter()
    for s in samples:
        right = float(s.reward or 0.0) >= 0.5
        parsed = not s.parse_status.is_failure
        t[s.role, "samples"] += 1
        t[s.role, "reward"] += float(s.reward or 0.0)
        t[s.role, "right"] += right
        t[s.role, "parsed"] += parsed
        t[s.role, "right_parsed"] += right and parsed
        t[s.role, "tokens"] += len(s.response_token_ids or [])
        t[s.role, "truncated"] += s.finish_reason == "length"
        parent = s.metadata.get("parent_reward")
        if parent is None:
            continue
        if s.role == "verifier":
            # a verifier's parent is the judged solution (reward 1 = right)
            wrong = parent < 0.5
            t["verifier", "on_wrong" if wrong else "on_right"] += 1
            t["verifier", "hit_wrong" if wrong else "hit_right"] += (
                s.parsed == (Verdict.WRONG if wrong else Verdict.CORRECT).value)
            if s.parsed is not None:
                flagged = s.parsed == Verdict.WRONG.value
                t["verifier", "tp"] += flagged and wrong
                t["verifier", "fp"] += flagged and not wrong
                t["verifier", "fn"] += (not flagged) and wrong
        elif s.role == "corrector" and parent >= 0.5:
            # a corrector's parent is the review that said "wrong" (reward 1 = it was wrong)
            t["corrector", "wrong_inputs"] += 1
            t["corrector", "fixed"] += right
    return t


def figures(t: Mapping) -> dict[str, float]:
    """The per-role figures of a `tally` (see the module docstring); a figure whose
    denominator is 0 is left out."""
    out: dict[str, float] = {}

    def ratio(key: str, num, den) -> None:
        if t.get(den, 0):
            out[key] = t.get(num, 0) / t[den]

    for role in sorted({k[0] for k in t}):
        n = (role, "samples")
        if not t.get(n, 0):
            continue
        out[f"{role}/samples"] = t[n]
        ratio(f"{role}/reward_mean", (role, "reward"), n)
        ratio(f"{role}/accuracy", (role, "right"), n)
        ratio(f"{role}/accuracy_parsed", (role, "right_parsed"), (role, "parsed"))
        ratio(f"{role}/response_len", (role, "tokens"), n)
        ratio(f"{role}/truncated_fraction", (role, "truncated"), n)
        out[f"{role}/parse_fail"] = 1 - t.get((role, "parsed"), 0) / t[n]
    tp, fp, fn = (t.get(("verifier", k), 0) for k in ("tp", "fp", "fn"))
    if tp + fp:
        out["verifier/precision"] = tp / (tp + fp)
    if tp + fn:
        out["verifier/recall"] = tp / (tp + fn)
    ratio("verifier/recall_correct", ("verifier", "hit_right"), ("verifier", "on_right"))
    if t.get(("verifier", "on_right"), 0) and t.get(("verifier", "on_wrong"), 0):
        out["verifier/balanced_accuracy"] = (t[("verifier", "hit_right")] / t[("verifier", "on_right")]
                                             + t[("verifier", "hit_wrong")] / t[("verifier", "on_wrong")]) / 2
    ratio("corrector/fix_rate", ("corrector", "fixed"), ("corrector", "wrong_inputs"))
    return out


def held_out_figures(samples: Sequence[Sample], *, seed: str) -> dict[str, Estimate]:
    """`figures` of held-out samples, each with its 95% interval: bootstrap over the problems
    (a problem's samples are resampled together); the sample counts are left out."""
    by_problem: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_problem[s.problem_id].append(s)
    estimates = bootstrap_figures([tally(by_problem[p]) for p in sorted(by_problem)], figures, seed=seed)
    return {k: v for k, v in estimates.items() if not k.endswith("/samples")}


def role_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """`figures` of all `samples`, plus the advantage statistics over those that have one (trained)."""
    by_role: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_role[s.role].append(s)
    out = figures(tally(samples))
    total_sq = sum(s.advantage ** 2 for s in samples if s.advantage is not None)
    for role, group in sorted(by_role.items()):
        adv = [s.advantage for s in group if s.advantage is not None]
        if adv:
            mean = _mean(adv)
            out[f"{role}/advantage_mean"] = mean
            out[f"{role}/advantage_std"] = math.sqrt(_mean([(a - mean) ** 2 for a in adv]))
            out[f"{role}/advantage_abs_mean"] = _mean([abs(a) for a in adv])
            out[f"{role}/advantage_second_moment"] = _mean([a * a for a in adv])
            out[f"{role}/advantage_share"] = sum(a * a for a in adv) / total_sq if total_sq else 0.0
            out[f"{role}/zero_std_group_fraction"] = _zero_std_fraction(group)
    return out


def _zero_std_fraction(samples: Sequence[Sample]) -> float:
    """Share of the GRPO groups whose rewards are all equal (their advantages are 0)."""
    ids: dict[str, int] = {}
    counts = count_degenerate_groups(torch.tensor([float(s.reward or 0.0) for s in samples]),
                                     torch.tensor([ids.setdefault(s.group_id, len(ids)) for s in samples]))
    return counts["zero_std_groups"] / counts["groups"]
