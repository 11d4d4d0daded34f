"""MoE routing replay in Megatron (megatron/routing_replay.py).

Multi-rank: Megatron with a replayed (random, partly -1) routing must equal transformers forced
to the same routing under every layout (EP: global expert ids; TP: sequence-parallel chunks and
padding; PP: each stage's layers), and replaying the model's own routing changes nothing.
World size 1: router gradients flow through the replayed gate weights, with and without full
activation recompute (the router re-runs inside backward). Pure: the token layout helpers.
"""
import pytest
import torch

from megatron_marsrl.megatron.launch import launch
from megatron_marsrl.megatron.routing_replay import NO_ROUTING, _local_rows, pack_for_replay

LAYOUTS = {
    "world1": (1, {}),
    "ep2": (2, {"ep": 2}),
    "tp2_sp": (2, {"tp": 2}),
    "pp2": (2, {"pp": 2}),
    "tp2_ep2": (2, {"tp": 2, "ep": 2}),
}
FAST = {"world1", "ep2"}


@pytest.mark.parametrize("layout", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in LAYOUTS])
def test_replay_equals_forced_hf_routing(tiny_hf, layout):
    world, parallel = LAYOUTS[layout]
    for r in launch("tests.megatron.routing_workers:forced_routing", world,
                    {"hf_dir": tiny_hf("qwen3_moe"), "layout": parallel}, env={"OMP_NUM_THREADS": "1"}):
        assert r["forcing_moves"] > 1e-3, r  # the forced routing really differs from the model's own
        assert r["forced_vs_hf"] < 1e-5, r
        assert r["own_vs_hf"] < 1e-5, r
        assert r["replay_own_vs_own"] < 1e-6, r
        assert r["coverage"] == 1.0, r  # every recorded choice of this stage's layers was replayed


@pytest.mark.parametrize("recompute", [None, "full"])
def test_router_gradients_flow_through_replayed_gates(tiny_hf, recompute):
    r = launch("tests.megatron.routing_workers:router_gradients", 1,
               {"hf_dir": tiny_hf("qwen3_moe"), "layout": {"recompute": recompute}}, env={"OMP_NUM_THREADS": "1"})[0]
    assert r["grad_norm"] > 1e-4, r
    assert r["grad_diff"] < 1e-6, r


def test_local_rows_lays_out_tokens_as_the_router_sees_them():
    b, rows, k = 2, 5, 2
    experts = torch.arange(b * rows * k).view(b, rows, k)  # unique ids: positions are traceable
    # No SP: sequence-major [s, b], rows cut to the forward's 4 positions.
    full = _local_rows(experts, 2 * 4, (2, 0, False))
    assert torch.equal(full, experts[:, :4].transpose(0, 1).reshape(-1, k))
    # SP over TP2 with 6 padded positions: rank 1 sees positions 3..5, 5 is padding (-1).
    mine = _local_rows(experts, 2 * 3, (2, 1, True)).view(3, b, k)
    assert torch.equal(mine[:2], experts[:, 3:5].transpose(0, 1))
    assert bool((mine[2] == -1).all())
    with pytest.raises(ValueError, match="multiple"):
        _local_rows(experts, 7, (1, 0, False))


def test_pack_for_replay_follows_the_packed_order():
    a = torch.tensor([[[0, 1]], [[2, 3]], [[1, 2]]])  # 3 rows, 1 layer, top-2
    c = torch.tensor([[[3, 0]]])
    out = pack_for_replay([a, None, c], [2, 3, 2])  # a cut to 2 rows, c padded to 2
    assert out.shape == (1, 7, 1, 2) and out.dtype == torch.int32
    assert out[0, :, 0].tolist() == [[0, 1], [2, 3]] + [[NO_ROUTING] * 2] * 3 + [[3, 0], [NO_ROUTING] * 2]
    assert pack_for_replay([None, None], [2, 2]) is None
