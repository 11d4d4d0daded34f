"""Plain records shared by the rollout side (agents, rewards) and the trainer.

Nothing here imports Megatron, SGLang or torch: the rollout produces these
objects, the trainer turns them into tensors. A `Sample` is one model call
(one role answering one prompt); a `Group` is the samples that answered the
same input, the unit inside which GRPO compares rewards.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class ParseStatus(str, enum.Enum):
    """How parsing a model output went. Every value has a defined consequence
    (documented in `megatron_marsrl.agents.parsing`) and is counted."""

    OK = "ok"
    EMPTY = "empty"                              # nothing left after removing the reasoning block
    TRUNCATED = "truncated"                      # generation hit the token limit
    UNCLOSED_THINK = "unclosed_think"            # reasoning block never closed: no answer text
    NO_ANSWER = "no_answer"                      # Solver/Corrector: no boxed / "final answer"
    NO_VERDICT = "no_verdict"                    # Verifier: no Correct/Wrong verdict found
    CONFLICTING_VERDICTS = "conflicting_verdicts"  # Verifier: both verdicts; the last one is used

    @property
    def is_failure(self) -> bool:
        """True when the output yielded no usable value (answer or verdict)."""
        return self not in (ParseStatus.OK, ParseStatus.CONFLICTING_VERDICTS)


class Verdict(str, enum.Enum):
    """The Verifier's one-word judgement of a solution."""

    CORRECT = "correct"
    WRONG = "wrong"


@dataclass(kw_only=True)
class Sample:
    """One model call: a role answering one prompt, plus what was parsed and scored."""

    sample_id: str
    """Unique id, e.g. "p17/verifier1/g3/5"; children point at it via `parent_id`."""
    role: str
    """Role name (prompt and weights): "solver", "verifier", "corrector", or a user role."""
    stage: str
    """Stage name used for grouping and statistics: "solver", "verifier1", "corrector2", ..."""
    turn: int
    """Position of the stage in the trajectory (0 = Solver); AT-GRPO groups by it."""
    problem_id: str
    """Id of the problem this trajectory works on."""
    group_id: str
    """Id of the same-input group; every sample of a group saw the identical prompt."""
    parent_id: str | None = None
    """`sample_id` of the output this sample's input was built from (None for the Solver)."""
    inputs: dict[str, str] = field(default_factory=dict)
    """Role inputs the prompt was built from ("problem", "solution", "report")."""
    prompt: str = ""
    """The prompt text as sent (rendered chat or plain completion prompt)."""
    prompt_token_ids: list[int] | None = None
    """Prompt tokens when the generator reports them (training engines do; HTTP may not)."""
    response: str = ""
    """The full generated text, reasoning block included."""
    response_token_ids: list[int] | None = None
    """Generated tokens when the generator reports them."""
    rollout_logprobs: list[float] | None = None
    """Log-probabilities of `response_token_ids` under the rollout engine (for TIS)."""
    finish_reason: str = ""
    """The engine's reason to stop: "stop", "length", or "" when unknown."""
    parse_status: ParseStatus = ParseStatus.OK
    """Outcome of parsing `response` with the role's parser."""
    parsed: str | None = None
    """The parsed value: the final answer (Solver/Corrector) or the verdict (Verifier)."""
    passed_on: str = ""
    """The text handed to the next agent (the response without its reasoning block)."""
    reward: float | None = None
    """Scalar reward, set once the reward function ran."""
    advantage: float | None = None
    """Set by the trainer when it computes the advantages of the sample's problem (the value
    its training sequence carries); None before that, and on samples never trained (evaluation)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form extras (engine timings, weight version, ...); never read by the maths."""


@dataclass(kw_only=True)
class Group:
    """Samples of one role that answered the identical input."""

    group_id: str
    """Unique id; equals `Sample.group_id` of every member."""
    role: str
    """Role name shared by all members."""
    stage: str
    """Stage name shared by all members."""
    turn: int
    """Stage position shared by all members."""
    problem_id: str
    """Problem shared by all members."""
    input_sample_id: str | None = None
    """The earlier sample this group's input came from (None for Solver groups)."""
    samples: list[Sample] = field(default_factory=list)
    """The members, in generation order."""

    def rewards(self) -> list[float]:
        """Rewards of the members; raises if one was not scored yet."""
        missing = [s.sample_id for s in self.samples if s.reward is None]
        if missing:
            raise ValueError(f"group {self.group_id}: samples {missing} have no reward yet; "
                             "run the reward step before reading rewards")
        return [float(s.reward) for s in self.samples]  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class Problem:
    """A training or evaluation problem with its reference answer."""

    id: str
    """Unique id (datasets: the "id" field)."""
    problem: str
    """Problem statement shown to the Solver."""
    answer: str
    """Reference final answer; used for rewards and scoring only, never shown to a model."""
