"""The step-time simulator (rl/simulate.py) held against the trainer: its rates fitted to one
measured `marsrl train` run, then the step times of the modes `marsrl bench pipeline` measures
predicted, to be printed next to the measured ones.

The procedure (the measured `marsrl bench pipeline` runs it; rl/bench_real.py):
  1. A calibration run: the bench's recipe and overrides in sync mode without overlap (the
     bench's sync run).
  2. From its steps after the first, as the trainer logged them (metrics.jsonl):
     * the workload: output lengths (mean and truncated share over every role, weighted by
       samples; `LengthModel.fit`), prompt tokens per sample ((trained - generated tokens) /
       samples), the share of trajectories that go on after a Verifier (solved from the
       corrector / verifier sample counts), the GPUs that train and that generate;
     * `weight_sync_s`: the step time outside rollout and training (optimizer step, weight
       sync, bookkeeping), the median over steps;
     * the two rates: the calibration run is simulated at nominal rates, then each rate is
       scaled by simulated / measured time: the decode rate (`engine_tokens_per_s` for the
       in-process engines, which batch statically; `decode_tokens_per_s` for SGLang servers)
       by the rollout time, the training rate by the training time. In a sync step without
       overlap each time is inversely proportional to its rate, so one scaling fits it (on
       average over the steps). The decode rate so holds everything the rollout spends
       besides decoding (prefill, the batcher's gather window, the agents' turn between
       stages) in proportion to the row-tokens decoded.
  3. Everything else comes from the recipe: problems per step, G, k, S, segment rollout, the
     scheduler's token budget, shared or per-role policies, the engines' batching and
     concurrency, the training layout.
  4. The prediction simulates each mode with the fitted config over the steps the bench
     measures (its first step dropped) and takes the median over `seeds` simulations. What
     the policy generated (lengths, prompts, continuation: `shape`) is read from each mode's
     own run: the policy trains differently in each mode, and its outputs set the work (a
     Verifier that flags more errors gives a step more Corrector samples). The rates, the
     per-batch cost and the step's fixed time come from the calibration run alone.

Not fitted: `colocated_decode_floor` (how a colocated GPU is shared while both decode and
training run; the simulator's rule is that decoding keeps priority). The calibration run has no
overlap to fit it from, so the overlap mode's figure also tests that rule.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from megatron_marsrl.rl.simulate import MODES, LengthModel, ModeResult, SimConfig, simulate

NOMINAL_RATE = 1000.0
"""Rate every fitted rate starts from (tokens/s); any positive value gives the same fit."""


@dataclass(kw_only=True)
class Calibration:
    """A SimConfig fitted to a measured run, with the measured figures it was fitted to."""

    config: SimConfig
    """The fitted configuration (measured_steps: the calibration run's)."""
    rollout_s: float
    """Measured mean rollout time per step of the calibration run."""
    train_s: float
    """Measured mean training time per step (rollout_and_train - rollout, no overlap)."""
    steps: int
    """Calibration steps read (the run's first step dropped)."""


def calibrate(train_config, records: list[dict], *, seeds: int = 5) -> Calibration:
    """Fit the simulator to `records`, the metrics of a sync run without overlap of
    `train_config` (first step already dropped)."""
    if train_config.pipeline.mode != "sync" or train_config.scheduler.overlap:
        raise ValueError("calibrate from a run with pipeline.mode=sync and scheduler.overlap=false: the rates are "
                         "read from rollout and training times that do not overlap")
    if not records:
        raise ValueError("no calibration steps: the calibration run needs at least 2 steps (the first is dropped)")
    rollout_s = statistics.fmean(r["time/rollout"] for r in records)
    train_s = statistics.fmean(r["time/rollout_and_train"] - r["time/rollout"] for r in records)
    if rollout_s <= 0 or train_s <= 0:
        raise ValueError(f"calibration run: rollout {rollout_s:.3g} s and training {train_s:.3g} s per step; "
                         "both must be > 0")
    nominal = workload(train_config, records)
    sim = _runs(nominal, "sync", steps=len(records), seeds=seeds)
    sim_rollout = statistics.fmean(t for run in sim for t in run.rollout_s)
    sim_train = statistics.fmean(step - roll - nominal.weight_sync_s for run in sim
                                 for step, roll in zip(run.step_s, run.rollout_s))
    decode = "engine_tokens_per_s" if nominal.engine_batching == "static" else "decode_tokens_per_s"
    fitted = dataclasses.replace(nominal, **{decode: NOMINAL_RATE * sim_rollout / rollout_s,
                                             "train_tokens_per_s_per_gpu": NOMINAL_RATE * sim_train / train_s})
    return Calibration(config=fitted, rollout_s=rollout_s, train_s=train_s, steps=len(records))


def shape(train_config, records: list[dict]) -> dict:
    """What the policy generated in a run, as SimConfig fields: output lengths (mean and
    truncated share over every role, weighted by samples), prompt tokens per sample, and the
    share of trajectories that go on after a Verifier."""
    roles = sorted({key.split("/")[1] for r in records for key in r
                    if key.startswith("rollout/") and key.endswith("/samples") and key.count("/") == 2})
    samples = {role: sum(r.get(f"rollout/{role}/samples", 0.0) for r in records) for role in roles}
    total = sum(samples.values())
    if not total:
        raise ValueError("the run logged no rollout samples (rollout/<role>/samples)")

    def weighted(name: str) -> float:
        return sum(r.get(f"rollout/{role}/{name}", 0.0) * r.get(f"rollout/{role}/samples", 0.0)
                   for r in records for role in roles) / total

    rollout = train_config.rollout
    lengths = LengthModel.fit(mean_tokens=max(1.0, weighted("response_len")), max_tokens=rollout.sampling.max_tokens,
                              truncated_fraction=weighted("truncated_fraction"))
    return {"mean_tokens": lengths.mean_tokens, "length_sigma": lengths.sigma,
            "prompt_tokens": max(0, round(sum(r["tokens/trained"] - r["tokens/generated"] for r in records) / total)),
            "continue_fraction": continue_fraction(samples.get("verifier", 0.0), samples.get("corrector", 0.0),
                                                   rollout.max_stages)}


def workload(train_config, records: list[dict]) -> SimConfig:
    """The run's workload and layout as a SimConfig, rates at NOMINAL_RATE."""
    rollout, engine = train_config.rollout, train_config.engine
    max_tokens = rollout.sampling.max_tokens
    generated = shape(train_config, records)
    prompt = generated["prompt_tokens"]
    train_gpus, rollout_gpus = int(records[0]["world/train_gpus"]), int(records[0]["world/rollout_gpus"])
    gpus_per_engine = 1 if engine.kind == "hf" else engine.tp_size
    if engine.placement == "split":
        placement = {"num_gpus": train_gpus + rollout_gpus, "rollout_gpus": rollout_gpus}
    else:  # in-process engines of every policy share rank 0's device
        placement = {"num_gpus": train_gpus, "engine_gpus": min(rollout_gpus, train_gpus // gpus_per_engine
                                                                * gpus_per_engine)}
    if engine.batching == "static":
        concurrency = max(1, engine.batch_tokens // (prompt + max_tokens))
    else:
        concurrency = engine.max_inflight_per_engine
    weight_sync = statistics.median(r["time/step"] - r["time/rollout_and_train"] for r in records)
    return SimConfig(
        seed=train_config.run.seed, measured_steps=len(records), problems_per_step=train_config.pipeline.problems_per_step,
        group_size=rollout.group_size, inputs_per_stage=rollout.inputs_per_stage, max_stages=rollout.max_stages,
        **generated, max_tokens=max_tokens, segment_tokens=train_config.pipeline.segment_tokens, **placement,
        gpus_per_engine=gpus_per_engine, engine_concurrency=concurrency, engine_batching=engine.batching,
        engine_tokens_per_s=NOMINAL_RATE, decode_tokens_per_s=NOMINAL_RATE,
        train_gpus_per_replica=train_gpus // train_config.parallel.dp(train_gpus),
        train_tokens_per_s_per_gpu=NOMINAL_RATE, token_budget=train_config.scheduler.token_budget,
        weight_sync_s=max(0.0, weight_sync), separate_policies=train_config.policy.sharing != "shared")


def continue_fraction(verifier_samples: float, corrector_samples: float, max_stages: int) -> float:
    """The share f of trajectories that go on after each Verifier stage, from the samples each
    role produced: stage s (1 = the first Verifier) is reached with probability f^(s // 2),
    Verifiers hold the odd stages and Correctors the even ones; solved by bisection."""
    if max_stages < 3 or not verifier_samples:
        return 0.0
    measured = corrector_samples / verifier_samples

    def ratio(f: float) -> float:
        reach = [f ** (s // 2) for s in range(1, max_stages)]
        return sum(reach[1::2]) / sum(reach[0::2])

    lo, hi = 0.0, 1.0
    if measured >= ratio(hi):
        return 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < measured else (lo, mid)
    return (lo + hi) / 2


@dataclass(kw_only=True)
class Prediction:
    """One mode's predicted figures (medians over the simulations)."""

    mode: str
    step_s: float
    """Median step time."""
    rollout_s: float
    """Median rollout time per step."""
    samples_per_s: float
    """Trained samples per second of wall time."""
    overlapped_rounds_fraction: float
    """Training rounds released while the rollout still ran."""


def predict(config: SimConfig, *, steps: int, seeds: int = 5,
            shapes: dict[str, dict] | None = None) -> dict[str, Prediction]:
    """Each mode over the steps the measured bench keeps: `steps` run, the first dropped.
    `shapes`: per mode, what its own run generated (`shape`), in place of the calibration
    run's: the policy trains differently in each mode and generates other outputs (how often
    the Verifier flags an error sets how many Corrector samples a step has)."""
    out = {}
    for mode in MODES:
        mode_config = dataclasses.replace(config, **(shapes or {}).get(mode, {}))
        runs = _runs(mode_config, mode, steps=steps - 1, seeds=seeds, warmup=1)
        out[mode] = Prediction(mode=mode, step_s=statistics.median(r.median_step_s for r in runs),
                               rollout_s=statistics.median(r.median_rollout_s for r in runs),
                               samples_per_s=statistics.median(r.samples_per_s for r in runs),
                               overlapped_rounds_fraction=statistics.median(r.overlapped_rounds_fraction
                                                                            for r in runs))
    return out


def _runs(config: SimConfig, mode: str, *, steps: int, seeds: int, warmup: int = 0) -> list[ModeResult]:
    return [simulate(dataclasses.replace(config, seed=config.seed + k, measured_steps=steps, warmup_steps=warmup),
                     modes=(mode,)).modes[mode] for k in range(seeds)]
