"""Projected RL step time at cluster scale: synchronous rollouts versus the MarsRL agentic
pipeline with the overlapping micro-batch scheduler (a discrete-event model, no GPU needed).

    from megatron_marsrl.rl.simulate import SimConfig, simulate
    print(simulate(SimConfig()).speedup)          # also: marsrl bench pipeline --simulate

Modes, each measured over `measured_steps` RL steps (the pipeline modes after `warmup_steps`
that fill the pipeline):
  sync              each step takes `problems_per_step` new problems through their whole
                    trajectory, Solver -> Verifier -> Corrector -> Verifier ... (at most
                    `max_stages`); a stage starts when every sample of the stage before it is
                    done (input selection needs the whole stage); then everything trains.
  pipeline          MarsRL agentic pipeline: a step runs ONE stage of every open trajectory
                    (new problems enter the Solver, last step's outputs feed the next stage),
                    outputs longer than `segment_tokens` continue at the next step; training
                    starts when the step's rollout is done.
  pipeline+overlap  the same, with training rounds released by `MicroBatchScheduler` as soon as
                    completed groups fill them, overlapping the remaining generation.
Every mode ends its step with the optimizer step and the weight sync (`weight_sync_s`).

Model, every assumption a `SimConfig` field:
  * Output lengths: lognormal with shape `length_sigma`, clipped at `max_tokens` (clipped =
    truncated outputs), its location solved so the clipped mean is `mean_tokens`.
  * Rollout: engines of `gpus_per_engine` GPUs, each decoding up to `engine_concurrency`
    sequences. `engine_batching="continuous"` (SGLang): each sequence decodes at
    `decode_tokens_per_s` tokens/s and requests wait FIFO for a free slot. "static" (the
    embedded engine's batcher): an engine runs one batch at a time, made of the requests
    waiting when it starts; every row steps until the batch's longest output is done, and
    the batch's row-tokens are decoded at `engine_tokens_per_s` (compute-bound, as on CPU).
    Prefill time and KV-cache pressure below the concurrency cap are ignored.
  * Training: data-parallel replicas of `train_gpus_per_replica` GPUs running rounds of the
    scheduler in lockstep; a round lasts its largest micro-batch's tokens (sequences packed
    into one row, what the trainer computes) / the replica's rate (linear in tokens: the
    long-context attention cost is folded into the rate).
  * Placement: colocated by default (every GPU hosts an engine and trains, as MarsRL runs):
    decoding keeps priority and training gets the GPU share it leaves (`colocated_decode_floor`
    whenever anything decodes, plus the busy share: of the slots, or of the engines running a
    static batch), so overlap only fills the rollout's tail; both states are assumed to fit in
    memory (lower `engine_concurrency` for a smaller KV cache). With `engine_gpus` set, only those GPUs host engines (all GPUs train). With
    `rollout_gpus` set, those GPUs only generate and the others only train.
  * A trajectory continues after a Verifier stage with probability `continue_fraction` (the
    Corrector only gets verifier outputs that flagged an error).
  * Segment rollout applies to the pipeline modes; samples of a segmented output count under
    the version of the step they finish in (older segments are off-policy: masked or
    importance-corrected by the trainer), matching the scheduler's one-version rule.
Deterministic for a given `seed`. Pure Python (stdlib random), no torch.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

from megatron_marsrl.rl.scheduler import MicroBatchScheduler, SchedulerConfig, SeqItem

MODES = ("sync", "pipeline", "pipeline+overlap")
ENGINE_BATCHING = ("continuous", "static")


@dataclass(kw_only=True)
class SimConfig:
    """A cluster, a model's speeds and a MarsRL recipe. Defaults: 64 x H100 training
    Qwen3-30B-A3B-Thinking with the MarsRL recipe (sources in each field's note)."""

    seed: int = 0
    """Seeds output lengths and trajectory continuation."""
    measured_steps: int = 8
    """RL steps measured per mode (figures are medians or totals over them)."""
    warmup_steps: int | None = None
    """Pipeline steps run before measuring, while the pipeline fills. None: the longest a
    trajectory can stay open, max_stages x ceil(max_tokens / segment_tokens), after which the
    open trajectories are in their steady state. Sync steps need none (all are alike)."""
    problems_per_step: int = 128
    """New problems per step (MarsRL: 128 prompts x 8 responses per step)."""
    group_size: int = 8
    """Samples per same-input group, G (MarsRL: 8)."""
    inputs_per_stage: int = 2
    """Outputs of a stage that become inputs of the next, k (MarsRL: 2); each is a group."""
    max_stages: int = 5
    """Agent stages per trajectory, S (MarsRL training: Solver, V1, C1, V2, C2)."""
    continue_fraction: float = 0.8
    """Share of trajectories going on after a Verifier stage (some verifier output flagged an
    error). Our assumption; MarsRL gives no figure."""
    mean_tokens: float = 20000
    """Mean output length in tokens (MarsRL-like long reasoning; our estimate)."""
    max_tokens: int = 65536
    """Output cap (MarsRL samples up to 64k new tokens)."""
    length_sigma: float = 1.0
    """Lognormal shape; 1.0 with the defaults truncates about 6% of outputs at max_tokens;
    0 gives every output exactly mean_tokens."""
    prompt_tokens: int = 2048
    """Prompt tokens per sample, trained with the response (verifier/corrector inputs carry a
    solution and a report, the Solver's far less; an average)."""
    segment_tokens: int | None = 16384
    """Segment rollout in the pipeline modes: at most this many tokens per output and step
    (MarsRL: 64k = 4 x 16k); None generates whole outputs."""
    num_gpus: int = 64
    """GPUs in the cluster (8 nodes of 8 x H100)."""
    rollout_gpus: int | None = None
    """None: colocated, every GPU hosts an engine and trains (MarsRL's set-up). A number: those
    GPUs only generate and the others only train (40 of 64 roughly balances the work)."""
    engine_gpus: int | None = None
    """Colocated only: the GPUs that host an engine (each of them also trains; the rest only
    train). None: every GPU."""
    gpus_per_engine: int = 4
    """GPUs per SGLang engine (Qwen3-30B-A3B bf16 weights, ~61 GB, plus KV cache)."""
    engine_concurrency: int = 128
    """Sequences one engine decodes at once (~2M tokens of KV cache per 4 x H100 engine at
    96 KiB per token, over ~15k tokens of average context)."""
    decode_tokens_per_s: float = 50.0
    """Decode speed of one sequence at full concurrency (3B active parameters; memory-bound
    steps of ~20 ms reading weights and long KV caches): ~1600 tokens/s per GPU."""
    engine_batching: str = "continuous"
    """"continuous": SGLang's scheduler (slots that free and refill one sequence at a time);
    "static": one batch at a time, each lasting its longest output (the embedded engine)."""
    engine_tokens_per_s: float = 10000.0
    """Static batching only: tokens/s one engine decodes over a batch's rows (finished rows
    keep stepping until the batch ends, so a batch of n rows whose longest output is L takes
    n x L / engine_tokens_per_s)."""
    train_gpus_per_replica: int = 8
    """GPUs per data-parallel training replica (EP=8 inside a node)."""
    train_tokens_per_s_per_gpu: float = 4000.0
    """Training throughput: ~6e10 FLOP per token (forward+backward of 3.3B active parameters,
    causal attention at ~20k context, plus the log-prob forward) at ~250 TFLOP/s per H100."""
    token_budget: int = 65536
    """Scheduler micro-batch budget in tokens (one max-length output)."""
    weight_sync_s: float = 20.0
    """Optimizer step plus weight sync to the engines, per step (our estimate)."""
    colocated_decode_floor: float = 0.25
    """Colocated only: share of the GPUs that decoding takes whenever any sequence decodes (the
    weights are read at every decode step, ~5 of a ~20 ms full-batch step); the rest grows with
    the busy slots (static batching: the engines running a batch). Training gets what decoding
    leaves (decoding keeps priority)."""
    separate_policies: bool = False
    """One policy per role (rounds of one policy each) instead of one shared model."""

    def __post_init__(self) -> None:
        for name in ("measured_steps", "problems_per_step", "group_size", "inputs_per_stage", "max_stages", "max_tokens", "num_gpus", "gpus_per_engine", "engine_concurrency", "train_gpus_per_replica",
                     "token_budget"):
            _positive_int(name, getattr(self, name))
        if self.engine_batching not in ENGINE_BATCHING:
            raise ValueError(f"engine_batching={self.engine_batching!r}: use one of {', '.join(ENGINE_BATCHING)}")
        for name in ("decode_tokens_per_s", "engine_tokens_per_s", "train_tokens_per_s_per_gpu"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be > 0")
        if self.warmup_steps is not None and (not isinstance(self.warmup_steps, int) or self.warmup_steps < 0):
            raise ValueError(f"warmup_steps={self.warmup_steps!r}: must be an integer >= 0 or None")
        for name in ("continue_fraction", "colocated_decode_floor"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: must be within [0, 1]")
        if self.prompt_tokens < 0 or self.weight_sync_s < 0:
            raise ValueError("prompt_tokens and weight_sync_s must be >= 0")
        if self.segment_tokens is not None:
            _positive_int("segment_tokens", self.segment_tokens)
        self.length_model()  # validates the length distribution
        self._check_placement()

    def _check_placement(self) -> None:
        gen, train = self.generation_gpus, self.training_gpus
        if self.rollout_gpus is not None and not 0 < self.rollout_gpus < self.num_gpus:
            raise ValueError(f"rollout_gpus={self.rollout_gpus}: must be between 1 and num_gpus-1={self.num_gpus - 1} "
                             f"(None colocates rollout and training)")
        if self.engine_gpus is not None and (not self.colocated or not 0 < self.engine_gpus <= self.num_gpus):
            raise ValueError(f"engine_gpus={self.engine_gpus}: only for colocated placements (rollout_gpus=None), "
                             f"between 1 and num_gpus={self.num_gpus}")
        if gen % self.gpus_per_engine:
            raise ValueError(f"{gen} rollout GPUs are not a multiple of gpus_per_engine={self.gpus_per_engine}")
        if train % self.train_gpus_per_replica:
            raise ValueError(f"{train} training GPUs are not a multiple of "
                             f"train_gpus_per_replica={self.train_gpus_per_replica}")

    @property
    def colocated(self) -> bool:
        return self.rollout_gpus is None

    @property
    def generation_gpus(self) -> int:
        if self.colocated:
            return self.num_gpus if self.engine_gpus is None else self.engine_gpus
        return self.rollout_gpus

    @property
    def training_gpus(self) -> int:
        return self.num_gpus if self.colocated else self.num_gpus - self.rollout_gpus

    @property
    def rollout_slots(self) -> int:
        """Sequences the whole rollout decodes at once."""
        return self.generation_gpus // self.gpus_per_engine * self.engine_concurrency

    @property
    def rollout_tokens_per_s(self) -> float:
        """Tokens/s the whole rollout decodes when every engine is busy."""
        if self.engine_batching == "static":
            return self.generation_gpus // self.gpus_per_engine * self.engine_tokens_per_s
        return self.rollout_slots * self.decode_tokens_per_s

    @property
    def pipeline_warmup_steps(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        segments = 1 if self.segment_tokens is None else math.ceil(self.max_tokens / self.segment_tokens)
        return self.max_stages * segments

    @property
    def dp_size(self) -> int:
        return self.training_gpus // self.train_gpus_per_replica

    def length_model(self) -> LengthModel:
        return LengthModel(mean_tokens=self.mean_tokens, max_tokens=self.max_tokens, sigma=self.length_sigma)


@dataclass(frozen=True, kw_only=True)
class LengthModel:
    """Output lengths: lognormal(mu, sigma) rounded and clipped to [1, max_tokens], mu solved
    so that the clipped mean is mean_tokens."""

    mean_tokens: float
    """Target mean of the clipped lengths."""
    max_tokens: int
    """Clip (the generation limit)."""
    sigma: float
    """Lognormal shape; 0: every length is mean_tokens."""
    mu: float = field(init=False)
    """Location, solved in __post_init__."""

    def __post_init__(self) -> None:
        if self.sigma < 0:
            raise ValueError(f"length_sigma={self.sigma}: must be >= 0")
        if self.mean_tokens < 1:
            raise ValueError(f"mean_tokens={self.mean_tokens}: must be >= 1 (outputs have at least one token)")
        if self.mean_tokens > self.max_tokens or (self.sigma > 0 and self.mean_tokens >= self.max_tokens):
            raise ValueError(f"mean_tokens={self.mean_tokens} must be below max_tokens={self.max_tokens} "
                             f"(equal only with length_sigma=0)")
        object.__setattr__(self, "mu", self._solve_mu())

    def clipped_mean(self, mu: float) -> float:
        s, log_cap = self.sigma, math.log(self.max_tokens)
        below = math.exp(mu + s * s / 2) * _phi((log_cap - mu - s * s) / s)
        return below + self.max_tokens * (1.0 - _phi((log_cap - mu) / s))

    def _solve_mu(self) -> float:
        if self.sigma == 0:
            return math.log(self.mean_tokens)
        lo, hi = math.log(self.mean_tokens) - 10 * self.sigma * self.sigma - 10, math.log(self.max_tokens) + 10
        for _ in range(200):  # the clipped mean grows with mu
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.clipped_mean(mid) < self.mean_tokens else (lo, mid)
        return (lo + hi) / 2

    def decoding_context(self) -> float:
        """Mean tokens in the KV cache of a decoding sequence, weighted by time (its response
        so far; add the prompt): E[L^2] / (2 E[L]) over the clipped lengths L. Long outputs
        dominate it: they decode the longest, holding the most."""
        if self.sigma == 0:
            return self.mean_tokens / 2
        s, cap = self.sigma, self.max_tokens
        below = math.exp(2 * self.mu + 2 * s * s) * _phi((math.log(cap) - self.mu - 2 * s * s) / s)
        return (below + cap * cap * (1.0 - _phi((math.log(cap) - self.mu) / s))) / (2 * self.mean_tokens)

    def truncated_fraction(self) -> float:
        """Share of outputs that hit max_tokens."""
        if self.sigma == 0:
            return float(self.mean_tokens >= self.max_tokens)
        return 1.0 - _phi((math.log(self.max_tokens) - self.mu) / self.sigma)

    @classmethod
    def fit(cls, *, mean_tokens: float, max_tokens: int, truncated_fraction: float) -> LengthModel:
        """The model with this clipped mean that truncates this share of the outputs (as
        measured): the shape is searched on a grid of 0.01 steps up to 6, the closest wins.
        Outputs that never hit the cap fit no lognormal shape: the narrowest (0.01) is used."""
        if not 0.0 <= truncated_fraction <= 1.0:
            raise ValueError(f"truncated_fraction={truncated_fraction}: must be within [0, 1]")
        mean_tokens = min(mean_tokens, max_tokens)
        if mean_tokens >= max_tokens:
            return cls(mean_tokens=max_tokens, max_tokens=max_tokens, sigma=0.0)
        fits = (cls(mean_tokens=mean_tokens, max_tokens=max_tokens, sigma=k / 100) for k in range(1, 601))
        return min(fits, key=lambda m: abs(m.truncated_fraction() - truncated_fraction))

    def sample(self, rng: random.Random) -> int:
        return min(self.max_tokens, max(1, round(rng.lognormvariate(self.mu, self.sigma))))


@dataclass(kw_only=True)
class ModeResult:
    """Measured figures of one mode over the steps after warm-up."""

    mode: str
    """"sync", "pipeline" or "pipeline+overlap"."""
    step_s: list[float]
    """Every measured step's time in seconds."""
    rollout_s: list[float]
    """Every measured step's rollout time (until its last sample is generated)."""
    median_step_s: float
    """Median step time."""
    median_rollout_s: float
    """Median time until the step's last sample is generated."""
    samples_per_s: float
    """Trained samples per second (all measured samples / all measured time)."""
    tokens_per_step: float
    """Mean trained tokens (prompt + response) per step."""
    train_idle_fraction: float
    """Share of training GPU-time not training (waiting for data, lockstep, weight sync)."""
    rollout_idle_fraction: float
    """Share of the rollout's decode capacity unused (tails, padded rows of static batches,
    training phases, weight sync)."""
    overlapped_rounds_fraction: float
    """Share of training rounds released while the rollout still ran."""


@dataclass(kw_only=True)
class SimResult:
    """Every mode's figures and the projected speed-ups."""

    config: SimConfig
    """The simulated configuration."""
    modes: dict[str, ModeResult]
    """Figures per mode, in MODES order."""

    @property
    def speedup(self) -> dict[str, float]:
        """Sync median step time / each mode's median step time."""
        base = self.modes["sync"].median_step_s
        return {name: base / row.median_step_s for name, row in self.modes.items()}

    def to_dict(self) -> dict:
        lengths = self.config.length_model()
        return {"config": dataclasses.asdict(self.config),
                "derived": {"rollout_slots": self.config.rollout_slots, "dp_size": self.config.dp_size,
                            "length_mu": lengths.mu, "truncated_fraction": lengths.truncated_fraction()},
                "modes": {name: dataclasses.asdict(row) for name, row in self.modes.items()},
                "speedup": self.speedup}


def simulate(config: SimConfig, modes: tuple[str, ...] = MODES) -> SimResult:
    """Simulate and measure `modes` (default all); deterministic for config.seed."""
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"modes {sorted(unknown)}: use {', '.join(MODES)}")
    return SimResult(config=config, modes={mode: _simulate_mode(config, mode) for mode in MODES if mode in modes})


# ---- the model ---------------------------------------------------------------------------

@dataclass(eq=False, kw_only=True)
class _Trajectory:
    """One problem's trajectory; `left` holds the tokens its current stage still generates."""

    tid: int
    stage: int = -1
    lengths: list[list[int]] = field(default_factory=list)
    left: list[list[int]] = field(default_factory=list)
    groups_left: int = 0

    def advance(self, cfg: SimConfig, lengths: LengthModel, rng: random.Random) -> bool:
        """Draw the next stage's groups; False when the trajectory ends."""
        nxt = self.stage + 1
        after_verifier = self.stage > 0 and self.stage % 2 == 1
        if nxt >= cfg.max_stages or (after_verifier and rng.random() >= cfg.continue_fraction):
            return False
        n_groups = 1 if nxt == 0 else cfg.inputs_per_stage
        self.stage = nxt
        self.lengths = [[lengths.sample(rng) for _ in range(cfg.group_size)] for _ in range(n_groups)]
        self.left = [list(g) for g in self.lengths]
        self.groups_left = n_groups
        return True

    def items(self, cfg: SimConfig, g: int, version: int) -> list[SeqItem]:
        role = "solver" if self.stage == 0 else ("verifier" if self.stage % 2 else "corrector")
        policy = role if cfg.separate_policies else "shared"
        gid = f"{self.tid}/{self.stage}/{g}"
        return [SeqItem(key=f"{gid}/{i}", policy=policy, num_tokens=cfg.prompt_tokens + n, version=version,
                        group_id=gid) for i, n in enumerate(self.lengths[g])]


@dataclass(kw_only=True)
class _Step:
    """One simulated step: its rollout (end, tokens decoded, when rounds were released, the
    busy share of the rollout capacity over time as change points), then its training and
    total time."""

    end: float = 0.0
    decoded: int = 0
    releases: list[tuple[float, list]] = field(default_factory=list)
    busy: list[tuple[float, float]] = field(default_factory=list)
    time: float = 0.0
    samples: int = 0
    tokens: int = 0
    rounds: int = 0
    overlapped: int = 0


class _Trainer:
    """The lockstep training replicas: rounds run one after the other, FIFO, at the share of
    the GPUs that generation leaves them (piecewise constant; starts never go back in time)."""

    def __init__(self, cfg: SimConfig, rollout: _Step):
        self.rate = cfg.train_tokens_per_s_per_gpu * cfg.train_gpus_per_replica
        self.free, self.samples, self.tokens = 0.0, 0, 0
        if cfg.colocated:
            floor = cfg.colocated_decode_floor
            self.share = [(t, 1.0 - (floor + (1 - floor) * busy if busy else 0.0)) for t, busy in rollout.busy]
        else:
            self.share = [(0.0, 1.0)]
        self.share.append((rollout.end, 1.0))
        self._at = 0

    def run(self, rounds, now: float) -> None:
        for r in rounds:
            self.free = self._finish(max(self.free, now), r.max_tokens / self.rate)
            self.samples += len(r.items)
            self.tokens += r.num_tokens

    def _finish(self, t: float, work: float) -> float:
        """When `work` seconds of full-speed training started at `t` are done."""
        while True:
            while self._at + 1 < len(self.share) and self.share[self._at + 1][0] <= t:
                self._at += 1
            share = self.share[self._at][1]
            until = self.share[self._at + 1][0] if self._at + 1 < len(self.share) else math.inf
            if share > 0 and t + work / share <= until:
                return t + work / share
            work -= share * (until - t)
            t = until


def _generate(cfg: SimConfig, lengths: LengthModel, rng: random.Random, open_trajs: list[_Trajectory], *,
              step: int, sched: MicroBatchScheduler, chain: bool, segment: int | None) -> _Step:
    """A FIFO multi-slot rollout over `open_trajs`' current stages; complete groups go to the
    scheduler as they finish. `chain` runs whole trajectories (sync mode)."""
    out = _Step()
    waiting: deque = deque((t, g, i) for t in open_trajs for g, row in enumerate(t.left)
                           for i, n in enumerate(row) if n)

    def decoded(traj: _Trajectory, g: int, i: int, n: int, now: float) -> None:
        """`n` more tokens of one sample are out at `now`: hand over its group once complete."""
        out.decoded += n
        traj.left[g][i] -= n
        if traj.left[g][i] or any(traj.left[g]):
            return
        sched.add_group(traj.items(cfg, g, step))
        out.releases.append((now, sched.pop_ready()))
        traj.groups_left -= 1
        if chain and traj.groups_left == 0 and traj.advance(cfg, lengths, rng):
            waiting.extend((traj, g2, i2) for g2, row in enumerate(traj.left) for i2 in range(len(row)))

    def start(traj: _Trajectory, g: int, i: int) -> tuple:
        return traj, g, i, traj.left[g][i] if segment is None else min(segment, traj.left[g][i])

    now, order = 0.0, 0
    running: list = []  # heap of (end, order, [samples]): sequences (continuous) or batches (static)
    static = cfg.engine_batching == "static"
    capacity = cfg.generation_gpus // cfg.gpus_per_engine if static else cfg.rollout_slots
    while waiting or running:
        while waiting and len(running) < capacity:
            if static:
                batch = [start(*waiting.popleft()) for _ in range(min(len(waiting), cfg.engine_concurrency))]
                end = now + len(batch) * max(n for *_, n in batch) / cfg.engine_tokens_per_s
            else:
                batch = [start(*waiting.popleft())]
                end = now + batch[0][3] / cfg.decode_tokens_per_s
            heapq.heappush(running, (end, order, batch))
            order += 1
        out.busy.append((now, len(running) / capacity))
        now, _, batch = heapq.heappop(running)
        for sample in batch:
            decoded(*sample, now)
    out.end = now
    return out


def _run_step(cfg: SimConfig, lengths: LengthModel, rng: random.Random, open_trajs: list[_Trajectory], *,
              step: int, sched: MicroBatchScheduler, chain: bool, segment: int | None) -> _Step:
    """One step: the rollout, then the training rounds it released (in time order), then the
    optimizer step and weight sync."""
    sched.begin_step(step, version=step)
    result = _generate(cfg, lengths, rng, open_trajs, step=step, sched=sched, chain=chain, segment=segment)
    result.releases.append((result.end, sched.finish_step()))
    trainer = _Trainer(cfg, result)
    for now, rounds in result.releases:
        trainer.run(rounds, now)
    report = sched.report()
    result.time = max(result.end, trainer.free) + cfg.weight_sync_s
    result.samples, result.tokens = trainer.samples, trainer.tokens
    result.rounds, result.overlapped = report.rounds, report.rounds_overlapped
    result.releases, result.busy = [], []  # only the figures are kept
    return result


def _simulate_mode(cfg: SimConfig, mode: str) -> ModeResult:
    rng, lengths = random.Random(cfg.seed), cfg.length_model()
    overlap = mode == "pipeline+overlap"
    policies = ("solver", "verifier", "corrector") if cfg.separate_policies else ("shared",)
    sched = MicroBatchScheduler(SchedulerConfig(token_budget=cfg.token_budget, overlap=overlap),
                                dp_size=cfg.dp_size, policies=policies)
    warmup = 0 if mode == "sync" else cfg.pipeline_warmup_steps
    open_trajs: list[_Trajectory] = []
    stats, next_tid = [], 0
    for step in range(warmup + cfg.measured_steps):
        new = [_Trajectory(tid=next_tid + j) for j in range(cfg.problems_per_step)]
        next_tid += len(new)
        for traj in new:
            traj.advance(cfg, lengths, rng)
        if mode == "sync":
            stats.append(_run_step(cfg, lengths, rng, new, step=step, sched=sched, chain=True, segment=None))
            continue
        open_trajs += new
        stats.append(_run_step(cfg, lengths, rng, open_trajs, step=step, sched=sched, chain=False,
                               segment=cfg.segment_tokens))
        open_trajs = [t for t in open_trajs if t.groups_left or t.advance(cfg, lengths, rng)]
    return _summarise(cfg, mode, stats[warmup:])


def _summarise(cfg: SimConfig, mode: str, stats: list[_Step]) -> ModeResult:
    total = sum(s.time for s in stats)
    train_capacity = cfg.train_tokens_per_s_per_gpu * cfg.training_gpus * total
    rollout_capacity = cfg.rollout_tokens_per_s * total
    return ModeResult(mode=mode, step_s=[s.time for s in stats], rollout_s=[s.end for s in stats],
                      median_step_s=statistics.median(s.time for s in stats),
                      median_rollout_s=statistics.median(s.end for s in stats),
                      samples_per_s=sum(s.samples for s in stats) / total,
                      tokens_per_step=sum(s.tokens for s in stats) / len(stats),
                      train_idle_fraction=1.0 - sum(s.tokens for s in stats) / train_capacity,
                      rollout_idle_fraction=1.0 - sum(s.decoded for s in stats) / rollout_capacity,
                      overlapped_rounds_fraction=sum(s.overlapped for s in stats) / max(1, sum(s.rounds for s in stats)))


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer")


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
