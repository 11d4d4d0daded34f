"""Roles as data: a name, a prompt builder, an output parser and a reward.

The inference loop and the training rollout only talk to roles through this
interface, so a user can replace a prompt, a parser or a reward (or the whole
role) without touching either. Built-in roles are looked up by name; user
roles by import path "pkg.module:ROLE", e.g.

    MY_SOLVER = dataclasses.replace(roles.SOLVER, build_prompt=my_prompt)
    marsrl solve --solver-role mypkg.roles:MY_SOLVER ...

Inputs each built-in role reads:
  solver     problem
  verifier   problem, solution
  corrector  problem, solution, report
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from megatron_marsrl import plugins
from megatron_marsrl.agents.client import Completion, GenerationRequest, Generator, Message, SamplingParams
from megatron_marsrl.agents.parsing import ParseCounter, ParsedOutput, parse_review, parse_solution
from megatron_marsrl.rewards.agent_rewards import RewardFn, answer_reward, verdict_reward


class PromptBuilder(Protocol):
    """Builds the chat messages of a role from its named inputs."""

    def __call__(self, inputs: Mapping[str, str]) -> list[Message]: ...


class OutputParser(Protocol):
    """Parses a role's output text; `finish_reason` tells whether it was cut off."""

    def __call__(self, text: str, finish_reason: str) -> ParsedOutput: ...


@dataclass(frozen=True, kw_only=True)
class Role:
    """One agent of the system."""

    name: str
    """Role name; samples and statistics are keyed by it."""
    input_keys: tuple[str, ...]
    """Inputs `build_prompt` needs; checked before every call."""
    build_prompt: PromptBuilder
    """Inputs -> chat messages."""
    parse_output: OutputParser
    """Output text -> answer / verdict and parse status."""
    reward: RewardFn
    """(sample, reference answer) -> reward, used in training rollouts and evaluation."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a role needs a non-empty name")
        for attr in ("build_prompt", "parse_output", "reward"):
            if not callable(getattr(self, attr)):
                raise TypeError(f"role {self.name!r}: {attr} must be callable, got {getattr(self, attr)!r}")

    def prompt(self, inputs: Mapping[str, str]) -> list[Message]:
        """The messages for `inputs`; raises if an input the role needs is missing."""
        missing = [k for k in self.input_keys if k not in inputs]
        if missing:
            raise ValueError(f"role {self.name!r} needs inputs {list(self.input_keys)}; missing {missing}")
        return self.build_prompt(inputs)


SOLVER_PROMPT = """\
Solve the math problem below. Reason step by step and double-check every \
computation before relying on it. Finish with the final answer on its own line \
in the form \\boxed{{answer}}.

Problem:
{problem}"""

VERIFIER_PROMPT = """\
You are checking a proposed solution to a math problem. Redo the key steps \
yourself and do not take any claim in the solution on trust.

Problem:
{problem}

Proposed solution:
{solution}

Write your review in two parts.
Findings: a numbered list of every error, gap or unjustified step, each saying \
where it occurs and why it is a problem. Write "None" if you found nothing.
Verdict: the last line must be exactly "Verdict: Correct" if both the reasoning \
and the final answer are right, or "Verdict: Wrong" otherwise."""

CORRECTOR_PROMPT = """\
Below are a math problem, a solution you wrote earlier, and a reviewer's report \
on that solution.

Problem:
{problem}

Your earlier solution:
{solution}

Reviewer's report:
{report}

Weigh each finding of the report. Fix the ones that hold. If you are sure a \
finding is mistaken, say so and explain why instead of changing correct work. \
Then write the complete revised solution from the beginning (not only the \
changes), ending with the final answer on its own line as \\boxed{{answer}}."""

# Given to the Corrector in the inference loop when a solution has no parsable
# final answer: it is rejected without a verifier call, and this is the report.
NO_ANSWER_REPORT = (
    "Findings:\n1. The solution does not finish with a final answer in the form \\boxed{...} "
    "(it may have been cut off). Complete the solution and state the final answer.\nVerdict: Wrong"
)


# What the held-out evaluation (agents/heldout.py) hands the Corrector as the Verifier's
# rejection of a fixed wrong solution.
REJECTION_REPORT = "Findings:\n1. The final answer is wrong.\nVerdict: Wrong"


def boxed_solution(answer: str) -> str:
    """A solution as the MarsRL Solver passes it on, reduced to its final answer."""
    return f"The final answer is \\boxed{{{answer}}}."


def _template_prompt(template: str) -> PromptBuilder:
    def build(inputs: Mapping[str, str]) -> list[Message]:
        return [{"role": "user", "content": template.format(**inputs)}]
    return build


SOLVER = Role(name="solver", input_keys=("problem",), build_prompt=_template_prompt(SOLVER_PROMPT),
              parse_output=parse_solution, reward=answer_reward)
VERIFIER = Role(name="verifier", input_keys=("problem", "solution"),
                build_prompt=_template_prompt(VERIFIER_PROMPT), parse_output=parse_review, reward=verdict_reward)
CORRECTOR = Role(name="corrector", input_keys=("problem", "solution", "report"),
                 build_prompt=_template_prompt(CORRECTOR_PROMPT), parse_output=parse_solution, reward=answer_reward)

BUILTIN_ROLES: dict[str, Role] = {r.name: r for r in (SOLVER, VERIFIER, CORRECTOR)}


@dataclass(frozen=True, kw_only=True)
class RoleSet:
    """The three slots of the system; each may hold a built-in or a user role."""

    solver: Role = SOLVER
    """Writes the first solution; needs input "problem"."""
    verifier: Role = VERIFIER
    """Reviews a solution; needs "problem", "solution"; its parser yields "correct" / "wrong"."""
    corrector: Role = CORRECTOR
    """Revises a solution given a report; needs "problem", "solution", "report"."""
    solution_text: Callable[[str], str] = boxed_solution
    """A final answer written as a solution the Verifier can judge (the held-out set's fixed
    right and wrong solutions); the Verifier's reward must read the answer back from it."""
    rejection_report: str = REJECTION_REPORT
    """A Verifier's report rejecting a solution, as the Corrector receives it (held-out set)."""

    def __post_init__(self) -> None:
        needs = {"solver": {"problem"}, "verifier": {"problem", "solution"},
                 "corrector": {"problem", "solution", "report"}}
        for slot, provided in needs.items():
            role: Role = getattr(self, slot)
            extra = set(role.input_keys) - provided
            if extra:
                raise ValueError(f"role {role.name!r} in the {slot} slot asks for inputs {sorted(extra)}, "
                                 f"but the system only provides {sorted(provided)} there")


def resolve_role(spec: str) -> Role:
    """A built-in role by name, or a user `Role` by import path "pkg.module:attr"."""
    role = plugins.resolve(spec, BUILTIN_ROLES, what="role")
    if not isinstance(role, Role):
        raise TypeError(f"{spec!r} resolved to {type(role).__name__}, expected a megatron_marsrl.agents.roles.Role")
    return role


def role_set(solver: str = "solver", verifier: str = "verifier", corrector: str = "corrector") -> RoleSet:
    """A `RoleSet` from three role specs (names or import paths)."""
    return RoleSet(solver=resolve_role(solver), verifier=resolve_role(verifier), corrector=resolve_role(corrector))


@dataclass(frozen=True, kw_only=True)
class RoleOutput:
    """One completion of a role, parsed."""

    messages: list[Message]
    """The prompt messages sent."""
    completion: Completion
    """What the generator returned."""
    parsed: ParsedOutput
    """What the role's parser made of it."""


async def call_role(role: Role, generator: Generator, inputs: Mapping[str, str], sampling: SamplingParams,
                    n: int = 1, counter: ParseCounter | None = None) -> list[RoleOutput]:
    """Sample `n` outputs of `role` on `inputs` and parse each (outcomes counted in `counter`)."""
    messages = role.prompt(inputs)
    completions = await generator.generate(GenerationRequest(messages=messages, n=n, sampling=sampling))
    outputs = []
    for completion in completions:
        parsed = role.parse_output(completion.text, completion.finish_reason)
        if counter is not None:
            counter.record(role.name, parsed.status)
        outputs.append(RoleOutput(messages=messages, completion=completion, parsed=parsed))
    return outputs
