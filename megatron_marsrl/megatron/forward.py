"""Pipeline-scheduled forward/backward passes: logits, per-token log-probs, training micro-batches.

All functions run Megatron's schedule (1F1B when PP>1), so they work unchanged under any
TP/PP/EP/DP layout. A micro-batch is either rows of token ids ``[b, seq]`` (one sequence per
row, causal attention) or, for the RL trainer, packed (megatron/actor.py ``pack_sequences``:
``tokens`` [1, sum of lengths] with ``cu_seqlens``): the sequences share one row, attention
stays within each (a block-diagonal causal mask on the local path; THD ``PackedSeqParams``
with Transformer Engine), so a micro-batch computes exactly its tokens and no
[b, longest, vocab/TP] logits of padding. Per-token results of a packed micro-batch are
unpacked to ``[b, longest - 1]``, the layout the loss reads for rows too.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from megatron_marsrl.megatron.memory import LOGIT_CHUNK_ELEMENTS


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def _run_schedule(model, micro_batches: list[dict], step: Callable, *, forward_only: bool) -> list:
    """Run ``step(model, batch) -> (output, loss_func)`` over micro-batches; return what the
    loss functions reported (last pipeline stage only; [] elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_marsrl.megatron.routing_replay import ROUTED_EXPERTS_KEY, routing_replay, set_routed_experts

    batches = iter(micro_batches)

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        # MoE routing replay: the engine's experts for this micro-batch (None: the router's own).
        set_routed_experts(chunk, batch.get(ROUTED_EXPERTS_KEY))
        return step(chunk, batch)

    seq = max(b["packed"]["inputs"].shape[1] if "packed" in b else b["tokens"].shape[1] for b in micro_batches)
    with routing_replay(model):
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=seq,
            micro_batch_size=micro_batches[0]["tokens"].shape[0],
            forward_only=forward_only,
        )


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def _pad_for_sequence_parallel(tokens: torch.Tensor) -> torch.Tensor:
    """Right-pad with token 0 to a multiple of TP: sequence parallel splits the sequence over
    TP ranks. Causal attention keeps the real positions unaffected; callers slice back."""
    from megatron.core import parallel_state as ps

    multiple = ps.get_tensor_model_parallel_world_size()
    extra = -tokens.shape[1] % multiple
    return torch.nn.functional.pad(tokens, (0, extra)) if extra else tokens


def _shifted(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded (inputs, labels) for next-token log-probs of ``tokens``."""
    return _pad_for_sequence_parallel(tokens[:, :-1]), _pad_for_sequence_parallel(tokens[:, 1:])


def _packed_inputs(model, batch: dict) -> dict:
    """The forward's inputs for a packed micro-batch (``tokens`` [1, T], ``cu_seqlens`` [b+1]).

    Each sequence contributes every token but its last (which predicts nothing within it) as
    inputs and the next tokens as labels, so input position i of sequence k is log-prob
    position i of row k of the unpacked layout, and a routing record (routing_replay.py) lines
    up with the inputs as it does for rows. Positions restart at every sequence (GPTModel's
    RoPE ignores them and rotates by row position on the local path: attention scores depend
    only on the distance between two positions, which the mask keeps within one sequence, so
    the result is the same; TE's THD RoPE restarts at each sequence itself). The row is
    padded at the end to a multiple of TP (sequence parallel splits it over the TP ranks), the
    padding forming a block of its own. ``dest`` maps each real position into ``[b, width]``.
    """
    from megatron.core import parallel_state as ps

    device = _device()
    tokens, cu = batch["tokens"].to(device), batch["cu_seqlens"].to(device).long()
    lengths = cu.diff() - 1  # next-token positions of each sequence
    n, real = lengths.numel(), int(lengths.sum())
    seq_id = torch.repeat_interleave(torch.arange(n, device=device), lengths)
    starts = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    offset = torch.arange(real, device=device) - starts[seq_id]
    source = cu[seq_id] + offset  # where each input sits in ``tokens``
    width = int(lengths.max())
    pad = -real % ps.get_tensor_model_parallel_world_size()
    bounds = torch.cat([starts, starts.new_tensor([real + pad])]) if pad else starts
    block = torch.repeat_interleave(torch.arange(bounds.numel() - 1, device=device), bounds.diff())
    return {"inputs": torch.nn.functional.pad(tokens[:, source], (0, pad)),
            "labels": torch.nn.functional.pad(tokens[:, source + 1], (0, pad)),
            "positions": (torch.arange(real + pad, device=device) - bounds[block])[None],
            "attention": _attention_args(model, bounds, block),
            "dest": seq_id * width + offset, "rows": n, "width": width}


def _attention_args(model, bounds: torch.Tensor, block: torch.Tensor) -> dict:
    """Keep each packed sequence's attention within itself: THD ``PackedSeqParams`` for
    Transformer Engine, else a block-diagonal causal mask (Megatron's convention: bool, True =
    masked out) that replaces the local attention's default causal one (fused_softmax.py
    ``forward_torch_softmax`` builds the causal mask only when none is given)."""
    from megatron_marsrl.megatron.model import have_transformer_engine

    if have_transformer_engine():  # GPU only; never run on this project's CPU machines
        from megatron.core.packed_seq_params import PackedSeqParams

        cu, longest = bounds.to(torch.int32), int(bounds.diff().max())
        return {"packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                     max_seqlen_q=longest, max_seqlen_kv=longest)}
    if _unwrap(model).config.masked_softmax_fusion:
        # Megatron's fused causal softmax kernel (fp16/bf16) ignores any mask it is given.
        raise RuntimeError("packed micro-batches need Transformer Engine or masked_softmax_fusion=False: "
                           "the fused causal softmax would attend across sequences")
    from megatron_marsrl.megatron.attention import packed_causal_mask

    return {"attention_mask": packed_causal_mask(block)}


def _unpack(values: torch.Tensor, packed: dict) -> torch.Tensor:
    """Per-position values of a packed row [1, T] (or [1, len(keep)] at the positions ``keep``)
    as ``[b, width]`` (0 beyond each sequence and at positions not kept); differentiable."""
    dest = packed["dest"] if packed.get("keep") is None else packed["dest"][packed["keep"]]
    flat = values.new_zeros(packed["rows"] * packed["width"])
    return flat.index_copy(0, dest, values[0, : dest.numel()]).view(packed["rows"], -1)


def _logits_at(positions: torch.Tensor):
    """A GPTModel ``output_processor`` (megatron-core >= 0.19) that applies the output layer to
    the decoder's hidden states at ``positions`` of the packed row only: logits [1, n, vocab/TP]."""
    def processor(*, hidden_states, output_layer, output_weight, runtime_gather_output, scale_logits, **_):
        logits, _ = output_layer(hidden_states.index_select(0, positions), weight=output_weight,
                                 runtime_gather_output=runtime_gather_output)
        return scale_logits(logits).transpose(0, 1).contiguous()

    return processor


def _forward(chunk, data: dict):
    """(logits, labels, to_rows) of one micro-batch: its forward, the next-token labels, and the
    map of per-position values to ``[b, seq-1]`` (rows) or ``[b, width]`` (packed). A packed
    micro-batch with ``keep`` (`_prepared`) gets logits at those positions only."""
    if "packed" in data:
        packed = data["packed"]
        keep = packed.get("keep")
        extra = {} if keep is None else {"output_processor": _logits_at(keep)}
        logits = chunk(packed["inputs"], packed["positions"], packed["attention"].get("attention_mask"),
                       packed_seq_params=packed["attention"].get("packed_seq_params"), **extra)
        labels = packed["labels"] if keep is None else packed["labels"][:, keep]
        return logits, labels, lambda values: _unpack(values, packed)
    tokens = data["tokens"]
    inputs, labels = _shifted(tokens)
    logits = chunk(inputs, _positions(inputs), None)
    return logits, labels, lambda values: values[:, : tokens.shape[1] - 1]


def _prepared(model, batch: dict) -> dict:
    """``batch`` with its tokens on the device and, when packed, the forward's inputs. A packed
    batch with a ``response_mask`` (training) keeps only the positions the loss reads: the
    output layer and the vocabulary softmax skip the prompts (most of an RL micro-batch's
    tokens); log-probs and entropies elsewhere read 0. Not under sequence parallelism, where
    the output layer gathers the row's TP chunks itself."""
    data = {**batch, "tokens": batch["tokens"].to(_device())}
    if "cu_seqlens" in batch:
        packed = data["packed"] = _packed_inputs(model, batch)
        if "response_mask" in batch and not _unwrap(model).config.sequence_parallel:
            keep = batch["response_mask"].to(_device()).flatten()[packed["dest"]].nonzero().flatten()
            packed["keep"] = keep if keep.numel() else keep.new_zeros(1)  # at least one row of logits
    return data


class _TokenStats(torch.autograd.Function):
    """Per-token log-prob of the label and entropy from TP-sharded logits, in token chunks.

    Forward keeps only the logits (as the model produced them) and two fp32 numbers per token;
    each chunk's fp32 working copy is dropped before the next. Backward recomputes the chunk's
    softmax and writes the gradient straight into one tensor of the logits' dtype. The vocabulary
    padding of the last TP shard (columns >= ``valid``) gets no probability and no gradient.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, valid, first, group, with_entropy):
        ctx.set_materialize_grads(False)
        flat, lab = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        log_z = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
        mean_x = torch.empty_like(log_z) if with_entropy else None
        logp = torch.empty_like(log_z)
        for lo, hi in _token_chunks(flat):
            x = flat[lo:hi, :valid].float() / temperature
            top = x.max(dim=-1).values if valid else torch.full(x.shape[:1], float("-inf"), device=x.device)
            if group is not None:
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            shifted = x - top[:, None]
            e = torch.exp(shifted)
            mine, at = _label_columns(lab[lo:hi], first, valid)
            # rows: sum of exp, the label's shifted logit, and (entropy only) sum of exp * shifted
            sums = torch.stack([e.sum(-1), shifted.gather(-1, at[:, None])[:, 0] * mine if valid else
                                torch.zeros_like(top)] + ([(e * shifted).sum(-1)] if with_entropy else []))
            if group is not None:
                dist.all_reduce(sums, group=group)
            log_z[lo:hi] = top + torch.log(sums[0])
            logp[lo:hi] = sums[1] - torch.log(sums[0])
            if with_entropy:
                mean_x[lo:hi] = top + sums[2] / sums[0]
            del x, shifted, e
        ctx.save_for_backward(logits, labels, log_z, mean_x)
        ctx.temperature, ctx.valid, ctx.first = temperature, valid, first
        entropy = (log_z - mean_x).view(labels.shape) if with_entropy else None
        return logp.view(labels.shape), entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, labels, log_z, mean_x = ctx.saved_tensors
        t, valid, first = ctx.temperature, ctx.valid, ctx.first
        flat, lab = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        grad = torch.zeros_like(flat)
        g_logp = None if g_logp is None else g_logp.reshape(-1).float()
        g_entropy = None if g_entropy is None else g_entropy.reshape(-1).float()
        for lo, hi in _token_chunks(flat):
            x = flat[lo:hi, :valid].float() / t
            p = torch.exp(x - log_z[lo:hi, None])
            g = torch.zeros_like(x)
            if g_logp is not None:  # d logp / dx = onehot(label) - p
                g -= p * g_logp[lo:hi, None]
                mine, at = _label_columns(lab[lo:hi], first, valid)
                g.scatter_add_(-1, at[:, None], (g_logp[lo:hi] * mine)[:, None])
            if g_entropy is not None:  # d H / dx = -p (x - E_p[x])
                g -= p * (x - mean_x[lo:hi, None]) * g_entropy[lo:hi, None]
            grad[lo:hi, :valid] = (g / t).to(grad.dtype)
            del x, p, g
        return grad.view(logits.shape), None, None, None, None, None, None


def _token_chunks(flat: torch.Tensor) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of ``flat`` [tokens, width] holding about LOGIT_CHUNK_ELEMENTS each."""
    rows, step = flat.shape[0], max(1, LOGIT_CHUNK_ELEMENTS // max(flat.shape[1], 1))
    return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]


def _label_columns(labels: torch.Tensor, first: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1.0 where the label's column is on this TP shard else 0.0, its local column clamped in range)."""
    mine = ((labels >= first) & (labels < first + valid)).float()
    return mine, (labels - first).clamp(0, max(valid - 1, 0))


def token_stats(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                vocab_size: int | None = None, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of each label, entropy of each token's distribution or None without
    ``with_entropy``), fp32, from TP-sharded ``logits`` [..., vocab/TP] divided by
    ``temperature`` (how the engine sampled), over the first ``vocab_size`` columns of the full
    vocabulary (None: all; the rest is TP padding).

    Both are differentiable. The full fp32 [tokens, vocab/TP] logits never exist: the work runs
    in chunks of LOGIT_CHUNK_ELEMENTS and backward recomputes each chunk's softmax, so a
    micro-batch holds its logits in the model's dtype plus, in backward, their gradient
    (memory.py counts them: LOGIT_COPIES, LOGIT_CHUNK_ELEMENTS). Equal to the unchunked
    vocab-parallel cross entropy and entropy within fp32 rounding (tests/megatron/test_streamed_training.py)."""
    from megatron.core import parallel_state as ps

    width = logits.shape[-1]
    tp = ps.get_tensor_model_parallel_world_size()
    first = ps.get_tensor_model_parallel_rank() * width
    valid = width if vocab_size is None else min(max(vocab_size - first, 0), width)
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    return _TokenStats.apply(logits, labels, float(temperature), valid, first, group, with_entropy)


def _stats(model, logits: torch.Tensor, labels: torch.Tensor, temperature: float, *,
           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_stats` over ``model``'s true vocabulary (its ``marsrl_vocab_size``)."""
    return token_stats(logits, labels, temperature=temperature, with_entropy=with_entropy,
                       vocab_size=getattr(_unwrap(model), "marsrl_vocab_size", None))


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _broadcast_from_last_stage(values: list[torch.Tensor], shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Give every pipeline stage the tensors computed on the last stage."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return values
    group = ps.get_pipeline_model_parallel_group()
    src = ps.get_pipeline_model_parallel_last_rank()
    if not ps.is_pipeline_last_stage():
        values = [torch.empty(shape, dtype=torch.float32, device=_device()) for shape in shapes]
    for tensor in values:
        dist.broadcast(tensor, src=src, group=group)
    return values


def token_logprobs(model, micro_batches: list[torch.Tensor], *, temperature: float = 1.0,
                   routed_experts: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """Log-probabilities of ``tokens[:, 1:]`` given the prefix, for each micro-batch.

    Returns one fp32 tensor ``[b, seq-1]`` per micro-batch on every rank (TP ranks via the
    vocab-parallel cross entropy, PP ranks by broadcast from the last stage). ``temperature``
    divides the logits first, matching how the rollout engine sampled. ``routed_experts``
    (one per micro-batch, or None) replays the engine's MoE routing (routing_replay.py).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")

    def step(chunk, batch):
        tokens = batch["tokens"]
        inputs, labels = _shifted(tokens)
        logits = chunk(inputs, _positions(inputs), None)

        def loss_func(out):
            logp, _ = _stats(model, out, labels, temperature)
            return out.sum() * 0.0, {"logprobs": logp[:, : tokens.shape[1] - 1].detach()}

        return logits, loss_func

    with torch.no_grad():
        routed = routed_experts or [None] * len(micro_batches)
        data = [{"tokens": t.to(_device()), "routed_experts": r} for t, r in zip(micro_batches, routed, strict=True)]
        out = _run_schedule(model, data, step, forward_only=True)
    values = [d["logprobs"] for d in out]
    return _broadcast_from_last_stage(values, [torch.Size((t.shape[0], t.shape[1] - 1)) for t in micro_batches])


def full_logits(model, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits ``[b, s, vocab]`` (gathered over TP) on the last pipeline stage,
    None elsewhere. For parity checks and debugging; training uses :func:`token_logprobs`."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    length = tokens.shape[1]
    vocab = getattr(_unwrap(model), "marsrl_vocab_size", None)

    def step(chunk, batch):
        inputs = _pad_for_sequence_parallel(batch["tokens"])
        logits = chunk(inputs, _positions(inputs), None)
        return logits, lambda out: (out.sum() * 0.0, {
            "logits": gather_from_tensor_model_parallel_region(out)[:, :length, :vocab].detach()})

    with torch.no_grad():
        out = _run_schedule(model, [{"tokens": tokens.to(_device())}], step, forward_only=True)
    return out[0]["logits"] if ps.is_pipeline_last_stage() else None


def _reduce_metrics(out: list[dict]) -> dict[str, float]:
    """Mean of each metric over the micro-batches of this rank's schedule, on every stage."""
    from megatron.core import parallel_state as ps

    keys = sorted(out[0]) if out else []
    # Only the last stage knows the keys; share them so every stage joins the same collectives.
    if ps.get_pipeline_model_parallel_world_size() > 1:
        holder = [keys]
        dist.broadcast_object_list(holder, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        keys = holder[0]
    if out:
        values = torch.stack([torch.stack([d[k].float() for d in out]).mean() for k in keys])
    else:
        values = torch.zeros(len(keys))
    values = _broadcast_from_last_stage([values.to(_device())], [values.shape])[0]
    return {k: float(v) for k, v in zip(keys, values)}


def backward_micro_batch(model, batch: dict, loss_fn: Callable, *, with_entropy: bool = False,
                         entropy_grad: bool = False) -> dict[str, float]:
    """Forward and backward of one micro-batch; gradients accumulate in the DDP buffers and the
    data-parallel reduction is *not* run (call :func:`finish_accumulation` once per step).

    This is what lets the RL trainer train a group as soon as it is generated while other
    groups are still being sampled: any number of these calls, in any order, then one sync.
    ``batch`` is packed (``tokens`` [1, T] and ``cu_seqlens``, actor.pack_sequences) or rows
    (``tokens`` [b, s]); either way ``loss_fn(logprobs [b, s-1], entropy [b, s-1] | None, batch)
    -> (loss, metrics)`` gets per-sequence rows, s the longest sequence (packed: only the
    positions of ``batch["response_mask"]`` are computed, the rest hold 0). An optional
    ``batch["routed_experts"]`` replays the engine's MoE routing (routing_replay.py). Log-probs
    and entropy come from :func:`token_stats` (token chunks, no full fp32 logits); the entropy
    carries gradient only with ``entropy_grad`` (an entropy bonus trains through it). Returns the
    metrics (floats) on every rank.
    """
    def step(chunk, data):
        logits, labels, to_rows = _forward(chunk, data)

        def loss_func(out):
            logp, entropy = _stats(model, out, labels, data.get("temperature", 1.0), with_entropy=with_entropy)
            logp = to_rows(logp)
            entropy = None if not with_entropy else to_rows(entropy if entropy_grad else entropy.detach())
            loss, metrics = loss_fn(logp, entropy, data)
            return loss, {"loss": loss.detach().clone(),
                          **{k: torch.as_tensor(v).detach().clone() for k, v in metrics.items()}}

        return logits, loss_func

    config = _unwrap(model).config
    finalize, config.finalize_model_grads_func = config.finalize_model_grads_func, None
    try:
        with model.no_sync():
            out = _run_schedule(model, [_prepared(model, batch)], step, forward_only=False)
    finally:
        config.finalize_model_grads_func = finalize
    return _reduce_metrics(out)


def micro_batch_logprobs(model, batch: dict, *, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs ``[b, s-1]`` of one micro-batch, packed or rows (as :func:`backward_micro_batch`
    lays them out), without gradient, on every rank (e.g. a frozen reference model's). A packed
    batch with a ``response_mask`` gets them at its True positions only (0 elsewhere)."""
    def step(chunk, data):
        logits, labels, to_rows = _forward(chunk, data)
        return logits, lambda out: (out.sum() * 0.0, {"logprobs": to_rows(
            _stats(model, out, labels, temperature)[0]).detach()})

    with torch.no_grad():
        data = _prepared(model, batch)
        out = _run_schedule(model, [data], step, forward_only=True)
    if "packed" in data:
        shape = torch.Size((data["packed"]["rows"], data["packed"]["width"]))
    else:
        shape = torch.Size((batch["tokens"].shape[0], batch["tokens"].shape[1] - 1))
    return _broadcast_from_last_stage([d["logprobs"] for d in out], [shape])[0]


def finish_accumulation(model, optimizer, *, grad_scale: float = 1.0, max_grad_norm: float | None = None) -> dict:
    """End of a step: the one gradient reduction (DP, expert-DP, SP layer norms, tied embeddings),
    ``grad_scale`` applied to the reduced gradients, then the optimizer step unless the gradient
    norm is not finite or above ``max_grad_norm`` (a spike), in which case nothing changes.

    Returns ``grad_norm`` (before clipping) and ``update_applied``; collective over all ranks.
    """
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([model])
    if grad_scale != 1.0:
        model.scale_gradients(grad_scale)
    optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    skip = not math.isfinite(grad_norm) or (max_grad_norm is not None and grad_norm > max_grad_norm)
    applied = False
    if not skip:
        applied, _, _ = optimizer.step()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    return {"grad_norm": grad_norm, "update_applied": bool(applied)}
