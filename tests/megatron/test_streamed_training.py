"""Training micro-batch by micro-batch (the RL trainer's overlap path) equals one scheduled step."""
import pytest

from megatron_marsrl.megatron.launch import launch


@pytest.mark.parametrize("layout", [{"ep": 2}, {"tp": 2}, pytest.param({"pp": 2}, marks=pytest.mark.slow)])
def test_streamed_micro_batches_equal_one_scheduled_step(tiny_hf, layout):
    diffs = launch("tests.megatron.workers:streamed_vs_step", 2, {"hf_dir": tiny_hf("qwen3_moe"), "layout": layout})
    measured = [d for d in diffs if d is not None]
    assert measured and max(measured) < 1e-5


def test_vocab_parallel_entropy(tiny_hf):
    diffs = launch("tests.megatron.workers:entropy_matches_reference", 2,
                   {"hf_dir": tiny_hf("qwen3_moe"), "layout": {"tp": 2}})
    assert max(diffs) < 1e-5
