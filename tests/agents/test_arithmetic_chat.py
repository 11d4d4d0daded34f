"""The arithmetic_chat roles: plain-English prompts for an instruct model, lenient parsers,
rewards through the agent rewards."""
import pytest

from megatron_marsrl.agents.arithmetic import CHAT_ROLES, parse_chat_answer, parse_chat_verdict
from megatron_marsrl.data_types import ParseStatus, Sample, Verdict
from megatron_marsrl.rl.config import TaskConfig
from megatron_marsrl.rl.rollout_side import role_set


@pytest.mark.parametrize("text,value", [("12", "12"), ("The answer is 12.", "12"), ("7 + 5 = 12", "12"),
                                        ("-3", "-3"), ("007", "7")])
def test_answer_is_the_last_integer(text, value):
    parsed = parse_chat_answer(text)
    assert (parsed.value, parsed.status) == (value, ParseStatus.OK)


def test_cut_off_or_numberless_replies_have_no_answer():
    assert parse_chat_answer("7 + 5 = 1", finish_reason="length").status == ParseStatus.TRUNCATED
    assert parse_chat_answer("I am not sure.").status == ParseStatus.NO_ANSWER
    assert parse_chat_answer("  ").status == ParseStatus.EMPTY


@pytest.mark.parametrize("text,verdict", [("Yes", Verdict.CORRECT), ("yes, it is right", Verdict.CORRECT),
                                          ("No.", Verdict.WRONG), ("**No**, 7 + 5 is 12", Verdict.WRONG)])
def test_verdict_is_the_first_word(text, verdict):
    assert parse_chat_verdict(text).value == verdict.value


def test_verdict_needs_yes_or_no_first():
    assert parse_chat_verdict("The answer is correct").status == ParseStatus.NO_VERDICT


def _sample(role, inputs, text):
    parsed = role.parse_output(text, "stop")
    return Sample(sample_id="s", group_id="g", problem_id="p", role=role.name, stage=role.name, turn=0,
                  inputs=inputs, response=text, parsed=parsed.value, parse_status=parsed.status)


def test_rewards_and_prompts():
    roles = role_set("arithmetic_chat")
    assert roles is CHAT_ROLES and TaskConfig(name="arithmetic_chat", train="arithmetic:train").name == "arithmetic_chat"
    problem = "What is 7 + 5?"
    assert roles.solver.prompt({"problem": problem})[0]["content"] == "What is 7 + 5? Reply with the number only."
    assert roles.solver.reward(_sample(roles.solver, {"problem": problem}, "It is 12."), "12") == 1.0
    judged = {"problem": problem, "solution": "7 + 5 = 13"}
    assert roles.verifier.reward(_sample(roles.verifier, judged, "No"), "12") == 1.0
    assert roles.verifier.reward(_sample(roles.verifier, judged, "Yes"), "12") == 0.0
    assert "A checker replied: No" in roles.corrector.prompt({**judged, "report": "No"})[0]["content"]
