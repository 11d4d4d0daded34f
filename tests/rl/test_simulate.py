"""The step-time simulator and `marsrl bench pipeline` (--simulate, and the measured mode with its runs stubbed)."""
import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_marsrl.rl.simulate import LengthModel, SimConfig, simulate

ROOT = Path(__file__).resolve().parents[2]

# 8 GPUs, 2 engines x 64 slots, 4 training replicas, short outputs: a long-tailed MarsRL step in
# miniature that simulates in well under a second per mode.
SMALL = dict(num_gpus=8, gpus_per_engine=4, engine_concurrency=64, train_gpus_per_replica=2, problems_per_step=8,
             mean_tokens=2000, max_tokens=8192, segment_tokens=2048, token_budget=8192, measured_steps=4,
             train_tokens_per_s_per_gpu=2000.0, weight_sync_s=5.0)


def small(**changes) -> SimConfig:
    return SimConfig(**{**SMALL, **changes})


def test_simulation_is_deterministic_given_the_seed():
    first, again = simulate(small()).to_dict(), simulate(small()).to_dict()
    assert first == again
    assert simulate(small(seed=1)).to_dict()["modes"] != first["modes"]


@pytest.mark.parametrize("rollout_gpus", [None, 4])
def test_pipeline_beats_sync_with_long_tailed_lengths(rollout_gpus):
    result = simulate(small(rollout_gpus=rollout_gpus))
    sync, pipe, overlap = (result.modes[m] for m in ("sync", "pipeline", "pipeline+overlap"))
    assert result.speedup["pipeline"] > 1.5
    assert overlap.median_step_s <= pipe.median_step_s
    assert overlap.samples_per_s > sync.samples_per_s
    assert overlap.overlapped_rounds_fraction > 0.5 and pipe.overlapped_rounds_fraction == 0
    # measured after warm-up, the pipeline trains as much per step as sync does (same problems in)
    assert pipe.tokens_per_step == pytest.approx(sync.tokens_per_step, rel=0.15)
    for row in result.modes.values():
        assert 0 <= row.train_idle_fraction < 1 and 0 <= row.rollout_idle_fraction < 1
        assert row.median_step_s >= row.median_rollout_s + 5.0  # the weight sync follows the rollout


def test_split_placement_gains_more_from_overlap_than_colocated():
    colocated, split = simulate(small()), simulate(small(rollout_gpus=4))
    gain = {name: r.modes["pipeline"].median_step_s / r.modes["pipeline+overlap"].median_step_s
            for name, r in (("colocated", colocated), ("split", split))}
    assert gain["split"] > gain["colocated"] >= 1.0


@pytest.mark.parametrize("rollout_gpus", [None, 4])
def test_modes_converge_with_constant_lengths_and_only_the_solver(rollout_gpus):
    result = simulate(small(length_sigma=0.0, max_stages=1, segment_tokens=None, rollout_gpus=rollout_gpus))
    for name in ("pipeline", "pipeline+overlap"):
        assert result.speedup[name] == pytest.approx(1.0)
    assert len({row.tokens_per_step for row in result.modes.values()}) == 1


def test_length_model_hits_its_mean_and_clip():
    model = LengthModel(mean_tokens=20000, max_tokens=65536, sigma=1.0)
    rng = random.Random(0)
    draws = [model.sample(rng) for _ in range(50000)]
    assert statistics.mean(draws) == pytest.approx(20000, rel=0.02)
    assert max(draws) == 65536 and min(draws) >= 1
    assert sum(d == 65536 for d in draws) / len(draws) == pytest.approx(model.truncated_fraction(), abs=0.005)
    assert LengthModel(mean_tokens=500, max_tokens=500, sigma=0.0).sample(rng) == 500


def test_decoding_context_is_the_time_weighted_kv_of_a_decoding_sequence():
    rng = random.Random(1)
    for sigma in (0.0, 0.6, 1.0):
        model = LengthModel(mean_tokens=20000, max_tokens=65536, sigma=sigma)
        draws = [model.sample(rng) for _ in range(50000)]
        # a sequence of length L decodes L steps holding L/2 tokens on average
        assert model.decoding_context() == pytest.approx(sum(d * d for d in draws) / (2 * sum(draws)), rel=0.03)
    assert LengthModel(mean_tokens=20000, max_tokens=65536, sigma=1.0).decoding_context() > 1.5 * 10000


def test_engines_on_fewer_colocated_gpus_slow_the_rollout():
    every, half = (simulate(small(engine_concurrency=16, engine_gpus=n), ("sync",)) for n in (None, 4))
    assert list(half.modes) == ["sync"]
    assert half.modes["sync"].median_rollout_s > 1.5 * every.modes["sync"].median_rollout_s


@pytest.mark.parametrize("changes, match", [
    (dict(engine_gpus=4, rollout_gpus=4), "engine_gpus=4: only for colocated placements"),
    (dict(engine_gpus=16), "engine_gpus=16: only for colocated placements"),
    (dict(group_size=0), "group_size=0: must be a positive integer"),
    (dict(mean_tokens=9000), "mean_tokens=9000 must be below max_tokens=8192"),
    (dict(length_sigma=-1.0), "length_sigma=-1.0"),
    (dict(continue_fraction=1.5), r"continue_fraction=1.5: must be within \[0, 1\]"),
    (dict(rollout_gpus=8), "rollout_gpus=8: must be between 1 and num_gpus-1=7"),
    (dict(rollout_gpus=6), "6 rollout GPUs are not a multiple of gpus_per_engine=4"),
    (dict(train_gpus_per_replica=3), "8 training GPUs are not a multiple of train_gpus_per_replica=3"),
    (dict(decode_tokens_per_s=0.0), "decode_tokens_per_s=0.0: must be > 0"),
    (dict(segment_tokens=0), "segment_tokens=0"),
    (dict(warmup_steps=-1), "warmup_steps=-1"),
])
def test_bad_parameters_raise_clear_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        small(**changes)


def _cli_args(*argv):
    from megatron_marsrl.commands import bench_pipeline

    parser = argparse.ArgumentParser()
    bench_pipeline.add_arguments(parser)
    return bench_pipeline, parser.parse_args([str(a) for a in argv])


def test_command_flags_and_set_overrides_reach_the_config(tmp_path, capsys):
    command, args = _cli_args("--simulate", "--gpus", 8, "--gpus-per-engine", 4, "--concurrency", 64,
                              "--gpus-per-replica", 2, "--problems", 8, "--mean-tokens", 2000, "--max-tokens", 8192,
                              "--segment-tokens", 0, "--rollout-gpus", 4, "--steps", 2, "--set", "warmup_steps=5",
                              "--set", "token_budget=8192", "--json", tmp_path / "sim.json")
    config = command.sim_config_from_args(args)
    assert (config.segment_tokens, config.rollout_gpus, config.warmup_steps, config.num_gpus) == (None, 4, 5, 8)
    assert command.run(args) == 0
    out = capsys.readouterr().out
    assert "pipeline+overlap" in out and "speed-up" in out
    result = json.loads((tmp_path / "sim.json").read_text())
    assert set(result["modes"]) == {"sync", "pipeline", "pipeline+overlap"}
    assert result["config"]["problems_per_step"] == 8 and result["speedup"]["sync"] == 1.0


def test_command_reports_bad_values(capsys):
    command, args = _cli_args("--simulate", "--set", "group_size=0")
    assert command.run(args) == 2
    assert "group_size=0" in capsys.readouterr().err


def test_measured_mode_trains_each_mode_and_reports_medians_speedups_and_calibrated_predictions(
        tmp_path, monkeypatch, capsys):
    # the training runs are stubbed: each gets three step records (first step already dropped)
    from megatron_marsrl.rl import bench_throughput

    calls = []

    def train_steps(recipe, overrides, run_dir, *, label):
        calls.append((recipe, overrides, Path(run_dir).name))
        rate = 10.0 * len(calls)  # sync 10, pipeline 20, pipeline+overlap 30 (+1 median offset)
        return [{"throughput/samples_per_s": rate + k, "time/step": 2.0 + k, "time/train_idle_fraction": 0.1,
                 "time/overlap_fraction": 0.5, "time/rollout": 1.0, "time/train": 0.8, "time/rollout_and_train": 1.8,
                 "tokens/generated": 300.0, "tokens/trained": 600.0, "world/train_gpus": 2.0, "world/rollout_gpus": 1.0,
                 "rollout/solver/samples": 16.0, "rollout/solver/response_len": 10.0,
                 "rollout/solver/truncated_fraction": 0.2, "rollout/verifier/samples": 16.0,
                 "rollout/verifier/response_len": 10.0, "rollout/verifier/truncated_fraction": 0.2}
                for k in (0.0, 1.0, 5.0)]

    monkeypatch.setattr(bench_throughput, "train_steps", train_steps)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the run directories' parent
    command, args = _cli_args("--recipe", "tiny_arithmetic", "--override", "rollout.group_size=2", "--steps", 4,
                              "--json", tmp_path / "real.json")
    assert command.run(args) == 0
    assert [c[2] for c in calls] == ["sync", "pipeline", "pipeline_overlap"]
    for (recipe, overrides, _), mode in zip(calls, ("sync", "pipeline", "pipeline")):
        assert recipe == "tiny_arithmetic" and f"pipeline.mode={mode}" in overrides
        assert "rollout.group_size=2" in overrides and "run.steps=4" in overrides
    assert [("scheduler.overlap=true" in c[1]) for c in calls] == [False, False, True]
    result = json.loads((tmp_path / "real.json").read_text())
    assert result["steps"] == 4 and list(result["modes"]) == ["sync", "pipeline", "pipeline+overlap"]
    rows = result["modes"]
    assert [rows[m]["throughput/samples_per_s"] for m in rows] == [11.0, 21.0, 31.0]  # medians
    assert [rows[m]["time/step"] for m in rows] == [3.0, 3.0, 3.0]
    assert [rows[m]["speedup_samples_per_s"] for m in rows] == pytest.approx([1.0, 21 / 11, 31 / 11])
    calibration = result["calibration"]
    assert calibration["steps"] == 3 and calibration["config"]["engine_batching"] == "static"
    assert calibration["config"]["weight_sync_s"] == pytest.approx(1.2)  # median of step - rollout_and_train
    for row in rows.values():
        assert row["predicted"]["step_s"] > 0
        assert row["error"]["time/step"] == pytest.approx(row["predicted"]["step_s"] / row["time/step"] - 1)
    out = capsys.readouterr().out
    assert "pipeline+overlap" in out and "pred step s" in out


def test_cli_subprocess_prints_json():
    proc = subprocess.run([sys.executable, "-m", "megatron_marsrl.cli", "bench", "pipeline", "--simulate", "--json", "-",
                           "--gpus", "8", "--gpus-per-engine", "4", "--gpus-per-replica", "2", "--problems", "4",
                           "--mean-tokens", "1000", "--max-tokens", "4096", "--segment-tokens", "1024", "--steps", "2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["speedup"]["pipeline"] > 1.0 and result["derived"]["dp_size"] == 4


def test_static_batches_last_their_longest_output_and_wait_for_the_engine():
    """One engine, one static batch per stage: with constant lengths L a sync step of P problems,
    G samples, k inputs, S=3 and every trajectory going on is three batches (P*G, P*k*G, P*k*G
    rows), each n*L / rate long; no round can start before the batch that ends it."""
    cfg = SimConfig(num_gpus=2, engine_gpus=1, gpus_per_engine=1, train_gpus_per_replica=1, problems_per_step=4,
                    group_size=2, inputs_per_stage=2, max_stages=3, continue_fraction=1.0, mean_tokens=10,
                    max_tokens=10, length_sigma=0.0, prompt_tokens=5, segment_tokens=None, engine_batching="static",
                    engine_concurrency=1000, engine_tokens_per_s=80.0, train_tokens_per_s_per_gpu=1e9,
                    weight_sync_s=0.0, measured_steps=2, token_budget=64)
    rows = 4 * 2 + 2 * (4 * 2 * 2)
    sync = simulate(cfg, modes=("sync",)).modes["sync"]
    assert sync.median_rollout_s == pytest.approx(rows * 10 / 80.0)
    # pipeline: steady steps hold every stage at once, one batch of the same rows
    pipe = simulate(dataclasses.replace(cfg, warmup_steps=2), modes=("pipeline",)).modes["pipeline"]
    assert pipe.median_rollout_s == pytest.approx(rows * 10 / 80.0)
    # a batch cap of 8 rows splits every stage into batches of 8: the same row-tokens, same time
    capped = simulate(dataclasses.replace(cfg, engine_concurrency=8), modes=("sync",)).modes["sync"]
    assert capped.median_rollout_s == pytest.approx(rows * 10 / 80.0)
    # two engines take a batch each: the Solver's one batch of 8, then each later stage's two at once
    two = simulate(dataclasses.replace(cfg, engine_gpus=2, engine_concurrency=8), modes=("sync",)).modes["sync"]
    assert two.median_rollout_s == pytest.approx(3 * 8 * 10 / 80.0)
    with pytest.raises(ValueError, match="engine_batching"):
        SimConfig(engine_batching="dynamic")


@pytest.mark.parametrize("truncated", [0.05, 0.3, 0.5])
def test_length_model_fit_matches_the_mean_and_the_truncated_share(truncated):
    model = LengthModel.fit(mean_tokens=300, max_tokens=512, truncated_fraction=truncated)
    assert model.clipped_mean(model.mu) == pytest.approx(300, rel=1e-6)
    assert model.truncated_fraction() == pytest.approx(truncated, abs=0.01)
    assert LengthModel.fit(mean_tokens=512, max_tokens=512, truncated_fraction=1.0).sigma == 0.0
