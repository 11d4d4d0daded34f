"""`marsrl bench learning`: which algorithm choices make the roles better at their jobs.

Runs `marsrl train` once per (variant, seed) on a recipe (the CPU main job by default), each
variant a set of config overrides (`VARIANTS`), and reports the final held-out figures as
mean +- std over seeds, their change from the first evaluation (mean +- std, and at how many
seeds the last 95% interval clears the first), then each run's first and final figures with
their intervals: a markdown file (learning.md), a bar chart (learning.png) and one JSON record
per run (runs.jsonl), all in the output directory next to the runs themselves.

The variants of a seed start from the same warm start (the recipe's supervised fine-tuning, if
it has one): the first run of a seed trains it and the later ones get a copy, which `marsrl
train` reuses when its settings match theirs (a variant that changes them trains its own). The
table's minutes are each run's own, without the warm start it trained.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

VARIANTS: dict[str, tuple[str, ...]] = {
    # advantages: whole trajectories per step, so that every estimator sees the same groups, of
    # four stages (Solver, Verifier, Corrector, Verifier): with one call per role Dr. MAS's
    # (problem, role) groups would be AT-GRPO's (problem, turn, role) ones
    "grpo_pooled": ("pipeline.mode=sync", "rollout.max_stages=4", "advantage.estimator=grpo_pooled"),
    "drmas": ("pipeline.mode=sync", "rollout.max_stages=4", "advantage.estimator=drmas"),
    "at_grpo": ("pipeline.mode=sync", "rollout.max_stages=4", "advantage.estimator=at_grpo"),
    # which solutions later stages take as inputs
    "select_random": ("rollout.selection=random",),
    "select_balanced": ("rollout.selection=balanced",),
    "select_adaptive": ("rollout.selection=adaptive",),
    # one model for every role, or one each
    "shared": ("policy.sharing=shared",),
    "per_role": ("policy.sharing=per_role",),
    # trajectories
    "sync": ("pipeline.mode=sync",),
    "pipeline": ("pipeline.mode=pipeline",),
}
"""Built-in variants: name -> overrides on top of the recipe (and of --override)."""

GRIDS: dict[str, tuple[str, ...]] = {
    "advantages": ("grpo_pooled", "drmas", "at_grpo"),
    "selection": ("select_random", "select_balanced", "select_adaptive"),
    "policies": ("shared", "per_role"),
    "trajectories": ("sync", "pipeline"),
}
"""Named groups of variants compared with each other."""

METRICS = ("eval/solver/accuracy", "eval/verifier/balanced_accuracy", "eval/corrector/fix_rate",
           "eval/system/accuracy")
"""The final held-out figures reported."""


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """One (variant, seed) run: its final held-out figures and what it cost."""

    variant: str
    seed: int
    final: dict[str, float]
    """The last evaluation's `METRICS` (those logged), with their interval ends (``/ci_low``,
    ``/ci_high``) where the run logged them."""
    first: dict[str, float]
    """The first evaluation's (before any RL step), the same way; empty when the run logged only one."""
    seconds: float
    """The whole run's wall time."""
    warm_start_seconds: float
    """The part of it that trained a warm start (0 when it reused a copied one, or has none)."""
    run_dir: str


def variant_overrides(name: str) -> tuple[str, ...]:
    """A built-in variant's overrides, or those of "custom:key=value,key=value"."""
    if name.startswith("custom:"):
        return tuple(o for o in name[len("custom:"):].split(",") if o)
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; built-in: {', '.join(VARIANTS)} "
                         "(or custom:key=value,key=value)")
    return VARIANTS[name]


def _evals(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [r for r in records if any(k in r for k in METRICS)]


def run_dir_of(out_dir: Path, variant: str, seed: int) -> Path:
    """Where one (variant, seed) run goes."""
    return out_dir / f"{variant.replace(':', '_').replace(',', '_').replace('=', '-')}-seed{seed}"


def check_new(out_dir: Path, variants: list[str], seeds: list[int]) -> None:
    """Refuse run directories that exist already (a finished run there would be mistaken for
    this one, or refused by `marsrl train`), before anything runs."""
    taken = [str(d) for v in variants for s in seeds if (d := run_dir_of(out_dir, v, s)).exists()]
    if taken:
        raise FileExistsError(f"run directories exist already: {', '.join(taken[:3])}; choose another --output "
                              "or delete them")


def run_one(recipe: str, variant: str, seed: int, out_dir: Path, overrides: list[str], *,
            timeout: float, warm_start: Path | None = None) -> RunResult:
    """Train one (variant, seed), starting from a copy of the warm start directory `warm_start`
    if there is one (`marsrl train` decides whether it is reusable); raises RuntimeError with the
    run's output tail if it fails."""
    run_dir = run_dir_of(out_dir, variant, seed)
    if warm_start is not None and warm_start.is_dir():
        shutil.copytree(warm_start, run_dir / "warm_start")  # keeps file times: a reused one stays older
    cmd = [sys.executable, "-m", "megatron_marsrl.cli", "train", "--recipe", recipe, f"run.output_dir={run_dir}",
           f"run.seed={seed}", "run.progress=false", "run.checkpoint_every=0", *overrides,
           *variant_overrides(variant)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started_at, start = time.time(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant} seed {seed} failed (exit {proc.returncode}); log: "
                           f"{run_dir / 'train.log'}\n{(proc.stdout + proc.stderr)[-3000:]}")
    evals = _evals(run_dir)
    if not evals:
        raise RuntimeError(f"variant {variant} seed {seed} logged no held-out evaluation: the recipe needs "
                           "task.eval and run.eval_every > 0")
    pick = lambda r: {k: r[k] for m in METRICS for k in (m, m + "/ci_low", m + "/ci_high") if k in r}  # noqa: E731
    summary = run_dir / "warm_start" / "summary.json"
    trained = summary.is_file() and summary.stat().st_mtime >= started_at
    # one evaluation is no "before and after": its figures are the final ones only
    return RunResult(variant=variant, seed=seed, final=pick(evals[-1]),
                     first=pick(evals[0]) if len(evals) > 1 else {},
                     seconds=time.perf_counter() - start,
                     warm_start_seconds=json.loads(summary.read_text())["seconds"] if trained else 0.0,
                     run_dir=str(run_dir))


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, math.sqrt(var)


def _by_variant(results: list[RunResult]) -> dict[str, list[RunResult]]:
    """The runs of each variant, variants in their first run's order."""
    out: dict[str, list[RunResult]] = {}
    for r in results:
        out.setdefault(r.variant, []).append(r)
    return out


def summarize(results: list[RunResult]) -> dict[str, dict[str, tuple[float, float]]]:
    """variant -> metric -> (mean, std) over seeds of the final figures, plus "seconds" (the
    runs' own, without a warm start they trained)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for variant, mine in _by_variant(results).items():
        row = {m: mean_std([r.final[m] for r in mine if m in r.final]) for m in METRICS
               if any(m in r.final for r in mine)}
        row["seconds"] = mean_std([r.seconds - r.warm_start_seconds for r in mine])
        out[variant] = row
    return out


@dataclass(frozen=True, kw_only=True)
class Change:
    """One variant's change of one figure from its first evaluation to its last, over seeds."""

    mean: float
    std: float
    """Sample standard deviation of the seeds' changes."""
    above: int
    """Seeds whose last 95% interval lies wholly above their first one."""
    below: int
    """Seeds whose last interval lies wholly below their first one."""
    bounded: int
    """Seeds that logged both intervals (what `above` and `below` count among)."""
    seeds: int
    """Seeds that logged the figure at both evaluations."""


def changes(results: list[RunResult]) -> dict[str, dict[str, Change]]:
    """variant -> metric -> what RL changed (last evaluation minus first) over the seeds, and at
    how many seeds the two evaluations' intervals do not overlap (only runs that logged them)."""
    out: dict[str, dict[str, Change]] = {}
    for variant, mine in _by_variant(results).items():
        row = {}
        for m in METRICS:
            both = [r for r in mine if m in r.first and m in r.final]
            if not both:
                continue
            mean, std = mean_std([r.final[m] - r.first[m] for r in both])
            low, high = m + "/ci_low", m + "/ci_high"
            bounded = [r for r in both if all(k in d for d in (r.first, r.final) for k in (low, high))]
            row[m] = Change(mean=mean, std=std, seeds=len(both), bounded=len(bounded),
                            above=sum(r.final[low] > r.first[high] for r in bounded),
                            below=sum(r.final[high] < r.first[low] for r in bounded))
        out[variant] = row
    return out


def _separated(change: Change) -> str:
    if not change.bounded:
        return "no intervals"
    return f"{change.above}/{change.bounded} above, {change.below} below"


def changes_markdown(table: dict[str, dict[str, Change]]) -> str:
    """The `changes` table: mean +- std of the change, and the seeds whose intervals separate."""
    metrics = [m for m in METRICS if any(m in row for row in table.values())]
    head = ["variant", *(m[len("eval/"):] for m in metrics)]
    lines = ["Change from the first evaluation to the last, mean +- std over seeds (seeds whose last 95% "
             "interval lies wholly above / below their first):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, row in table.items():
        cells = [f"{row[m].mean:+.3f} +- {row[m].std:.3f} ({_separated(row[m])})" if m in row else "-"
                 for m in metrics]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(summary: dict[str, dict[str, tuple[float, float]]], *, seeds: list[int], command: str,
             warm_starts: Sequence[float] = ()) -> str:
    """The results table (mean +- std over the seeds), and the warm starts trained (seconds)."""
    metrics = [m for m in METRICS if any(m in row for row in summary.values())]
    head = ["variant", *(m[len("eval/"):] for m in metrics), "minutes"]
    lines = [f"`{command}`", "", f"Final held-out figures, mean +- std over seeds {seeds}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, row in summary.items():
        cells = [f"{row[m][0]:.3f} +- {row[m][1]:.3f}" if m in row else "-" for m in metrics]
        minutes = row["seconds"][0] / 60
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {minutes:.1f} |")
    if warm_starts:
        lines += ["", f"Minutes without the warm start: {len(warm_starts)} trained, "
                  f"{sum(warm_starts) / len(warm_starts) / 60:.1f} min each; the other runs reused a copy."]
    return "\n".join(lines) + "\n"


def per_run_markdown(results: Sequence[RunResult]) -> str:
    """Each run's first -> final held-out figures, each with its 95% interval where logged."""
    metrics = [m for m in METRICS if any(m in r.final for r in results)]

    def cell(figures: dict[str, float], m: str) -> str:
        if m not in figures:
            return "-"
        low, high = figures.get(m + "/ci_low"), figures.get(m + "/ci_high")
        return f"{figures[m]:.2f}" + (f" [{low:.2f}, {high:.2f}]" if low is not None and high is not None else "")

    head = ["variant", "seed", *(m[len("eval/"):] for m in metrics)]
    lines = ["Each run, first -> final evaluation (95% intervals):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        lines.append(f"| {r.variant} | {r.seed} | "
                     + " | ".join(f"{cell(r.first, m)} -> {cell(r.final, m)}" for m in metrics) + " |")
    return "\n".join(lines) + "\n"


def write_report(results: list[RunResult], out_dir: Path, *, seeds: list[int], command: str) -> str:
    """learning.md, learning.png and runs.jsonl in `out_dir`; returns the markdown."""
    from dataclasses import asdict

    from megatron_marsrl.rl.plot import bar_chart

    summary = summarize(results)
    text = markdown(summary, seeds=seeds, command=command,
                    warm_starts=[r.warm_start_seconds for r in results if r.warm_start_seconds > 0])
    text += "\n" + changes_markdown(changes(results)) + "\n" + per_run_markdown(results)
    (out_dir / "learning.md").write_text(text)
    (out_dir / "runs.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in results))
    groups = {m[len("eval/"):]: {v: row[m] for v, row in summary.items() if m in row} for m in METRICS}
    bar_chart({k: v for k, v in groups.items() if v}, out_dir / "learning.png",
              title=f"final held-out figures, mean +- std over seeds {seeds}")
    return text
