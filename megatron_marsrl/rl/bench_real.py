"""The measured half of `marsrl bench pipeline`: one workload trained three ways, side by side,
next to what the step-time simulator predicts for each (the modes of rl/simulate.py):

    sync              whole trajectories, then train (no overlap): the textbook baseline
    pipeline          MarsRL agentic pipeline (one stage of every open trajectory per step),
                      training after the step's rollout
    pipeline+overlap  the same with the overlapping micro-batch scheduler

Each mode is a real `marsrl train` run (same recipe, overrides and seed) for --steps steps; the
first step (start-up, warm caches) is dropped and medians of the rest are reported. A pipeline
step holds one stage of many trajectories while a sync step holds whole trajectories, so the
figure to compare across modes is samples/s (trained samples per second of wall time); step
time and the trainer's idle fraction are reported too.

The sync run also calibrates the step-time simulator (rl/sim_calibrate.py: the decode and
training rates and the step's fixed time, read from its metrics); the simulator then predicts
each mode's median step time, rollout time and samples/s, printed next to the measured ones
with the relative error. The sync row checks the fit (means fitted, medians compared); the two
pipeline rows are predictions: their batching, step composition and overlap are the
simulator's. What the policy generated in each mode (lengths, how often the Verifier flagged
an error and so how many Corrector samples a step had) is read from that mode's own run: it is
the workload the step times are predicted for, not a property of the system.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

MODES = {
    "sync": ["pipeline.mode=sync", "scheduler.overlap=false"],
    "pipeline": ["pipeline.mode=pipeline", "scheduler.overlap=false"],
    "pipeline+overlap": ["pipeline.mode=pipeline", "scheduler.overlap=true"],
}
FIGURES = ("time/step", "throughput/samples_per_s", "time/train_idle_fraction", "time/overlap_fraction",
           "time/rollout", "time/train")
COMPARED = {"time/step": "step_s", "time/rollout": "rollout_s", "throughput/samples_per_s": "samples_per_s"}
"""Measured figure -> the Prediction field it is compared with."""


def run_real(args) -> int:
    from megatron_marsrl.rl.bench_throughput import resolve_config
    from megatron_marsrl.rl.sim_calibrate import calibrate, predict, shape

    steps = args.steps or 6
    if steps < 2:
        raise SystemExit("error: --steps must be >= 2 in the measured mode (the first step is dropped)")
    workdir = Path(tempfile.mkdtemp(prefix="marsrl-bench-pipeline-"))
    overrides = {mode: [*args.override, *extra, f"run.steps={steps}"] for mode, extra in MODES.items()}
    sync_config = resolve_config(args.recipe, overrides["sync"])  # fails here, before any run, on a bad override
    records = {mode: _train(args.recipe, mode, overrides[mode], workdir) for mode in MODES}
    calibration = calibrate(sync_config, records["sync"])
    predicted = predict(calibration.config, steps=steps,
                        shapes={mode: shape(sync_config, records[mode]) for mode in MODES})
    results = {}
    for mode in MODES:
        results[mode] = _medians(records[mode])
        results[mode]["predicted"] = dataclasses.asdict(predicted[mode])
        results[mode]["error"] = {key: _relative_error(getattr(predicted[mode], field), results[mode][key])
                                  for key, field in COMPARED.items()}
    base = results["sync"]["throughput/samples_per_s"]
    for row in results.values():
        row["speedup_samples_per_s"] = row["throughput/samples_per_s"] / base if base else float("nan")
    _print(args.recipe, steps, results)
    if args.json:
        text = json.dumps({"recipe": args.recipe, "steps": steps, "modes": results,
                           "calibration": {"config": dataclasses.asdict(calibration.config),
                                           "rollout_s": calibration.rollout_s, "train_s": calibration.train_s,
                                           "steps": calibration.steps, "from": "sync"}}, indent=2)
        print(text) if args.json == "-" else Path(args.json).write_text(text)
    return 0


def _train(recipe: str, label: str, overrides: list[str], workdir: Path) -> list[dict]:
    from megatron_marsrl.rl.bench_throughput import train_steps

    run_dir = workdir / label.replace("+", "_")
    return train_steps(recipe, [f"run.output_dir={run_dir}", "run.progress=false", "run.eval_every=0",
                                "run.checkpoint_every=0", *overrides], run_dir, label=f"bench pipeline: {label}")


def _relative_error(predicted: float, measured: float) -> float | None:
    """predicted / measured - 1 (None when nothing was measured)."""
    return predicted / measured - 1.0 if measured else None


def _medians(steps: list[dict]) -> dict:
    return {key: statistics.median(r.get(key, 0.0) for r in steps) for key in FIGURES}


def _print(recipe: str, steps: int, results: dict) -> None:
    print(f"bench pipeline (measured): recipe {recipe}, median of steps 2..{steps}; "
          "predicted: the simulator calibrated on the sync run")
    print(f"{'mode':<18}{'step s':>9}{'samples/s':>11}{'train idle':>12}{'overlap':>10}{'speed-up':>10}"
          f"  |{'pred step s':>12}{'error':>8}{'pred samples/s':>16}{'error':>8}")
    for mode, row in results.items():
        pred, err = row["predicted"], row["error"]
        print(f"{mode:<18}{row['time/step']:>9.2f}{row['throughput/samples_per_s']:>11.1f}"
              f"{row['time/train_idle_fraction']:>12.1%}{row['time/overlap_fraction']:>10.1%}"
              f"{row['speedup_samples_per_s']:>9.2f}x  |{pred['step_s']:>12.2f}{err['time/step']:>+8.0%}"
              f"{pred['samples_per_s']:>16.1f}{err['throughput/samples_per_s']:>+8.0%}")
