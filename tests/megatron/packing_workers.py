"""Run on each rank by tests/megatron/test_packing.py (via megatron_marsrl.megatron.launch).

The reference is the same micro-batch as rows padded to the longest sequence ([b, longest],
default causal attention), which is how the trainer ran micro-batches before packing; it is
built here, from the packed batch, because production only packs.
"""
from __future__ import annotations

import torch

from megatron_marsrl.megatron.actor import Sequence, pack_sequences
from megatron_marsrl.megatron.routing_replay import NO_ROUTING
from megatron_marsrl.megatron.verify import build_from_hf

LENGTHS = [(5, 9), (3, 4), (7, 12), (2, 6)]
"""(prompt, response) tokens of the micro-batch's sequences: different lengths, an odd total."""


def _sequences(vocab: int, routing: tuple[int, int, int] | None) -> list[Sequence]:
    gen = torch.Generator().manual_seed(11)
    seqs = []
    for i, (p, r) in enumerate(LENGTHS):
        ids = torch.randint(0, vocab, (p + r,), generator=gen).tolist()
        record = None
        if routing is not None and i != 1:  # sequence 1 without a record: the router decides
            layers, top_k, experts = routing
            record = torch.rand(p + r - 1, layers, experts, generator=gen).topk(top_k, dim=-1).indices
            record[::4] = NO_ROUTING
        seqs.append(Sequence(prompt_ids=ids[:p], response_ids=ids[p:], advantage=(-1.0) ** i * (i + 1),
                             reward=float(i), rollout_logprobs=[-1.0] * r, trained_from=i % 2,
                             routed_experts=record))
    return seqs


def padded_rows(packed: dict) -> dict:
    """The packed batch as rows [b, longest] (token 0 after each sequence), routing [b, longest-1]."""
    cu = packed["cu_seqlens"].long()
    tokens = torch.zeros(cu.numel() - 1, int(cu.diff().max()), dtype=torch.long)
    routed = packed.get("routed_experts")
    rows_routed = None
    if routed is not None:
        rows_routed = torch.full((tokens.shape[0], tokens.shape[1] - 1, *routed.shape[2:]), NO_ROUTING,
                                 dtype=routed.dtype)
    for k in range(tokens.shape[0]):
        a, b = int(cu[k]), int(cu[k + 1])
        tokens[k, : b - a] = packed["tokens"][0, a:b]
        if routed is not None:
            rows_routed[k, : b - a - 1] = routed[0, a - k: b - k - 1]
    rows = {key: v for key, v in packed.items() if key not in ("cu_seqlens", "routed_experts")}
    rows["tokens"] = tokens
    if rows_routed is not None:
        rows["routed_experts"] = rows_routed
    return rows


def packed_vs_rows(hf_dir: str, layout: dict, replay: bool = False) -> dict:
    """One micro-batch through forward.backward_micro_batch packed and as padded rows, same
    model and loss (log-probs and an entropy bonus): max |difference| of the log-probs and
    entropies the loss saw at trained positions (None off the last pipeline stage), of every
    parameter's gradient, and of the frozen-reference log-probs (forward.micro_batch_logprobs)
    there. Packed, only trained positions get logits (forward._prepared)."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_marsrl.megatron.forward import backward_micro_batch, micro_batch_logprobs
    from megatron_marsrl.megatron.optim import OptimConfig, wrap_ddp_and_optimizer

    arch, _, model = build_from_hf(hf_dir, layout)
    ddp, _ = wrap_ddp_and_optimizer(model, OptimConfig(optimizer="sgd", lr=0.1, clip_grad=0.0))
    routing = (arch.num_layers, arch.moe_topk, arch.num_experts) if replay else None
    packed = pack_sequences(_sequences(arch.vocab_size, routing))
    rows = padded_rows(packed)
    real = torch.zeros_like(packed["response_mask"])
    for k, n in enumerate(packed["cu_seqlens"].diff().tolist()):
        real[k, : n - 1] = True
    # a packed training micro-batch computes logits where the loss reads (forward._prepared)
    trained = packed["response_mask"]
    assert 0 < int(trained.sum()) < int(real.sum())

    def run(batch):
        seen = {}

        def loss_fn(logp, entropy, b):
            seen["logp"], seen["entropy"] = logp.detach().cpu(), entropy.detach().cpu()
            mask = b["response_mask"].to(logp.device)
            adv = b["advantages"].to(logp.device)[:, None]
            # a token mean, as the trainer's losses are: gradients of order 1
            return (-(logp * adv * mask).sum() - 0.1 * (entropy * mask).sum()) / mask.sum(), {}

        ddp.zero_grad_buffer()
        ddp.train()
        backward_micro_batch(ddp, batch, loss_fn, with_entropy=True, entropy_grad=True)
        # Sequence parallel leaves each TP rank a partial gradient of the parameters that see
        # its chunk of the row (norms, routers), and the row splits differently when packed:
        # compare what the step's reduction makes of them.
        finalize_model_grads([ddp])
        grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
        ddp.eval()
        seen["reference"] = micro_batch_logprobs(ddp, batch, temperature=0.7).cpu()
        return seen, grads

    from megatron_marsrl.megatron import attention

    carried, read_back = [], attention.causal_blocks

    def spy(mask, length):  # does each layer get the mask with its blocks (no [T, T] rebuild)?
        carried.append(mask is not None and hasattr(mask, attention._BLOCKS))
        return read_back(mask, length)

    attention.causal_blocks = spy
    try:
        got, got_grads = run(packed)
    finally:
        attention.causal_blocks = read_back
    ref, ref_grads = run(rows)
    norms = [float(g.norm()) for g in ref_grads.values()]
    diffs = {n: float((got_grads[n] - ref_grads[n]).abs().max()) for n in ref_grads}
    out = {"grad": max(diffs.values()), "worst": max(diffs, key=diffs.get),
           "grad_norm": max(norms), "params": len(norms),
           "reference": float((got["reference"] - ref["reference"])[trained].abs().max()),
           "attention_calls": len(carried), "blocks_carried": sum(carried)}
    for key in ("logp", "entropy"):
        out[key] = float((got[key] - ref[key])[trained].abs().max()) if key in got else None
    return out
