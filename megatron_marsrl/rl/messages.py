"""What rank 0 tells the other training ranks during a step.

Rank 0 alone sees the rollouts; during `Trainer.train_while_generating` it broadcasts one
message at a time on the control group (gloo, `broadcast_object_list`, so each is pickled)
and the other ranks act on it, so every collective inside Megatron runs in the same order
everywhere: any number of `TrainRound` (with an `Update` after a PPO mini-batch), then `StepEnd`, or `StepAbort` when the rollout side
failed. Messages hold plain data only (no tensors beyond a sequence's routing record, no
handles) and a round carries just the sequences its micro-batches train.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_marsrl.megatron.actor import Sequence


@dataclass(frozen=True, kw_only=True)
class TrainRound:
    """Train one micro-batch per data-parallel rank of one policy (a scheduler `Round`)."""

    policy: str
    """The policy the round trains."""
    micro_batches: list[list[tuple[str, Sequence]]]
    """Per data-parallel rank (by index), its micro-batch as (role, sequence) pairs; empty when
    the rank has nothing this round (it still joins the collectives)."""


@dataclass(frozen=True, kw_only=True)
class Update:
    """A PPO mini-batch of `policy` is complete: reduce its gradients and step its optimizer now,
    before the step's remaining rounds (`PolicyConfig.mini_batch_sequences`)."""

    policy: str
    """The policy to update."""


@dataclass(frozen=True)
class TrainPhase:
    """The step's rollout is over (time-shared colocation): the engines released their memory,
    and the ranks bring the trainer's state back to the GPU before the rounds that follow."""


@dataclass(frozen=True)
class StepEnd:
    """Every round of the step was sent: the ranks go on to the step's metric reduction."""


@dataclass(frozen=True, kw_only=True)
class StepAbort:
    """The rollout side failed or a stop signal arrived: the step ends without an update."""

    reason: str
    """What went wrong on rank 0 ("ExceptionType: message")."""
    by_signal: bool
    """True when SIGTERM/SIGINT stopped the step (the run exits cleanly after a checkpoint)."""


StepMessage = TrainRound | Update | TrainPhase | StepEnd | StepAbort
"""Every message of a step."""
