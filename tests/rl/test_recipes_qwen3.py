"""Qwen3-30B-A3B recipes and `marsrl train --dry-run`: every recipe's plan fits (as a real
subprocess of the CLI), bad layouts exit 2 with a clear message, the architecture comes from
model.path/config.json when present, optimizer offload is validated, and the example scripts
are valid bash naming recipes that exist. No GPU, no Megatron initialisation."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_marsrl.megatron.optim import OptimConfig
from megatron_marsrl.megatron.parallel import LayoutError
from megatron_marsrl.rl.dry_run import plan
from megatron_marsrl.rl.overrides import apply_overrides
from megatron_marsrl.rl.recipes import RECIPES, get_recipe
from megatron_marsrl.rl.recipes_qwen3 import QWEN3_30B_A3B_THINKING_2507, QWEN3_RECIPES

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "qwen3_30b_a3b"
SCRIPTS = ("convert_before.sh", "convert_after.sh", "train.sbatch", "train_torchrun.sh")


def _nodes(name: str) -> int:
    match = re.search(r"_h100x(\d+)(?:_split)?$", name)
    return int(match.group(1)) // 8 if match else 1


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megatron_marsrl.cli", "train", "--dry-run", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_dry_run_fits_under_80_gib(name):
    proc = _dry_run("--recipe", name, "--nodes", str(_nodes(name)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "verdict: fits" in out
    totals = [float(v) for v in re.search(r"^total\s+([\d. ]+)$", out, re.M).group(1).split()]
    assert totals and max(totals) < 80.0
    if name in QWEN3_RECIPES:
        assert "model: model.arch" in out  # no checkpoint here: the embedded config.json values
        assert f"= {_nodes(name) * 8}" in out
        nodes = _nodes(name)
        if name.endswith("_split"):  # the trainer's GPUs and the engines' are planned apart
            assert f"{nodes * 2} of them train" in out and f"{nodes * 3} engine(s) per policy" in out
            at_once = float(re.search(r"engine-only GPUs \(split\): ([\d.]+) GiB", out).group(1))
        else:  # time-shared: each phase has the GPU to itself, the larger one is the peak
            assert "time-shared (pipeline.time_shared)" in out and "trainer offloaded during rollout" in out
            at_once = max(totals)
        assert max(totals) <= 80.0 - 6.0 and at_once <= 80.0 - 6.0  # the reserve: 6 GiB of 80 stays free
        headroom, reserve = map(float, re.search(r"verdict: fits.*headroom ([\d.]+) \(at least ([\d.]+)", out).groups())
        assert headroom >= reserve == 6.0
        # the mode x placement projection: every row fits, and the fastest is named
        assert "projected step time per mode x placement" in out
        rows = re.findall(r"^(colocated, \w+(?:-\w+)?|split \d+\+\d+)\s+\d+/\d+\s+\d+\s+\d+\s+([\d.]+)", out, re.M)
        assert rows and all(float(peak) <= 74.0 for _, peak in rows)
        assert "fastest: " in out
        if name.endswith("_split"):  # its own split is the fastest of the table, and runs in the trainer
            best = re.search(r"^fastest: split (\d+)\+(\d+), pipeline\+overlap: \d+ s/step, ([\d.]+)x", out, re.M)
            assert best and (int(best[1]), int(best[2])) == (nodes * 6, nodes * 2), out
            assert float(best[3]) >= (2.5 if nodes == 8 else 2.0)  # the target at 64 GPUs
            assert "this config runs pipeline+overlap (split" in out
        else:  # time-shared colocation in the agentic pipeline: the fastest row, and what the recipe runs
            assert re.search(r"^fastest: colocated, time-shared, pipeline: ", out, re.M), out
            assert "this config runs pipeline (time-shared colocated engines on every node)" in out


def test_tp_not_dividing_the_kv_heads_exits_2():
    proc = _dry_run("--recipe", "qwen3_30b_a3b_h100x8", "parallel.tp=8")
    assert proc.returncode == 2
    assert "num_key_value_heads=4 not divisible by tp=8" in proc.stderr


def test_eight_gpus_without_offload_exits_2_naming_the_overrun():
    proc = _dry_run("--recipe", "qwen3_30b_a3b_h100x8", "optim.cpu_offload_fraction=0")
    assert proc.returncode == 2
    assert "verdict: does NOT fit" in proc.stdout
    assert "train-phase peak" in proc.stderr
    assert "exceeds the 74.0 GiB usable (80.0 less a 6.0 GiB reserve)" in proc.stderr
    assert "optimizer" in proc.stderr and "optimizer offload" in proc.stderr


def _config(name: str, *overrides: str):
    return apply_overrides(get_recipe(name), list(overrides))


@pytest.mark.parametrize("override, message", [
    ("parallel.tp=3", "not divisible by tp*pp = 3*1"),
    ("parallel.distributed_optimizer=false", "needs distributed_optimizer=True"),
])
def test_bad_layouts_raise_layout_errors(override, message):
    with pytest.raises(LayoutError, match=re.escape(message)):
        plan(_config("qwen3_30b_a3b_h100x8", override), nodes=1, gpus_per_node=8)


def test_engines_must_fit_a_node():
    with pytest.raises(LayoutError, match=r"need GPUs 0\.\.7 of a node, which has 4"):
        plan(_config("qwen3_30b_a3b_h100x8"), nodes=2, gpus_per_node=4)


def test_engines_resident_during_training_bound_the_plan():
    # A larger KV pool fits each phase alone but not both at once (the trainer keeps SGLang resident).
    result = plan(_config("qwen3_30b_a3b_h100x64", "engine.max_total_tokens=2000000",
                          "engine.mem_fraction_static=0.6", "pipeline.time_shared=false", "scheduler.overlap=true"), nodes=8, gpus_per_node=8)
    assert result.problems and "does not release engine memory" in result.problems[0]
    assert "does NOT fit" in result.verdict


def test_time_shared_colocation_plans_with_the_larger_phase():
    # the pool that cannot sit next to a resident trainer fits when the two take turns
    big = ("engine.max_total_tokens=2000000", "engine.mem_fraction_static=0.8")
    resident = plan(_config("qwen3_30b_a3b_h100x64", *big, "pipeline.time_shared=false", "scheduler.overlap=true"), nodes=8, gpus_per_node=8)
    shared = plan(_config("qwen3_30b_a3b_h100x64", *big, "pipeline.time_shared=true", "scheduler.overlap=false"),
                  nodes=8, gpus_per_node=8)
    assert resident.problems and "or set pipeline.time_shared=true" in resident.problems[0]
    assert not shared.problems and shared.peak_gib <= 74.0
    assert "trainer offloaded during rollout" in shared.report and "train + generate at once" not in shared.report


def test_train_and_generate_must_leave_the_reserve_free():
    # the 8-GPU plan with SGLang at 60% of the GPU (~76 GiB at once) fits 80 GiB but not 74
    result = plan(_config("qwen3_30b_a3b_h100x8", "engine.max_total_tokens=4000000", "engine.mem_fraction_static=0.6",
                          "optim.cpu_offload_fraction=1.0", "pipeline.time_shared=false", "scheduler.overlap=true"), nodes=1, gpus_per_node=8)
    assert 74.0 < result.peak_gib < 80.0 and "does NOT fit" in result.verdict
    assert "more than the 74.0 GiB usable (80.0 less a 6.0 GiB reserve)" in result.problems[0]


@pytest.mark.parametrize("budget, tokens", [(32768, 65536), (69632, 69632), (100000, 100000)])
def test_micro_batch_tokens_follow_the_scheduler_bound(budget, tokens):
    # padded tokens of the largest micro-batch: the budget, or one max-length output alone
    result = plan(_config("qwen3_30b_a3b_h100x64", f"scheduler.token_budget={budget}"), nodes=8, gpus_per_node=8)
    assert f" {tokens} tokens/micro-batch" in result.report


def test_config_json_of_model_path_wins_over_the_embedded_arch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B_THINKING_2507, "num_key_value_heads": 2}))
    with pytest.raises(LayoutError, match="num_key_value_heads=2 not divisible by tp=4"):
        plan(_config("qwen3_30b_a3b_h100x8", f"model.path={tmp_path}"), nodes=1, gpus_per_node=8)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_THINKING_2507))
    result = plan(_config("qwen3_30b_a3b_h100x8", f"model.path={tmp_path}"), nodes=1, gpus_per_node=8)
    assert f"model: {tmp_path / 'config.json'}" in result.report and not result.problems


def test_without_config_json_or_arch_the_dry_run_says_what_to_give():
    with pytest.raises(FileNotFoundError, match="model.arch"):
        plan(_config("qwen3_30b_a3b_h100x8", "model.arch={}"), nodes=1, gpus_per_node=8)


def test_qwen3_recipes_carry_the_marsrl_numbers():
    for name in QWEN3_RECIPES:
        c = get_recipe(name)
        assert (c.rollout.group_size, c.rollout.inputs_per_stage, c.rollout.max_stages) == (8, 2, 5)
        assert (c.rollout.sampling.temperature, c.rollout.sampling.top_p) == (0.85, 1.0)
        assert c.rollout.sampling.max_tokens == 65536 and c.pipeline.problems_per_step == 128
        assert c.optim.lr == 1e-6 and c.pipeline.mode == "pipeline"
        assert c.pipeline.segment_tokens == 16384  # MarsRL: 64k outputs in 16k segments
        assert c.task.name == "math" and c.engine.kind == "sglang_server"
        assert c.scheduler.token_budget >= c.rollout.sampling.max_tokens
        assert c.parallel.tp == 4 and c.parallel.distributed_optimizer and c.parallel.recompute == "full"


def test_cpu_offload_fraction_is_validated():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="cpu_offload_fraction"):
            OptimConfig(cpu_offload_fraction=bad)
    with pytest.raises(ValueError, match="needs optimizer='adam'"):
        OptimConfig(optimizer="sgd", cpu_offload_fraction=0.5)


def test_cpu_offload_maps_to_megatron_fields_and_refuses_cpu_and_replicated_optimizer():
    torch = pytest.importorskip("torch")
    from megatron.core.optimizer import OptimizerConfig

    from megatron_marsrl.megatron import optim

    assert optim._offload_options(OptimConfig(), False) == {}
    with pytest.raises(ValueError, match="needs parallel.distributed_optimizer=true"):
        optim._offload_options(OptimConfig(cpu_offload_fraction=0.5), False)
    if torch.cuda.is_available():
        fields = optim._offload_options(OptimConfig(cpu_offload_fraction=0.5), True)
        assert fields["optimizer_offload_fraction"] == 0.5
        assert set(fields) <= set(OptimizerConfig.__dataclass_fields__)
    else:
        assert {"optimizer_cpu_offload", "optimizer_offload_fraction",
                "use_precision_aware_optimizer"} <= set(OptimizerConfig.__dataclass_fields__)
        with pytest.raises(ValueError, match=r"optim\.cpu_offload_fraction=0\.5: .*needs CUDA"):
            optim.wrap_ddp_and_optimizer(object(), OptimConfig(cpu_offload_fraction=0.5), distributed_optimizer=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_scripts_are_valid_bash(script):
    proc = subprocess.run(["bash", "-n", str(EXAMPLES / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", ("train.sbatch", "train_torchrun.sh"))
def test_launch_scripts_name_recipes_that_exist(script):
    text = (EXAMPLES / script).read_text()
    assert "qwen3_30b_a3b_h100x$((NNODES * GPUS_PER_NODE))" in text
    allowed = re.search(r'case "\$NNODES" in\s+([\d|]+)\)', text).group(1).split("|")
    for nodes in allowed:  # every node count the script accepts builds an existing recipe name
        assert f"qwen3_30b_a3b_h100x{int(nodes) * 8}" in RECIPES
    for literal in re.findall(r"qwen3_30b_a3b_h100x\d+", text):
        assert literal in RECIPES


@pytest.mark.parametrize("name", sorted(QWEN3_RECIPES))
def test_recipe_kv_pool_bytes_from_the_model_shape(name):
    # KV bytes per token worked out here from config.json (K and V, every layer, the KV heads one
    # engine GPU holds, bf16) x the recipe's pool, not taken from the estimator
    arch, config = QWEN3_30B_A3B_THINKING_2507, get_recipe(name)
    heads_per_gpu = -(-arch["num_key_value_heads"] // config.engine.tp_size)  # replicated past TP4
    per_token = 2 * arch["num_hidden_layers"] * heads_per_gpu * arch["head_dim"] * 2
    kv_gib = config.engine.max_total_tokens * per_token / 2**30
    result = plan(config, nodes=_nodes(name), gpus_per_node=8)
    if name.endswith("_split"):  # an engine-only GPU: TP2 weights (28.4 GiB), the pool, runtime and context
        gib, tokens = re.search(r"engine-only GPUs \(split\): ([\d.]+) GiB per GPU, KV pool (\d+)", result.report).groups()
        assert int(tokens) == config.engine.max_total_tokens
        assert float(gib) == pytest.approx(30.53e9 * 2 / 2 / 2**30 + kv_gib + 5.0, abs=0.5) and float(gib) <= 74.0
        return
    reported = float(re.search(r"^SGLang KV cache\s+[\d.]+\s+([\d.]+)$", result.report, re.M).group(1))
    assert reported == pytest.approx(kv_gib, abs=0.005)
    # the pool fits the budget: everything else in the rollout phase (time-shared: the trainer's
    # state is in host memory), plus this KV, leaves the reserve
    assert config.pipeline.time_shared
    at_once = float(re.search(r"^total\s+[\d.]+\s+([\d.]+)$", result.report, re.M).group(1))
    assert at_once - reported + kv_gib <= 80.0 - 6.0


def test_bf16_gradient_buffers_halve_the_planned_gradients():
    from megatron_marsrl.megatron.hf_config import ModelArch
    from megatron_marsrl.rl.dry_run import estimate

    arch = ModelArch.from_hf_dict(QWEN3_30B_A3B_THINKING_2507)
    fp32 = estimate(_config("qwen3_30b_a3b_h100x8"), arch, 8)
    bf16 = estimate(_config("qwen3_30b_a3b_h100x8", "optim.grad_reduce_in_fp32=false"), arch, 8)
    assert bf16.grads_gib == pytest.approx(fp32.grads_gib / 2) and fp32.grads_gib > 5
    assert bf16.params_gib == fp32.params_gib


def test_split_engine_pool_is_capped_by_the_memory_fraction_and_must_fit():
    def engine_only(*overrides):
        result = plan(_config("qwen3_30b_a3b_h100x64_split", *overrides), nodes=8, gpus_per_node=8)
        gib, tokens = re.search(r"engine-only GPUs \(split\): ([\d.]+) GiB per GPU, KV pool (\d+)", result.report).groups()
        return float(gib), int(tokens), result

    gib, tokens, _ = engine_only()
    small_gib, small, _ = engine_only("engine.mem_fraction_static=0.7")
    per_token_gib = 2 * 48 * 2 * 128 * 2 / 2**30  # TP2: 2 of the 4 KV heads per GPU, bf16 K and V, 48 layers
    weights = gib - 5.0 - tokens * per_token_gib
    # SGLang's pool under the fraction: 0.7 x 80 GiB less the CUDA context (1 GiB) and the weights
    assert small == pytest.approx((0.7 * 80 - 1.0 - weights) / per_token_gib, abs=300) and small < tokens  # gib is printed to 0.01
    assert small_gib == pytest.approx(gib - (tokens - small) * per_token_gib, abs=0.01)
    _, _, too_big = engine_only("engine.max_total_tokens=1500000", "engine.mem_fraction_static=0.95")
    assert any("an engine-only GPU needs" in p for p in too_big.problems)
    with pytest.raises(LayoutError, match="leaves no GPU of a node to train"):
        plan(_config("qwen3_30b_a3b_h100x64_split", "engine.base_gpu_id=0", "engine.num_engines=4"), nodes=8,
             gpus_per_node=8)
