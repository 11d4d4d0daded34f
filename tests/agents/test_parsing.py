"""Answer, verdict and reasoning-block parsing; every failure has a status."""
from __future__ import annotations

import pytest

from megatron_marsrl.agents.parsing import (ParseCounter, extract_answer, extract_boxed, find_verdicts,
                                            parse_review, parse_solution, split_reasoning)
from megatron_marsrl.data_types import ParseStatus, Verdict


@pytest.mark.parametrize("text, answer", [
    ("so the total is \\boxed{42}.", "42"),
    ("\\boxed{1} first try, then \\boxed{2}", "2"),                # last box wins
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                      # nested braces
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("answer \\fbox{7}", "7"),
    ("answer \\boxed 9", "9"),
    ("\\boxed{336^\\circ}", "336^\\circ"),
    ("Final Answer: $17$.", "17"),
    ("**Final answer:** 23", "23"),
    ("The final answer is 1024.", "1024"),
    ("Final answer\n\n88", "88"),
    ("final answer: 3\nwait, final answer: 4", "4"),
    ("\\boxed{5}\nFinal answer: 6", "5"),                            # a box beats a final-answer line
    ("Final answer: \\(\\frac{1}{2}\\).", "\\frac{1}{2}"),             # inline math delimiters
    ("Final answer:\n\\[ 12 \\]", "12"),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("text", ["", "no answer here", "before the final answer, let me check",
                                  "\\boxed{}", "\\boxed{12"])
def test_extract_answer_none(text):
    assert extract_answer(text) is None


def test_extract_boxed_skips_an_unbalanced_trailing_box():
    assert extract_boxed("\\boxed{3} then \\boxed{4") == ["3"]


@pytest.mark.parametrize("text, verdict", [
    ("Verdict: Correct", Verdict.CORRECT),
    ("findings: none\nverdict: correct", Verdict.CORRECT),
    ("**Verdict:** WRONG.", Verdict.WRONG),
    ("## Verdict\n**Incorrect**", Verdict.WRONG),
    ("Verdict - not correct", Verdict.WRONG),
    ("Final verdict: the solution is correct!", Verdict.CORRECT),
    ("My review...\n\n`Wrong`", Verdict.WRONG),                      # bare last-line verdict
    ("Review done.\n**Correct.**\n", Verdict.CORRECT),
    ("\\boxed{\\text{Wrong}}", Verdict.WRONG),
    ("\\boxed{\\textbf{Correct}}", Verdict.CORRECT),
    ("Verdict: *Correct*", Verdict.CORRECT),
])
def test_verdicts(text, verdict):
    parsed = parse_review(text)
    assert parsed.status is ParseStatus.OK
    assert parsed.value == verdict.value


def test_conflicting_verdicts_take_the_last_and_are_flagged():
    parsed = parse_review("Verdict: Correct\nOn second thought there is a gap.\nVerdict: Wrong")
    assert parsed.value == "wrong" and parsed.status is ParseStatus.CONFLICTING_VERDICTS
    assert not parsed.status.is_failure
    boxed_first = parse_review("\\boxed{\\text{Wrong}}\nOn reflection the step holds.\nVerdict: Correct")
    assert boxed_first.value == "correct"  # "last" means last in the text, whatever its form
    same = parse_review("Verdict: Wrong\n...\nVerdict: wrong")
    assert same.status is ParseStatus.OK and same.value == "wrong"


@pytest.mark.parametrize("text", ["The solution looks plausible.",
                                  "I cannot decide whether it is correct or wrong.",
                                  "Before my verdict, some findings."])
def test_missing_verdict(text):
    parsed = parse_review(text)
    assert parsed.value is None and parsed.status is ParseStatus.NO_VERDICT and parsed.status.is_failure


def test_verdict_inside_reasoning_block_is_ignored():
    parsed = parse_review("<think>verdict: correct? no</think>Findings: 1. gap.\nVerdict: Wrong")
    assert parsed.value == "wrong" and parsed.reasoning == "verdict: correct? no"
    assert find_verdicts("<think>x") == []


@pytest.mark.parametrize("parser", [parse_solution, parse_review])
def test_shared_failure_outcomes(parser):
    truncated = parser("Verdict: Correct \\boxed{5}", "length")
    assert truncated.status is ParseStatus.TRUNCATED and truncated.value is None
    unclosed = parser("<think>still thinking \\boxed{5} verdict: correct")
    assert unclosed.status is ParseStatus.UNCLOSED_THINK and unclosed.passed_on == ""
    empty = parser("<think>all reasoning</think>   ")
    assert empty.status is ParseStatus.EMPTY


def test_solution_without_answer():
    parsed = parse_solution("I believe it is five.")
    assert parsed.status is ParseStatus.NO_ANSWER and parsed.value is None
    assert parsed.passed_on == "I believe it is five."


def test_split_reasoning_forms():
    assert split_reasoning("<think>a</think>b") == ("a", "b", True)
    assert split_reasoning("a</think>b") == ("a", "b", True)          # template opened the block
    assert split_reasoning("<think>a") == ("a", "", False)
    assert split_reasoning("plain") == (None, "plain", True)


def test_parse_counter():
    counter = ParseCounter()
    for status in (ParseStatus.OK, ParseStatus.OK, ParseStatus.NO_VERDICT):
        counter.record("verifier", status)
    counter.record("solver", ParseStatus.TRUNCATED)
    assert counter.count("verifier", ParseStatus.OK) == 2
    assert counter.as_dict() == {"solver": {"truncated": 1}, "verifier": {"no_verdict": 1, "ok": 2}}
