"""The Solver-Verifier-Corrector inference loop (MarsRL's V-C reasoning system).

One run on a problem:

    solution = Solver(problem)
    repeat (at most max_rounds verifications):
        review = Verifier(problem, solution)
        Correct -> one more confirmation; accept after `accept_after` in a row
        Wrong   -> solution = Corrector(problem, solution, review);
                   give up after `max_failures` Wrong in a row

Defined outcomes for unusable outputs (see `parsing.py`): a solution without
a parsable final answer (or cut off) is rejected without a verifier call and
the Corrector gets a fixed report (`roles.NO_ANSWER_REPORT`); a review without
a verdict counts as Wrong, never as a confirmation. Thinking models: every
agent sees only the text after the reasoning block.

Several independent runs per problem run concurrently. The final answer is the
answer whose solutions the verifier confirmed most often over all runs (ties:
accepted runs, then the earliest); when nothing was ever confirmed, the most
common run answer.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_marsrl.agents.client import Generator, SamplingParams
from megatron_marsrl.agents.parsing import ParseCounter
from megatron_marsrl.agents.roles import NO_ANSWER_REPORT, Role, RoleSet, call_role
from megatron_marsrl.data_types import ParseStatus, Verdict
from megatron_marsrl.rewards.math_match import answers_match

SLOTS = ("solver", "verifier", "corrector")


@dataclass(kw_only=True)
class SystemConfig:
    """Loop limits of the inference system."""

    accept_after: int = 4
    """Consecutive Correct verdicts that accept a solution (MarsRL code: 4; IMO-2025 pipeline: 5)."""
    max_failures: int = 10
    """Consecutive Wrong verdicts after which a run gives up."""
    max_rounds: int = 40
    """Most verifications per run: a Correct/Wrong alternation would otherwise never hit either limit."""
    runs: int = 1
    """Independent runs per problem; the final answer is voted over them."""

    def __post_init__(self) -> None:
        for name in ("accept_after", "max_failures", "max_rounds", "runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(kw_only=True)
class Step:
    """One agent call (or the automatic rejection of an answerless solution)."""

    role: str          # "solver" | "verifier" | "corrector" | "auto_reject" (slot names)
    candidate: int     # index of the solution produced (solver/corrector) or judged (verifier/auto_reject)
    text: str          # full output, reasoning included
    passed_on: str     # what the next agent saw
    finish_reason: str
    parse_status: str
    parsed: str | None  # answer, or "correct" / "wrong"
    reasoning: str | None = None


@dataclass(kw_only=True)
class Candidate:
    """One solution version in a run."""

    answer: str | None
    confirmations: int = 0


@dataclass(kw_only=True)
class RunResult:
    run: int
    outcome: str               # "accepted" | "gave_up" | "max_rounds"
    answer: str | None         # answer of the run's most confirmed candidate (ties: latest)
    candidates: list[Candidate] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)


@dataclass(kw_only=True)
class ProblemResult:
    problem_id: str
    problem: str
    final_answer: str | None
    runs: list[RunResult]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ReasoningSystem:
    """Runs the loop with one `Generator` per slot (they may be the same object)."""

    def __init__(self, *, roles: RoleSet, generators: Mapping[str, Generator],
                 sampling: Mapping[str, SamplingParams], config: SystemConfig,
                 counter: ParseCounter | None = None,
                 same_answer: Callable[[str, str], bool] = answers_match) -> None:
        missing = [s for s in SLOTS if s not in generators or s not in sampling]
        if missing:
            raise ValueError(f"generators and sampling need entries for {list(SLOTS)}; missing {missing}")
        self.roles, self.generators, self.sampling = roles, generators, sampling
        self.config = config
        self.counter = counter if counter is not None else ParseCounter()
        self.same_answer = same_answer

    async def _call(self, slot: str, inputs: Mapping[str, str], candidate: int) -> Step:
        role: Role = getattr(self.roles, slot)
        (out,) = await call_role(role, self.generators[slot], inputs, self.sampling[slot], counter=self.counter)
        return Step(role=slot, candidate=candidate, text=out.completion.text, passed_on=out.parsed.passed_on,
                    finish_reason=out.completion.finish_reason, parse_status=out.parsed.status.value,
                    parsed=out.parsed.value, reasoning=out.parsed.reasoning or out.completion.reasoning)

    async def _review(self, problem: str, solution: Step) -> tuple[Step, bool]:
        """(review step, confirmed?) for the current solution."""
        if ParseStatus(solution.parse_status).is_failure:
            step = Step(role="auto_reject", candidate=solution.candidate, text=NO_ANSWER_REPORT,
                        passed_on=NO_ANSWER_REPORT, finish_reason="", parse_status=ParseStatus.OK.value,
                        parsed=Verdict.WRONG.value)
            return step, False
        review = await self._call("verifier", {"problem": problem, "solution": solution.passed_on},
                                  solution.candidate)
        return review, review.parsed == Verdict.CORRECT.value

    async def run_once(self, problem: str, run: int = 0) -> RunResult:
        """One independent run of the loop on `problem`."""
        cfg = self.config
        solution = await self._call("solver", {"problem": problem}, candidate=0)
        result = RunResult(run=run, outcome="max_rounds", answer=None, steps=[solution],
                           candidates=[Candidate(answer=_answer_of(solution))])
        streak = failures = 0
        for _ in range(cfg.max_rounds):
            review, confirmed = await self._review(problem, solution)
            result.steps.append(review)
            if confirmed:
                result.candidates[-1].confirmations += 1
                streak, failures = streak + 1, 0
                if streak >= cfg.accept_after:
                    result.outcome = "accepted"
                    break
                continue
            streak, failures = 0, failures + 1
            if failures >= cfg.max_failures:
                result.outcome = "gave_up"
                break
            inputs = {"problem": problem, "solution": solution.passed_on, "report": review.passed_on}
            solution = await self._call("corrector", inputs, candidate=len(result.candidates))
            result.steps.append(solution)
            result.candidates.append(Candidate(answer=_answer_of(solution)))
        result.answer = _run_answer(result.candidates)
        return result

    async def solve(self, problem_id: str, problem: str) -> ProblemResult:
        """All runs of `problem` (concurrently) and the voted final answer."""
        runs = await asyncio.gather(*(self.run_once(problem, r) for r in range(self.config.runs)))
        return ProblemResult(problem_id=problem_id, problem=problem, runs=list(runs),
                             final_answer=vote(list(runs), self.same_answer))


def system_tally(result: ProblemResult, answer: str,
                 same_answer: Callable[[str, str], bool] = answers_match) -> Counter:
    """Counts of one problem's runs: ("system", "runs"), ("system", "right") (the run's answer is
    right) and ("system", "solver_right") (its first solution, the Solver alone, is right)."""
    def right(a: str | None) -> bool:
        return a is not None and same_answer(a, answer)

    return Counter({("system", "runs"): len(result.runs),
                    ("system", "right"): sum(right(run.answer) for run in result.runs),
                    ("system", "solver_right"): sum(right(run.candidates[0].answer) for run in result.runs)})


def system_figures(t: Mapping) -> dict[str, float]:
    """From summed `system_tally`s: "accuracy", "solver_accuracy" and "gain" (their difference:
    a paired comparison of the loop with the Solver on the same runs)."""
    runs = t.get(("system", "runs"), 0)
    if not runs:
        return {}
    accuracy, solver = t.get(("system", "right"), 0) / runs, t.get(("system", "solver_right"), 0) / runs
    return {"accuracy": accuracy, "solver_accuracy": solver, "gain": accuracy - solver}


def _answer_of(solution: Step) -> str | None:
    return None if ParseStatus(solution.parse_status).is_failure else solution.parsed


def _run_answer(candidates: list[Candidate]) -> str | None:
    best: Candidate | None = None
    for c in candidates:  # ">=": ties go to the latest candidate
        if c.answer is not None and (best is None or c.confirmations >= best.confirmations):
            best = c
    return best.answer if best else None


def vote(runs: list[RunResult], same_answer: Callable[[str, str], bool]) -> str | None:
    """The answer confirmed most often over all runs' candidates (see module docstring)."""
    clusters: list[dict[str, Any]] = []  # representative answer, confirmations, accepted runs, run answers

    def cluster_of(answer: str) -> dict[str, Any]:
        for c in clusters:
            if c["answer"] == answer or same_answer(answer, c["answer"]):
                return c
        clusters.append({"answer": answer, "confirmations": 0, "accepted": 0, "runs": 0})
        return clusters[-1]

    for run in runs:
        for cand in run.candidates:
            if cand.answer is not None:
                cluster_of(cand.answer)["confirmations"] += cand.confirmations
        if run.answer is not None:
            c = cluster_of(run.answer)
            c["runs"] += 1
            c["accepted"] += run.outcome == "accepted"
    if not clusters:
        return None
    # max() keeps the first of equal keys, i.e. the earliest-seen cluster.
    if any(c["confirmations"] for c in clusters):
        return max(clusters, key=lambda c: (c["confirmations"], c["accepted"]))["answer"]
    return max(clusters, key=lambda c: c["runs"])["answer"]
