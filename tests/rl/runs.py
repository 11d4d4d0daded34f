"""Running `marsrl train` as a user would, and reading what a run leaves behind: the helpers
of the tests that train (test_train.py, test_train_sglang.py, test_main_job.py and others).

Each run re-executes the command under torchrun: 2 gloo ranks (EP2), real Megatron-core,
real engines.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROLES = ("solver", "verifier", "corrector")


def command(run_dir: Path, *args: str, recipe: str = "tiny_arithmetic") -> list[str]:
    return [sys.executable, "-m", "megatron_marsrl.cli", "train", "--recipe", recipe,
            f"run.output_dir={run_dir}", "run.progress=false", *args]


def run_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def train(run_dir: Path, *args: str, timeout: float = 600, recipe: str = "tiny_arithmetic") -> subprocess.CompletedProcess:
    proc = subprocess.run(command(run_dir, *args, recipe=recipe), capture_output=True, text=True, timeout=timeout,
                          env=run_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def step_metrics(run_dir: Path) -> dict[int, dict]:
    """Training-step records of metrics.jsonl by step (evaluation records excluded)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "time/step" in record:
            out[record["step"]] = record
    return out


def eval_metrics(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if any(k.startswith("eval/") for k in record):
            out[record["step"]] = record
    return out


def tensorboard_tags(run_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return set(acc.Tags()["scalars"])


def check_steps(run_dir: Path, steps: int, *, filled: bool = True) -> dict[int, dict]:
    metrics = step_metrics(run_dir)
    assert sorted(metrics) == list(range(1, steps + 1))
    for step, m in metrics.items():
        # step k trains weight version k-1 (the version its scheduler items carry); the engines'
        # own record of the version they generated every token with must say the same
        assert m["rollout/engine_version_min"] == m["rollout/engine_version_max"] == step - 1
        assert math.isfinite(m["train/loss"]) and math.isfinite(m["shared/grad_norm"])
        assert m["shared/update_skipped"] == 0.0
        # the pipeline fills: solver at step 1, verifier at 2, corrector at 3 (reproducibly so with
        # the embedded engine; SGLang's sampling varies with how requests happen to be batched, and
        # a step 3 may then find no rejected solution to correct: `filled=False` checks the roles that ran)
        for role in ROLES[:step] if filled else [r for r in ROLES if f"rollout/{r}/samples" in m]:
            # tiny_arithmetic rewards: 1 right, 0 wrong, -0.5 (the format penalty) unparsable
            r = {k: m[f"rollout/{role}/{k}"] for k in ("reward_mean", "accuracy", "parse_fail")}
            assert r["reward_mean"] == pytest.approx(r["accuracy"] - 0.5 * r["parse_fail"], abs=1e-9), (step, role, r)
        # the engine was given exactly the trained weights: its log-probs equal Megatron's
        assert m["shared/sync_probe_mismatch"] < 1e-4
        assert m["train/mismatch_abs"] < 1e-4
    return metrics


def assert_same_steps(a: dict[int, dict], b: dict[int, dict], steps) -> None:
    """The two runs' metrics of `steps` agree: rollouts exactly (same samples), training to fp tolerance."""
    for step in steps:
        for key in ("rollout/samples", "rollout/pending_stage_inputs",
                    *(f"rollout/{r}/reward_mean" for r in ROLES), *(f"rollout/{r}/response_len" for r in ROLES)):
            assert b[step].get(key) == a[step].get(key), (step, key)
        for key in ("train/loss", "train/entropy", "shared/grad_norm",
                    *(k for k in ("train/dmmpt_active", "train/dmmpt_masked_fraction") if k in a[step])):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-6), (step, key)


def wait_for(condition, proc, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training exited early with {proc.returncode}")
        try:
            if condition():
                return
        except (ValueError, json.JSONDecodeError, FileNotFoundError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("timed out waiting for training progress")
