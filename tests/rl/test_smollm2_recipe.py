"""The `smollm2_arithmetic` recipe: a real pretrained model (SmolLM2-135M-Instruct from its
GGUF file) through `marsrl train`: converted at start-up, one rank, "auto" dtype, chat-template roles, weight sync."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from megatron_marsrl.precision import choose_dtype

from tests.rl.runs import run_env, step_metrics


def _train(run_dir, *args, timeout=900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_marsrl.cli", "train", "--recipe", "smollm2_arithmetic",
           f"run.output_dir={run_dir}", "run.progress=false", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env())


@pytest.mark.slow
def test_dry_run_reads_the_architecture_from_the_gguf_file(tmp_path):
    proc = _train(tmp_path / "run", "--dry-run", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SmolLM2-135M-Instruct.Q4_1.gguf (GGUF metadata)" in proc.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_steps_of_the_real_model(tmp_path):
    run = tmp_path / "run"
    # the recipe's dtype "auto": bf16 where the CPU has bf16 matrix instructions
    proc = _train(run, "run.steps=2", "run.eval_every=0", "run.checkpoint_every=2", "pipeline.problems_per_step=1",
                  "rollout.group_size=2", "rollout.sampling.max_tokens=8")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # config.json records "auto" as this machine resolved it
    dtype = choose_dtype("auto").name
    assert json.loads((run / "config.json").read_text())["model"]["dtype"] == dtype
    # the engine generates in the training dtype; bf16 kernels differ between HF and Megatron
    # by ~0.04-0.11 nats per token on average (measured), fp32 ones agree to rounding
    bound = 1e-4 if dtype == "float32" else 0.15
    config = json.loads((run / "initial_model" / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"]) == ("llama", 30)
    assert "<|im_start|>" in (run / "initial_model" / "chat_template.jinja").read_text()
    metrics = step_metrics(run)
    assert sorted(metrics) == [1, 2]
    for step, m in metrics.items():
        assert m["rollout/engine_version_min"] == m["rollout/engine_version_max"] == step - 1
        assert math.isfinite(m["train/loss"]) and m["shared/update_skipped"] == 0.0
        assert m["shared/sync_probe_mismatch"] < bound and m["train/mismatch_abs"] < bound
        r = {k: m[f"rollout/solver/{k}"] for k in ("reward_mean", "accuracy", "parse_fail")}
        assert r["reward_mean"] == pytest.approx(r["accuracy"] - 0.2 * r["parse_fail"], abs=1e-9)
    assert any(p.name.startswith("step_") for p in (run / "checkpoints").iterdir())
