"""Routed experts from the rollout engines, and the issue's proof on CPU: replaying them in
Megatron makes its log-probs match the engine's better when top-k choices flip between engine
and trainer (router weights perturbed very slightly), and changes nothing with identical weights.
With the real SGLang engines the proof runs in tests/rollout/test_sglang_engine.py, in the
same launch as the weight-sync test."""
import base64

import pytest
import torch

from megatron_marsrl.megatron.launch import launch
from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling
from megatron_marsrl.rollout.hf_engine import TransformersEngine
from megatron_marsrl.rollout.routed_experts import RoutedExpertsRecorder, decode_sglang
from megatron_marsrl.rollout.sglang_engine import EngineError, to_record


def _requests(record: bool, n: int = 3):
    return [EngineRequest(rid=str(i), prompt_ids=list(range(1 + i, 5 + 2 * i)), return_routed_experts=record and i != 1,
                          sampling=EngineSampling(temperature=0.8, max_new_tokens=6)) for i in range(n)]


def test_embedded_engine_records_the_routing_of_every_fed_token(tiny_hf):
    engine = TransformersEngine(tiny_hf("qwen3_moe"), seed=1)
    outs = engine.generate(_requests(record=True))
    assert outs[1].routed_experts is None  # not asked for
    for out in (outs[0], outs[2]):
        seq = out.prompt_ids + out.output_ids
        assert out.routed_experts.shape == (len(seq) - 1, 2, 2) and out.routed_experts.dtype == torch.int32
        with RoutedExpertsRecorder(engine.model, 2) as recorder, torch.no_grad():
            engine.model(input_ids=torch.tensor([seq[:-1]]))  # teacher-forced, unpadded
        expected = recorder.take(1)[0]
        assert torch.equal(out.routed_experts.sort(-1).values, expected.sort(-1).values)
    assert all(o.routed_experts is None for o in engine.generate(_requests(record=False)))


def test_embedded_engine_refuses_routing_of_a_dense_model(tiny_hf):
    engine = TransformersEngine(tiny_hf("qwen3"), seed=1)
    with pytest.raises(ValueError, match="no MoE routers"):
        engine.generate(_requests(record=True))


def test_sglang_record_decodes_routed_experts():
    routed = torch.arange(5 * 2 * 2, dtype=torch.int32).view(5, 2, 2)
    encoded = base64.b64encode(routed.numpy().tobytes()).decode()
    req = EngineRequest(prompt_ids=[1, 2, 3], return_routed_experts=True)
    out = {"output_ids": [7, 8, 9], "meta_info": {"finish_reason": {"type": "length"}, "routed_experts": encoded,
                                                  "output_token_logprobs": [[-1.0, 7, None]] * 3}}
    assert torch.equal(to_record(req, out, 0, experts_layout=(2, 2)).routed_experts, routed)
    with pytest.raises(ValueError, match="expected"):
        decode_sglang(encoded, rows=4, layout=(2, 2))
    del out["meta_info"]["routed_experts"]
    with pytest.raises(EngineError, match="enable_return_routed_experts"):
        to_record(req, out, 0, experts_layout=(2, 2))



def test_a_record_without_a_log_prob_per_token_is_refused_at_the_engine_boundary():
    """Training needs the engine's log-prob of every output token (loss.old_logprobs=rollout, TIS,
    the mismatch metrics): an SGLang result without them is an error naming the request, not a
    sample that trains against zeros; an aborted request may carry fewer."""
    req = EngineRequest(prompt_ids=[1, 2, 3], rid="r7")
    out = {"output_ids": [7, 8, 9], "meta_info": {"finish_reason": {"type": "stop"}}}
    with pytest.raises(ValueError, match=r"'r7': the engine returned 0 log-probs for 3 output tokens"):
        to_record(req, out, 0)
    out["meta_info"]["output_token_logprobs"] = [[-1.0, 7, None]] * 2
    with pytest.raises(ValueError, match="returned 2 log-probs for 3"):
        to_record(req, out, 0)
    out["meta_info"]["finish_reason"] = {"type": "abort"}
    assert to_record(req, out, 0).finish_reason == "abort"


def assert_replay_helps(r: dict) -> None:
    """What `routing_workers.replay_report` must show: replay removes the mismatch that flipped
    routing causes, and changes nothing with identical weights."""
    assert r["rows_ok"] and r["engine_vs_hf_routing"] > 0.99, r
    same, moved = r["identical"], r["perturbed"]
    assert same["replay"]["max"] < 1e-5 and abs(same["replay"]["max"] - same["no_replay"]["max"]) < 1e-6, r
    assert r["perturbed_routing_agreement"] < 1.0, r  # the perturbation flipped some top-k choices
    assert moved["replay"]["max"] < moved["no_replay"]["max"] / 10, r
    assert moved["replay"]["mean"] < moved["no_replay"]["mean"] / 10, r


@pytest.mark.slow
def test_replay_reduces_mismatch_with_the_embedded_engine(tiny_hf):
    r = launch("tests.rollout.routing_workers:replay_vs_engine", 1,
               {"hf_dir": tiny_hf("qwen3_moe"), "layout": {}, "engine": "hf"}, env={"OMP_NUM_THREADS": "1"})[0]
    assert_replay_helps(r)
