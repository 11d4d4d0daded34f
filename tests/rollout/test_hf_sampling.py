"""The embedded engine's sampler: exact draws, its own RNG, reproducible per-request seeds."""
import torch

from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling
from megatron_marsrl.rollout.hf_engine import TransformersEngine, _GumbelSampler


def _frequencies(sampling: EngineSampling, logits: torch.Tensor, n: int = 40000) -> torch.Tensor:
    sampler = _GumbelSampler(sampling, torch.Generator().manual_seed(0))
    picks = sampler(None, logits.expand(n, -1)).argmax(-1)
    return torch.bincount(picks, minlength=logits.shape[-1]).float() / n


def test_gumbel_sampler_draws_from_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    got = _frequencies(EngineSampling(temperature=0.7), logits)
    assert torch.allclose(got, torch.softmax(logits[0] / 0.7, -1), atol=0.01)


def test_gumbel_sampler_top_p_and_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    probs = torch.softmax(logits[0], -1)  # ~0.64, 0.24, 0.09, 0.03
    got = _frequencies(EngineSampling(temperature=1.0, top_p=0.8), logits)
    assert got[2:].sum() == 0  # the first two reach 0.8; the rest are cut
    assert torch.allclose(got[:2], probs[:2] / probs[:2].sum(), atol=0.01)
    got = _frequencies(EngineSampling(temperature=1.0, top_k=1), logits)
    assert got[0] == 1.0


def test_seeded_requests_ignore_the_global_rng(tiny_hf):
    engine = TransformersEngine(tiny_hf("qwen3"), seed=0)
    req = EngineRequest(prompt_ids=[1, 2, 3], sampling=EngineSampling(temperature=1.0, max_new_tokens=12, seed=77))
    torch.manual_seed(1)
    first = engine.generate([req])[0].output_ids
    torch.manual_seed(2)
    engine.generate([EngineRequest(prompt_ids=[5, 6], sampling=EngineSampling(max_new_tokens=5))])  # moves engine RNG
    state = torch.get_rng_state()
    assert engine.generate([req])[0].output_ids == first
    assert torch.equal(torch.get_rng_state(), state)  # generation left the global RNG alone
