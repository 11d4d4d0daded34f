"""Calibrating the step-time simulator on a measured run (rl/sim_calibrate.py)."""
import dataclasses

import pytest

from megatron_marsrl.rl.bench_throughput import resolve_config
from megatron_marsrl.rl.sim_calibrate import calibrate, continue_fraction, predict, shape
from megatron_marsrl.rl.simulate import SimConfig, simulate

SYNC = ["pipeline.mode=sync", "scheduler.overlap=false", "rollout.sampling.max_tokens=12"]


def _truth(train_config) -> SimConfig:
    """What a sync run of tiny_arithmetic looks like to the simulator: constant lengths (every
    output truncated), every trajectory going on, known rates."""
    p = train_config.pipeline.problems_per_step
    return SimConfig(seed=0, measured_steps=4, problems_per_step=p, group_size=train_config.rollout.group_size,
                     inputs_per_stage=train_config.rollout.inputs_per_stage, max_stages=3, continue_fraction=1.0,
                     mean_tokens=12, max_tokens=12, length_sigma=0.0, prompt_tokens=20, segment_tokens=None,
                     num_gpus=2, engine_gpus=1, gpus_per_engine=1, engine_batching="static",
                     engine_concurrency=65536 // 32, engine_tokens_per_s=3000.0, train_gpus_per_replica=1,
                     train_tokens_per_s_per_gpu=5000.0, token_budget=train_config.scheduler.token_budget,
                     weight_sync_s=0.2)


def _records(truth: SimConfig) -> list[dict]:
    """metrics.jsonl records of the run `truth` simulates, with the keys the trainer logs."""
    sync = simulate(truth, modes=("sync",)).modes["sync"]
    g, k, p = truth.group_size, truth.inputs_per_stage, truth.problems_per_step
    samples = {"solver": p * g, "verifier": p * k * g, "corrector": p * k * g}
    n = sum(samples.values())
    records = []
    for step, (total, rollout) in enumerate(zip(sync.step_s, sync.rollout_s), start=2):
        r = {"step": step, "time/step": total, "time/rollout": rollout,
             "time/rollout_and_train": total - truth.weight_sync_s, "tokens/generated": n * truth.max_tokens,
             "tokens/trained": n * (truth.max_tokens + truth.prompt_tokens), "world/train_gpus": 2.0,
             "world/rollout_gpus": 1.0}
        for role, count in samples.items():
            r.update({f"rollout/{role}/samples": float(count), f"rollout/{role}/response_len": float(truth.max_tokens),
                      f"rollout/{role}/truncated_fraction": 1.0})
        records.append(r)
    return records


def test_calibration_recovers_the_rates_of_a_known_run_and_predicts_its_modes():
    train_config = resolve_config("tiny_arithmetic", SYNC)
    truth = _truth(train_config)
    records = _records(truth)
    fitted = calibrate(train_config, records).config
    assert fitted.engine_batching == "static" and fitted.continue_fraction == pytest.approx(1.0)
    assert (fitted.mean_tokens, fitted.max_tokens, fitted.prompt_tokens) == (12, 12, 20)
    assert fitted.weight_sync_s == pytest.approx(0.2)
    assert fitted.engine_tokens_per_s == pytest.approx(truth.engine_tokens_per_s, rel=1e-6)
    assert fitted.train_tokens_per_s_per_gpu == pytest.approx(truth.train_tokens_per_s_per_gpu, rel=1e-6)
    predicted = predict(fitted, steps=5)
    for mode, row in simulate(dataclasses.replace(truth, warmup_steps=1)).modes.items():
        assert predicted[mode].step_s == pytest.approx(row.median_step_s, rel=1e-6), mode


def test_a_faster_engine_in_the_measured_run_gives_a_faster_fitted_engine():
    train_config = resolve_config("tiny_arithmetic", SYNC)
    slow, fast = _truth(train_config), dataclasses.replace(_truth(train_config), engine_tokens_per_s=6000.0)
    slow_fit, fast_fit = (calibrate(train_config, _records(t)).config for t in (slow, fast))
    assert fast_fit.engine_tokens_per_s == pytest.approx(2 * slow_fit.engine_tokens_per_s, rel=1e-6)
    assert fast_fit.train_tokens_per_s_per_gpu == pytest.approx(slow_fit.train_tokens_per_s_per_gpu, rel=1e-6)


@pytest.mark.parametrize("max_stages", [3, 4, 5, 6])
@pytest.mark.parametrize("f", [0.0, 0.3, 0.8, 1.0])
def test_continue_fraction_is_solved_from_the_roles_sample_counts(max_stages, f):
    reach = [f ** (s // 2) for s in range(1, max_stages)]  # stage 1 = the first Verifier
    verifier, corrector = sum(reach[0::2]), sum(reach[1::2])
    assert continue_fraction(verifier * 64, corrector * 64, max_stages) == pytest.approx(f, abs=1e-9)


def test_calibration_needs_a_sync_run_without_overlap():
    with pytest.raises(ValueError, match="pipeline.mode=sync"):
        calibrate(resolve_config("tiny_arithmetic", []), [{"time/step": 1.0}])
    with pytest.raises(ValueError, match="no calibration steps"):
        calibrate(resolve_config("tiny_arithmetic", SYNC), [])


def test_each_mode_is_predicted_for_what_its_own_run_generated():
    """A mode whose run had no Corrector samples (no trajectory went on) is predicted with that
    workload and the calibration run's rates; the other modes keep the calibration's."""
    train_config = resolve_config("tiny_arithmetic", SYNC)
    truth = _truth(train_config)
    fitted = calibrate(train_config, _records(truth)).config
    stopped = _records(truth)
    for r in stopped:
        r["rollout/corrector/samples"] = 0.0
    generated = shape(train_config, stopped)
    assert generated["continue_fraction"] == pytest.approx(0.0, abs=1e-12) and generated["mean_tokens"] == 12
    base, fewer = predict(fitted, steps=5), predict(fitted, steps=5, shapes={"pipeline": generated})
    assert fewer["pipeline"].step_s < base["pipeline"].step_s
    assert fewer["sync"].step_s == base["sync"].step_s
