"""TensorBoard scalars, a JSONL metrics log and the console progress bar (rank 0 only)."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)

KEY_FIGURES = {"rollout/solver/reward_mean": "solver", "rollout/verifier/reward_mean": "verifier",
               "rollout/corrector/reward_mean": "corrector", "time/step": "s/step"}


class Observer:
    """Writes every finite scalar of a step to TensorBoard (run_dir/tensorboard) and to
    run_dir/metrics.jsonl, and shows the key figures on a progress bar."""

    def __init__(self, run_dir: str | Path, *, total_steps: int, start_step: int, progress: bool):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(run_dir) / "tensorboard"
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
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="marsrl train", unit="step",
                            dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        scalars = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and math.isfinite(float(v))}
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()
        self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self.jsonl.flush()
        if self.bar is not None and not any(k.startswith("eval/") for k in scalars):
            self.bar.set_postfix({short: f"{scalars[k]:.3g}" for k, short in KEY_FIGURES.items() if k in scalars},
                                 refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.writer.close()
        self.jsonl.close()


def set_aside_old_logs(run_dir: str | Path) -> list[Path]:
    """A run starting at step 0 in a directory that already has logs (an earlier attempt that
    stopped before its first checkpoint, or --resume without one) starts fresh ones: the old
    metrics.jsonl and tensorboard/ are renamed to metrics.<n>.jsonl and tensorboard.<n>/, the
    way config.json is kept as config.<n>.json, so two runs' steps never mix."""
    run_dir = Path(run_dir)
    moved = []
    for name, pattern in (("metrics.jsonl", "metrics.{}.jsonl"), ("tensorboard", "tensorboard.{}")):
        old = run_dir / name
        if old.is_file() or (old.is_dir() and any(old.iterdir())):
            n = 1
            while (run_dir / pattern.format(n)).exists():
                n += 1
            old.rename(run_dir / pattern.format(n))
            moved.append(run_dir / pattern.format(n))
            log.warning("%s holds logs of an earlier attempt without a checkpoint: kept as %s", run_dir, moved[-1].name)
    return moved
