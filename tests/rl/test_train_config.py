"""Cross-section rules of `TrainConfig`: options that only make sense together are refused
with a message naming the fix."""
from __future__ import annotations

import pytest

from megatron_marsrl.rl.overrides import OverrideError, apply_overrides
from megatron_marsrl.rl.recipes import get_recipe


def _config(*overrides: str):
    return apply_overrides(get_recipe("tiny_arithmetic"), list(overrides))


@pytest.mark.parametrize("estimator", ["drmas", "grpo_pooled"])
def test_estimators_pooling_stages_need_whole_trajectories(estimator):
    with pytest.raises(OverrideError, match=f"{estimator} pools the stages.*pipeline.mode=sync"):
        _config(f"advantage.estimator={estimator}")  # the recipe runs the agentic pipeline
    assert _config(f"advantage.estimator={estimator}", "pipeline.mode=sync").advantage.estimator == estimator


def test_mini_batches_need_the_behaviour_ratio():
    with pytest.raises(OverrideError, match="mini_batch_sequences needs loss.old_logprobs=rollout"):
        _config("policy.mini_batch_sequences=16")
    config = _config("policy.mini_batch_sequences=16", "loss.old_logprobs=rollout")
    assert config.policy.mini_batch_sequences == 16
    with pytest.raises(OverrideError, match="must be >= 1"):
        _config("policy.mini_batch_sequences=0", "loss.old_logprobs=rollout")


def test_behaviour_ratio_makes_tis_redundant_and_bad_names_are_refused():
    with pytest.raises(OverrideError, match="TIS would weigh every token by exactly 1"):
        _config("loss.old_logprobs=rollout", "loss.tis={}")
    with pytest.raises(OverrideError, match="ratio 'tokens' is not one of"):
        _config("loss.ratio=tokens")
    with pytest.raises(OverrideError, match="old_logprobs 'engine' is not one of"):
        _config("loss.old_logprobs=engine")
