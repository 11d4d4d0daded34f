"""`marsrl bench throughput`: the record's arithmetic on known metrics, the peak table, and a
real 3-step CPU run (2 gloo ranks, embedded engine) whose record must be finite and consistent."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from megatron_marsrl.rl.bench_throughput import gpu_peak_flops, resolve_config, throughput_record


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989.5), ("NVIDIA H100 PCIe", 756.5),
                                          ("NVIDIA H100 NVL", 835.5), ("NVIDIA H200", 989.5),
                                          ("NVIDIA H200 NVL", 835.5), ("NVIDIA A100-SXM4-80GB", None)])
def test_peak_table(name, tflops):
    peak = gpu_peak_flops(name)
    assert (peak is None) if tflops is None else peak == pytest.approx(tflops * 1e12)


def _step(step, *, rollout, rat, train, idle, sync, total, generated, trained, attended):
    return {"step": step, "time/step": total, "time/rollout": rollout, "time/rollout_and_train": rat,
            "time/train": train, "time/train_idle": idle, "time/sync": sync, "time/overlap_fraction": 0.5,
            "tokens/generated": generated, "tokens/trained": trained, "tokens/attended_len": attended,
            "tokens/max_seq_len": 30, "rollout/samples": 10, "shared/sync_gb": 0.5,
            "world/train_gpus": 2, "world/rollout_gpus": 1}


def test_record_arithmetic(tiny_hf):
    from megatron_marsrl.megatron.hf_config import ModelArch
    from megatron_marsrl.megatron.memory import model_flops_per_token

    arch = ModelArch.from_hf_dir(tiny_hf("qwen3"))
    config = resolve_config("tiny_arithmetic", [])
    steps = [_step(2, rollout=2.0, rat=2.5, train=1.0, idle=1.0, sync=0.25, total=3.0, generated=100, trained=200,
                   attended=10.0),
             _step(3, rollout=4.0, rat=4.5, train=3.0, idle=1.0, sync=0.75, total=6.0, generated=300, trained=400,
                   attended=20.0)]
    rec = throughput_record(steps, config=config, arch=arch, device={"peak_flops_per_gpu": 1e9})
    assert rec["step_time_s"] == pytest.approx(4.5)
    assert sum(rec["step_parts_s"].values()) == pytest.approx(4.5)
    assert sum(rec["trainer_time_s"].values()) == pytest.approx(4.5)
    assert rec["rollout"]["tokens_per_s_per_gpu"] == pytest.approx(400 / 6.0 / 1)
    assert rec["train"]["tokens_per_s_per_gpu"] == pytest.approx(600 / 4.0 / 2)
    assert rec["nemo_rl"]["tokens_per_sec_per_gpu"] == pytest.approx(600 / 9.0 / 2)  # colocated: 2 GPUs in all
    assert rec["weight_sync"]["gb_per_s"] == pytest.approx(1.0 / 1.0)
    flops = model_flops_per_token(arch, seq_len=10.0) * 200 + model_flops_per_token(arch, seq_len=20.0) * 400
    assert rec["train"]["mfu"] == pytest.approx(flops / 4.0 / 2 / 1e9)
    assert rec["idle_fractions"]["trainer_idle"] == pytest.approx(2.0 / 9.0)


def _finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_cpu_run_record_is_consistent(tmp_path):
    out_json = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, "-m", "megatron_marsrl.cli", "bench", "throughput", "--steps", "3",
                           "--output-dir", str(tmp_path / "bench"), "--json", str(out_json)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rec = json.loads(proc.stdout)  # stdout is exactly the record
    assert rec == json.loads(out_json.read_text())
    assert rec["measured_steps"] == 2 and rec["device"]["type"] == "cpu"
    # the peak is the matmul probe of the model's shapes in the run's dtype (tiny_arithmetic: fp32)
    assert "measured float32 matmul peak" in rec["device"]["peak_source"] and "bf16" in rec["device"]["name"]
    for figure in (rec["step_time_s"], rec["rollout"]["tokens_per_s_per_gpu"], rec["train"]["tokens_per_s_per_gpu"],
                   rec["nemo_rl"]["tokens_per_sec_per_gpu"], rec["weight_sync"]["time_s"], rec["weight_sync"]["gb"],
                   rec["weight_sync"]["gb_per_s"], rec["train"]["model_tflops_per_s_per_gpu"],
                   rec["rollout"]["generated_tokens"], rec["train"]["trained_tokens"], rec["nemo_rl"]["t_max_seq_len"]):
        assert _finite_positive(figure), rec
    assert 0 < rec["train"]["mfu"] <= 1
    for parts in (rec["step_parts_s"], rec["trainer_time_s"]):
        assert all(v >= 0 for v in parts.values()), parts
        assert sum(parts.values()) == pytest.approx(rec["step_time_s"], rel=0.02)
    assert rec["trainer_time_s"]["train"] + rec["trainer_time_s"]["train_idle"] <= rec["step_time_s"]
    assert all(0 <= v <= 1 for v in rec["idle_fractions"].values()), rec["idle_fractions"]
    assert rec["rollout"]["tokens_per_s_per_gpu"] == pytest.approx(
        rec["rollout"]["generated_tokens"] / rec["rollout"]["time_s"] / rec["device"]["rollout_gpus"])
    assert rec["train"]["tokens_per_s_per_gpu"] == pytest.approx(
        rec["train"]["trained_tokens"] / rec["train"]["time_s"] / rec["device"]["train_gpus"])
    assert rec["device"]["train_gpus"] == 2 and rec["nemo_rl"]["training_tp_cp_ep_pp_vpp"][2] == 2
    # the saved requests, replayed as one engine batch per measured step
    saved = sorted((tmp_path / "bench" / "run" / "rollouts").glob("step_*.jsonl"))
    assert [p.name for p in saved] == ["step_000001.jsonl", "step_000002.jsonl", "step_000003.jsonl"]
    rows = [json.loads(line) for line in saved[0].read_text().splitlines()]
    assert rows and all(r["role"] == "solver" and r["prompt_token_ids"] and r["response_token_ids"] for r in rows)
    batch = rec["rollout"]["engine_batch"]
    assert batch["requests_per_step"] == rec["nemo_rl"]["g_gbs"] and batch["threads"] == 1
    assert _finite_positive(batch["tokens_per_s"]) and batch["generated_tokens_per_step"] > 0
    assert rec["rollout"]["over_engine_batch"] == pytest.approx(rec["rollout"]["tokens_per_s_per_gpu"] / batch["tokens_per_s"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "bench" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"bench/train/mfu", "bench/rollout/tokens_per_s_per_gpu", "bench/mean/step_time_s"} <= tags
    assert [e.step for e in acc.Scalars("bench/train/mfu")] == [2, 3]


def test_cpu_peak_probe_uses_the_model_shapes(tiny_hf):
    from megatron_marsrl.megatron.hf_config import ModelArch
    from megatron_marsrl.rl.bench_throughput import measure_cpu_peak, probe_shapes

    arch = ModelArch.from_hf_dir(tiny_hf("qwen3"))
    shapes = probe_shapes(arch)
    assert (1024, arch.hidden_size, 2 * arch.ffn_hidden_size) in shapes
    for dtype in ("float32", "bfloat16"):
        assert _finite_positive(measure_cpu_peak(1, dtype, shapes, repeats=2))
