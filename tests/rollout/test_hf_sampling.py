"""The embedded engine's sampler: exact draws, its own RNG, reproducible per-request seeds
whatever a request is batched with, and the dynamic batcher in front of it."""
import concurrent.futures

import torch

from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling
from megatron_marsrl.rollout.hf_engine import TransformersEngine, gumbel_perturb


def _frequencies(sampling: EngineSampling, logits: torch.Tensor, n: int = 40000) -> torch.Tensor:
    picks = gumbel_perturb(sampling, logits.expand(n, -1), torch.Generator().manual_seed(0)).argmax(-1)
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


def test_a_batch_is_perturbed_as_its_rows_are_one_by_one():
    """The batch's sampler (rows of one sampling together) gives each row the values
    `gumbel_perturb` gives it alone, in row order, also where rows share one generator (the
    unseeded requests of a batch) and the batch mixes temperatures, top-p, top-k and greedy."""
    from megatron_marsrl.rollout.hf_engine import _GumbelSampler

    settings = [EngineSampling(temperature=1.0), EngineSampling(temperature=0.7, top_p=0.9),
                EngineSampling(temperature=0.7, top_p=0.9), EngineSampling(temperature=0.0),
                EngineSampling(temperature=1.0), EngineSampling(temperature=1.3, top_k=3)]
    scores = torch.randn(len(settings), 50, generator=torch.Generator().manual_seed(3)) * 3

    def generators():  # rows 0, 2 and 4 share one (unseeded requests), the others have their own
        shared = torch.Generator().manual_seed(11)
        return [shared if row % 2 == 0 else torch.Generator().manual_seed(row) for row in range(len(settings))]

    alone = torch.stack([gumbel_perturb(s, scores[row], g)
                         for row, (s, g) in enumerate(zip(settings, generators()))])
    together = _GumbelSampler(list(zip(settings, generators())))(None, scores)
    assert torch.equal(alone, together)


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


def _seeded(prompt, seed, max_new=10, **kw):
    return EngineRequest(rid=f"s{seed}", prompt_ids=prompt,
                         sampling=EngineSampling(temperature=1.0, max_new_tokens=max_new, seed=seed, **kw))


def test_seeded_tokens_do_not_depend_on_the_batch(tiny_hf):
    """Same request + same seed = same tokens and log-probs, alone or inside a batch of other
    prompts (other lengths, sampling settings and limits): each row has its own generator."""
    engine = TransformersEngine(tiny_hf("qwen3"), seed=0)
    target = _seeded([4, 9, 2, 7], 1234)
    alone = engine.generate([target])[0]
    others = [_seeded([3] * n, 50 + n, max_new=4 + n, top_p=0.9) for n in (1, 6, 11)]
    others.append(EngineRequest(prompt_ids=[8, 8], sampling=EngineSampling(temperature=0.0, max_new_tokens=16)))
    batched = engine.generate(others[:2] + [target] + others[2:])
    assert batched[2].output_ids == alone.output_ids
    assert torch.allclose(torch.tensor(batched[2].logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    assert [len(o.output_ids) for o in batched[:2]] == [5, 10]  # each row keeps its own limit
    assert engine.generate([_seeded([4, 9, 2, 7], 999)])[0].output_ids != alone.output_ids  # the seed matters
    engine.shutdown()


def test_concurrent_requests_form_batches_and_keep_their_seeds(tiny_hf):
    """Requests sent one by one from many threads run as a few batches, not one by one, and each
    gets the tokens it gets alone."""
    engine = TransformersEngine(tiny_hf("qwen3"), seed=0)
    requests = [_seeded([1 + i % 5, 2, 3 + i % 3], 100 + i, max_new=6) for i in range(16)]
    alone = [engine.generate([r])[0].output_ids for r in requests[:4]]
    runs_before = len(engine.batch_sizes)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda r: engine.generate([r])[0], requests))
    batches = list(engine.batch_sizes)[runs_before:]
    assert sum(batches) == 16 and len(batches) <= 8 and max(batches) >= 4, batches
    assert [o.output_ids for o in outs[:4]] == alone
    engine.shutdown()


def test_the_batch_token_budget_bounds_batches(tiny_hf):
    engine = TransformersEngine(tiny_hf("qwen3"), seed=0, max_total_tokens=64, max_batch_tokens=64)
    futures = [engine.submit([_seeded([1, 2, 3, 4], i, max_new=12)]) for i in range(8)]  # 16 tokens each
    assert all(len(f.result()[0].output_ids) <= 12 for f in futures)
    assert max(engine.batch_sizes) <= 4 and sum(engine.batch_sizes) == 8
    engine.shutdown()
