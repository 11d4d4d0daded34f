"""The policy loss against a token-by-token python reference (values, gradients, metrics)."""
from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_marsrl.algorithms.losses import (AGGREGATIONS, DMMPTConfig, PolicyLossConfig, PolicyLossInputs,
                                               TISConfig, aggregate, dmmpt_mask, policy_loss)


def make_inputs(seed: int, *, per_token_adv: bool = False, B: int = 6, T: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = 0  # a sequence with no response tokens at all
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logprobs = -torch.rand(B, T, generator=g) * 3
    logprobs[torch.rand(B, T, generator=g) < 0.3] = -0.002          # confident tokens for DMMPT
    old = logprobs + 0.4 * torch.randn(B, T, generator=g)            # ratios on both sides of the clip range
    rollout = old + 0.2 * torch.randn(B, T, generator=g)
    rollout[1] = old[1] - 0.8                                        # large mismatch: p_old >> p_rollout
    rollout[4] = old[4] + 0.8                                        # and the other way round
    adv = torch.randn(B, T, generator=g) if per_token_adv else torch.randn(B, generator=g)
    ref = logprobs + 0.3 * torch.randn(B, T, generator=g)
    ref[2, ::2] += 4.0  # exp(d) - d - 1 > 10: the k3 clamp holds these tokens
    return {"logprobs": logprobs, "old_logprobs": old, "advantages": adv, "response_mask": mask,
            "ref_logprobs": ref,
            "entropy": torch.rand(B, T, generator=g), "rollout_logprobs": rollout,
            "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])[:B]}


def reference(x: dict[str, torch.Tensor], cfg: PolicyLossConfig, lp: torch.Tensor,
              step_gate: bool | None = None) -> tuple[torch.Tensor, dict]:
    """Token by token, with python branches; `lp` is the leaf the gradient flows to;
    `step_gate`: the step's DMMPT decision (None: from these tokens' mean entropy)."""
    B, T = lp.shape
    mask = x["response_mask"]
    valid = [[t for t in range(T) if mask[b, t]] for b in range(B)]
    counts = {"tokens": 0, "clip_low": 0, "clip_high": 0, "dual": 0, "dropped": 0, "kept": 0, "k3_clamped": 0}
    dmmpt_on = False
    if cfg.dmmpt is not None:
        ents = [float(x["entropy"][b, t]) for b in range(B) for t in valid[b]]
        dmmpt_on = sum(ents) / max(len(ents), 1) < cfg.dmmpt.entropy_target if step_gate is None else step_gate
    per_seq: list[list[torch.Tensor]] = []
    for b in range(B):
        keep_seq = True
        if cfg.tis is not None and cfg.tis.mismatch_threshold is not None and valid[b]:
            diffs = [float(x["old_logprobs"][b, t] - x["rollout_logprobs"][b, t]) for t in valid[b]]
            keep_seq = abs(sum(diffs) / len(diffs)) <= math.log(cfg.tis.mismatch_threshold)
        kept = []
        for t in valid[b]:
            counts["tokens"] += 1
            if not keep_seq:
                continue
            if dmmpt_on and x["rewards"][b] >= cfg.dmmpt.positive_reward and \
                    math.exp(float(lp[b, t].detach())) > cfg.dmmpt.prob_threshold:
                counts["dropped"] += 1
                continue
            a = float(x["advantages"][b, t] if x["advantages"].dim() == 2 else x["advantages"][b])
            if cfg.ratio == "sequence":  # GSPO: the sequence's geometric-mean ratio, this token's gradient
                mean = sum(float(lp[b, u].detach() - x["old_logprobs"][b, u]) for u in valid[b]) / len(valid[b])
                ratio = math.exp(mean) * torch.exp(lp[b, t] - float(lp[b, t]))
            else:
                ratio = torch.exp(lp[b, t] - x["old_logprobs"][b, t])
            r = float(ratio.detach())
            clipped = ratio if 1 - cfg.clip_low <= r <= 1 + cfg.clip_high else \
                torch.tensor(min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high))
            loss = -a * ratio if -a * r >= -a * float(clipped.detach()) else -a * clipped
            counts["kept"] += 1
            counts["clip_high"] += a > 0 and r > 1 + cfg.clip_high
            counts["clip_low"] += a < 0 and r < 1 - cfg.clip_low
            if cfg.dual_clip is not None and a < 0 and float(loss.detach()) > -a * cfg.dual_clip:
                loss, counts["dual"] = torch.tensor(-a * cfg.dual_clip), counts["dual"] + 1
            if cfg.tis is not None:
                loss = loss * min(math.exp(float(x["old_logprobs"][b, t] - x["rollout_logprobs"][b, t])), cfg.tis.cap)
            if cfg.kl_coef:
                d = x["ref_logprobs"][b, t] - lp[b, t]
                k3 = torch.exp(d) - d - 1
                if float(k3.detach()) > 10.0:  # verl's bound: a constant, no gradient
                    k3, counts["k3_clamped"] = torch.tensor(10.0), counts["k3_clamped"] + 1
                loss = loss + cfg.kl_coef * k3
            loss = loss - cfg.entropy_coef * float(x["entropy"][b, t])
            kept.append(loss)
        per_seq.append(kept)
    nonempty = [s for s in per_seq if s]
    if not nonempty:
        return lp.sum() * 0, counts
    if cfg.aggregation == "token-mean":
        total = sum(l for s in nonempty for l in s) / sum(len(s) for s in nonempty)
    elif cfg.aggregation == "seq-mean-token-mean":
        total = sum(sum(s) / len(s) for s in nonempty) / len(nonempty)
    else:
        total = sum(sum(s) for s in nonempty) / len(nonempty)
    return total, counts


CONFIGS = {
    "plain": dict(),
    "clip_higher_dual": dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0),
    "kl_entropy": dict(kl_coef=0.1, entropy_coef=0.01),
    "dmmpt_active": dict(dmmpt=DMMPTConfig(prob_threshold=0.99, entropy_target=5.0)),
    "dmmpt_inactive": dict(dmmpt=DMMPTConfig(prob_threshold=0.99, entropy_target=0.05)),
    "tis_cap": dict(tis=TISConfig(cap=1.2)),
    "tis_mask": dict(tis=TISConfig(cap=2.0, mismatch_threshold=1.5)),
    "gspo": dict(ratio="sequence", clip_low=0.05, clip_high=0.08),
    "gspo_dual_kl": dict(ratio="sequence", clip_low=0.01, clip_high=0.02, dual_clip=1.02, kl_coef=0.1),
    "everything": dict(clip_high=0.28, dual_clip=2.0, kl_coef=0.05, entropy_coef=0.02,
                       dmmpt=DMMPTConfig(entropy_target=5.0), tis=TISConfig(cap=1.5, mismatch_threshold=1.5)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("seed, per_token_adv", [(0, False), (1, True), (2, False)])
def test_loss_and_gradient_match_reference(name, aggregation, seed, per_token_adv):
    x = make_inputs(seed, per_token_adv=per_token_adv)
    cfg = PolicyLossConfig(aggregation=aggregation, **CONFIGS[name])
    lp_fast = x["logprobs"].clone().requires_grad_(True)
    loss, metrics = policy_loss(PolicyLossInputs(**{**x, "logprobs": lp_fast}), cfg)
    loss.backward()
    lp_ref = x["logprobs"].clone().requires_grad_(True)
    want, counts = reference(x, cfg, lp_ref)
    want.backward()
    torch.testing.assert_close(loss.detach(), want.detach().to(loss.dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp_fast.grad, lp_ref.grad, rtol=1e-5, atol=1e-6)
    kept = max(counts["kept"], 1)
    assert metrics["clip_high_fraction"].item() == pytest.approx(counts["clip_high"] / kept, abs=1e-6)
    assert metrics["clip_low_fraction"].item() == pytest.approx(counts["clip_low"] / kept, abs=1e-6)
    assert metrics["dual_clip_fraction"].item() == pytest.approx(counts["dual"] / kept, abs=1e-6)
    if cfg.dmmpt is not None:
        assert metrics["dmmpt_masked_fraction"].item() == pytest.approx(counts["dropped"] / counts["tokens"])
        assert (counts["dropped"] > 0) == (name != "dmmpt_inactive") == bool(metrics["dmmpt_active"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_setup_exercises_every_branch(seed):
    x = make_inputs(seed)
    _, counts = reference(x, PolicyLossConfig(clip_high=0.28, dual_clip=1.5), x["logprobs"].clone())
    assert counts["clip_low"] and counts["clip_high"] and counts["dual"]
    _, counts = reference(x, PolicyLossConfig(kl_coef=0.1), x["logprobs"].clone())
    assert counts["k3_clamped"]
    cfg = PolicyLossConfig(tis=TISConfig(mismatch_threshold=1.5))
    _, metrics = policy_loss(PolicyLossInputs(**x), cfg)
    assert 0 < metrics["tis_masked_sequence_fraction"] < 1


def test_reference_setup_exercises_every_sequence_ratio_branch():
    """A sequence's mean log-ratio strays less than its tokens': tight clips, over the seeds used."""
    cfg = PolicyLossConfig(ratio="sequence", clip_low=0.01, clip_high=0.01, dual_clip=1.02)
    totals = {"clip_low": 0, "clip_high": 0, "dual": 0}
    for seed in (0, 1, 2):
        x = make_inputs(seed)
        _, counts = reference(x, cfg, x["logprobs"].clone())
        totals = {k: v + counts[k] for k, v in totals.items()}
    assert all(totals.values()), totals


@pytest.mark.parametrize("target, step_gate", [(0.05, True), (5.0, False)])
def test_the_steps_dmmpt_decision_overrides_the_micro_batchs_entropy(target, step_gate):
    """The trainer decides DMMPT once per step: a micro-batch whose own entropy says the opposite
    follows the step's decision."""
    x = make_inputs(5)
    cfg = PolicyLossConfig(dmmpt=DMMPTConfig(entropy_target=target))
    own = bool(policy_loss(PolicyLossInputs(**x), cfg)[1]["dmmpt_active"])
    assert own != step_gate
    lp = x["logprobs"].clone().requires_grad_(True)
    loss, metrics = policy_loss(PolicyLossInputs(**{**x, "logprobs": lp}, dmmpt_active=step_gate), cfg)
    loss.backward()
    lp_ref = x["logprobs"].clone().requires_grad_(True)
    want, counts = reference(x, cfg, lp_ref, step_gate=step_gate)
    want.backward()
    assert bool(metrics["dmmpt_active"]) == step_gate and (counts["dropped"] > 0) == step_gate
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-5, atol=1e-6)


def test_dmmpt_only_masks_confident_tokens_of_positive_samples():
    x = make_inputs(4)
    drop, active = dmmpt_mask(x["logprobs"], x["entropy"], x["rewards"], x["response_mask"],
                              DMMPTConfig(prob_threshold=0.99, entropy_target=10.0))
    assert bool(active) and drop.any()
    assert not drop[x["rewards"] < 1].any()
    assert (x["logprobs"][drop].exp() > 0.99).all() and x["response_mask"][drop].all()


def test_all_tokens_masked_gives_zero_loss_and_zero_grad():
    x = make_inputs(5)
    x["response_mask"] = torch.zeros_like(x["response_mask"])
    lp = x["logprobs"].clone().requires_grad_(True)
    loss, _ = policy_loss(PolicyLossInputs(**{**x, "logprobs": lp}), PolicyLossConfig())
    loss.backward()
    assert loss.item() == 0 and torch.count_nonzero(lp.grad) == 0


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_padding_values_never_reach_the_loss(per_token_adv):
    """-inf / nan in padded positions (common sentinels) change nothing: loss, gradient, metrics."""
    x = make_inputs(0, per_token_adv=per_token_adv)
    pad = ~x["response_mask"]
    garbage = {k: v.clone() for k, v in x.items()}
    for name in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs"):
        garbage[name][pad] = float("-inf")
    garbage["entropy"][pad] = float("nan")
    if per_token_adv:
        garbage["advantages"][pad] = float("nan")
    cfg = PolicyLossConfig(**CONFIGS["everything"])
    results = []
    for data in (x, garbage):
        lp = data["logprobs"].clone().requires_grad_(True)
        loss, metrics = policy_loss(PolicyLossInputs(**{**data, "logprobs": lp}), cfg)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    (clean_loss, clean_grad, clean_metrics), (loss, grad, metrics) = results
    torch.testing.assert_close(loss, clean_loss)
    torch.testing.assert_close(grad, clean_grad)
    assert torch.count_nonzero(grad[pad]) == 0
    for name, value in clean_metrics.items():
        torch.testing.assert_close(metrics[name], value, msg=name)


def test_missing_inputs_and_bad_config_are_clear_errors():
    x = make_inputs(0)
    with pytest.raises(ValueError, match=r"needs inputs \['ref_logprobs'\]"):
        policy_loss(PolicyLossInputs(**{**x, "ref_logprobs": None}), PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="advantages must be"):
        PolicyLossInputs(**{**x, "advantages": torch.zeros(3)})
    with pytest.raises(ValueError, match="aggregation 'mean' is not one of"):
        PolicyLossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        PolicyLossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="tis cap must be >= 1"):
        TISConfig(cap=0.5)


# ---- two data-parallel ranks (gloo) ---------------------------------------------------------------------
def _dp_data() -> dict[str, torch.Tensor]:
    x = make_inputs(7)
    x["entropy"][:3] *= 0.1  # rank 0's half has low entropy, rank 1's high: only the global mean may decide
    return x


DP_DMMPT = DMMPTConfig(entropy_target=0.35)


def _dp_worker(rank: int, world: int, init_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x = _dp_data()
        mine = {k: v[rank * 3:(rank + 1) * 3] for k, v in x.items()}
        for aggregation in AGGREGATIONS:
            cfg = PolicyLossConfig(aggregation=aggregation, dmmpt=DP_DMMPT, kl_coef=0.1)
            lp = mine["logprobs"].clone().requires_grad_(True)
            loss, _ = policy_loss(PolicyLossInputs(**{**mine, "logprobs": lp}), cfg, process_group=dist.group.WORLD)
            loss.backward()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            grads = [torch.zeros_like(lp.grad) for _ in range(world)]
            dist.all_gather(grads, lp.grad / world)  # what averaging gradients over ranks applies
            if rank == 0:
                full = x["logprobs"].clone().requires_grad_(True)
                want, _ = policy_loss(PolicyLossInputs(**{**x, "logprobs": full}), cfg)
                want.backward()
                results[aggregation] = (torch.allclose(mean_loss / world, want.detach(), atol=1e-6)
                                        and torch.allclose(torch.cat(grads), full.grad, atol=1e-6))
    finally:
        dist.destroy_process_group()


def test_two_ranks_reproduce_the_global_aggregate():
    x = _dp_data()
    m = x["response_mask"].float()
    local_1 = (x["entropy"][3:] * m[3:]).sum() / m[3:].sum()
    assert (x["entropy"] * m).sum() / m.sum() < DP_DMMPT.entropy_target < local_1  # the case is discriminating
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_dp_worker, args=(2, os.path.join(tmp, "init"), results), nprocs=2, join=True)
        assert dict(results) == {a: True for a in AGGREGATIONS}


def test_aggregate_without_group_is_local():
    loss = torch.tensor([[1.0, 3.0], [5.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(3.0)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 5.0) / 2)
    assert aggregate(loss, mask, "seq-sum").item() == pytest.approx((4.0 + 5.0) / 2)


def test_low_precision_inputs_track_float32():
    x = make_inputs(1)
    cfg = PolicyLossConfig(**CONFIGS["everything"])
    full, _ = policy_loss(PolicyLossInputs(**x), cfg)
    half = {k: v.bfloat16() if v.is_floating_point() else v for k, v in x.items()}
    low, metrics = policy_loss(PolicyLossInputs(**half), cfg)
    assert low.dtype == torch.bfloat16 and torch.isfinite(low)
    assert low.float().item() == pytest.approx(full.item(), rel=2e-2)
    assert all(torch.isfinite(v) for v in metrics.values())
