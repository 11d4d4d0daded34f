"""MoE routing replay: Megatron's routers use the experts the rollout engine routed each token to.

Why: a tiny numeric difference between engine and trainer (kernels, bf16, a weight round trip)
flips a token's top-k choice, and a flipped expert changes that token's log-prob by O(1), far
beyond the rest of the train/rollout mismatch. Replaying the engine's choices removes it.

Batch key ``routed_experts``: ints ``[batch, rows, layers, top_k]`` aligned with the *model
inputs* of a micro-batch: row i holds the global expert ids (0..num_experts-1) of the token at
input position i in every decoder layer. For rows of token ids the inputs are ``tokens[:, :-1]``,
which is exactly what an engine record covers (rollout/routed_experts.py); a packed micro-batch
(batch 1) has each sequence's inputs back to back, so its records are too (:func:`pack_for_replay`).
Rows beyond ``rows`` and rows holding -1 (padding, sequences without a record, dense layers)
keep the router's own choice.

Gradients: the replayed experts fix *which* experts a token uses; their gate weights are
recomputed from the current router logits (softmax over the chosen experts' logits, or the
full softmax gathered at them for pre-softmax routers), exactly as megatron-core's own
RouterReplay does. So the router still gets gradients through the gate weights, as in the
published replay designs (R3); only the discrete top-k selection is taken from the engine.
The auxiliary load-balancing loss, when enabled, still sees the router's own top-k.

Implementation: megatron-core 0.19.2 has the hook point (TopKRouter.router_replay, consulted by
topk_routing_with_score_function) and a RouterReplay class whose forward/backward actions must
be switched globally between forward and backward. That does not fit the 1F1B schedule, where
forwards and backwards of different micro-batches interleave, and it knows nothing of the token
layout. So each router gets a ``LayerReplay`` (a RouterReplay subclass, :func:`_replay_class`) that
- takes its layer's slice of the record (PP: a stage's routers carry global layer numbers),
- lays it out as the router sees tokens: sequence-major [s, b] flattened, and with sequence
  parallel only this TP rank's contiguous chunk of the sequence (EP needs nothing: routing
  happens before dispatch, over global expert ids),
- serves activation recompute (full or MoE-layer recompute re-runs the router inside the
  backward pass) from a FIFO of the micro-batches' records, backwards running in forward order.
Not supported (raises): fused TE routing (moe_router_fusion), sinkhorn / quantile routing.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

ROUTED_EXPERTS_KEY = "routed_experts"
NO_ROUTING = -1
"""A record entry without routing (the same convention as rollout/routed_experts.py)."""


class RoutingReplayError(ValueError):
    """A routed-experts record that does not fit the model or the micro-batch."""


def _routers(model) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def _layout(router) -> tuple[int, int, bool]:
    """(TP size, TP rank, sequence parallel) of the tokens this router sees."""
    from megatron.core import parallel_state as ps

    sp = bool(router.config.sequence_parallel) and ps.get_tensor_model_parallel_world_size() > 1
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), sp


def _check_supported(router) -> None:
    if router.config.moe_router_fusion:
        raise RoutingReplayError("routing replay needs moe_router_fusion=False (the fused TE top-k bypasses the replay hook)")
    kinds = router.routing_type if isinstance(router.routing_type, list) else [router.routing_type]
    bad = [k for k in kinds if k in ("sinkhorn", "quantile_balancing")]
    if bad:
        raise RoutingReplayError(f"routing replay does not support {bad[0]} routing")


def _in_backward() -> bool:
    """True while autograd runs a backward pass (torch >= 2.1 exposes the running graph task;
    -1 outside one). The router runs there only when activations are recomputed."""
    return torch._C._current_graph_task_id() >= 0


@functools.cache
def _replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class LayerReplay(RouterReplay):
        """One router's replay state: the record of the micro-batch being run forward, and a
        FIFO of records for recomputation during backward (which runs in forward order)."""

        def __init__(self, router):
            super().__init__()
            RouterReplay.global_router_replay_instances.remove(self)  # per model, not Megatron's global list
            self.layer_number = router.layer_number
            self.layout = _layout(router)
            self.current: torch.Tensor | None = None
            self.recompute: list[torch.Tensor | None] = []
            self.replayed = 0  # tokens routed from a record in forwards (not recomputes), see replay_coverage

        def push(self, experts: torch.Tensor | None) -> None:
            self.current = experts
            self.recompute.append(experts)

        def clear(self) -> None:
            self.current, self.recompute = None, []

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            experts = self.recompute.pop(0) if _in_backward() and self.recompute else self.current
            if experts is None:
                return default_compute_topk(scores, topk, num_groups, group_topk)
            target = _local_rows(experts, scores.shape[0], self.layout).to(scores.device)
            if target.shape[1] != topk:
                raise RoutingReplayError(f"layer {self.layer_number}: record has top-{target.shape[1]}, router top-{topk}")
            missing = (target < 0).any(dim=1, keepdim=True)
            if not _in_backward():
                self.replayed += int((~missing).sum())
            if bool(missing.any()):
                _, own = default_compute_topk(scores, topk, num_groups, group_topk)
                target = torch.where(missing, own, target)
            # Gate weights of the replayed experts from the current scores: differentiable.
            return scores.gather(1, target), target

    return LayerReplay


def _local_rows(experts: torch.Tensor, num_tokens: int, layout: tuple[int, int, bool]) -> torch.Tensor:
    """This rank's ``[num_tokens, k]`` targets from one layer's ``[b, rows, k]`` record: rows
    padded/cut to the forward's sequence, laid out sequence-major, SP-chunked."""
    tp, tp_rank, sp = layout
    batch, rows, top_k = experts.shape
    if num_tokens % batch:
        raise RoutingReplayError(f"router sees {num_tokens} tokens, not a multiple of the record's batch {batch}")
    local = num_tokens // batch
    seq = local * tp if sp else local
    if rows < seq:
        experts = torch.nn.functional.pad(experts, (0, 0, 0, seq - rows), value=NO_ROUTING)
    by_position = experts[:, :seq].transpose(0, 1)
    if sp:
        by_position = by_position[tp_rank * local: (tp_rank + 1) * local]
    return by_position.reshape(num_tokens, top_k).long()


def _replays(model, *, install: bool) -> list:
    """The replay state of each router of ``model`` (installed on first use when ``install``)."""
    out = []
    for router in _routers(model):
        if not isinstance(router.router_replay, _replay_class()):
            if not install:
                continue
            _check_supported(router)
            router.router_replay = _replay_class()(router)
        out.append(router.router_replay)
    return out


def _validate(routed: torch.Tensor, replays: list, num_experts: int) -> None:
    if routed.dim() != 4:
        raise RoutingReplayError(f"routed_experts must be [batch, rows, layers, top_k]; got shape {tuple(routed.shape)}")
    last_layer = max(r.layer_number for r in replays)
    if routed.shape[2] < last_layer:
        raise RoutingReplayError(f"routed_experts has {routed.shape[2]} layers; this stage routes up to layer {last_layer}")
    if bool((routed >= num_experts).any()) or bool((routed < NO_ROUTING).any()):
        raise RoutingReplayError(f"routed_experts holds ids outside -1..{num_experts - 1}")
    ordered = routed.sort(dim=-1).values
    if bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()):
        raise RoutingReplayError("routed_experts repeats an expert within a token's top-k")


def set_routed_experts(model, routed: torch.Tensor | None) -> None:
    """Routing for the next forward of ``model`` (one micro-batch): ``routed`` as described in
    the module docstring, or None for the routers' own choice. Call once per micro-batch
    forward, inside :func:`routing_replay`. A no-op for dense models and stages without MoE."""
    replays = _replays(model, install=routed is not None)
    if not replays:
        return
    if routed is not None:
        router = _routers(model)[0]
        routed = routed.to(router.weight.device)  # once per micro-batch, not once per layer
        _validate(routed, replays, router.config.num_moe_experts)
    for replay in replays:
        replay.push(None if routed is None else routed[:, :, replay.layer_number - 1])


def replay_coverage(model, routed: torch.Tensor) -> float:
    """Share of ``routed``'s entries (token x MoE layer with a record; one micro-batch's batch
    value) that ``model``'s routers took from the record in forwards since the last call, which
    resets the count. Counted over this stage's layers; with sequence parallelism each TP rank
    routes its own chunk of the tokens, so the ranks' counts are summed. 0 when nothing was
    recorded for this stage; 1 when every recorded choice was replayed."""
    from megatron.core import parallel_state as ps

    replays = _replays(model, install=False)
    if not replays:
        return 0.0
    replayed = torch.tensor(float(sum(r.replayed for r in replays)))
    for replay in replays:
        replay.replayed = 0
    if any(r.layout[2] for r in replays):
        dist.all_reduce(replayed, group=ps.get_tensor_model_parallel_group())
    layers = [r.layer_number - 1 for r in replays]
    recorded = int((routed[:, :, layers] >= 0).all(-1).sum())
    return float(replayed) / recorded if recorded else 0.0


def clear_routed_experts(model) -> None:
    """Forget all routing given to ``model`` (its routers choose for themselves again)."""
    for replay in _replays(model, install=False):
        replay.clear()


@contextlib.contextmanager
def routing_replay(model):
    """Scope of one schedule run (forwards and backwards): records given with
    :func:`set_routed_experts` inside are dropped on exit, also on error."""
    try:
        yield
    finally:
        clear_routed_experts(model)


def pack_for_replay(records: list[torch.Tensor | None], lengths: list[int]) -> torch.Tensor | None:
    """Engine records (``[rows_i, layers, top_k]`` or None) of a packed micro-batch's sequences
    as one ``routed_experts`` batch value ``[1, sum(lengths), layers, top_k]``: sequence i's
    rows, cut or padded with -1 to ``lengths[i]`` (its tokens - 1: the forward's inputs of it,
    forward.py), back to back in packing order. None when no sequence has a record."""
    known = [r for r in records if r is not None]
    if not known:
        return None
    _, layers, top_k = known[0].shape
    out = torch.full((1, sum(lengths), layers, top_k), NO_ROUTING, dtype=torch.int32)
    start = 0
    for record, length in zip(records, lengths, strict=True):
        if record is not None:
            rows = min(length, record.shape[0])
            out[0, start: start + rows] = torch.as_tensor(record[:rows], dtype=torch.int32)
        start += length
    return out
