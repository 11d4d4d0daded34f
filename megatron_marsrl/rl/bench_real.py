"""The measured half of `marsrl bench pipeline`: one workload trained three ways, side by side.

    sync              whole trajectories, then train (no overlap): the textbook baseline
    sync+overlap      whole trajectories; a problem trains as soon as its trajectory is done
    pipeline+overlap  MarsRL agentic pipeline with the overlapping micro-batch scheduler

Each mode is a real `marsrl train` run (same recipe, overrides and seed) for --steps steps; the
first step (start-up, warm caches) is dropped and medians of the rest are reported. A pipeline
step holds one stage of many trajectories while a sync step holds whole trajectories, so the
figure to compare is samples/s (trained samples per second of wall time); step time and the
trainer's idle fraction are reported too.
"""
from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

MODES = {
    "sync": ["pipeline.mode=sync", "scheduler.overlap=false"],
    "sync+overlap": ["pipeline.mode=sync", "scheduler.overlap=true"],
    "pipeline+overlap": ["pipeline.mode=pipeline", "scheduler.overlap=true"],
}
FIGURES = ("time/step", "throughput/samples_per_s", "time/train_idle_fraction", "time/overlap_fraction",
           "time/rollout", "time/train")


def run_real(args) -> int:
    steps = args.steps or 6
    if steps < 2:
        raise SystemExit("error: --steps must be >= 2 in the measured mode (the first step is dropped)")
    workdir = Path(tempfile.mkdtemp(prefix="marsrl-bench-pipeline-"))
    results = {}
    for mode, overrides in MODES.items():
        results[mode] = _measure(args.recipe, mode, [*args.override, *overrides, f"run.steps={steps}"], workdir)
    base = results["sync"]["throughput/samples_per_s"]
    for row in results.values():
        row["speedup_samples_per_s"] = row["throughput/samples_per_s"] / base if base else float("nan")
    _print(args.recipe, steps, results)
    if args.json:
        text = json.dumps({"recipe": args.recipe, "steps": steps, "modes": results}, indent=2)
        print(text) if args.json == "-" else Path(args.json).write_text(text)
    return 0


def _measure(recipe: str, mode: str, overrides: list[str], workdir: Path) -> dict:
    from megatron_marsrl.rl.bench_throughput import train_steps

    run_dir = workdir / mode.replace("+", "_")
    steps = train_steps(recipe, [f"run.output_dir={run_dir}", "run.progress=false", "run.eval_every=0",
                                 "run.checkpoint_every=0", *overrides], run_dir, label=f"bench pipeline: {mode}")
    return {key: statistics.median(r.get(key, 0.0) for r in steps) for key in FIGURES}


def _print(recipe: str, steps: int, results: dict) -> None:
    print(f"bench pipeline (measured): recipe {recipe}, median of steps 2..{steps}")
    print(f"{'mode':<18}{'step s':>9}{'samples/s':>11}{'train idle':>12}{'overlap':>10}{'speed-up':>10}")
    for mode, row in results.items():
        print(f"{mode:<18}{row['time/step']:>9.2f}{row['throughput/samples_per_s']:>11.1f}"
              f"{row['time/train_idle_fraction']:>12.1%}{row['time/overlap_fraction']:>10.1%}"
              f"{row['speedup_samples_per_s']:>9.2f}x")
