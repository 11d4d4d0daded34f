"""Megatron's standard training step, as a reference for the tests: all micro-batches in one
pipeline schedule, gradients synced by the schedule, then the optimizer step. The trainer uses
forward.backward_micro_batch + finish_accumulation instead (a group trains as soon as it is
generated); test_streamed_training checks the two agree, other tests use this to change weights."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


def padding_masked(scaled: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """``scaled`` (this TP rank's shard of fp32 logits) with the columns beyond the true
    vocabulary ``vocab`` (None: no padding) set to -inf, in place."""
    from megatron.core import parallel_state as ps

    first = ps.get_tensor_model_parallel_rank() * scaled.shape[-1]
    if vocab is not None and first + scaled.shape[-1] > vocab:
        scaled[..., max(vocab - first, 0):] = float("-inf")
    return scaled


def _unchunked(model, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The full fp32 logits / temperature with the TP vocabulary padding at -inf: the plain
    path that forward.token_stats (what the trainer runs) computes in chunks."""
    from megatron_marsrl.megatron.forward import _unwrap

    return padding_masked(logits.float() / temperature, getattr(_unwrap(model), "marsrl_vocab_size", None))


def train_step(model, optimizer, micro_batches: list[dict], loss_fn: Callable) -> dict:
    """One optimizer step over ``micro_batches`` (gradients accumulated, synced once).

    ``loss_fn(logprobs [b, s-1], batch) -> (loss scalar, metrics dict)`` gets the per-token
    log-probs of ``batch["tokens"][:, 1:]`` (temperature ``batch.get("temperature", 1)``;
    optional ``batch["routed_experts"]`` replays MoE routing, see routing_replay.py).
    Returns the averaged metrics, ``grad_norm`` and whether the update was applied.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_marsrl.megatron.forward import _device, _positions, _reduce_metrics, _run_schedule, _shifted

    def step(chunk, batch):
        tokens = batch["tokens"]
        inputs, labels = _shifted(tokens)
        logits = chunk(inputs, _positions(inputs), None)

        def loss_func(out):
            logp = -vocab_parallel_cross_entropy(_unchunked(model, out, batch.get("temperature", 1.0)), labels)
            loss, metrics = loss_fn(logp[:, : tokens.shape[1] - 1], batch)
            # clone(): the schedule divides the returned loss in place by the micro-batch count.
            return loss, {"loss": loss.detach().clone(),
                          **{k: torch.as_tensor(v).detach().clone() for k, v in metrics.items()}}

        return logits, loss_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    data = [{**b, "tokens": b["tokens"].to(_device())} for b in micro_batches]
    out = _run_schedule(model, data, step, forward_only=False)
    applied, grad_norm, _ = optimizer.step()
    metrics = _reduce_metrics(out)
    if ps.get_data_parallel_world_size() > 1:  # the step's metrics: mean over data-parallel ranks too
        values = torch.tensor(list(metrics.values()), device=_device())
        dist.all_reduce(values, group=ps.get_data_parallel_group())
        metrics = dict(zip(metrics, (values / ps.get_data_parallel_world_size()).tolist()))
    return {**metrics, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "update_applied": bool(applied)}
