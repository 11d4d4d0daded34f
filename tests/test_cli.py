"""The `marsrl` console command and the benchmark script, run as a user would."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_marsrl

ROOT = Path(__file__).resolve().parents[1]


def _marsrl(*args, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "megatron_marsrl", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_version_and_help():
    code, out = _marsrl("--version")
    assert code == 0 and megatron_marsrl.__version__ in out
    code, out = _marsrl("--help")
    assert code == 0
    for sub in ("train", "sft", "selfcheck", "convert", "bench", "solve", "eval"):
        assert re.search(rf"^    {sub}\b", out, re.M), (sub, out)  # listed as a subcommand


def test_subcommand_help_lists_its_own_options():
    code, out = _marsrl("convert", "hf-to-mcore", "--help")
    assert code == 0 and "--input" in out and "--etp" in out
    # a group's help lists its subcommands (it used to exit 2: "SUBCOMMAND is required")
    for group, subs in (("convert", ("hf-to-mcore", "mcore-to-hf", "gguf-to-hf")),
                        ("bench", ("throughput", "learning", "rollout", "weight-sync"))):
        code, out = _marsrl(group, "--help")
        assert code == 0 and all(s in out for s in subs), out
    code, out = _marsrl("bench")
    assert code == 2 and "required: SUBCOMMAND" in out
    code, out = _marsrl("train", "--help")  # every built-in recipe is named
    from megatron_marsrl.rl.recipes import RECIPES

    assert code == 0 and all(name in out for name in RECIPES), out


def test_unknown_subcommand_is_an_error():
    code, out = _marsrl("frobnicate")
    assert code == 2 and "invalid choice" in out


@pytest.mark.slow
def test_train_recipe_errors_and_a_config_file(tmp_path, monkeypatch):
    code, out = _marsrl("train", "--recipe", "nosuch", "--print-config")
    assert code == 2 and "unknown recipe 'nosuch'" in out and "smollm2_arithmetic" in out, out
    (tmp_path / "myrecipes.py").write_text("def broken():\n    return {'run': {}}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    code, out = _marsrl("train", "--recipe", "myrecipes:broken", "--print-config")
    assert code == 2 and "gave a dict" in out and "Traceback" not in out, out
    # --config: a YAML mapping applied to the recipe, then KEY=VALUE on top of it
    (tmp_path / "c.yaml").write_text("run:\n  steps: 3\n  seed: 7\noptim:\n  lr: 0.25\n")
    code, out = _marsrl("train", "--recipe", "tiny_arithmetic", "--config", tmp_path / "c.yaml", "run.seed=9",
                        "--print-config")
    assert code == 0, out
    config = json.loads(out)
    assert (config["run"]["steps"], config["run"]["seed"], config["optim"]["lr"]) == (3, 9, 0.25)
    (tmp_path / "bad.yaml").write_text("run:\n  stepz: 3\n")
    code, out = _marsrl("train", "--recipe", "tiny_arithmetic", "--config", tmp_path / "bad.yaml", "--print-config")
    assert code == 2 and "stepz" in out, out
    # held-out problems that training would share: refused with the config
    code, out = _marsrl("train", "--recipe", "tiny_arithmetic", "task.eval=arithmetic:eval?n=8&holdout=65",
                        "--print-config")
    assert code == 2 and "give both specs the same holdout" in out, out
    # more held-out problems than the difficulty has: refused before the warm start trains
    run = tmp_path / "run"
    code, out = _marsrl("train", "--recipe", "tiny_arithmetic_sft_rl", f"run.output_dir={run}",
                        "task.eval=arithmetic:eval?n=19&max_operand=9&max_terms=2&ops=%2B-")
    assert code != 0 and "found only 18 distinct problems for n=19" in out, out[-3000:]
    assert not (run / "warm_start").exists()


@pytest.mark.slow
def test_bench_convert_prints_and_records_figures(tmp_path):
    out_json = tmp_path / "bench.json"
    code, out = _marsrl("bench", "convert", "--size-mb", 40, "--repeats", 1, "--json", out_json)
    assert code == 0, out
    result = json.loads(out_json.read_text())
    assert result["bytes"] > 20e6
    assert set(result["phases"]) == {"raw", "load", "export", "save"}
    for row in result["phases"].values():
        assert row["seconds"] > 0 and row["gb_per_s"] > 0
    assert "x raw" in out


@pytest.mark.slow
def test_selfcheck_main_job_passes(tmp_path):
    code, out = _marsrl("selfcheck", "--out", tmp_path / "selfcheck")
    assert code == 0, out[-3000:]
    assert "bit-exact: True" in out and "PASSED" in out
    assert (tmp_path / "selfcheck" / "mcore" / "marsrl_checkpoint.json").is_file()


@pytest.mark.slow
def test_bench_rollout_and_weight_sync_report_figures(tmp_path):
    code, out = _marsrl("bench", "rollout", "--engines", "hf", "--batch", 2, "--new-tokens", 8, "--repeats", 1,
                        "--json", tmp_path / "r.json")
    assert code == 0, out
    row = json.loads((tmp_path / "r.json").read_text())["hf"]
    assert row["tokens_per_batch"] == 16 and row["batch_tokens_per_s"] > 0 and row["pool_tokens_per_s"] > 0
    assert row["pool_over_batch"] > 0 and "pool/batch" in out
    code, out = _marsrl("bench", "weight-sync", "--size-mb", 30, "--repeats", 1, "--json", tmp_path / "w.json")
    assert code == 0, out
    result = json.loads((tmp_path / "w.json").read_text())
    assert result["bytes"] > 20e6 and result["sync"]["gb_per_s"] > 0 and result["sync_over_copy"] > 0


def test_engine_factory_rejects_bad_input(tmp_path):

    from megatron_marsrl.rollout.factory import make_engine

    with pytest.raises(FileNotFoundError, match="no config.json"):
        make_engine("hf", str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="engine kind='vllm'"):
        make_engine("vllm", str(tmp_path))


def test_engine_config_validates_gpu_placement():

    from megatron_marsrl.rollout.factory import RolloutEngineConfig

    assert RolloutEngineConfig(kind="sglang_server", num_engines=4, tp_size=2).num_engines == 4
    with pytest.raises(ValueError, match="need more than the 8 GPUs"):
        RolloutEngineConfig(kind="sglang_server", num_engines=3, tp_size=2, base_gpu_id=4)
    with pytest.raises(ValueError, match="placement=split needs engine.kind=sglang_server"):
        RolloutEngineConfig(kind="sglang", placement="split")
    with pytest.raises(ValueError, match="choose one of colocated, split"):
        RolloutEngineConfig(kind="sglang_server", placement="apart")


def test_engines_on_other_nodes_must_be_reachable_and_split_engines_off_the_trainer_gpus(monkeypatch):
    import dataclasses

    import torch

    from megatron_marsrl.rl.node_engines import NodeRank, check_placement
    from megatron_marsrl.rl.recipes import get_recipe

    config = get_recipe("tiny_arithmetic")
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, kind="sglang_server"))
    two_nodes = NodeRank(node=0, nodes=2, local_rank=0, per_node=4)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    check_placement(config, two_nodes)  # node groups on this machine: loopback servers are reachable
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    with pytest.raises(ValueError, match="set engine.host=0.0.0.0"):
        check_placement(config, two_nodes)
    check_placement(config, dataclasses.replace(two_nodes, nodes=1))  # one node: its engines are rank 0's
    split = dataclasses.replace(config, engine=dataclasses.replace(config.engine, placement="split", base_gpu_id=2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="set engine.base_gpu_id=4"):
        check_placement(split, dataclasses.replace(two_nodes, nodes=1))


def test_start_engines_gives_a_pool(tiny_hf):
    import asyncio

    from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling
    from megatron_marsrl.rollout.factory import RolloutEngineConfig, start_engines

    pool = start_engines(RolloutEngineConfig(kind="hf", num_engines=2), tiny_hf("llama"))
    try:
        request = EngineRequest(prompt_ids=[3, 4], sampling=EngineSampling(max_new_tokens=2, seed=1))
        assert len(pool.engines) == 2 and pool.engines[0] is not pool.engines[1]
        each = [engine.generate([request])[0] for engine in pool.engines]  # both engines serve
        assert all(len(o.output_ids) == 2 and o.finish_reason == "length" for o in each)
        assert each[0].output_ids == each[1].output_ids  # same weights, same seeded request
        out = asyncio.run(pool.generate(request))
        assert out.output_ids == each[0].output_ids
    finally:
        pool.shutdown()
