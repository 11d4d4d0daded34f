"""`marsrl bench throughput`: an end-to-end RL step benchmark, reported as one JSON record.

    marsrl bench throughput                                        # tiny_arithmetic, 6 steps (CPU)
    marsrl bench throughput --recipe my.pkg:recipe --nproc-per-node 8 --steps 10 --json out.json
    marsrl bench throughput --override engine.kind=sglang --override run.sync_probe=false

It runs `marsrl train --recipe R` for --steps steps as a subprocess (as `bench pipeline` does),
drops the first step (start-up, warm caches) and reads the rest from the run's metrics.jsonl.
Figures are means over the measured steps, ratios taken of sums, so the parts of a step add up
to the step time exactly. Nothing here differs between CPU and GPU except the peak FLOP/s: a
GPU's datasheet figure, or on CPU the best FLOP/s a matmul of the model's own shapes reaches in
the run's training dtype on this machine (`device.peak_source` says which; `device.name` names
the CPU and its bf16 matrix instructions).

The fields follow NeMo-RL's published performance summary, so the figures compare directly:
https://docs.nvidia.com/nemo/rl/latest/about/performance-summary.html
  * "Tokens/sec/GPU" of a stage = tokens the stage processed / (stage time x the stage's GPUs):
    `rollout.tokens_per_s_per_gpu` (generated tokens / generation time / engine GPUs) and
    `train.tokens_per_s_per_gpu` (trained tokens / training time / training GPUs);
  * their table row (`nemo_rl`): model, on/off policy, T-max sequence length, G-average
    sequence length, #GPUs, G-GBS, T-GBS, generation [TP,PP], training [TP,CP,EP,PP,VPP],
    "Tokens / sec / GPU" (the v0.4 table's headline: trained tokens / step time / all GPUs) and
    "Total Step time(s)";
  * "Training MFU": model FLOPs of the trained tokens (megatron.memory.model_flops_per_token at
    the step's attended length) / training time / (training GPUs x peak FLOP/s).

The rollout's generated tokens/s stands next to the engine's own: the run saves its samples
(run.save_rollouts), and after it each measured step's requests go to one engine of the run's
kind as one batch (`rollout.engine_batch`; `rollout.over_engine_batch` = the rollout's
tokens/s per engine over the batch's), so the cost of the agents, the pool and the stages
waiting on each other shows.

A step has two timelines, both reported and both summing to the step time:
  * `step_parts_s`, the critical path: rollout (the generation window; training runs inside
    it), train_after_rollout (training left when generation ended), sync, other (optimizer
    step, bookkeeping);
  * `trainer_time_s`, what the trainer (rank 0) did: train, train_idle (waiting for rollouts),
    sync, other.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

NEMO_RL_URL = "https://docs.nvidia.com/nemo/rl/latest/about/performance-summary.html"

# Dense bf16 Tensor Core peaks per GPU. NVIDIA's datasheets list the figures "with sparsity";
# dense is half: H100 SXM 1,979 -> 989.5, H100 NVL 1,671 -> 835.5, H100 PCIe 1,513 -> 756.5
# TFLOPS (https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet);
# H200 SXM 1,979 -> 989.5, H200 NVL 1,671 -> 835.5 TFLOPS
# (https://www.nvidia.com/en-us/data-center/h200/). Checked in order: the first pattern that
# matches torch.cuda.get_device_name() wins ("NVIDIA H100 80GB HBM3" is the SXM part).
GPU_PEAK_BF16 = (
    (r"H200.*NVL", 835.5e12),
    (r"H200", 989.5e12),
    (r"H100.*NVL", 835.5e12),
    (r"H100.*PCIe", 756.5e12),
    (r"H100", 989.5e12),
)


def gpu_peak_flops(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the GPU called ``name``; None when the table lacks it."""
    for pattern, peak in GPU_PEAK_BF16:
        if re.search(pattern, name):
            return peak
    return None


def probe_shapes(arch) -> list[tuple[int, int, int]]:
    """(m, k, n) of the model's own training matmuls at 1024 tokens: the attention projections
    and the MLP's (the expert MLP's for MoE), forward shapes."""
    m, h = 1024, arch.hidden_size
    ffn = arch.moe_ffn_hidden_size if arch.is_moe else arch.ffn_hidden_size
    qkv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    return [(m, h, qkv), (m, h, 2 * ffn), (m, ffn, h)]


def measure_cpu_peak(threads: int, dtype: str, shapes: list[tuple[int, int, int]], *, repeats: int = 5) -> float:
    """The best matmul FLOP/s of this CPU over ``shapes`` in ``dtype`` with ``threads`` threads
    (best of ``repeats`` each): CPUs have no datasheet figure that torch reaches, so MFU on CPU
    is against what the model's own shapes reach in the training dtype."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = 0.0
    try:
        for m, k, n in shapes:
            a, b = torch.randn(m, k).to(getattr(torch, dtype)), torch.randn(k, n).to(getattr(torch, dtype))
            a @ b  # warm-up
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                best = max(best, 2.0 * m * k * n / (time.perf_counter() - start))
    finally:
        torch.set_num_threads(before)
    return best


def cpu_name() -> str:
    """The CPU's model name and its bf16 matrix instructions (machines of one kind differ)."""
    from megatron_marsrl.precision import cpu_bf16_flags, cpuinfo_field

    model = cpuinfo_field("model name") or "unknown CPU"
    flags = cpu_bf16_flags()
    return f"{model} ({', '.join(flags) if flags else 'no bf16 matrix instructions'})"


def rank_threads(train_gpus: int) -> int:
    """The threads each training rank of the run had: torchrun gives each of several ranks one
    thread unless OMP_NUM_THREADS says otherwise."""
    import torch

    return int(os.environ.get("OMP_NUM_THREADS") or 0) or (1 if train_gpus > 1 else torch.get_num_threads())


def device_peak(*, train_gpus: int, dtype: str = "float32", arch=None, peak_tflops: float | None = None) -> dict:
    """The device the ranks train on and its peak FLOP/s per GPU (per rank on CPU: the matmul
    probe of ``arch``'s shapes in ``dtype``, the run's resolved training dtype)."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        peak = peak_tflops * 1e12 if peak_tflops else gpu_peak_flops(name)
        source = ("--peak-tflops" if peak_tflops else "datasheet bf16 dense (see GPU_PEAK_BF16)" if peak
                  else "unknown GPU: pass --peak-tflops for MFU")
        return {"type": "cuda", "name": name, "peak_flops_per_gpu": peak, "peak_source": source}
    threads = rank_threads(train_gpus)
    if peak_tflops:
        return {"type": "cpu", "name": cpu_name(), "peak_flops_per_gpu": peak_tflops * 1e12,
                "peak_source": "--peak-tflops"}
    shapes = probe_shapes(arch) if arch is not None else [(1024, 1024, 1024)]
    return {"type": "cpu", "name": cpu_name(), "peak_flops_per_gpu": measure_cpu_peak(threads, dtype, shapes),
            "peak_source": f"CPU: measured {dtype} matmul peak of this machine on the model's shapes "
                           f"{shapes}, {threads} thread(s) per rank (no GPU; 'GPUs' below are training "
                           "ranks and engines on this CPU)"}


# ---- the record ---------------------------------------------------------------------------------
def _div(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _sum(steps: list[dict], key: str) -> float:
    return float(sum(r.get(key, 0.0) for r in steps))


def total_gpus(config, train_gpus: int, rollout_gpus: int) -> tuple[int, bool]:
    """All GPUs of the run and whether the engines share the training GPUs: rank 0 starts its
    engines on GPUs base_gpu_id.. of its node, which the local training ranks also use."""
    eng = config.engine
    local = min(train_gpus, eng.gpus_per_node)
    colocated = eng.kind == "hf" or eng.base_gpu_id + rollout_gpus <= local
    return (train_gpus if colocated else train_gpus + rollout_gpus), colocated


def throughput_record(steps: list[dict], *, config, arch, device: dict) -> dict:
    """The benchmark's figures from the measured steps' metrics (metrics.jsonl records)."""
    from megatron_marsrl.megatron.memory import count_params, model_flops_per_token

    n = len(steps)
    if n == 0:
        raise ValueError("no measured steps: run at least 2 steps (the first is dropped)")
    t = {k: _sum(steps, f"time/{k}") for k in ("step", "rollout", "train", "train_idle", "sync", "rollout_and_train")}
    generated, trained = _sum(steps, "tokens/generated"), _sum(steps, "tokens/trained")
    samples = _sum(steps, "rollout/samples")
    train_gpus, rollout_gpus = int(steps[0]["world/train_gpus"]), int(steps[0]["world/rollout_gpus"])
    gpus, colocated = total_gpus(config, train_gpus, rollout_gpus)
    flops = sum(model_flops_per_token(arch, seq_len=r["tokens/attended_len"]) * r["tokens/trained"] for r in steps)
    peak = device.get("peak_flops_per_gpu")
    train_flops_s = _div(flops, t["train"] * train_gpus)
    sync_gb = sum(v for r in steps for k, v in r.items() if k.endswith("/sync_gb"))
    mean = {k: v / n for k, v in t.items()}
    params = count_params(arch)
    return {
        "benchmark": "marsrl bench throughput", "reference": NEMO_RL_URL,
        "recipe": None, "overrides": [], "steps": None,  # filled in by the caller
        "measured_steps": n, "statistic": "mean over the measured steps (ratios of sums)",
        "device": {**device, "train_gpus": train_gpus, "rollout_gpus": rollout_gpus, "total_gpus": gpus,
                   "colocated": colocated},
        "model": {"path": config.model.path, "params_total": params.total, "params_active": params.active,
                  "train_flops_per_token": flops / trained if trained else None},
        "nemo_rl": {
            "model": Path(config.model.path).name if config.model.path != "task" else f"{config.task.name} task model",
            "policy": "on-policy" if config.pipeline.segment_tokens is None else "segment rollout (partly off-policy)",
            "t_max_seq_len": max(int(r.get("tokens/max_seq_len", 0)) for r in steps),
            "g_avg_seq_len": _div(trained, samples), "gpus": gpus,
            "g_gbs": samples / n, "t_gbs": samples / n,
            "generation_tp_pp": [config.engine.tp_size, 1],
            "training_tp_cp_ep_pp_vpp": [config.parallel.tp, 1, config.parallel.ep, config.parallel.pp, "n/a"],
            "tokens_per_sec_per_gpu": _div(trained, t["step"] * gpus), "total_step_time_s": mean["step"]},
        "step_time_s": mean["step"],
        "step_parts_s": {"rollout": mean["rollout"], "train_after_rollout": mean["rollout_and_train"] - mean["rollout"],
                         "sync": mean["sync"], "other": mean["step"] - mean["rollout_and_train"] - mean["sync"]},
        "trainer_time_s": {"train": mean["train"], "train_idle": mean["train_idle"], "sync": mean["sync"],
                           "other": mean["step"] - mean["train"] - mean["train_idle"] - mean["sync"]},
        "rollout": {"time_s": mean["rollout"], "generated_tokens": generated / n, "gpus": rollout_gpus,
                    "tokens_per_s_per_gpu": _div(generated, t["rollout"] * rollout_gpus)},
        "train": {"time_s": mean["train"], "trained_tokens": trained / n, "gpus": train_gpus,
                  "tokens_per_s_per_gpu": _div(trained, t["train"] * train_gpus),
                  "model_tflops_per_s_per_gpu": train_flops_s / 1e12 if train_flops_s is not None else None,
                  "mfu": _div(train_flops_s, peak) if train_flops_s is not None and peak else None},
        "weight_sync": {"time_s": mean["sync"], "gb": sync_gb / n, "gb_per_s": _div(sync_gb, t["sync"]),
                        "includes_probe": bool(config.run.sync_probe)},
        "idle_fractions": {"trainer_idle": _div(t["train_idle"], t["step"]),
                           "trainer_not_training": _div(t["step"] - t["train"], t["step"]),
                           "rollout_not_generating": _div(t["step"] - t["rollout"], t["step"]),
                           "train_overlapped_with_rollout": _div(_sum(steps, "time/overlap_fraction"), n)},
        "per_step_time_s": [r["time/step"] for r in steps],
    }


# ---- running it ---------------------------------------------------------------------------------
def resolve_config(recipe: str, overrides: list[str]):
    from megatron_marsrl.rl.overrides import apply_overrides
    from megatron_marsrl.rl.recipes import get_recipe

    return apply_overrides(get_recipe(recipe), overrides)


def run_bench(*, recipe: str, overrides: list[str], steps: int, output_dir: str | None = None,
              nproc_per_node: int | None = None, peak_tflops: float | None = None) -> dict:
    """Train, measure, and return the record (also written to OUTPUT/record.json and, as
    `bench/...` scalars, to OUTPUT/tensorboard)."""
    if steps < 2:
        raise ValueError(f"--steps {steps}: need >= 2 (the first step is dropped as warm-up)")
    out = Path(output_dir or f"outputs/bench_throughput/{re.sub(r'[^A-Za-z0-9_.-]+', '_', recipe)}-"
                             f"{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output dir {out} is not empty; choose another --output-dir")
    run_dir = out / "run"
    train_args = [*overrides, f"run.steps={steps}", f"run.output_dir={run_dir}", "run.progress=false",
                  "run.eval_every=0", "run.checkpoint_every=0", "run.save_rollouts=true"]
    config = resolve_config(recipe, train_args)  # fails here, before launching, on a bad override
    measured = train_steps(recipe, train_args, run_dir, nproc_per_node=nproc_per_node, label="bench throughput")
    arch = _arch(config, run_dir)
    dtype = json.loads((run_dir / "config.json").read_text())["model"]["dtype"]  # as the run resolved it
    device = device_peak(train_gpus=int(measured[0]["world/train_gpus"]) if measured else 1, dtype=dtype, arch=arch,
                         peak_tflops=peak_tflops)
    record = throughput_record(measured, config=config, arch=arch, device=device)
    batch = engine_batch(config, run_dir, [r["step"] for r in measured], dtype=dtype,
                         threads=rank_threads(int(measured[0]["world/train_gpus"])))
    record["rollout"]["engine_batch"] = batch
    rollout_rate = record["rollout"]["tokens_per_s_per_gpu"]
    record["rollout"]["over_engine_batch"] = (_div(rollout_rate, batch["tokens_per_s"])
                                              if rollout_rate is not None and batch["tokens_per_s"] else None)
    record.update(recipe=recipe, overrides=list(overrides), steps=steps, output_dir=str(out), train_args=train_args)
    (out / "record.json").write_text(json.dumps(record, indent=2))
    _tensorboard(out / "tensorboard", measured, record, config=config, arch=arch, device=device)
    return record


def engine_batch(config, run_dir: Path, steps: list[int], *, dtype: str, threads: int) -> dict:
    """Each of ``steps``' requests, as the run saved them (run_dir/rollouts/), given to one of the
    run's engines as one batch: the engine's own speed on the step's work, next to what the
    rollout got through the agents and the pool. The engine starts from the run's starting
    weights in its dtype, with the run's sampling and the training ranks' threads; the outputs
    differ from the run's (other weights, other seeds), so compare tokens/s."""
    import torch

    from megatron_marsrl.rollout.chat import load_tokenizer, stop_token_ids
    from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling
    from megatron_marsrl.rollout.factory import start_engines

    model_dir = str(config.model.start_checkpoint(run_dir))
    stop = stop_token_ids(load_tokenizer(model_dir))
    s = config.rollout.sampling
    batches = []
    for step in steps:
        rows = [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        batches.append([EngineRequest(rid=f"{step}-{i}", prompt_ids=r["prompt_token_ids"],
                                      sampling=EngineSampling(temperature=s.temperature, top_p=s.top_p,
                                                              max_new_tokens=s.max_tokens, stop_token_ids=stop,
                                                              seed=i))
                        for i, r in enumerate(rows) if r["prompt_token_ids"]])
    if not any(batches):
        raise RuntimeError(f"{run_dir / 'rollouts'}: the measured steps saved no requests with prompt token ids")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    pool = start_engines(config.engine, model_dir, dtype=getattr(torch, dtype))
    try:
        engine = pool.engines[0]
        engine.generate(next(b for b in batches if b)[:1])  # warm-up
        tokens, seconds = 0, 0.0
        for requests in batches:
            start = time.perf_counter()
            tokens += sum(len(out.output_ids) for out in engine.generate(requests))
            seconds += time.perf_counter() - start
    finally:
        pool.shutdown()
        torch.set_num_threads(before)
    n = len(batches)
    return {"tokens_per_s": _div(tokens, seconds), "requests_per_step": sum(map(len, batches)) / n,
            "generated_tokens_per_step": tokens / n, "time_s": seconds / n, "engine": config.engine.kind,
            "threads": threads}


def train_steps(recipe: str, overrides: list[str], run_dir: Path, *, nproc_per_node: int | None = None,
                label: str) -> list[dict]:
    """Run `marsrl train` (overrides must set run.output_dir=run_dir) as a subprocess and return
    its per-step metrics records, the first (start-up, warm caches) dropped. Both benchmarks
    measure through this."""
    cmd = [sys.executable, "-m", "megatron_marsrl.cli", "train", "--recipe", recipe, *overrides]
    if nproc_per_node:
        cmd += ["--nproc-per-node", str(nproc_per_node)]
    print(f"[{label}] {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"marsrl train failed ({proc.returncode}):\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "time/step" in r][1:]


def _arch(config, run_dir: Path):
    from megatron_marsrl.megatron.hf_config import ModelArch

    return ModelArch.from_hf_dir(config.model.start_checkpoint(run_dir))


_NOT_SCALARS = ("steps", "measured_steps", "device", "model")  # constants of the run: in the record only


def _scalars(record: dict, prefix: str = "bench") -> dict[str, float]:
    """The record's numeric leaves as TensorBoard tags (lists, text and run constants left out)."""
    out = {}
    for key, value in record.items():
        if key in _NOT_SCALARS:
            continue
        if isinstance(value, dict):
            out.update(_scalars(value, f"{prefix}/{key}"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}/{key}"] = float(value)
    return out


def _tensorboard(path: Path, measured: list[dict], record: dict, *, config, arch, device) -> None:
    """Per measured step `bench/...` (each step's own figures) and `bench/mean/...` (the record)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(path))
    try:
        for r in measured:
            for tag, value in _scalars(throughput_record([r], config=config, arch=arch, device=device)).items():
                writer.add_scalar(tag, value, r["step"])
        for tag, value in _scalars(record, "bench/mean").items():
            writer.add_scalar(tag, value, measured[-1]["step"])
    finally:
        writer.close()
