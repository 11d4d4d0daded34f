"""The dry run's mode x placement projection (rl/projection.py): each placement's KV pool comes
from the memory model, its engine concurrency from the pool, its step time from the simulator;
every row fits the GPU, and the table names the fastest."""
import pytest

from megatron_marsrl.megatron.memory import GIB, ColocatedRollout, estimate_memory, kv_bytes_per_token
from megatron_marsrl.rl.dry_run import estimate, memory_config, model_arch, plan, train_and_generate_gib
from megatron_marsrl.rl.overrides import apply_overrides
from megatron_marsrl.rl.projection import (MAX_SEQUENCES_PER_GPU, RESIDENT, TIME_SHARED, config_mode,
                                           engine_gpus_started, format_table, project)
from megatron_marsrl.rl.recipes import get_recipe
from megatron_marsrl.rl.simulate import MODES

# 16 problems per step instead of 128: the same memory plan, simulated in a few seconds
FAST = ("pipeline.problems_per_step=16",)
# The recipes time-share their GPUs; these tests project them with engines resident next to the
# trainer and overlap, with the pool a resident trainer leaves (the recipes' earlier settings).
RESIDENT_CONFIG = {
    "qwen3_30b_a3b_h100x8": ("optim.cpu_offload_fraction=1.0", "engine.max_total_tokens=524288"),
    "qwen3_30b_a3b_h100x16": ("optim.cpu_offload_fraction=0.75", "engine.max_total_tokens=720896"),
    "qwen3_30b_a3b_h100x64": ("engine.max_total_tokens=1048576",),
}


def _resident(name: str) -> list[str]:
    return ["pipeline.time_shared=false", "scheduler.overlap=true", "engine.mem_fraction_static=0.6",
            *RESIDENT_CONFIG[name]]


def _table(name="qwen3_30b_a3b_h100x64", *overrides, world=64):
    config = apply_overrides(get_recipe(name), [*FAST, *_resident(name), *overrides])
    arch, _ = model_arch(config)
    est = estimate(config, arch, world)
    peak = train_and_generate_gib(est, len(config.policy_names()))
    return config, arch, est, project(config, arch, memory_config(config, arch, world, kv_cache_tokens=1), est, peak,
                                      nodes=world // 8)


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
    # the config as it runs: its own pool, one engine per node (every node starts its own),
    # training next to them
    assert resident.kv_tokens == est.kv_cache_tokens == config.engine.max_total_tokens
    assert resident.engine_gpus == 8 * config.engine.num_engines * config.engine.tp_size == 64 and resident.in_trainer
    assert set(resident.step_s) == set(MODES)
    # time-shared: no overlap; the trainer's state is off the GPU, so the pool is far larger
    assert set(shared.step_s) == {"sync", "pipeline"} and shared.in_trainer
    assert shared.kv_tokens > 2 * resident.kv_tokens and shared.engine_gpus == 64
    assert shared.sequences_per_engine > resident.sequences_per_engine
    # ... and that pool, put back into the memory model, fills the rollout phase to the reserve
    memory = memory_config(config, arch, 64, kv_cache_tokens=shared.kv_tokens)
    two_phase = estimate_memory(arch, config.parallel, type(memory)(**{**memory.__dict__,
                                                                       "offload_trainer_in_rollout": True}))
    kv_gib = kv_bytes_per_token(arch, ColocatedRollout(engine_tp=8, kv_cache_tokens=1)) / GIB
    assert est.usable_gib - kv_gib < two_phase.rollout_gib <= est.usable_gib
    assert shared.peak_gib == pytest.approx(two_phase.peak_gib)


def test_engines_on_every_node_count_in_the_resident_row():
    config, arch, est, table = _table()
    memory = memory_config(config, arch, 64, kv_cache_tokens=1)
    one_node = project(config, arch, memory, est, train_and_generate_gib(est), nodes=1)
    # the same engines on one 64-GPU "node" instead of eight nodes: an eighth of the engines
    assert one_node.rows[0].engine_gpus == 8 and table.rows[0].engine_gpus == 64
    assert min(one_node.rows[0].step_s.values()) > 2 * min(table.rows[0].step_s.values())
    # in-process engines live in rank 0's process: the first node only, whatever the cluster
    assert engine_gpus_started(apply_overrides(config, ["engine.kind=sglang"]), 8) == 8
    assert engine_gpus_started(config, 8) == 64


def test_split_inside_nodes_runs_in_the_trainer_only_with_engines_narrower_than_a_node():
    _, _, _, table = _table()  # TP8 engines: only whole nodes can be split, which the trainer cannot launch
    splits = [row for row in table.rows if row.placement.startswith("split")]
    assert splits and not any(row.in_trainer for row in splits)
    _, _, _, narrow = _table("qwen3_30b_a3b_h100x64", "engine.tp_size=2")
    splits = [row for row in narrow.rows if row.placement.startswith("split")]
    assert splits and all(row.in_trainer and row.engine_gpus % 8 == 0 and row.engine_gpus // 8 % 2 == 0
                          for row in splits)


def test_format_names_the_fastest_and_what_the_trainer_runs():
    config, _, _, table = _table()
    text = format_table(table)
    assert "projected step time per mode x placement" in text
    row, mode = table.fastest()
    assert f"fastest: {row.placement}, {mode}: {row.step_s[mode]:.0f} s/step" in text
    assert f"this config runs {config_mode(config)}" in text
    assert config_mode(config) == "pipeline+overlap (resident colocated engines on every node)"
    assert text.count("(not in trainer)") == sum(not row.in_trainer for row in table.rows) > 0


def test_a_split_that_cannot_train_is_left_out_with_the_reason():
    # 8 GPUs: any split leaves too few GPUs for the 30B trainer (or none for whole engines)
    _, _, _, table = _table("qwen3_30b_a3b_h100x8", world=8)
    assert not any(row.placement.startswith("split") for row in table.rows)
    assert all(not why.startswith("split") or "GiB per GPU" in why or "layout" in why for why in table.skipped)


def test_dry_run_prints_the_table_only_when_asked():
    config = apply_overrides(get_recipe("qwen3_30b_a3b_h100x16"), [*FAST, *_resident("qwen3_30b_a3b_h100x16")])
    assert "projected step time" not in plan(config, nodes=2, gpus_per_node=8).report
    assert "projected step time" in plan(config, nodes=2, gpus_per_node=8, with_projection=True).report
    # CPU engines: no table
    tiny = get_recipe("tiny_arithmetic")
    assert "projected step time" not in plan(tiny, nodes=1, gpus_per_node=2, with_projection=True).report


def test_the_time_shared_recipes_run_their_fastest_row():
    """The colocated recipes as shipped: time-shared, the agentic pipeline, the pool of the
    time-shared row; the table's fastest row the trainer runs is theirs."""
    config = apply_overrides(get_recipe("qwen3_30b_a3b_h100x64"), list(FAST))
    arch, _ = model_arch(config)
    est = estimate(config, arch, 64)
    table = project(config, arch, memory_config(config, arch, 64, kv_cache_tokens=1), est,
                    train_and_generate_gib(est, 1), nodes=8)
    assert config_mode(config) == "pipeline (time-shared colocated engines on every node)"
    row, mode = table.fastest(in_trainer=True)
    assert (row.placement, mode) == (TIME_SHARED, "pipeline")
    assert config.engine.max_total_tokens <= row.kv_tokens  # the recipe's pool, within what the row fills
