"""The inference loop end to end with scripted model outputs."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from megatron_marsrl.agents.client import SamplingParams
from megatron_marsrl.agents.roles import NO_ANSWER_REPORT, RoleSet
from megatron_marsrl.agents.system import SLOTS, ReasoningSystem, RunResult, SystemConfig, vote
from megatron_marsrl.data_types import ParseStatus

from .helpers import ScriptedGenerator, oracle_respond, prompt_text, section

OK, BAD = "Findings: None\nVerdict: Correct", "Findings:\n1. Step 2 divides by zero.\nVerdict: Wrong"


def make_system(gen: ScriptedGenerator, **cfg: int) -> ReasoningSystem:
    sampling = SamplingParams()
    return ReasoningSystem(roles=RoleSet(), generators={s: gen for s in SLOTS},
                           sampling={s: sampling for s in SLOTS}, config=SystemConfig(**cfg))


def run_once(gen: ScriptedGenerator, **cfg: int) -> RunResult:
    return asyncio.run(make_system(gen, **cfg).run_once("What is 2+3?"))


def test_accepts_after_n_consecutive_correct_verdicts():
    gen = ScriptedGenerator({"solver": ["\\boxed{5}"], "verifier": [OK] * 3})
    result = run_once(gen, accept_after=3)
    assert result.outcome == "accepted" and result.answer == "5"
    assert gen.roles_called() == ["solver", "verifier", "verifier", "verifier"]
    assert result.candidates[0].confirmations == 3


def test_correct_then_accept_after_a_wrong_verdict():
    gen = ScriptedGenerator({"solver": ["\\boxed{6}"], "verifier": [BAD, OK, OK],
                             "corrector": ["Fixed the slip.\n\\boxed{5}"]})
    result = run_once(gen, accept_after=2)
    assert result.outcome == "accepted" and result.answer == "5"
    assert gen.roles_called() == ["solver", "verifier", "corrector", "verifier", "verifier"]
    corrector_prompt = prompt_text(gen.requests[2][1].messages)
    assert "divides by zero" in section(corrector_prompt, "Reviewer's report:")
    assert "\\boxed{6}" in corrector_prompt


def test_streak_resets_on_wrong_and_gives_up_after_m_failures():
    gen = ScriptedGenerator({"solver": ["\\boxed{1}"], "verifier": [OK, BAD, BAD, BAD],
                             "corrector": ["\\boxed{2}", "\\boxed{3}"]})
    result = run_once(gen, accept_after=2, max_failures=3)
    assert result.outcome == "gave_up"
    assert [c.answer for c in result.candidates] == ["1", "2", "3"]
    # the only confirmed candidate is the first one: the run answers with it
    assert result.answer == "1"


def test_a_correct_verdict_resets_the_failure_count():
    # failures are counted in a row: Wrong, Correct, Wrong is one failure, not two
    gen = ScriptedGenerator({"solver": ["\\boxed{1}"], "verifier": [BAD, OK, BAD, OK, OK],
                             "corrector": ["\\boxed{2}", "\\boxed{3}"]})
    result = run_once(gen, accept_after=2, max_failures=2)
    assert result.outcome == "accepted" and result.answer == "3"
    assert [c.confirmations for c in result.candidates] == [0, 1, 2]


def test_max_rounds_stops_an_alternating_loop():
    gen = ScriptedGenerator({"solver": ["\\boxed{1}"], "verifier": [OK, BAD] * 5,
                             "corrector": [f"\\boxed{{{i}}}" for i in range(2, 7)]})
    result = run_once(gen, accept_after=2, max_failures=2, max_rounds=6)
    assert result.outcome == "max_rounds"
    assert gen.roles_called().count("verifier") == 6


def test_answerless_solution_is_rejected_without_verifier_call():
    gen = ScriptedGenerator({"solver": ["I think it is five."], "verifier": [OK],
                             "corrector": ["Final answer: 5"]})
    result = run_once(gen, accept_after=1)
    assert [s.role for s in result.steps] == ["solver", "auto_reject", "corrector", "verifier"]
    assert result.steps[0].parse_status == ParseStatus.NO_ANSWER.value
    assert NO_ANSWER_REPORT in prompt_text(gen.requests[1][1].messages)
    assert result.outcome == "accepted" and result.answer == "5"


def test_truncated_solution_and_missing_verdict_never_confirm():
    gen = ScriptedGenerator({"solver": [("\\boxed{5} and then", "length")],
                             "verifier": ["Looks fine to me.", OK],
                             "corrector": ["\\boxed{5}", "\\boxed{5}"]})
    result = run_once(gen, accept_after=1)
    roles = [s.role for s in result.steps]
    assert roles == ["solver", "auto_reject", "corrector", "verifier", "corrector", "verifier"]
    assert result.steps[0].parse_status == ParseStatus.TRUNCATED.value
    assert result.steps[3].parse_status == ParseStatus.NO_VERDICT.value
    assert result.outcome == "accepted"


def test_parse_outcomes_are_counted():
    gen = ScriptedGenerator({"solver": [("cut", "length")], "verifier": ["Verdict: Correct\nVerdict: Wrong"],
                             "corrector": ["\\boxed{2}"]})
    system = make_system(gen, max_failures=2)
    result = asyncio.run(system.run_once("p"))
    assert result.outcome == "gave_up"
    counts = system.counter.as_dict()
    assert counts["solver"] == {"truncated": 1}
    assert counts["corrector"] == {"ok": 1}
    assert counts["verifier"] == {"conflicting_verdicts": 1}  # last verdict (Wrong) used -> gave up


def test_thinking_block_is_not_passed_on():
    gen = ScriptedGenerator({"solver": ["<think>secret musing 41</think>So \\boxed{5}"],
                             "verifier": ["<think>hmm, verdict: wrong?</think>Verdict: Correct"]})
    result = run_once(gen, accept_after=1)
    verifier_prompt = prompt_text(gen.requests[1][1].messages)
    assert "secret musing" not in verifier_prompt and "So \\boxed{5}" in verifier_prompt
    assert result.steps[1].parsed == "correct"  # the verdict inside the reasoning is ignored
    assert result.steps[0].reasoning == "secret musing 41"


def test_several_runs_vote_for_the_most_confirmed_answer():
    gen = ScriptedGenerator(respond=oracle_respond({"q": ("5", "5", "5")}))
    result = asyncio.run(make_system(gen, runs=3, accept_after=2).solve("q", "[q] add"))
    assert len(result.runs) == 3 and all(r.outcome == "accepted" for r in result.runs)
    assert result.final_answer == "5"


def test_vote_rules():
    def run(answers_confirmations, outcome="gave_up"):
        from megatron_marsrl.agents.system import Candidate, _run_answer
        cands = [Candidate(answer=a, confirmations=c) for a, c in answers_confirmations]
        return RunResult(run=0, outcome=outcome, answer=_run_answer(cands), candidates=cands)

    same = lambda a, b: a == b  # noqa: E731
    # confirmations summed over runs beat a single accepted run with fewer
    runs = [run([("7", 3)], "accepted"), run([("8", 2)]), run([("8", 2)])]
    assert vote(runs, same) == "8"
    # confirmations decide, not the number of runs ending with an answer
    assert vote([run([("7", 4)], "accepted"), run([("8", 0)]), run([("8", 1)])], same) == "7"
    # equal confirmations: the answer with more accepted runs, even when seen later
    assert vote([run([("8", 1), ("9", 0), ("8", 1)]), run([("7", 2)], "accepted")], same) == "7"
    # within a run, equal confirmations go to the latest candidate
    assert run([("1", 0), ("2", 0)]).answer == "2" and run([("1", 1), ("2", 0)]).answer == "1"
    # no confirmations anywhere: majority of run answers
    assert vote([run([("1", 0)]), run([("2", 0)]), run([("2", 0)])], same) == "2"
    # equivalent answers are pooled through the matcher
    assert vote([run([("1/2", 1)]), run([("0.5", 1)]), run([("3", 1)])], lambda a, b: {a, b} <= {"1/2", "0.5"}) \
        == "1/2"
    assert vote([run([(None, 0)])], same) is None


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="accept_after must be >= 1, got 0"):
        SystemConfig(accept_after=0)
    with pytest.raises(ValueError, match="missing"):
        ReasoningSystem(roles=RoleSet(), generators={}, sampling={}, config=SystemConfig())


def test_loop_over_http_with_truncation_and_a_flaky_endpoint():
    """The real client against a local OpenAI-style server: a cut-off first solution, a 503, then recovery."""
    from megatron_marsrl.agents.client import EndpointConfig, OpenAIClient

    from .helpers import ScriptedServer, openai_reply, request_prompt, role_of

    script = {"solver": [("Let me see... \\boxed{4", "length")], "corrector": ["Done.\n\\boxed{5}"],
              "verifier": [OK, OK]}
    failures = [503]

    def handler(path, body):
        if failures:
            return failures.pop(), "overloaded"
        return 200, openai_reply(path, body, [script[role_of(request_prompt(path, body))].pop(0)])

    async def go(url):
        async with OpenAIClient(EndpointConfig(base_url=url, backoff_s=0.01)) as client:
            system = ReasoningSystem(roles=RoleSet(), generators={s: client for s in SLOTS},
                                     sampling={s: SamplingParams() for s in SLOTS}, config=SystemConfig(accept_after=2))
            return await system.solve("q", "What is 2+3?")

    with ScriptedServer(handler) as server:
        result = asyncio.run(go(server.url))
    run = result.runs[0]
    assert [s.role for s in run.steps] == ["solver", "auto_reject", "corrector", "verifier", "verifier"]
    assert run.steps[0].finish_reason == "length" and run.steps[0].parse_status == "truncated"
    assert result.final_answer == "5" and run.outcome == "accepted"
    assert len(server.requests) == 5  # one retried solver request + corrector + two verifications


def test_system_tally_pairs_each_run_with_its_first_solution():
    from megatron_marsrl.agents.system import Candidate, ProblemResult, RunResult, system_figures, system_tally

    def run(first: str, final: str | None) -> RunResult:
        return RunResult(run=0, outcome="accepted", answer=final, candidates=[Candidate(answer=first)])

    results = [ProblemResult(problem_id="a", problem="", final_answer=None, runs=[run("3", "4"), run("4", "4")]),
               ProblemResult(problem_id="b", problem="", final_answer=None, runs=[run("7", None), run("1", "7")])]
    total = sum((system_tally(r, ref) for r, ref in zip(results, ["4", "7"])), start=Counter())
    # two misses fixed, one right answer lost
    assert system_figures(total) == {"accuracy": 0.75, "solver_accuracy": 0.5, "gain": 0.25}
    assert system_figures({}) == {}
