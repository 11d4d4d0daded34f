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
     * the decode rate. Engines that run one batch at a time (the in-process kinds) log each
       batch (engine_batches.jsonl: rows, longest output, seconds): a line through them gives
       the rate over row-tokens; the cost of a batch besides its row-tokens
       (`batch_overhead_s`) is then set so that the simulated rollout takes the measured time
       (it also holds what the simulator does not model: extra batches that form when
       requests miss one another's gather window, the agents' turn between stages). If the
       fitted rate alone makes the rollout slower than measured, the overhead is 0 and the
       rate is scaled instead, as for SGLang servers. For SGLang servers
       (continuous batching) the calibration run is simulated at a nominal rate and the rate
       scaled by simulated / measured rollout time (inversely proportional in a sync step);
     * the training rate: scaled the same way by the training time (training after the
       rollout, inversely proportional to its rate).
  3. Everything else comes from the recipe: problems per step, G, k, S, segment rollout, the
     scheduler's token budget, shared or per-role policies, the engines' batching and
     concurrency, the training layout.
  4. The prediction simulates each mode with the fitted config over the steps the bench
     measures (its first step dropped) and takes the median over `seeds` simulations.

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


def calibrate(train_config, records: list[dict], *, batches: list[dict] = (), seeds: int = 5) -> Calibration:
    """Fit the simulator to `records`, the metrics of a sync run without overlap of
    `train_config` (first step already dropped), and `batches`, the lines of its
    engine_batches.jsonl (those of other steps are left out)."""
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
    steps = {r.get("step") for r in records}
    rate = _engine_rate([b for b in batches if b.get("step") in steps])
    if nominal.engine_batching == "static" and rate is not None:
        nominal = _fit_batch_overhead(dataclasses.replace(nominal, engine_tokens_per_s=rate), rollout_s, seeds=seeds)
    batched = nominal.batch_overhead_s > 0  # else the decode rate is scaled to the rollout time
    sim = _runs(nominal, "sync", steps=len(records), seeds=seeds)
    sim_rollout = statistics.fmean(t for run in sim for t in run.rollout_s)
    sim_train = statistics.fmean(step - roll - nominal.weight_sync_s for run in sim
                                 for step, roll in zip(run.step_s, run.rollout_s))
    rates = {"train_tokens_per_s_per_gpu": NOMINAL_RATE * sim_train / train_s}
    if not batched:
        decode = "engine_tokens_per_s" if nominal.engine_batching == "static" else "decode_tokens_per_s"
        rates[decode] = NOMINAL_RATE * sim_rollout / rollout_s
    return Calibration(config=dataclasses.replace(nominal, **rates), rollout_s=rollout_s, train_s=train_s,
                       steps=len(records))


def _engine_rate(batches: list[dict]) -> float | None:
    """Row-tokens/s of the engines over their batches: the slope of a least-squares line
    seconds = a + row-tokens / rate (the marginal rate; a batch also costs a fixed amount,
    fitted in `_fit_batch_overhead`), or the mean rate when the batches do not spread enough
    to draw the line. None without batches."""
    if not batches:
        return None
    x = [b["rows"] * b["longest"] for b in batches]
    y = [b["seconds"] for b in batches]
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((xi - mx) ** 2 for xi in x)
    sxy = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y))
    if sxx > 0 and sxy > 0 and my - sxy / sxx * mx >= 0:
        return sxx / sxy
    return sum(x) / sum(y) if sum(y) > 0 and sum(x) > 0 else None


def _fit_batch_overhead(config: SimConfig, rollout_s: float, *, seeds: int) -> SimConfig:
    """`config` with the batch_overhead_s whose simulated sync rollout takes `rollout_s` per
    step (bisection; the rollout grows with it). It holds what a batch costs besides its
    row-tokens: prefill and set-up in the engine, the batcher's gather window, the agents' turn
    between stages, and the batches that form when requests miss one another's window (the
    simulator forms one batch per wave of requests)."""
    def rollout(overhead: float) -> float:
        runs = _runs(dataclasses.replace(config, batch_overhead_s=overhead), "sync", steps=config.measured_steps,
                     seeds=seeds)
        return statistics.fmean(t for run in runs for t in run.rollout_s)

    lo, hi = 0.0, rollout_s
    if rollout(lo) >= rollout_s:
        return config
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rollout(mid) < rollout_s else (lo, mid)
    return dataclasses.replace(config, batch_overhead_s=(lo + hi) / 2)


def workload(train_config, records: list[dict]) -> SimConfig:
    """The run's workload and layout as a SimConfig, rates at NOMINAL_RATE."""
    roles = sorted({key.split("/")[1] for r in records for key in r
                    if key.startswith("rollout/") and key.endswith("/samples") and key.count("/") == 2})
    samples = {role: sum(r.get(f"rollout/{role}/samples", 0.0) for r in records) for role in roles}
    total = sum(samples.values())
    if not total:
        raise ValueError("the calibration run logged no rollout samples (rollout/<role>/samples)")

    def weighted(name: str) -> float:
        return sum(r.get(f"rollout/{role}/{name}", 0.0) * r.get(f"rollout/{role}/samples", 0.0)
                   for r in records for role in roles) / total

    rollout, engine = train_config.rollout, train_config.engine
    max_tokens = rollout.sampling.max_tokens
    lengths = LengthModel.fit(mean_tokens=max(1.0, weighted("response_len")), max_tokens=max_tokens,
                              truncated_fraction=weighted("truncated_fraction"))
    prompt = max(0, round(sum(r["tokens/trained"] - r["tokens/generated"] for r in records) / total))
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
        continue_fraction=continue_fraction(samples.get("verifier", 0.0), samples.get("corrector", 0.0),
                                            rollout.max_stages),
        mean_tokens=lengths.mean_tokens, max_tokens=max_tokens, length_sigma=lengths.sigma,
        prompt_tokens=prompt, segment_tokens=train_config.pipeline.segment_tokens, **placement,
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


def predict(config: SimConfig, *, steps: int, seeds: int = 5) -> dict[str, Prediction]:
    """Each mode over the steps the measured bench keeps: `steps` run, the first dropped."""
    out = {}
    for mode in MODES:
        runs = _runs(config, mode, steps=steps - 1, seeds=seeds, warmup=1)
        out[mode] = Prediction(mode=mode, step_s=statistics.median(r.median_step_s for r in runs),
                               rollout_s=statistics.median(r.median_rollout_s for r in runs),
                               samples_per_s=statistics.median(r.samples_per_s for r in runs),
                               overlapped_rounds_fraction=statistics.median(r.overlapped_rounds_fraction
                                                                            for r in runs))
    return out


def _runs(config: SimConfig, mode: str, *, steps: int, seeds: int, warmup: int = 0) -> list[ModeResult]:
    return [simulate(dataclasses.replace(config, seed=config.seed + k, measured_steps=steps, warmup_steps=warmup),
                     modes=(mode,)).modes[mode] for k in range(seeds)]
