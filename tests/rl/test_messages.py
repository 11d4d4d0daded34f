"""Step messages between training ranks (rl/messages.py): typed, picklable, small."""
from __future__ import annotations

import pickle

import pytest

from megatron_marsrl.megatron.actor import Sequence
from megatron_marsrl.rl.messages import StepAbort, StepEnd, TrainRound, Update


def _round() -> TrainRound:
    seq = Sequence(prompt_ids=[1, 2, 3], response_ids=[4, 5], advantage=0.5, reward=1.0,
                   rollout_logprobs=[-0.1, -0.2])
    return TrainRound(policy="shared", micro_batches=[[("solver", seq), ("verifier", seq)], []])


@pytest.mark.parametrize("msg", [_round(), Update(policy="verifier"), StepEnd(), StepAbort(reason="RuntimeError: engines gave up",
                                                                   by_signal=False)])
def test_messages_survive_the_broadcast_pickle(msg):
    back = pickle.loads(pickle.dumps(msg))
    assert type(back) is type(msg) and back == msg


def test_messages_are_small():
    assert len(pickle.dumps(StepEnd())) < 100
    assert len(pickle.dumps(StepAbort(reason="x", by_signal=True))) < 150
    rnd = _round()
    # a round costs its sequences plus a small envelope
    assert len(pickle.dumps(rnd)) < len(pickle.dumps(rnd.micro_batches)) + 150


def test_messages_are_immutable_records():
    with pytest.raises(AttributeError):
        StepEnd().extra = 1
    with pytest.raises(TypeError):
        StepAbort("positional", True)  # fields by name only
