"""Answer matching with math-verify and the agent-specific rewards."""
from __future__ import annotations

import threading

import pytest

from megatron_marsrl.data_types import ParseStatus, Sample
from megatron_marsrl.rewards.agent_rewards import answer_reward, verdict_reward, with_format_penalty
from megatron_marsrl.rewards.math_match import MatchOutcome, answers_match, match_answer, normalize_answer


@pytest.mark.parametrize("pred, ref, outcome", [
    ("204", "204", MatchOutcome.SAME_TEXT),
    ("336", "336^\\circ", MatchOutcome.SAME_TEXT),
    ("336^{\\circ}", "336^\\circ", MatchOutcome.SAME_TEXT),
    ("336°", "336^\\circ", MatchOutcome.SAME_TEXT),
    ("$\\boxed{70}$", "70", MatchOutcome.SAME_TEXT),
    ("\\frac{1}{2}", "0.5", MatchOutcome.EQUIVALENT),
    ("\\dfrac{3}{6}", "\\frac12", MatchOutcome.EQUIVALENT),
    ("2\\sqrt{2}", "\\sqrt{8}", MatchOutcome.EQUIVALENT),
])
def test_matches(pred, ref, outcome):
    result = match_answer(pred, ref)
    assert result.matched and result.outcome is outcome


@pytest.mark.parametrize("pred, ref, outcome", [
    ("205", "204", MatchOutcome.DIFFERENT),
    ("335", "336^\\circ", MatchOutcome.DIFFERENT),
    ("\\frac{1}{3}", "0.5", MatchOutcome.DIFFERENT),
    (None, "204", MatchOutcome.NO_PREDICTION),
    ("   ", "204", MatchOutcome.NO_PREDICTION),
    ("9" * 2000, "204", MatchOutcome.TOO_LONG),
])
def test_mismatches(pred, ref, outcome):
    result = match_answer(pred, ref)
    assert not result.matched and result.outcome is outcome


def test_matching_works_off_the_main_thread():
    # math_verify's signal-based timeouts would raise off the main thread; ours turns them off there
    results = []
    thread = threading.Thread(target=lambda: results.append((answers_match("\\frac{2}{4}", "0.5"),
                                                             answers_match("3", "0.5"))))
    thread.start()
    thread.join()
    assert results == [(True, False)]


def test_normalize_answer():
    assert normalize_answer(" $\\boxed{\\text{ 12 }}$. ") == "12"
    assert normalize_answer("90^{\\circ}") == normalize_answer("90") == "90"


def sample(role: str, parsed, status=ParseStatus.OK, solution: str | None = None) -> Sample:
    return Sample(sample_id="s", role=role, stage=role, turn=0, problem_id="p", group_id="g", parsed=parsed,
                  parse_status=status, inputs={} if solution is None else {"problem": "P", "solution": solution})


def test_answer_reward():
    assert answer_reward(sample("solver", "336"), "336^\\circ") == 1.0
    assert answer_reward(sample("solver", "335"), "336^\\circ") == 0.0
    assert answer_reward(sample("solver", None, ParseStatus.NO_ANSWER), "336") == 0.0


@pytest.mark.parametrize("solution, verdict, reward", [
    ("so \\boxed{12}", "correct", 1.0),     # passes a correct solution
    ("so \\boxed{12}", "wrong", 0.0),       # flags a correct one
    ("so \\boxed{13}", "wrong", 1.0),       # flags a wrong one
    ("so \\boxed{13}", "correct", 0.0),     # passes a wrong one
    ("no final answer", "wrong", 1.0),      # an answerless solution is wrong
    ("so \\boxed{12}", None, 0.0),          # no verdict is never right
])
def test_verdict_reward_truth_table(solution, verdict, reward):
    status = ParseStatus.OK if verdict else ParseStatus.NO_VERDICT
    assert verdict_reward(sample("verifier", verdict, status, solution), "12") == reward


def test_verdict_reward_needs_the_judged_solution():
    with pytest.raises(ValueError, match="has no 'solution' input"):
        verdict_reward(sample("verifier", "wrong"), "12")


def test_verdict_reward_reads_the_judged_answer_with_the_tasks_parser():
    from megatron_marsrl.agents import arithmetic

    reward = arithmetic.VERIFIER.reward  # the arithmetic task's solutions are bare digits
    assert reward(sample("verifier", "correct", solution="1 2"), "12") == 1.0
    assert reward(sample("verifier", "wrong", solution="1 3"), "12") == 1.0
    assert reward(sample("verifier", "correct", solution="no"), "12") == 0.0
    assert arithmetic.SOLVER.reward is answer_reward


def test_format_penalty_only_on_parse_failures():
    penalized = with_format_penalty(answer_reward, 0.25)
    assert penalized(sample("solver", "12"), "12") == 1.0
    assert penalized(sample("solver", None, ParseStatus.TRUNCATED), "12") == -0.25
    assert penalized(sample("solver", "12", ParseStatus.CONFLICTING_VERDICTS), "13") == 0.0
    assert with_format_penalty(answer_reward, 0.0) is answer_reward
    with pytest.raises(ValueError, match="format penalty must be >= 0"):
        with_format_penalty(answer_reward, -1)
