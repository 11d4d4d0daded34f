"""Per-GPU memory estimate and model FLOPs: counts against transformers, sharding arithmetic,
recompute, layout errors and budget checks. Fast: no processes, no Megatron import."""
import dataclasses
import math

import pytest

from megatron_marsrl.megatron.hf_config import ModelArch
from megatron_marsrl.megatron.memory import (ColocatedRollout, MemoryBudgetError, MemoryConfig, check_fits,
                                             count_params, estimate_memory, format_report,
                                             model_flops_per_token)
from megatron_marsrl.megatron.parallel import LayoutError, ParallelConfig
from megatron_marsrl.megatron.tiny import FAMILIES, make_hf_checkpoint

from megatron_marsrl.rl.recipes_qwen3 import QWEN3_30B_A3B_THINKING_2507 as QWEN3_30B_A3B  # noqa: E402

ARCH = ModelArch.from_hf_dict(QWEN3_30B_A3B)

# The layouts proposed for H100-80GB clusters (colocated SGLang, TP4 engines): each must fit.
H100_LAYOUTS = {
    8: (dict(tp=4, ep=8), dict(cp=1, micro_batch_tokens=32768, optimizer_offload_fraction=1.0), 0.8),
    16: (dict(tp=4, ep=16), dict(cp=1, micro_batch_tokens=32768, optimizer_offload_fraction=0.5), 0.8),
    32: (dict(tp=4, ep=32), dict(cp=2, micro_batch_tokens=65536), 0.8),
    64: (dict(tp=4, ep=32), dict(cp=2, micro_batch_tokens=65536), 0.8),
}


def _estimate(arch=ARCH, world=8, tokens=4096, **layout):
    knobs = {k: layout.pop(k) for k in list(layout) if k in {f.name for f in dataclasses.fields(MemoryConfig)}}
    config = MemoryConfig(world_size=world, micro_batch_tokens=tokens, **knobs)
    return estimate_memory(arch, ParallelConfig(**layout), config)


def _h100(world):
    layout, knobs, fraction = H100_LAYOUTS[world]
    parallel = ParallelConfig(**layout, sequence_parallel=True, distributed_optimizer=True, recompute="full")
    rollout = ColocatedRollout(engine_tp=4, mem_fraction_static=fraction)
    return estimate_memory(ARCH, parallel, MemoryConfig(world_size=world, rollout=rollout, **knobs))


def test_qwen3_30b_a3b_counts_match_transformers_and_model_card():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in QWEN3_30B_A3B.items() if k != "model_type"})
    with torch.device("meta"):  # shapes only: 30.5B parameters, no memory
        model = transformers.Qwen3MoeForCausalLM(config)
    counts = count_params(ARCH)
    assert counts.total == sum(p.numel() for p in model.parameters()) == 30_532_122_624
    assert counts.active == pytest.approx(3.3e9, rel=0.03)  # model card: 3.3B activated
    assert counts.active == counts.total - counts.expert + counts.expert * 8 // 128


@pytest.mark.parametrize("family,overrides", [
    ("qwen3_moe", None), ("qwen3_moe", dict(num_hidden_layers=4, mlp_only_layers=[1])),
    ("qwen3", None), ("llama", None),
])
def test_tiny_checkpoint_counts_match_the_saved_tensors(tmp_path, family, overrides):
    from safetensors import safe_open

    path = make_hf_checkpoint(family, tmp_path, overrides=overrides)
    saved = 0
    for shard in path.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            saved += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert count_params(ModelArch.from_hf_dir(path)).total == saved


def test_tensor_parallel_halves_dense_and_expert_parallel_halves_experts():
    one, two = _estimate(tp=1, ep=8), _estimate(tp=2, ep=8)
    assert two.dense_params == pytest.approx(one.dense_params / 2, rel=0.01)
    assert two.dense_params > one.dense_params / 2  # norms and the router are replicated over TP
    assert two.expert_params == one.expert_params
    four, eight = _estimate(ep=4), _estimate(ep=8)
    assert eight.expert_params * 2 == four.expert_params
    assert eight.dense_params == four.dense_params
    assert _estimate(pp=2, ep=4).expert_params * 2 == four.expert_params


def test_distributed_optimizer_shards_over_data_and_expert_data_parallel():
    plain, dist = _estimate(ep=4), _estimate(ep=4, distributed_optimizer=True)
    assert plain.optimizer_gib == pytest.approx(12 * (plain.dense_params + plain.expert_params) / 2**30)
    # dense state over DP = 8, expert state over expert-DP = 8 / EP = 2
    assert dist.optimizer_gib == pytest.approx(12 * (dist.dense_params / 8 + dist.expert_params / 2) / 2**30)
    assert dist.params_gib == plain.params_gib and dist.grads_gib == plain.grads_gib
    half = _estimate(ep=4, distributed_optimizer=True, optimizer_offload_fraction=0.5)
    assert half.optimizer_gib == pytest.approx(dist.optimizer_gib / 2)
    fp32 = _estimate(ep=4, param_bytes=4)
    assert fp32.optimizer_gib == pytest.approx(plain.optimizer_gib * 8 / 12)  # no separate main params


def test_recompute_reduces_activations_and_tokens_scale_them():
    none, sel, full = (_estimate(tp=2, ep=8, recompute=r) for r in (None, "selective", "full"))
    assert full.activations_gib < sel.activations_gib < none.activations_gib
    # layer inputs only (h / TP under sequence parallel, bf16), plus the final norm's input and output
    assert full.activations_gib == pytest.approx(2 * 4096 * (48 + 2) * 2048 / 2 / 2**30)
    assert _estimate(tp=2, ep=8, tokens=8192).activations_gib == pytest.approx(2 * none.activations_gib)
    assert _estimate(tp=2, ep=8, cp=2, tokens=8192).activations_gib == pytest.approx(none.activations_gib)


def test_logits_are_counted_in_the_parameter_dtype_over_the_vocab_shard_on_the_last_stage():
    # three bf16 logit-sized tensors (logits, their gradient, one layout copy) and one chunk's fp32
    # temporaries of forward.token_stats: never a full fp32 copy
    est = _estimate(tp=2, ep=8, tokens=4096)
    elements = 4096 * 151936 / 2
    assert est.logits_gib == pytest.approx((elements * 3 * 2 + 2**24 * 4 * 4) / 2**30)
    # PP2: the first stage holds two micro-batches in flight but no logits; it is the worse stage here
    pp = _estimate(tp=2, pp=2, ep=4, tokens=4096)
    assert pp.stage in (0, 1) and (pp.logits_gib == 0) == (pp.stage == 0)


@pytest.mark.parametrize("layout,needle", [
    (dict(tp=3, world=3), "num_attention_heads=32 not divisible by tp=3"),
    (dict(ep=3), "num_experts=128 not divisible by ep=3"),
    (dict(pp=5, world=5), "num_hidden_layers=48 not divisible by pp=5"),
    (dict(tp=4, cp=4), "not divisible by tp\\*pp\\*cp"),
    (dict(tp=2, cp=2, tokens=4098), "multiple of 8"),
    (dict(optimizer_offload_fraction=0.5), "needs distributed_optimizer"),
])
def test_invalid_layouts_raise_value_errors(layout, needle):
    with pytest.raises(LayoutError, match=needle) as info:
        _estimate(**layout)
    assert isinstance(info.value, ValueError)


def test_invalid_engine_settings_raise():
    with pytest.raises(ValueError, match="exactly one"):
        ColocatedRollout(engine_tp=4)
    with pytest.raises(ValueError, match="engine_tp=3"):
        estimate_memory(ARCH, ParallelConfig(ep=4), MemoryConfig(
            world_size=12, micro_batch_tokens=4096, rollout=ColocatedRollout(engine_tp=3, kv_cache_tokens=1000)))


def test_30b_a3b_on_one_gpu_does_not_fit_but_still_prints():
    est = _estimate(world=1, distributed_optimizer=True, recompute="full")
    assert est.params_gib > 50
    report = format_report(est)
    assert "total" in report and "TP1 PP1 EP1" in report
    with pytest.raises(MemoryBudgetError, match=r"train-phase peak .* exceeds the 74.0 GiB usable \(80.0 less a 6.0"):
        check_fits(est)


def test_colocated_peak_is_the_larger_phase_not_the_sum():
    rollout = ColocatedRollout(engine_tp=4, kv_cache_tokens=200_000)
    est = _estimate(tp=4, ep=8, distributed_optimizer=True, recompute="full", optimizer_offload_fraction=1.0,
                    rollout=rollout)
    assert est.kv_cache_gib == pytest.approx(200_000 * 2 * 48 * 1 * 128 * 2 / 2**30)  # 1 KV head per GPU
    assert est.engine_weights_gib == pytest.approx(count_params(ARCH).total * 2 / 4 / 2**30, rel=0.02)
    assert est.peak_gib == max(est.train_gib, est.rollout_gib) < est.train_gib + est.rollout_gib
    assert est.rollout_gib == pytest.approx(est.framework_gib + est.trainer_resident_gib + est.engine_weights_gib
                                            + est.kv_cache_gib + est.engine_other_gib)
    offloaded = dataclasses.replace(MemoryConfig(world_size=8, micro_batch_tokens=4096, rollout=rollout),
                                    offload_trainer_in_rollout=True)
    assert estimate_memory(ARCH, ParallelConfig(tp=4, ep=8), offloaded).trainer_resident_gib == 0
    check_fits(est)


def test_mem_fraction_too_small_for_the_engine_is_reported():
    rollout = ColocatedRollout(engine_tp=4, mem_fraction_static=0.2)
    est = _estimate(tp=4, ep=8, rollout=rollout)  # 16 GiB cannot hold the resident trainer plus 14 GiB of weights
    assert est.kv_cache_tokens == 0
    with pytest.raises(MemoryBudgetError, match="no room for a KV cache"):
        check_fits(est)


@pytest.mark.parametrize("world", sorted(H100_LAYOUTS))
def test_proposed_h100_layouts_fit(world):
    est = _h100(world)
    check_fits(est)
    assert est.kv_cache_tokens > 500_000 and est.headroom_gib >= est.reserve_gib == 6.0
    assert f"{world} GPUs" in format_report(est)


def _colocated_peak(kv_tokens, **knobs):
    rollout = ColocatedRollout(engine_tp=4, kv_cache_tokens=kv_tokens)
    return _estimate(tp=4, ep=8, distributed_optimizer=True, recompute="full", optimizer_offload_fraction=1.0,
                     rollout=rollout, **knobs)


def test_a_plan_must_leave_the_reserve_free():
    # a rollout phase of ~77 GiB is below the GPU's 80 but inside the 6 GiB reserve
    est = _colocated_peak(1_430_000)
    assert est.reserve_gib == 6.0 and est.usable_gib == 74.0
    assert est.usable_gib < est.peak_gib < est.gpu_memory_gib
    with pytest.raises(MemoryBudgetError, match=r"rollout-phase peak .* exceeds the 74.0 GiB usable \(80.0 less a "
                                                r"6.0 GiB reserve\) by"):
        check_fits(est)
    assert "(reserve: at least 6.00 kept free)" in format_report(est)
    check_fits(_colocated_peak(1_430_000, reserve_fraction=0.0))  # the same plan without a reserve
    check_fits(_colocated_peak(1_250_000))                          # or with less KV cache


def test_the_reserve_scales_with_the_gpu():
    assert _estimate(gpu_memory_gib=141.0).reserve_gib == pytest.approx(141 * 6 / 80)
    with pytest.raises(LayoutError, match=r"reserve_fraction=1.0: must be in \[0, 1\)"):
        _estimate(reserve_fraction=1.0)


def test_model_flops_count_only_routed_experts():
    flops = model_flops_per_token(ARCH, seq_len=0)
    assert flops / 6 == pytest.approx(3.04e9, rel=0.01)  # active matmul weights incl. the output layer
    wider = dataclasses.replace(ARCH, num_experts=256)  # more experts, same top-8: only the router grows
    assert model_flops_per_token(wider, seq_len=0) - flops == pytest.approx(6 * 48 * 2048 * 128)
    attn = model_flops_per_token(ARCH, seq_len=4096, causal=False) - flops
    assert attn == pytest.approx(12 * 48 * 32 * 128 * 4096)
    assert model_flops_per_token(ARCH, seq_len=4096) - flops == pytest.approx(attn / 2)


def test_rollout_phase_overrun_names_the_rollout_knobs():
    rollout = ColocatedRollout(engine_tp=4, kv_cache_tokens=3_000_000)  # 69 GiB of KV per GPU
    est = _estimate(tp=4, ep=8, distributed_optimizer=True, recompute="full", optimizer_offload_fraction=1.0,
                    rollout=rollout)
    assert est.rollout_gib > est.train_gib and est.peak_gib == est.rollout_gib
    with pytest.raises(MemoryBudgetError, match="rollout-phase peak .* lower mem_fraction_static"):
        check_fits(est)
