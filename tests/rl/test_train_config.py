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


def test_gspo_needs_the_behaviour_ratio():
    with pytest.raises(OverrideError, match="ratio=sequence \\(GSPO\\) needs loss.old_logprobs=rollout"):
        _config("loss.ratio=sequence")
    assert _config("loss.ratio=sequence", "loss.old_logprobs=rollout").loss.ratio == "sequence"


def test_behaviour_ratio_makes_tis_redundant_and_bad_names_are_refused():
    with pytest.raises(OverrideError, match="TIS would weigh every token by exactly 1"):
        _config("loss.old_logprobs=rollout", "loss.tis={}")
    with pytest.raises(OverrideError, match="ratio 'tokens' is not one of"):
        _config("loss.ratio=tokens", "loss.old_logprobs=rollout")
    with pytest.raises(OverrideError, match="old_logprobs 'engine' is not one of"):
        _config("loss.old_logprobs=engine")


def test_warm_start_from_task_demonstrations_needs_an_arithmetic_task():
    with pytest.raises(OverrideError, match="warm_start.data=task has demonstrations for the arithmetic tasks only"):
        _config("warm_start={}", "task.name=math")
    assert _config("warm_start={}", "task.name=math", "warm_start.data=chats.jsonl").warm_start.data == "chats.jsonl"
    with pytest.raises(OverrideError, match="warm_start.lr=0.0: must be > 0"):
        _config("warm_start={}", "warm_start.lr=0")


def test_task_demonstrations_teach_each_role_the_right_reply():
    from megatron_marsrl.agents import arithmetic
    from megatron_marsrl.rl.data import dataset_from_spec

    problems = dataset_from_spec("arithmetic:train?n=20&seed=0&max_operand=9&max_terms=2&ops=%2B-")
    chats = arithmetic.demonstrations(problems, seed=0, judged=3)
    per = 1 + 2 * 3 + 1
    assert len(chats) == per * len(problems)
    for p, group in zip(problems, (chats[i:i + per] for i in range(0, len(chats), per))):
        solve, checks, fix = group[0], group[1:-1], group[-1]
        assert solve[-1]["content"] == p.answer and fix[-1]["content"] == p.answer
        shown = [c[0]["content"].split("=")[-1].strip(" :") for c in checks]
        verdicts = [c[-1]["content"] for c in checks]
        assert verdicts == ["yes", "no"] * 3  # balanced: each wrong solution next to the right one
        assert shown[0::2] == [p.answer] * 3
        wrong = shown[1::2]
        assert len(set(wrong)) == 3 and p.answer not in wrong
        assert all(int(w) >= 0 and abs(int(w) - int(p.answer)) <= 9 for w in wrong)
        assert 1 <= abs(int(wrong[0]) - int(p.answer)) <= 3  # the first is a near miss, the one fixed
        assert fix[0]["content"].endswith(f"= {wrong[0]} no =")
        assert arithmetic.parse_verdict(checks[0][-1]["content"]).value == "correct"
    assert (arithmetic.demonstrations(problems, seed=0, judged=3) == chats
            != arithmetic.demonstrations(problems, seed=1, judged=3))
    with pytest.raises(ValueError, match="judged=0 must be >= 1"):
        arithmetic.demonstrations(problems, seed=0, judged=0)
