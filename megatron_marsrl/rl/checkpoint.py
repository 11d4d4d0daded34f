"""Run checkpoints: every policy's model and optimizer plus the trainer state, saved atomically.

Layout under the run directory:

    checkpoints/step_000010/policy_shared/    Megatron torch_dist (model + optimizer), any layout
    checkpoints/step_000010/trainer_state.json  step, data position, in-flight stage inputs, ...
    checkpoints/step_000010/rng.pt            rank 0's Python / NumPy / torch RNG states

A checkpoint is written into a hidden ".step_N.partial" directory and renamed when complete,
so a run killed at any moment (SIGKILL included) never leaves a half-written checkpoint that
`latest` would pick; partial directories are removed by the next save.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from megatron_marsrl.megatron.dist_checkpoint import _barrier, _rank

STATE_FILE = "trainer_state.json"
PREFIX = "step_"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    """Renamed into place (the state file is written before the rename)."""
    return path.name.startswith(PREFIX) and (path / STATE_FILE).is_file()


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    root = checkpoints_dir(run_dir)
    done = sorted(p for p in root.glob(f"{PREFIX}*") if is_complete(p)) if root.is_dir() else []
    return done[-1] if done else None


def save(run_dir: str | Path, step: int, actors: dict, state: dict, *, keep: int) -> Path:
    """Collective: every rank writes its shards; rank 0 writes the state and renames."""
    root = checkpoints_dir(run_dir)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".{final.name}.partial"
    if _rank() == 0:
        for stale in [*root.glob(".*.partial"), *root.glob(".*.old")]:
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    for name, actor in actors.items():
        actor.save(tmp / f"policy_{name}", {"step": step})
    if _rank() == 0:
        torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state()}, tmp / "rng.pt")
        (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=1))
        if final.exists():  # same step saved again (a redo save): never be without one complete copy
            old = root / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        for old in sorted(p for p in root.glob(f"{PREFIX}*") if is_complete(p))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(path: str | Path, actors: dict) -> dict:
    """Collective: load every policy and return the trainer state (RNG restored on rank 0)."""
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    missing = [n for n in actors if not (path / f"policy_{n}").is_dir()]
    if missing:
        raise ValueError(f"{path} has no checkpoint of policies {missing}; it was saved with "
                         f"{sorted(p.name[7:] for p in path.glob('policy_*'))} (policy.sharing changed?)")
    for name, actor in actors.items():
        actor.load(path / f"policy_{name}")
    if _rank() == 0 and (path / "rng.pt").is_file():
        rng = torch.load(path / "rng.pt", weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
    return json.loads((path / STATE_FILE).read_text())
