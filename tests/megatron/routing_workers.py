"""Run on each rank by the routing-replay tests (via megatron_marsrl.megatron.launch).

The reference is transformers with the same routing forced through a hook on its routers:
the chosen experts come from the record, their gate weights from the router's own logits
(softmax, then renormalised over the top-k: Qwen3-MoE's norm_topk_prob), which is what
replay in Megatron must reproduce under every layout.
"""
from __future__ import annotations

import contextlib

import torch

from megatron_marsrl.megatron.forward import token_logprobs
from megatron_marsrl.megatron.routing_replay import replay_coverage
from megatron_marsrl.megatron.verify import build_from_hf

SEQ = 12  # 11 inputs: TP2 pads one position (replayed as the router's own choice)


def random_routing(batch: int, rows: int, layers: int, top_k: int, num_experts: int, seed: int) -> torch.Tensor:
    """Distinct random experts per token and layer; every fifth row left to the router (-1)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch, rows, layers, num_experts, generator=gen)
    routed = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    routed[:, ::5] = -1
    return routed


@contextlib.contextmanager
def forced_hf_routing(model, routed: torch.Tensor | None):
    """transformers' Qwen3-MoE routers use ``routed`` ([b, s, layers, k]; -1 rows: own choice)."""
    from megatron_marsrl.rollout.routed_experts import RoutedExpertsRecorder

    gates = RoutedExpertsRecorder(model, model.config.num_hidden_layers).gates
    handles = []
    for layer, gate in gates.items():
        def hook(module, args, out, layer=layer):
            logits, _, own = out
            forced = routed[:, :, layer].reshape(-1, own.shape[-1]).long()
            idx = torch.where((forced < 0).any(-1, keepdim=True), own, forced)
            weights = torch.softmax(logits.float(), dim=-1).gather(1, idx)
            if module.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), idx
        if routed is not None:
            handles.append(gate.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def hf_logprobs(model, tokens: torch.Tensor, routed: torch.Tensor | None = None) -> torch.Tensor:
    with forced_hf_routing(model, routed):
        logits = model(input_ids=tokens[:, :-1]).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def forced_routing(hf_dir: str, layout: dict) -> dict:
    """Megatron under ``layout`` with replayed routing vs transformers forced to the same
    routing; also how far the forced routing moves the log-probs (so replay took effect)."""
    import transformers

    arch, _, model = build_from_hf(hf_dir, layout)
    tokens = torch.randint(0, arch.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    routed = random_routing(2, SEQ - 1, arch.num_layers, arch.moe_topk, arch.num_experts, seed=4)
    replayed = token_logprobs(model, [tokens], routed_experts=[routed])[0].cpu()
    coverage = replay_coverage(model, routed)  # the share of the record this rank's routers replayed
    own = token_logprobs(model, [tokens])[0].cpu()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_forced, ref_own = hf_logprobs(hf, tokens, routed), hf_logprobs(hf, tokens)
        own_record = _hf_record(hf, tokens)
    replay_own = token_logprobs(model, [tokens], routed_experts=[own_record])[0].cpu()
    return {"forced_vs_hf": float((replayed - ref_forced).abs().max()),
            "own_vs_hf": float((own - ref_own).abs().max()),
            "forcing_moves": float((ref_forced - ref_own).abs().max()),
            "replay_own_vs_own": float((replay_own - own).abs().max()), "coverage": coverage}


def _hf_record(hf, tokens: torch.Tensor) -> torch.Tensor:
    from megatron_marsrl.rollout.routed_experts import RoutedExpertsRecorder

    with RoutedExpertsRecorder(hf, hf.config.num_hidden_layers) as recorder:
        hf(input_ids=tokens[:, :-1])
    return recorder.take(tokens.shape[0])


def router_gradients(hf_dir: str, layout: dict) -> dict:
    """Router weight gradients of -sum(log-probs) with replayed routing (one micro-batch, world
    size 1), Megatron vs transformers forced to the same routing."""
    import transformers

    from megatron_marsrl.megatron.forward import backward_micro_batch
    from megatron_marsrl.megatron.optim import OptimConfig, wrap_ddp_and_optimizer

    arch, _, model = build_from_hf(hf_dir, layout)
    ddp, _ = wrap_ddp_and_optimizer(model, OptimConfig(optimizer="sgd", lr=0.1, clip_grad=0.0))
    tokens = torch.randint(0, arch.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    routed = random_routing(2, SEQ - 1, arch.num_layers, arch.moe_topk, arch.num_experts, seed=4)
    ddp.train()
    backward_micro_batch(ddp, {"tokens": tokens, "routed_experts": routed}, lambda lp, ent, b: (-lp.sum(), {}))
    ours = {int(n.split(".")[2]): p.main_grad.detach().clone() for n, p in model.named_parameters() if "router.weight" in n}
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    (-hf_logprobs(hf, tokens, routed).sum()).backward()
    diffs = [float((ours[i] - hf.model.layers[i].mlp.gate.weight.grad).abs().max()) for i in ours]
    return {"grad_diff": max(diffs), "grad_norm": min(float(g.norm()) for g in ours.values())}
