"""A packed micro-batch (one row, attention kept within each sequence) gives the log-probs,
entropies, reference log-probs and parameter gradients of the same sequences padded to rows
[b, longest], within 1e-5, under every layout (megatron/forward.py, actor.pack_sequences);
with MoE routing replay the packed record order matches the rows' one."""
import pytest
import torch

from megatron_marsrl.megatron.actor import Sequence, pack_sequences
from megatron_marsrl.megatron.launch import launch

LAYOUTS = {
    "world1": (1, {}, True),
    "tp2_sp": (2, {"tp": 2}, False),
    "ep2": (2, {"ep": 2}, True),
    "pp2": (2, {"pp": 2}, True),
}
FAST = {"world1", "tp2_sp"}


@pytest.mark.parametrize("layout", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in LAYOUTS])
def test_packed_equals_padded_rows(tiny_hf, layout):
    world, parallel, replay = LAYOUTS[layout]
    results = launch("tests.megatron.packing_workers:packed_vs_rows", world,
                     {"hf_dir": tiny_hf("qwen3_moe"), "layout": parallel, "replay": replay},
                     env={"OMP_NUM_THREADS": "1"})
    assert any(r["logp"] is not None for r in results)  # the last stage compared what the loss saw
    for r in results:
        assert r["grad_norm"] > 1e-3, r  # the loss reaches the parameters: the comparison means something
        assert r["grad"] < 1e-5, r
        assert r["reference"] < 1e-5, r
        # every attention layer of the packed runs read the blocks the mask carries
        assert r["attention_calls"] > 0 and r["blocks_carried"] == r["attention_calls"], r
        if r["logp"] is not None:
            assert r["logp"] < 1e-5 and r["entropy"] < 1e-5, r


def test_pack_sequences_layout():
    seqs = [Sequence(prompt_ids=[1, 2], response_ids=[3, 4, 5], advantage=1.0, reward=0.0, trained_from=1,
                     rollout_logprobs=[-0.1, -0.2, -0.3]),
            Sequence(prompt_ids=[6], response_ids=[7], advantage=-1.0, reward=1.0)]
    batch = pack_sequences(seqs)
    assert batch["tokens"].tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert batch["cu_seqlens"].tolist() == [0, 5, 7] and batch["cu_seqlens"].dtype == torch.int32
    # [b, longest - 1], position i predicts token i + 1 of its own sequence
    assert batch["response_mask"].tolist() == [[False, False, True, True], [True, False, False, False]]
    assert batch["rollout_logprobs"][0].tolist() == pytest.approx([0.0, -0.1, -0.2, -0.3])
    assert "routed_experts" not in batch

