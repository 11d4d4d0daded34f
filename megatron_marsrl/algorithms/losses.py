"""The policy-gradient loss: PPO clip with the MarsRL / UloRL additions.

Compared with the textbook PPO-clip objective:
  * the ratio is per token (PPO) or per sequence (GSPO, `ratio="sequence"`: the geometric
    mean of a sequence's token ratios, clipped as a whole, with each token's gradient
    flowing through it, i.e. GSPO-token with the sequence advantage);
  * clip-higher: separate lower and upper clip ranges (1 - clip_low, 1 + clip_high);
  * dual clip: for negative advantages the loss is also capped at -A * c, so a
    huge ratio on a bad token cannot blow the update up;
  * three aggregations: "token-mean" (every token weighs the same),
    "seq-mean-token-mean" (each sequence's token mean, averaged over sequences:
    MarsRL's choice) and "seq-sum" (each sequence's token losses summed, then
    averaged over sequences);
  * optional k3 KL to a reference policy (clamped to [0, 10] per token, as verl does) and an
    entropy bonus;
  * DMMPT (dynamic masking of mastered positive tokens): while the policy's mean
    entropy is below a target, tokens of reward-1 samples that the policy
    already predicts with probability above a threshold are dropped from the
    loss, which slows the entropy collapse. Whether masking is on is one decision for
    a whole step (`PolicyLossInputs.dmmpt_active`, which the trainer sets from the
    policy's mean entropy); without it, each call decides from its own tokens;
  * TIS: the rollout engine (SGLang) and the trainer (Megatron) compute slightly
    different probabilities; each token's policy-gradient term is weighted by
    min(p_old / p_rollout, cap), and whole sequences whose mismatch exceeds a
    threshold are dropped.

Masked tokens (response padding, DMMPT, TIS-dropped sequences) leave both the
numerator and the denominator of the aggregation. Sequences with no remaining
token leave the sequence count.

Everything is pure torch on explicit [B, T] tensors. When a process group is
given, the aggregation denominator and DMMPT's mean entropy are summed over
it; on a single rank (or without a group) these reductions are no-ops.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-sum")
_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: beyond this a ratio is an outlier anyway; avoids inf * 0 = nan
K3_MAX = 10.0
"""Per-token k3 values are clamped to [0, K3_MAX] (verl's low_var_kl bound): one token the
reference finds very unlikely cannot dominate the KL term or its gradient."""
RATIOS = ("token", "sequence")
OLD_LOGPROBS = ("current", "rollout")


@dataclass(kw_only=True)
class DMMPTConfig:
    """Dynamic masking of mastered positive tokens."""

    prob_threshold: float = 0.99
    """A token of a positive sample is "mastered" when the policy gives it more than this probability."""
    entropy_target: float = 0.3
    """Masking is active only while the mean token entropy (nats) is below this."""
    positive_reward: float = 1.0
    """Samples whose reward is >= this count as positive (binary rewards: 1)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.prob_threshold < 1.0:
            raise ValueError(f"dmmpt prob_threshold must be in (0, 1), got {self.prob_threshold}")
        if not self.entropy_target > 0:
            raise ValueError(f"dmmpt entropy_target must be > 0 nats, got {self.entropy_target}")


@dataclass(kw_only=True)
class TISConfig:
    """Truncated importance sampling against the rollout engine's log-probs."""

    cap: float = 2.0
    """Per-token weights min(p_old / p_rollout, cap); must be >= 1."""
    mismatch_threshold: float | None = None
    """Drop a sequence when its geometric-mean ratio p_old / p_rollout is above this or below its
    inverse (e.g. 2.0); None keeps every sequence."""

    def __post_init__(self) -> None:
        if not self.cap >= 1.0:
            raise ValueError(f"tis cap must be >= 1 (it truncates importance weights), got {self.cap}")
        if self.mismatch_threshold is not None and not self.mismatch_threshold > 1.0:
            raise ValueError(f"tis mismatch_threshold must be > 1 or None, got {self.mismatch_threshold}")


@dataclass(kw_only=True)
class PolicyLossConfig:
    """The policy loss and its optional terms."""

    clip_low: float = 0.2
    """Ratios below 1 - clip_low are clipped (this bounds the step on negative-advantage tokens)."""
    clip_high: float = 0.2
    """Ratios above 1 + clip_high are clipped; > clip_low is "clip-higher" (e.g. 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -A * c; None: off."""
    ratio: str = "token"
    """"token": PPO's per-token ratio; "sequence": GSPO's sequence ratio (the length-normalised
    product of the token ratios), the choice for MoE policies whose token ratios are noisy
    (GSPO's paper clips it far tighter, e.g. clip_low=3e-4, clip_high=4e-4)."""
    old_logprobs: str = "current"
    """What the trainer puts in the ratio's denominator. "current": its own log-probs, detached
    (on-policy: every ratio is 1, so no clip ever acts, and a step is one update). "rollout":
    the engine's log-probs of the tokens, the behaviour policy (decoupled PPO): the ratio
    measures how far the policy moved since a token was generated (earlier updates of the same
    step, `policy.mini_batch_sequences`; older weights of continued segments) and the clips act
    on it; the engine/trainer mismatch enters the ratio too, so TIS is not needed with it."""
    aggregation: str = "seq-mean-token-mean"
    """One of "token-mean", "seq-mean-token-mean", "seq-sum" (see the module docstring)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference policy; 0 disables it (no ref log-probs needed)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 disables it."""
    dmmpt: DMMPTConfig | None = None
    """DMMPT masking; None: off."""
    tis: TISConfig | None = field(default=None)
    """Truncated importance sampling with rollout log-probs; None: off."""

    def __post_init__(self) -> None:
        if not 0.0 < self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in (0, 1), got {self.clip_low}")
        if not self.clip_high > 0.0:
            raise ValueError(f"clip_high must be > 0, got {self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip}")
        if self.ratio not in RATIOS:
            raise ValueError(f"ratio {self.ratio!r} is not one of {RATIOS}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs {self.old_logprobs!r} is not one of {OLD_LOGPROBS}")
        if self.old_logprobs == "rollout" and self.tis is not None:
            raise ValueError("old_logprobs='rollout' already takes the ratio against the engine's log-probs; "
                             "TIS would weigh every token by exactly 1: set tis=null")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation {self.aggregation!r} is not one of {AGGREGATIONS}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}")


@dataclass(frozen=True, kw_only=True)
class PolicyLossInputs:
    """Per-token tensors of one micro-batch, shape [B, T] unless stated."""

    logprobs: torch.Tensor
    """Log-probs of the response tokens under the current policy (carries the gradient)."""
    old_logprobs: torch.Tensor
    """Log-probs under the policy that is being improved on (the trainer's recomputation)."""
    advantages: torch.Tensor
    """Advantage per sequence [B] or per token [B, T]."""
    response_mask: torch.Tensor
    """1 / True for response tokens that count, 0 / False for prompt and padding."""
    ref_logprobs: torch.Tensor | None = None
    """Reference-policy log-probs; required when kl_coef > 0."""
    entropy: torch.Tensor | None = None
    """Per-token entropy of the current policy; required for the entropy bonus and DMMPT."""
    rollout_logprobs: torch.Tensor | None = None
    """The rollout engine's log-probs of the same tokens; required for TIS."""
    rewards: torch.Tensor | None = None
    """Per-sequence rewards [B]; required for DMMPT."""
    dmmpt_active: bool | None = None
    """Whether DMMPT masks this step (decided once per step by the caller); None: decide from
    this call's mean entropy (summed over the process group)."""

    def __post_init__(self) -> None:
        shape = self.logprobs.shape
        if self.logprobs.dim() != 2:
            raise ValueError(f"logprobs must be [B, T], got shape {tuple(shape)}")
        for name in ("old_logprobs", "response_mask", "ref_logprobs", "entropy", "rollout_logprobs"):
            t = getattr(self, name)
            if t is not None and t.shape != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logprobs")
        if self.advantages.shape not in (shape, shape[:1]):
            raise ValueError(f"advantages must be [B] or [B, T] = {tuple(shape)}, got {tuple(self.advantages.shape)}")
        if self.rewards is not None and self.rewards.shape != shape[:1]:
            raise ValueError(f"rewards must be [B] = {tuple(shape[:1])}, got {tuple(self.rewards.shape)}")


def _world(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _sum_over(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum a detached tensor over the group; identity on one rank."""
    x = x.detach().clone()
    if _world(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, mode: str,
              process_group: dist.ProcessGroup | None = None, *, normalizer: float | None = None) -> torch.Tensor:
    """Reduce [B, T] token losses to a scalar with `mode` (see module docstring).

    With a process group of size W the denominator (token or sequence count) is
    summed over the group and the result multiplied by W, so that averaging the
    gradients over the group (DDP / Megatron default) yields the gradient of the
    aggregate over all ranks' data.

    With `normalizer` the denominator is that constant instead (no collective): a
    trainer that streams micro-batches of one step divides by the step's total
    `aggregation_units` once all of them are known (see `aggregation_units`).
    """
    m = mask.to(token_loss.dtype)
    masked = torch.where(mask.bool(), token_loss, torch.zeros((), dtype=token_loss.dtype, device=token_loss.device))
    if mode == "token-mean":
        numerator, denominator = masked.sum(), m.sum()
    elif mode in ("seq-mean-token-mean", "seq-sum"):
        tokens = m.sum(-1)
        per_seq = masked.sum(-1)
        if mode == "seq-mean-token-mean":
            per_seq = per_seq / tokens.clamp(min=1)
        numerator, denominator = per_seq.sum(), (tokens > 0).to(token_loss.dtype).sum()
    else:
        raise ValueError(f"aggregation {mode!r} is not one of {AGGREGATIONS}")
    if normalizer is not None:
        return numerator / normalizer
    denominator = _sum_over(denominator, process_group).clamp(min=1)
    return numerator * _world(process_group) / denominator


def aggregation_units(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What `aggregate` divides by for this micro-batch: counted tokens ("token-mean") or
    sequences with at least one counted token (the per-sequence modes)."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation {mode!r} is not one of {AGGREGATIONS}")
    m = mask.bool()
    return m.sum().float() if mode == "token-mean" else m.any(-1).sum().float()


def log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token log-ratio [B, T]. "token": logp - old. "sequence" (GSPO-token): every token
    carries its sequence's mean log-ratio as value, and its own log-prob's gradient
    (logp - sg(logp) + sg(mean over the sequence of logp - old))."""
    diff = logprobs - old_logprobs
    if kind == "token":
        return diff.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if kind != "sequence":
        raise ValueError(f"ratio {kind!r} is not one of {RATIOS}")
    m = mask.to(diff.dtype)
    seq = ((diff.detach() * m).sum(-1) / m.sum(-1).clamp(min=1)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return logprobs - logprobs.detach() + seq[:, None]


def ppo_clip_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        config: PolicyLossConfig, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate loss and boolean masks of where each clip was active; `mask`
    marks the response tokens (a sequence ratio averages over them)."""
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logprobs)
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, mask, config.ratio))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    loss = torch.maximum(unclipped, clipped)
    flags = {"clip_high": (adv > 0) & (ratio > 1.0 + config.clip_high),
             "clip_low": (adv < 0) & (ratio < 1.0 - config.clip_low)}
    if config.dual_clip is not None:
        cap = -adv * config.dual_clip
        flags["dual_clip"] = (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    return loss, flags


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || ref): exp(d) - d - 1 with d = ref - logp, in
    [0, K3_MAX] (no gradient where the bound holds it)."""
    d = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (torch.exp(d) - d - 1.0).clamp(max=K3_MAX)


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                config: TISConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token weights min(p_old/p_rollout, cap), per-sequence keep mask [B]); no gradient."""
    log_ratio = (old_logprobs - rollout_logprobs).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    weights = torch.exp(log_ratio).clamp(max=config.cap)
    keep = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    if config.mismatch_threshold is not None:
        m = mask.to(log_ratio.dtype)
        mean_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)
        bound = torch.log(torch.tensor(config.mismatch_threshold, dtype=log_ratio.dtype))
        keep = mean_log_ratio.abs() <= bound
    return weights, keep


def dmmpt_gate(mean_entropy: float, config: DMMPTConfig) -> bool:
    """Whether DMMPT masks: the policy's mean token entropy (nats) is below the target."""
    return mean_entropy < config.entropy_target


def dmmpt_mask(logprobs: torch.Tensor, entropy: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor,
               config: DMMPTConfig, process_group: dist.ProcessGroup | None = None, *,
               active: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens to drop [B, T], whether masking was active). `active` is the step's decision;
    None: decided here from the mean entropy of these tokens over the group."""
    if active is None:
        m = mask.to(entropy.dtype)
        stats = _sum_over(torch.stack([(entropy.detach() * m).sum(), m.sum()]), process_group)
        active = dmmpt_gate(float(stats[0] / stats[1].clamp(min=1)), config)
    active = torch.tensor(bool(active), device=mask.device)
    positive = (rewards >= config.positive_reward)[:, None]
    confident = logprobs.detach() > torch.log(torch.tensor(config.prob_threshold, dtype=logprobs.dtype))
    return mask.bool() & positive & confident & active, active


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(torch.float32)
    return ((x.detach().to(torch.float32) * m).sum() / m.sum().clamp(min=1))


def policy_loss(inputs: PolicyLossInputs, config: PolicyLossConfig,
                process_group: dist.ProcessGroup | None = None, *,
                normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar loss to minimise and detached 0-dim metrics.

    Metrics: pg_loss, clip_low_fraction, clip_high_fraction, dual_clip_fraction,
    approx_kl (old vs current), and when enabled kl, entropy, dmmpt_active,
    dmmpt_masked_fraction, tis_weight_mean, tis_truncated_fraction,
    tis_masked_sequence_fraction, and aggregation_units (the denominator's share of
    this micro-batch). Fractions are over response tokens (sequences for the last
    one) of this micro-batch. `normalizer`: see `aggregate`.
    """
    _check_required(inputs, config)
    mask = inputs.response_mask.bool()
    inputs = _zero_padding(inputs, mask)
    loss_mask, metrics = mask, {}
    pg, flags = ppo_clip_token_loss(inputs.logprobs, inputs.old_logprobs, inputs.advantages, config, mask)
    if config.tis is not None:
        weights, keep = tis_weights(inputs.old_logprobs, inputs.rollout_logprobs, mask, config.tis)
        pg = pg * weights
        loss_mask = loss_mask & keep[:, None]
        metrics["tis_weight_mean"] = _masked_mean(weights, mask)
        metrics["tis_truncated_fraction"] = _masked_mean(weights >= config.tis.cap, mask)
        metrics["tis_masked_sequence_fraction"] = (~keep).float().mean()
    if config.dmmpt is not None:
        drop, active = dmmpt_mask(inputs.logprobs, inputs.entropy, inputs.rewards, mask, config.dmmpt, process_group,
                                  active=inputs.dmmpt_active)
        loss_mask = loss_mask & ~drop
        metrics["dmmpt_active"] = active.float()
        metrics["dmmpt_masked_fraction"] = _masked_mean(drop, mask)
    token_loss = pg
    if config.kl_coef > 0:
        kl = k3_kl(inputs.logprobs, inputs.ref_logprobs)
        token_loss = token_loss + config.kl_coef * kl
        metrics["kl"] = _masked_mean(kl, loss_mask)
    if config.entropy_coef > 0:
        token_loss = token_loss - config.entropy_coef * inputs.entropy
    if inputs.entropy is not None:
        metrics["entropy"] = _masked_mean(inputs.entropy, mask)
    loss = aggregate(token_loss, loss_mask, config.aggregation, process_group, normalizer=normalizer)
    metrics["aggregation_units"] = aggregation_units(loss_mask, config.aggregation)
    metrics["pg_loss"] = _masked_mean(pg, loss_mask)
    for name in ("clip_low", "clip_high", "dual_clip"):
        metrics[f"{name}_fraction"] = _masked_mean(flags.get(name, torch.zeros_like(mask)), loss_mask)
    metrics["approx_kl"] = _masked_mean(k3_kl(inputs.logprobs, inputs.old_logprobs), mask)
    return loss, metrics


def _zero_padding(inputs: PolicyLossInputs, mask: torch.Tensor) -> PolicyLossInputs:
    """`inputs` with every per-token tensor set to 0 outside `mask`.

    Padding often holds -inf log-probs or nan; multiplying by a 0 mask would
    still give nan (nan * 0 = nan) and poison the loss, the TIS sequence test
    and the DMMPT entropy mean. `torch.where` also sends no gradient there.
    """
    per_token = ("logprobs", "old_logprobs", "ref_logprobs", "entropy", "rollout_logprobs")
    if inputs.advantages.dim() == 2:
        per_token += ("advantages",)
    zero = {name: torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))
            for name in per_token if (t := getattr(inputs, name)) is not None}
    return dataclasses.replace(inputs, **zero)


def _check_required(inputs: PolicyLossInputs, config: PolicyLossConfig) -> None:
    needs = {"ref_logprobs": config.kl_coef > 0, "rollout_logprobs": config.tis is not None,
             "entropy": config.entropy_coef > 0 or config.dmmpt is not None,
             "rewards": config.dmmpt is not None}
    missing = [name for name, needed in needs.items() if needed and getattr(inputs, name) is None]
    if missing:
        raise ValueError(f"policy loss config needs inputs {missing}; pass them in PolicyLossInputs "
                         "or disable the terms that use them (kl_coef, tis, entropy_coef, dmmpt)")
