"""Training micro-batch by micro-batch (the RL trainer's overlap path) equals one scheduled step."""
import pytest

from megatron_marsrl.megatron.launch import launch


@pytest.mark.parametrize("layout", [{"ep": 2}, {"tp": 2}, pytest.param({"pp": 2}, marks=pytest.mark.slow)])
def test_streamed_micro_batches_equal_one_scheduled_step(tiny_hf, layout):
    diffs = launch("tests.megatron.workers:streamed_vs_step", 2, {"hf_dir": tiny_hf("qwen3_moe"), "layout": layout})
    measured = [d for d in diffs if d is not None]
    assert measured and max(measured) < 1e-5


@pytest.mark.parametrize("chunk_elements", [64, 2**24])  # 64: a token per chunk (TP2 shards of 32); 2**24: one chunk
def test_chunked_token_stats_equal_the_full_softmax_at_tp2(tiny_hf, chunk_elements):
    """Log-probs, entropy and their gradients from the chunked path (what training runs) match
    the full fp32 softmax and Megatron's unchunked cross entropy within 1e-5, padding included;
    so do the log-probs and their gradient when the entropy is skipped (with_entropy=False)."""
    results = launch("tests.megatron.workers:token_stats_vs_reference", 2,
                     {"hf_dir": tiny_hf("qwen3_moe"), "layout": {"tp": 2}, "chunk_elements": chunk_elements})
    for r in results:
        assert max(r.values()) < 1e-5, r
