"""Megatron -> rollout engine weight sync, and the train/rollout log-prob mismatch probe.

Both are collective over the training ranks: every rank runs the export (TP/EP gathers, PP/EP
broadcasts inside export_hf_buckets) and only the rank that holds an engine applies buckets.
Memory beyond the model stays at one bucket plus one gathered tensor.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_marsrl.megatron.forward import token_logprobs
from megatron_marsrl.megatron.hf_checkpoint import export_hf_buckets
from megatron_marsrl.megatron.hf_config import ModelArch


def sync_weights(model, arch: ModelArch, engine, *, version: int, bucket_bytes: int = 256 << 20) -> dict:
    """Send the current Megatron weights to ``engine`` (None on ranks without one)."""
    start = time.perf_counter()
    nbytes = tensors = 0
    for bucket in export_hf_buckets(model, arch, bucket_bytes=bucket_bytes):
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if engine is not None:
            tensors += engine.update_weights([bucket], version=version)
    seconds = time.perf_counter() - start
    return {"bytes": nbytes, "seconds": seconds, "tensors": tensors, "gb_per_s": nbytes / max(seconds, 1e-9) / 1e9}


def _share(obj, src: int = 0):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def logprob_mismatch(model, sequences: list[list[int]] | None, engine_logprobs: list[list[float]] | None, *,
                     temperature: float = 1.0, response_starts: list[int] | None = None, src: int = 0) -> dict:
    """Max and mean |Megatron - engine| log-prob over the scored tokens, on every rank.

    ``sequences`` / ``engine_logprobs`` are needed on rank ``src`` only. ``engine_logprobs[i]``
    covers tokens ``sequences[i][response_starts[i]:]`` (default 1: every token after the first).
    """
    sequences, engine_logprobs, response_starts = _share((sequences, engine_logprobs, response_starts), src)
    starts = response_starts or [1] * len(sequences)
    ours = token_logprobs(model, [torch.tensor([s]) for s in sequences], temperature=temperature)
    diffs = []
    for lp, theirs, start in zip(ours, engine_logprobs, starts):
        mine = lp[0, start - 1:].cpu()
        diffs.append((mine - torch.tensor(theirs, dtype=mine.dtype)).abs())
    flat = torch.cat(diffs)
    return {"max": float(flat.max()), "mean": float(flat.mean()), "tokens": int(flat.numel())}
