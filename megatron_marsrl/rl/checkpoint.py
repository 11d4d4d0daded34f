"""Run checkpoints: every policy's model and optimizer plus the trainer state, saved atomically.

Layout under the run directory:

    checkpoints/step_000010/policy_shared/    Megatron torch_dist (model + optimizer), any layout
    checkpoints/step_000010/trainer_state.json  step, data position, in-flight stage inputs, ...
    checkpoints/step_000010/rng.safetensors   rank 0's Python / NumPy / torch (CUDA) RNG states

Nothing here is unpickled: RNG states are tensors plus JSON in a safetensors file, and the
rng.pt of older checkpoints is read with ``weights_only=True`` (NumPy arrays allowed, nothing
else), so a tampered run directory cannot run code on resume.

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
RNG_FILE = "rng.safetensors"
LEGACY_RNG_FILE = "rng.pt"
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
        save_rng(tmp / RNG_FILE)
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
    if _rank() == 0:
        load_rng(path)
    return json.loads((path / STATE_FILE).read_text())


def save_rng(file: Path) -> None:
    """Rank 0's RNG states as tensors (+ the few scalars as JSON metadata): no pickle."""
    from safetensors.torch import save_file

    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"python": torch.tensor(mt, dtype=torch.int64), "numpy": torch.from_numpy(keys.astype(np.int64)),
               "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors.update({f"cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    scalars = {"python": [version, gauss], "numpy": [kind, int(pos), int(has_gauss), float(cached)]}
    save_file(tensors, str(file), metadata={"scalars": json.dumps(scalars)})


def load_rng(path: Path) -> None:
    """Restore the RNG states saved with a checkpoint (nothing when it has none)."""
    if (path / RNG_FILE).is_file():
        from safetensors import safe_open

        with safe_open(str(path / RNG_FILE), framework="pt") as f:
            scalars = json.loads(f.metadata()["scalars"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        random.setstate((scalars["python"][0], tuple(tensors["python"].tolist()), scalars["python"][1]))
        kind, pos, has_gauss, cached = scalars["numpy"]
        np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(tensors["torch"])
        cuda = [tensors[f"cuda_{i}"] for i in range(sum(k.startswith("cuda_") for k in tensors))]
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    elif (path / LEGACY_RNG_FILE).is_file():
        rng = _load_legacy_rng(path / LEGACY_RNG_FILE)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])


def _load_legacy_rng(file: Path) -> dict:
    """rng.pt of checkpoints saved before rng.safetensors: a pickle of tuples, NumPy arrays and
    a tensor, read with weights_only=True and only NumPy's array reconstruction allowed."""
    import pickle

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import _reconstruct
    allowed = [_reconstruct, (_reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype,
               type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(file, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{file}: cannot be read safely (it holds more than RNG states: {exc}). Delete it to "
                         "resume without restoring the RNG state, or resume from another checkpoint") from exc
