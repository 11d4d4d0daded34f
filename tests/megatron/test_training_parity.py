"""A few optimizer steps under TP2 / EP2 / PP2 / DP2 give the world-size-1 losses (1e-5)."""
import pytest

from megatron_marsrl.megatron.launch import launch


@pytest.fixture(scope="module")
def reference(tiny_hf):
    cache = {}

    def get(family, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = launch("tests.megatron.workers:train_losses", 1, {"hf_dir": tiny_hf(family), "layout": {}, **kw})[0]
        return cache[key]

    return get


@pytest.mark.parametrize("family,layout", [
    ("qwen3_moe", {"tp": 2}),
    ("qwen3_moe", {"ep": 2}),
    pytest.param("qwen3_moe", {"pp": 2}, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", {}, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", {"tp": 2, "recompute": "full"}, marks=pytest.mark.slow),
    ("llama", {"pp": 2}),  # tied embeddings: the two stages' copies must stay in sync
    pytest.param("qwen3", {"tp": 2}, marks=pytest.mark.slow),  # qk-norm grads reduced over TP
])
def test_losses_match_world_size_one(tiny_hf, reference, family, layout):
    ref = reference(family)
    got = launch("tests.megatron.workers:train_losses", 2, {"hf_dir": tiny_hf(family), "layout": layout})
    assert ref[1] != ref[0]  # the updates moved the loss: the comparison means something
    for rank_losses in got:
        assert rank_losses == pytest.approx(ref, abs=1e-5)


@pytest.mark.slow
def test_distributed_optimizer_with_adam(tiny_hf, reference):
    kw = {"optimizer": "adam", "lr": 1e-2, "adam_eps": 1e-3}
    ref = reference("qwen3_moe", **kw)
    got = launch("tests.megatron.workers:train_losses", 2,
                 {"hf_dir": tiny_hf("qwen3_moe"), "layout": {"ep": 2, "distributed_optimizer": True}, **kw})
    assert got[0] == pytest.approx(ref, abs=1e-5)


def test_padded_vocab_trains_like_world_size_one(tiny_hf):
    hf = tiny_hf("llama", vocab_size=127)
    ref = launch("tests.megatron.workers:train_losses", 1, {"hf_dir": hf, "layout": {}})[0]
    got = launch("tests.megatron.workers:train_losses", 2, {"hf_dir": hf, "layout": {"tp": 2}})
    assert got[0] == pytest.approx(ref, abs=1e-5)


def test_bf16_gradient_buffers_halve_the_buffer_at_a_measured_accuracy_cost(tiny_hf):
    """optim.grad_reduce_in_fp32=false: bf16 buffers (accumulation and the EP2 data-parallel
    sum in bf16) differ from fp32 buffers by a small, non-zero relative error."""
    results = launch("tests.megatron.workers:grad_buffer_precision", 2,
                     {"hf_dir": tiny_hf("qwen3_moe"), "layout": {"ep": 2}})
    for r in results:
        assert r["dtypes"] == ["torch.float32", "torch.bfloat16"], r
        assert 1e-4 < r["relative_error"] < 5e-2, r
    print("bf16 gradient buffers, relative L2 error vs fp32:", [round(r["relative_error"], 5) for r in results])


def test_offloading_a_policy_between_steps_changes_nothing(tiny_hf):
    """Time-shared colocation's trainer side: parameters, gradient buffers and Adam state leave
    their storages (emptied) and come back in place, and training goes on bit for bit as in a
    policy that never moved (EP2, two Adam steps after round trips)."""
    results = launch("tests.megatron.workers:offload_round_trip", 2, {"hf_dir": tiny_hf("qwen3_moe"),
                                                                      "layout": {"ep": 2}})
    for r in results:
        assert r["emptied"] and r["moved_bytes"] > 0
        assert r["max_diff"] == 0.0, r


@pytest.mark.parametrize("world,layout", [(1, {}), (2, {}), (2, {"distributed_optimizer": True})])
def test_dithered_main_params_let_small_bf16_updates_through(tiny_hf, world, layout):
    """bf16 main copies start on the bf16 grid, where an Adam step smaller than half the spacing
    changes no weight; dithered inside their rounding cells they still round to the same weights
    (step 0 unchanged) and the step reaches the bf16 weights in full, on average."""
    results = launch("tests.megatron.workers:dithered_main_params", world, {"hf_dir": tiny_hf("llama"), "layout": layout})
    for r in results:
        assert r["on_grid_at_start"] and r["rounds_back"], r
        assert r["moved"] > 0 and r["off_grid"] > 0.99, r
        assert r["reached_on_grid"] < 0.5 and 0.8 < r["reached_dithered"] < 1.2, r
    if world == 2 and not layout:  # data-parallel replicas hold whole main copies: the same ones
        assert results[0]["main_sum"] == results[1]["main_sum"]
