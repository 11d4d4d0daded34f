"""Megatron -> rollout engine weight sync, and the train/rollout log-prob mismatch probe.

Both are collective over the training ranks: every rank runs the export (TP/EP gathers, PP/EP
sends inside export_hf_buckets) and only rank 0, which holds the engine pools (its own node's
engines and the other nodes'), receives and applies buckets.
Memory beyond the model stays at one bucket plus one gathered tensor.

This is the Megatron side: `sync_weights` sends to anything with ``update_weights`` (an engine
or a pool), `sync_and_verify` checks an EnginePool (``read_weights``, ``score_each``); nothing
here imports rollout/ at run time. The engine side of the disaggregated broadcast is
rollout/weight_sync.py.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_marsrl.megatron import hf_mapping
from megatron_marsrl.megatron.forward import token_logprobs
from megatron_marsrl.megatron.hf_checkpoint import export_hf_buckets
from megatron_marsrl.megatron.hf_config import ModelArch

if TYPE_CHECKING:
    from megatron_marsrl.rollout.pool import EnginePool


READBACK_ROWS = 64
"""Rows (dim 0) of each read-back tensor compared bit for bit after a sync."""


def readback_names(arch: ModelArch) -> list[str]:
    """The tensors read back after a sync: the first and the last weight matrix of the decoder
    (every element trained, unlike embedding rows of unseen tokens), sharded by rows on every
    engine, so the first rows of an engine's rank-0 shard are the first rows of the tensor."""
    matrices = [n for n, shape in hf_mapping.hf_shapes(arch).items()
                if len(shape) == 2 and n.endswith("q_proj.weight")]
    return sorted(set(matrices[:1] + matrices[-1:]), key=matrices.index)


def sync_weights(model, arch: ModelArch, engine, *, version: int, bucket_bytes: int = 256 << 20,
                 keep: dict[str, torch.Tensor] | None = None) -> dict:
    """Send the current Megatron weights to ``engine`` (on rank 0; None on the other ranks,
    which only take part in the export). ``bytes`` counts what rank 0 received. ``keep``
    (rank 0): names whose first :data:`READBACK_ROWS` rows are copied into it as sent."""
    start = time.perf_counter()
    nbytes = tensors = 0
    for bucket in export_hf_buckets(model, arch, bucket_bytes=bucket_bytes):
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if keep is not None:
            keep.update({n: t[:READBACK_ROWS].to("cpu", copy=True) for n, t in bucket if n in keep})
        if engine is not None:
            tensors += engine.update_weights([bucket], version=version)
    seconds = time.perf_counter() - start
    return {"bytes": nbytes, "seconds": seconds, "tensors": tensors, "gb_per_s": nbytes / max(seconds, 1e-9) / 1e9}


class WeightSyncError(RuntimeError):
    """After a sync the engine does not hold the weights Megatron sent."""


def sync_and_verify(model, arch: ModelArch, engine: EnginePool | None, *, version: int, probe: list[list[int]],
                    bucket_bytes: int = 256 << 20, tolerance: float = 1e-3, readback: bool = True) -> dict:
    """Sync, then check that the engines took the weights, two ways (collective; ``engine``, the
    policy's pool, and ``probe`` on the engine rank only, None elsewhere):

    - read-back: a few rows of :func:`readback_names` read from the engine must equal, bit for
      bit, what Megatron sent (catches a sync that did nothing even when the weights moved by
      less than the log-probs show, e.g. bf16 at lr 1e-6). Engines that cannot read weights
      back (SGLang's Qwen models) report None and are checked by the probe alone; FP8 engines
      hold other values by design (``readback=False``).
    - probe: the mean |engine - Megatron| log-prob over the ``probe`` tokens (temperature 1)
      must stay within ``tolerance`` for every usable engine of a pool, each on its own (catches
      wrong tensors, or an engine the update did not reach; a robust statistic, so one token's
      rounding cannot trip it).

    Raises :class:`WeightSyncError`. Returns the sync figures plus ``mismatch``
    (mean/max/tokens of the engine that differs most) and ``readback`` (tensors compared, None
    when the engine cannot)."""
    names = readback_names(arch) if readback and engine is not None else []
    sent = dict.fromkeys(names)
    report = sync_weights(model, arch, engine, version=version, bucket_bytes=bucket_bytes, keep=sent)
    report["readback"] = _check_readback(engine, sent, version) if names else None
    # every engine of the pool scores the probe (other nodes' engines take weights another way)
    each = engine.score_each(probe) if engine is not None else None
    mismatches = [logprob_mismatch(model, probe, scored) for scored in _share(each) or ()]
    worst = max(range(len(mismatches)), key=lambda i: mismatches[i]["mean"])
    report["mismatch"] = mismatches[worst]
    if report["mismatch"]["mean"] > tolerance:
        which = f"engine {worst} of {len(mismatches)}" if len(mismatches) > 1 else "the engine"
        raise WeightSyncError(f"after syncing weight version {version} the log-probs of {which} differ from "
                              f"Megatron's by {report['mismatch']['mean']:.3g} on average (tolerance {tolerance}); "
                              "check that the engine knows every exported tensor name and that the update reached it")
    return report


def _check_readback(engine, sent: dict[str, torch.Tensor], version: int) -> int | None:
    held = engine.read_weights(list(sent), READBACK_ROWS)
    if any(v is None for v in held.values()):
        return None
    for name, expected in sent.items():
        rows = min(len(held[name]), len(expected))  # an engine's TP shard may have fewer rows
        got, expected = held[name][:rows].float(), expected[:rows].float()
        if rows == 0 or got.shape != expected.shape or not torch.equal(got, expected):
            diff = (got - expected).abs().max() if rows and got.shape == expected.shape else "shape"
            raise WeightSyncError(f"after syncing weight version {version} the engine's {name} is not what "
                                  f"Megatron sent (first {rows} rows, max |diff| {diff}): the update "
                                  "did not reach this tensor")
    return len(sent)


def _share(obj, src: int = 0):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def logprob_mismatch(model, sequences: list[list[int]] | None, engine_logprobs: list[list[float]] | None, *,
                     temperature: float = 1.0, response_starts: list[int] | None = None, src: int = 0) -> dict:
    """Mean and max |Megatron - engine| log-prob over the scored tokens, on every rank.

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
