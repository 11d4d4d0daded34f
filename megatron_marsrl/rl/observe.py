"""TensorBoard scalars, a JSONL metrics log and the console (rank 0 only): a progress bar,
one summary line per step and per evaluation, and the end-of-run results table."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

from megatron_marsrl.rl.console import terminal

log = logging.getLogger(__name__)

KEY_FIGURES = {"rollout/solver/reward_mean": "solver", "rollout/verifier/reward_mean": "verifier",
               "rollout/corrector/reward_mean": "corrector", "time/step": "s/step"}
# The per-step summary line: rewards, then the update, then the time.
STEP_FIGURES = {"rollout/solver/reward_mean": "solver", "rollout/verifier/reward_mean": "verifier",
                "rollout/corrector/reward_mean": "corrector", "train/loss": "loss", "shared/grad_norm": "grad_norm",
                "time/step": "s"}
# The results table's last-step figures (held-out evaluation rows come from the eval/ keys).
FINAL_FIGURES = {"rollout/solver/reward_mean": "solver reward_mean", "rollout/solver/accuracy": "solver accuracy",
                 "rollout/verifier/reward_mean": "verifier reward_mean",
                 "rollout/verifier/accuracy": "verifier accuracy",
                 "rollout/corrector/reward_mean": "corrector reward_mean",
                 "rollout/corrector/accuracy": "corrector accuracy", "train/loss": "train loss",
                 "shared/grad_norm": "grad norm", "time/step": "seconds per step",
                 "throughput/rollout_tokens_per_s": "rollout tokens/s"}
ROLE_ORDER = ("solver", "verifier", "corrector")
EVAL_ORDER = ("reward_mean", "accuracy")


class Observer:
    """Writes every finite scalar of a step to TensorBoard (run_dir/tensorboard) and to
    run_dir/metrics.jsonl, and shows the key figures on the console (rl/console.py)."""

    def __init__(self, run_dir: str | Path, *, total_steps: int, start_step: int, progress: bool,
                 quiet: bool = False):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "tensorboard"
        path = Path(run_dir) / "metrics.jsonl"
        if not start_step:
            set_aside_old_logs(run_dir)
        # A resumed run redoes the steps after its checkpoint: drop what an earlier attempt
        # logged for them, so each step appears once.
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=start_step + 1 if start_step else None)
        if start_step and path.is_file():
            kept = [line for line in path.read_text().splitlines() if json.loads(line).get("step", 0) <= start_step]
            path.write_text("".join(f"{line}\n" for line in kept))
        self.jsonl = path.open("a")
        self.bar = None
        if progress and terminal().isatty():  # in a file or pipe the step lines say it all
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="marsrl train", unit="step",
                            dynamic_ncols=True, file=terminal())
        self.total_steps = total_steps
        self.quiet = quiet
        """No console lines (a warm start inside `marsrl train` logs to its files only)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        scalars = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and math.isfinite(float(v))}
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()
        self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self.jsonl.flush()
        if any(k.startswith("eval/") for k in scalars):
            self._say(eval_line(step, scalars))
            return
        self._say(step_line(step, self.total_steps, scalars))
        if self.bar is not None:
            self.bar.set_postfix({short: f"{scalars[k]:.3g}" for k, short in KEY_FIGURES.items() if k in scalars},
                                 refresh=False)
            self.bar.update(1)

    def save_rollouts(self, step: int, samples) -> Path:
        """The step's samples as JSON lines in run_dir/rollouts/step_NNNNNN.jsonl (a redone step
        replaces its file)."""
        path = self.run_dir / "rollouts" / f"step_{step:06d}.jsonl"
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps(sample_record(s)) + "\n" for s in samples))
        return path

    def _say(self, line: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(line, file=terminal())
        else:
            print(line, file=terminal(), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.writer.close()
        self.jsonl.close()


def sample_record(sample) -> dict:
    """A Sample as JSON-ready fields; metadata keeps its JSON values (the parent's reward, the
    tokens' weight versions), not the MoE routing record."""
    record = dataclasses.asdict(sample)
    record["parse_status"] = sample.parse_status.value
    record["metadata"] = {k: v for k, v in sample.metadata.items() if k != "routed_experts"}
    return record


def step_line(step: int, total: int, scalars: dict[str, float]) -> str:
    """``step 12/60  solver -0.312  verifier 0.125  ...  s 1.23``."""
    figures = "  ".join(f"{short} {scalars[k]:.3g}" for k, short in STEP_FIGURES.items() if k in scalars)
    return f"step {step}/{total}  {figures}"


def eval_line(step: int, scalars: dict[str, float]) -> str:
    """``eval @ step 30  solver reward -0.1 acc 0.02 [0, 0.06]  verifier ...`` (the accuracy's 95%
    interval where one was logged)."""
    def accuracy(role: str) -> str:
        key = f"eval/{role}/accuracy"
        if key not in scalars:
            return ""
        interval = (f" [{scalars[key + '/ci_low']:.3g}, {scalars[key + '/ci_high']:.3g}]"
                    if key + "/ci_low" in scalars and key + "/ci_high" in scalars else "")
        return f" acc {scalars[key]:.3g}{interval}"

    parts = [f"{role} reward {scalars[f'eval/{role}/reward_mean']:.3g}{accuracy(role)}"
             for role in ROLE_ORDER if f"eval/{role}/reward_mean" in scalars]
    if "eval/loss" in scalars:  # marsrl sft
        parts.append(f"loss {scalars['eval/loss']:.4g}")
    return f"eval @ step {step}  " + "  ".join(parts)


def results_table(run_dir: str | Path) -> str:
    """The end-of-run table from run_dir/metrics.jsonl: held-out evaluation at the first and
    the last evaluated step (when the run evaluates), each figure with its 95% interval where
    the run logged one, then the last step's key figures."""
    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    steps = [r for r in records if "time/step" in r]
    lines = []
    if evals:
        cols = [evals[0], evals[-1]] if len(evals) > 1 else evals[:1]
        lines.append(_row("held-out evaluation (95% interval)", [f"step {r['step']}" for r in cols]))
        figures = {k for r in cols for k in r if k.startswith("eval/") and not k.endswith(CI_SUFFIXES)}
        for key in sorted(figures, key=_eval_order):
            _, role, name = key.split("/", 2)
            lines.append(_row(f"  {role} {name}", [_with_interval(r, key) for r in cols]))
    if steps:
        last = steps[-1]
        lines.append(_row(f"last step ({last['step']})", []))
        lines += [_row(f"  {label}", [_num(last[k])]) for k, label in FINAL_FIGURES.items() if k in last]
    return "\n".join(lines)


CI_SUFFIXES = ("/ci_low", "/ci_high")
"""Where a logged figure keeps its 95% interval: ``key/ci_low``, ``key/ci_high``."""

HELD_OUT_CURVES = ("eval/solver/accuracy", "eval/verifier/balanced_accuracy", "eval/corrector/fix_rate",
                   "eval/system/accuracy", "eval/system/solver_accuracy")
"""The held-out figures drawn by `plot_held_out` (those the run logged)."""


def plot_held_out(run_dir: str | Path) -> Path | None:
    """run_dir/heldout.png: each `HELD_OUT_CURVES` metric over the evaluated steps, with its
    95% interval as a band; None when the run never evaluated."""
    from megatron_marsrl.rl.plot import line_chart

    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    series = {key[5:]: [(r["step"], r[key]) for r in records if key in r] for key in HELD_OUT_CURVES}
    bands = {key[5:]: [(r["step"], r[key + "/ci_low"], r[key + "/ci_high"]) for r in records
                       if key + "/ci_low" in r and key + "/ci_high" in r] for key in HELD_OUT_CURVES}
    series = {name: points for name, points in series.items() if points}
    if not series:
        return None
    return line_chart(series, Path(run_dir) / "heldout.png", title=f"held-out evaluation: {Path(run_dir).name}",
                      bands={name: band for name, band in bands.items() if band and name in series})


def _eval_order(key: str) -> tuple:
    _, role, name = key.split("/", 2)
    return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), role,
            EVAL_ORDER.index(name) if name in EVAL_ORDER else len(EVAL_ORDER), name)


def _row(label: str, cells: list[str]) -> str:
    return f"{label:<36}" + "".join(f"{c:>24}" for c in cells)


def _with_interval(record: dict, key: str) -> str:
    """``0.255 [0.21, 0.30]`` (the value alone where no interval was logged)."""
    low, high = record.get(key + "/ci_low"), record.get(key + "/ci_high")
    if record.get(key) is None or low is None or high is None:
        return _num(record.get(key))
    return f"{record[key]:.3f} [{low:.3f}, {high:.3f}]"


def _num(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def set_aside_old_logs(run_dir: str | Path) -> list[Path]:
    """A run starting at step 0 in a directory that already has logs (an earlier attempt that
    stopped before its first checkpoint, or --resume without one) starts fresh ones: the old
    metrics.jsonl, tensorboard/ and rollouts/ are renamed to metrics.<n>.jsonl, tensorboard.<n>/
    and rollouts.<n>/, the way config.json is kept as config.<n>.json, so two runs' steps never
    mix."""
    run_dir = Path(run_dir)
    moved = []
    for name, pattern in (("metrics.jsonl", "metrics.{}.jsonl"), ("tensorboard", "tensorboard.{}"),
                          ("rollouts", "rollouts.{}")):
        old = run_dir / name
        if old.is_file() or (old.is_dir() and any(old.iterdir())):
            n = 1
            while (run_dir / pattern.format(n)).exists():
                n += 1
            old.rename(run_dir / pattern.format(n))
            moved.append(run_dir / pattern.format(n))
            log.warning("%s holds logs of an earlier attempt without a checkpoint: kept as %s", run_dir, moved[-1].name)
    return moved
