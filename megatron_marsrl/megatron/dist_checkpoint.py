"""Megatron distributed checkpoints (torch_dist) with resharding to another layout.

Directory layout written by :func:`save_checkpoint`::

    CKPT/                     renamed into place only when complete
      dist/                   Megatron dist-checkpointing files: {"model": ..., "optimizer": ...}
      marsrl_checkpoint.json  HF config, the layout it was saved under, step, extra state

A directory without ``marsrl_checkpoint.json`` (written last, before the rename) is never
treated as a checkpoint. Loading under any other layout works because every tensor is stored
with its global shape and offsets (optimizer state in the "fully sharded model space" format).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_marsrl.outputs import replace

META_FILE = "marsrl_checkpoint.json"
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class CheckpointNotFoundError(FileNotFoundError):
    """The directory is missing or is not a complete marsrl checkpoint."""


class CheckpointMismatchError(ValueError):
    """The checkpoint's keys differ from the model's (a missing key is never skipped silently)."""


def is_complete(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file() and (Path(path) / "dist").is_dir()


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist")
    if not is_complete(path):
        raise CheckpointNotFoundError(
            f"{path} is not a complete marsrl checkpoint (no {META_FILE}); it may be a partial save")
    return json.loads((path / META_FILE).read_text())


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_str(value: str | None) -> str:
    holder = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    return holder[0]


def save_checkpoint(path: str | Path, model, *, optimizer=None, meta: dict,
                    extra_files: dict[str, Path] | None = None) -> None:
    """Collective save of ``model`` (and ``optimizer``) to ``path``; atomic at the end.

    ``extra_files`` maps names under ``path`` to files copied in before the final rename
    (e.g. tokenizer files)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    tmp = None
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = str(path.parent / f".{path.name}.partial-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(Path(tmp) / "dist")
    tmp = Path(_broadcast_str(tmp))
    if optimizer is not None:
        _check_optimizer_supported(optimizer)
        meta = {**meta, "optimizer": _optimizer_signature(optimizer)}
    state = _sharded_state(model, optimizer, is_loading=False)
    _in_process_write_results()
    dist_checkpointing.save(state, str(tmp / "dist"))
    _barrier()
    if _rank() == 0:
        for name, src in (extra_files or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tmp / name)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        replace(tmp, path, kind="mcore")  # never deletes a directory marsrl did not write
    _barrier()


def _in_process_write_results() -> None:
    """Megatron's torch_dist writer (FileSystemWriterAsync, megatron-core 0.19) returns each
    rank's write results through a ``multiprocessing.Manager().Queue()`` made on the first save
    from a *spawn* context: a server process and a resource tracker per rank (~600 MB resident),
    which outlive a rank that leaves without finalizers (os._exit, SIGKILL) as orphans. Our saves
    are synchronous (``dist_checkpointing.save`` writes in this process, with threads), so an
    in-process queue does the same job and no process is started. Delete when Megatron's sync
    save stops creating the Manager (filesystem_async.get_write_results_queue)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def load_checkpoint(path: str | Path, model, *, optimizer=None) -> dict:
    """Collective load into ``model`` (and ``optimizer``) of any layout; returns the meta."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    meta = read_meta(path)
    if optimizer is not None:
        _check_optimizer_supported(optimizer)
        saved, mine = meta.get("optimizer"), _optimizer_signature(optimizer)
        if saved is None:
            raise CheckpointNotFoundError(f"{path} holds no optimizer state; load the model only (optimizer=None)")
        if saved != mine:
            raise ValueError(
                f"{path}: optimizer state was saved as {saved} but this layout builds {mine}; Megatron "
                "cannot map optimizer state between these (expert parameters get their own optimizer "
                "when EP>1). Load the model only, or resume with a layout of the same kind.")
        _materialise_adam_state(optimizer)
    state = _sharded_state(model, optimizer, is_loading=True)
    # RETURN_ALL: Megatron names what this model asks for that the checkpoint lacks ("unexpected",
    # per rank) and what the checkpoint holds that no rank asked for ("missing", all ranks).
    loaded, extra, absent = dist_checkpointing.load(state, str(Path(path) / "dist"), strict=StrictHandling.RETURN_ALL)
    # strict=False only because torch would demand "_extra_state" entries (TE-style modules)
    # that Megatron stores apart; every real parameter or buffer is checked right below.
    result = _unwrap(model).load_state_dict(loaded["model"], strict=False)
    _raise_on_mismatch(path, absent=[*absent, *result.missing_keys],
                       extra=[*result.unexpected_keys, *(k for k in extra if optimizer is not None
                                                         or not _OPTIMIZER_KEY.match(k))])
    if optimizer is not None:
        if "optimizer" not in loaded:
            raise CheckpointNotFoundError(f"{path} holds no optimizer state; load without an optimizer")
        optimizer.load_state_dict(loaded["optimizer"])
    return meta


# Optimizer state in a checkpoint: "optimizer." or, with one optimizer per parameter kind (MoE
# experts under EP), "chained_<i>.optimizer.". A model-only load leaves these unread.
_OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")


def _raise_on_mismatch(path, *, absent: list[str], extra: list[str]) -> None:
    """Every rank raises the same error when any rank found a key the model needs missing from
    the checkpoint, or model keys in the checkpoint this model does not have (another model?)."""
    mine = [sorted(set(absent)), sorted(set(extra))]
    every = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    absent = sorted({k for a, _ in every for k in a})
    extra = sorted({k for _, e in every for k in e})
    if absent or extra:
        raise CheckpointMismatchError(
            f"{path} does not match this model: " + "; ".join(
                part for part in (f"missing from the checkpoint: {', '.join(absent[:20])}" if absent else "",
                                  f"in the checkpoint but not in this model: {', '.join(extra[:20])}" if extra else "")
                if part) + " (saved from another model or configuration?)")


def _materialise_adam_state(optimizer) -> None:
    """Give every parameter of a fresh torch Adam its state (step included) before loading.

    Megatron's Adam init_state_fn (optimizer/__init__.py, 0.19) creates exp_avg/exp_avg_sq but
    not "step"; with torch's own Adam (no Apex/TE, as on CPU) the distributed optimizer's
    state_dict() then fails on `assert len(steps) == 1`. Loading overwrites all of it.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                state.setdefault("step", torch.tensor(0.0))


def _optimizer_signature(optimizer) -> dict:
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return {"parts": len(subs), "distributed": any(type(s).__name__ == "DistributedOptimizer" for s in subs)}


def _check_optimizer_supported(optimizer) -> None:
    # Megatron 0.19's DistributedOptimizer checkpoints its state through code paths that assume
    # Apex/TE Adam (a per-parameter "step", fused buffers); with torch's Adam (CPU) its load
    # fails inside Megatron. Refuse clearly instead of writing a checkpoint that cannot load.
    if _optimizer_signature(optimizer)["distributed"] and not torch.cuda.is_available():
        raise NotImplementedError(
            "checkpointing the optimizer state of the distributed optimizer is not supported on CPU "
            "(megatron-core 0.19 needs Apex/TE Adam for it); use distributed_optimizer=False on CPU "
            "or save/load the model only")


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def _sharded_state(model, optimizer, *, is_loading: bool) -> dict:
    model_state = _unwrap(model).sharded_state_dict()
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                          metadata=_OPTIM_METADATA)
    return state

