"""`marsrl bench learning`: variants, the mean +- std report, and a real two-variant run."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_marsrl.rl import bench_learning as bl


def test_variants_and_grids_name_real_overrides():
    from megatron_marsrl.rl.overrides import apply_overrides
    from megatron_marsrl.rl.recipes import get_recipe

    for grid in bl.GRIDS.values():
        for name in grid:
            apply_overrides(get_recipe("tiny_arithmetic"), list(bl.variant_overrides(name)))  # each one valid
    assert bl.variant_overrides("custom:loss.ratio=sequence,loss.clip_low=3e-4") == \
        ("loss.ratio=sequence", "loss.clip_low=3e-4")
    with pytest.raises(ValueError, match="unknown variant 'dr_mas'"):
        bl.variant_overrides("dr_mas")


def test_existing_run_directories_are_refused_before_anything_runs(tmp_path):
    bl.check_new(tmp_path, ["drmas", "at_grpo"], [1, 2])
    bl.run_dir_of(tmp_path, "at_grpo", 2).mkdir()
    with pytest.raises(FileExistsError, match="at_grpo-seed2.*choose another --output"):
        bl.check_new(tmp_path, ["drmas", "at_grpo"], [1, 2])


def test_report_is_mean_and_sample_std_over_seeds(tmp_path):
    def result(variant, seed, solver, system=None, warm=0.0):
        final = {"eval/solver/accuracy": solver, "eval/solver/accuracy/ci_low": solver - 0.1,
                 "eval/solver/accuracy/ci_high": solver + 0.1,
                 **({"eval/system/accuracy": system} if system is not None else {})}
        return bl.RunResult(variant=variant, seed=seed, final=final, first={"eval/solver/accuracy": 0.25},
                            seconds=60.0 * seed + warm, warm_start_seconds=warm, run_dir="")

    results = [result("drmas", 1, 0.5, 0.6, warm=90.0), result("drmas", 2, 0.7, 0.8, warm=150.0),
               result("at_grpo", 1, 0.4)]
    summary = bl.summarize(results)
    assert summary["drmas"]["eval/solver/accuracy"] == pytest.approx((0.6, 0.1414213), abs=1e-6)
    assert summary["at_grpo"]["eval/solver/accuracy"] == (0.4, 0.0)
    assert "eval/system/accuracy" not in summary["at_grpo"]
    text = bl.write_report(results, tmp_path, seeds=[1, 2], command="marsrl bench learning")
    assert "| drmas | 0.600 +- 0.141 | 0.700 +- 0.141 | 1.5 |" in text
    assert "| at_grpo | 0.400 +- 0.000 | - | 1.0 |" in text
    assert "Minutes without the warm start: 2 trained, 2.0 min each" in text
    assert "| drmas | +0.350 +- 0.141 (no intervals) |\n" in text  # the change table
    # each run's first and final figures, with the intervals it logged
    assert "| drmas | 2 | 0.25 -> 0.70 [0.60, 0.80] | - -> 0.80 |" in text
    assert "| at_grpo | 1 | 0.25 -> 0.40 [0.30, 0.50] | - -> - |" in text
    assert (tmp_path / "learning.png").stat().st_size > 1000
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 3


def test_changes_count_the_seeds_whose_intervals_separate():
    """The change table: mean +- sample std of last - first over seeds, and per seed whether the
    last interval lies wholly above or below the first (overlapping ones count as neither)."""
    def figures(value, half):
        return {"eval/solver/accuracy": value, "eval/solver/accuracy/ci_low": value - half,
                "eval/solver/accuracy/ci_high": value + half}

    def run(seed, first, last, half=0.05):
        return bl.RunResult(variant="v", seed=seed, first=figures(first, half), final=figures(last, half),
                            seconds=1.0, warm_start_seconds=0.0, run_dir="")

    # +0.3 apart, +0.05 overlapping, -0.2 apart below; a run without intervals counts in the mean only
    bare = bl.RunResult(variant="v", seed=4, first={"eval/solver/accuracy": 0.5}, final={"eval/solver/accuracy": 0.6},
                        seconds=1.0, warm_start_seconds=0.0, run_dir="")
    table = bl.changes([run(1, 0.2, 0.5), run(2, 0.4, 0.45), run(3, 0.6, 0.4), bare])
    change = table["v"]["eval/solver/accuracy"]
    assert (change.above, change.below, change.bounded, change.seeds) == (1, 1, 3, 4)
    assert change.mean == pytest.approx((0.3 + 0.05 - 0.2 + 0.1) / 4)
    assert change.std == pytest.approx(statistics.stdev([0.3, 0.05, -0.2, 0.1]))
    assert "eval/verifier/balanced_accuracy" not in table["v"]
    assert "| v | +0.062 +- 0.206 (1/3 above, 1 below) |" in bl.changes_markdown(table)


@pytest.mark.slow
def test_bench_learning_runs_each_variant_from_its_seeds_warm_start_and_reports(tmp_path):
    """Two estimators and a variant with another warm start learning rate, one seed, on the main
    job's recipe cut short: the first run trains the warm start, the second reuses its copy, the
    third (other settings) trains its own."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "megatron_marsrl.cli", "bench", "learning", "--variant", "drmas",
           "--variant", "at_grpo", "--variant", "custom:advantage.estimator=at_grpo,warm_start.lr=0.001",
           "--seeds", "7", "--output", str(out), "--steps", "2", "--override", "warm_start.epochs=1",
           "--override", "run.eval_every=2", "--override", "pipeline.problems_per_step=4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["seed"]) for r in runs] == \
        [("drmas", 7), ("at_grpo", 7), ("custom:advantage.estimator=at_grpo,warm_start.lr=0.001", 7)]
    for r, estimator in zip(runs, ("drmas", "at_grpo", "at_grpo")):
        # the report's figures are the run's own last held-out evaluation
        evals = [json.loads(line) for line in (Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines()
                 if "eval/solver/accuracy" in line]
        assert evals[-1]["step"] == 2 and r["final"]["eval/solver/accuracy"] == evals[-1]["eval/solver/accuracy"]
        config = json.loads((Path(r["run_dir"]) / "config.json").read_text())
        assert config["advantage"]["estimator"] == estimator and config["run"]["seed"] == 7
    assert [json.loads((Path(r["run_dir"]) / "config.json").read_text())["pipeline"]["mode"] for r in runs] == \
        ["sync", "sync", "pipeline"]
    first, reused, own = runs
    assert first["warm_start_seconds"] > 0 and reused["warm_start_seconds"] == 0 and own["warm_start_seconds"] > 0
    weights = [(Path(r["run_dir"]) / "warm_start" / "hf" / "model.safetensors").read_bytes() for r in runs]
    assert weights[1] == weights[0] and weights[2] != weights[0]
    report = (out / "learning.md").read_text()
    assert "| drmas |" in report and "2 trained" in report and (out / "learning.png").is_file()
    drmas_row = next(line for line in report.splitlines() if line.startswith("| drmas | 7 | "))
    assert drmas_row.count(" -> ") == 4 and drmas_row.count(" [") >= 6  # first and final, with intervals
