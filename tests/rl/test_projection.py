"""The dry run's mode x placement projection (rl/projection.py): each placement's KV pool comes
from the memory model, its engine concurrency from the pool, its step time from the simulator;
every row fits the GPU, and the table names the fastest."""
import pytest

from megatron_marsrl.megatron.memory import GIB, ColocatedRollout, estimate_memory, kv_bytes_per_token
from megatron_marsrl.rl.dry_run import estimate, memory_config, model_arch, plan, train_and_generate_gib
from megatron_marsrl.rl.overrides import apply_overrides
from megatron_marsrl.rl.projection import (MAX_SEQUENCES_PER_GPU, RESIDENT, TIME_SHARED, config_mode, format_table,
                                           project)
from megatron_marsrl.rl.recipes import get_recipe
from megatron_marsrl.rl.simulate import MODES

# 16 problems per step instead of 128: the same memory plan, simulated in a few seconds
FAST = ("pipeline.problems_per_step=16",)


def _table(name="qwen3_30b_a3b_h100x64", *overrides, world=64):
    config = apply_overrides(get_recipe(name), [*FAST, *overrides])
    arch, _ = model_arch(config)
    est = estimate(config, arch, world)
    peak = train_and_generate_gib(est, len(config.policy_names()))
    return config, arch, est, project(config, arch, memory_config(config, arch, world, kv_cache_tokens=1), est, peak)


def test_every_row_fits_and_takes_its_concurrency_from_its_kv_pool():
    config, arch, est, table = _table()
    names = [row.placement for row in table.rows]
    assert names[:2] == [RESIDENT, TIME_SHARED] and all(n.startswith("split ") for n in names[2:]) and len(names) > 2
    for row in table.rows:
        assert row.peak_gib <= est.usable_gib + 1e-6
        assert row.sequences_per_engine == min(MAX_SEQUENCES_PER_GPU * config.engine.tp_size,
                                               row.kv_tokens // table.context_tokens)
        assert all(t > 0 for t in row.step_s.values())
    resident, shared = table.rows[0], table.rows[1]
    # today's trainer: the config's own pool, engines on the first node only, training next to them
    assert resident.kv_tokens == est.kv_cache_tokens == config.engine.max_total_tokens
    assert resident.engine_gpus == config.engine.num_engines * config.engine.tp_size == 8 and resident.in_trainer
    assert set(resident.step_s) == set(MODES)
    # time-shared: no overlap; the trainer's state is off the GPU, so the pool is far larger
    assert set(shared.step_s) == {"sync", "pipeline"} and not shared.in_trainer
    assert shared.kv_tokens > 2 * resident.kv_tokens and shared.engine_gpus == 64
    assert shared.sequences_per_engine > resident.sequences_per_engine
    # ... and that pool, put back into the memory model, fills the rollout phase to the reserve
    memory = memory_config(config, arch, 64, kv_cache_tokens=shared.kv_tokens)
    two_phase = estimate_memory(arch, config.parallel, type(memory)(**{**memory.__dict__,
                                                                       "offload_trainer_in_rollout": True}))
    kv_gib = kv_bytes_per_token(arch, ColocatedRollout(engine_tp=8, kv_cache_tokens=1)) / GIB
    assert est.usable_gib - kv_gib < two_phase.rollout_gib <= est.usable_gib
    assert shared.peak_gib == pytest.approx(two_phase.peak_gib)


def test_more_engines_make_every_placement_faster_than_today():
    _, _, _, table = _table()
    resident = table.rows[0]
    for row in table.rows[1:]:
        assert min(row.step_s.values()) < min(resident.step_s.values())
    row, mode = table.fastest()
    assert row.step_s[mode] == min(t for r in table.rows for t in r.step_s.values())
    today, _ = table.fastest(in_trainer=True)
    assert today is resident


def test_format_names_the_fastest_and_what_the_trainer_runs():
    config, _, _, table = _table()
    text = format_table(table)
    assert "projected step time per mode x placement" in text
    row, mode = table.fastest()
    assert f"fastest: {row.placement}, {mode}: {row.step_s[mode]:.0f} s/step" in text
    assert f"this config runs {config_mode(config)}" in text and config_mode(config).startswith("pipeline+overlap (resident")
    assert text.count("(not in trainer)") == len(table.rows) - 1


def test_a_split_that_cannot_train_is_left_out_with_the_reason():
    # 8 GPUs: any split leaves too few GPUs for the 30B trainer (or none for whole engines)
    _, _, _, table = _table("qwen3_30b_a3b_h100x8", world=8)
    assert not any(row.placement.startswith("split") for row in table.rows)
    assert all(not why.startswith("split") or "GiB per GPU" in why or "layout" in why for why in table.skipped)


def test_dry_run_prints_the_table_only_when_asked():
    config = apply_overrides(get_recipe("qwen3_30b_a3b_h100x16"), list(FAST))
    assert "projected step time" not in plan(config, nodes=2, gpus_per_node=8).report
    assert "projected step time" in plan(config, nodes=2, gpus_per_node=8, with_projection=True).report
    # CPU engines: no table
    tiny = get_recipe("tiny_arithmetic")
    assert "projected step time" not in plan(tiny, nodes=1, gpus_per_node=2, with_projection=True).report
