"""Run on each rank by the routing-replay engine tests (via megatron_marsrl.megatron.launch).

The proof of the issue: rank 0 holds a rollout engine that records the experts it routed each
token to. Megatron (same checkpoint, under a layout) then recomputes the rollout log-probs
with and without replaying that routing, first with identical weights, then with its router
weights perturbed very slightly, so that some top-k choices flip as tiny numeric differences
between engine and trainer do in production.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from megatron_marsrl.megatron.forward import token_logprobs
from megatron_marsrl.megatron.verify import build_from_hf
from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling
from tests.rollout.workers import TEMPERATURE, _engine, _train_then_sync, distributed_update


def _rollouts(engine, vocab: int, count: int, new_tokens: int) -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    requests = [EngineRequest(rid=str(i), prompt_ids=torch.randint(0, vocab, (4 + i % 3,), generator=gen).tolist(),
                              sampling=EngineSampling(temperature=TEMPERATURE, max_new_tokens=new_tokens),
                              return_routed_experts=True) for i in range(count)]
    return [{"tokens": o.prompt_ids + o.output_ids, "start": len(o.prompt_ids), "logprobs": o.logprobs,
             "routed": o.routed_experts} for o in engine.generate(requests)]


def _share(obj):
    holder = [obj]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _noise(layer: int, shape, scale: float) -> torch.Tensor:
    """The same perturbation of layer ``layer``'s router on every rank (and in transformers)."""
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(100 + layer))


@contextlib.contextmanager
def _perturbed_routers(model, scale: float):
    """Megatron's router weights perturbed by `_noise` inside the block, restored exactly after."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    saved = [router.weight.detach().clone() for router in routers]
    with torch.no_grad():
        for router in routers:
            router.weight.add_(_noise(router.layer_number - 1, router.weight.shape, scale).to(router.weight.device))
    try:
        yield
    finally:
        with torch.no_grad():
            for router, weight in zip(routers, saved):
                router.weight.copy_(weight)


def _mismatch(model, rollouts: list[dict], *, replay: bool) -> dict:
    diffs = []
    for r in rollouts:
        routed = [r["routed"][None]] if replay else None
        ours = token_logprobs(model, [torch.tensor([r["tokens"]])], temperature=TEMPERATURE, routed_experts=routed)[0]
        diffs.append((ours[0, r["start"] - 1:].cpu() - torch.tensor(r["logprobs"])).abs())
    flat = torch.cat(diffs)
    return {"max": float(flat.max()), "mean": float(flat.mean()), "tokens": int(flat.numel())}


def _hf_routing(hf_dir: str, rollouts: list[dict], scale: float) -> list[torch.Tensor]:
    """transformers' own routing of each rollout, router weights perturbed by ``scale``."""
    import transformers

    from megatron_marsrl.rollout.routed_experts import RoutedExpertsRecorder

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            layer.mlp.gate.weight.add_(_noise(i, layer.mlp.gate.weight.shape, scale))
        out = []
        for r in rollouts:
            with RoutedExpertsRecorder(hf, hf.config.num_hidden_layers) as recorder:
                hf(input_ids=torch.tensor([r["tokens"][:-1]]))
            out.append(recorder.take(1)[0])
    return out


def _agreement(records: list[torch.Tensor], others: list[torch.Tensor]) -> float:
    """Fraction of (token, layer) whose top-k expert sets agree."""
    same = [(a.sort(-1).values == b.sort(-1).values).all(-1) for a, b in zip(records, others)]
    return float(torch.cat([s.flatten() for s in same]).float().mean())


def replay_vs_engine(hf_dir: str, layout: dict, engine: str = "hf") -> dict:
    """`replay_report` with an engine of kind ``engine`` and Megatron under ``layout``."""
    held = _engine(engine, hf_dir, routed_experts=True) if int(os.environ["RANK"]) == 0 else None  # before Megatron
    arch, _, model = build_from_hf(hf_dir, layout)
    try:
        return replay_report(model, arch, held, hf_dir)
    finally:
        if held is not None:
            held.shutdown()


def replay_then_train_sync(hf_dir: str, layout: dict, engine: str, call_log: str) -> dict:
    """One engine and one Megatron model for two proofs (one SGLang start, one launch): the
    routing replay's (`replay_report`, under key "replay"), then train-then-sync's
    (tests.rollout.workers), which finds the model as it was built; an SGLang server then takes
    a disaggregated trainer's updates (`distributed_update`, under key "disaggregated"). A stand-in kernel that
    SGLang's processes call is written to `call_log` (set here, so the launch's environment
    stays the fork server's)."""
    os.environ["MARSRL_SGL_KERNEL_CALL_LOG"] = call_log
    held = _engine(engine, hf_dir, routed_experts=True) if int(os.environ["RANK"]) == 0 else None
    arch, _, model = build_from_hf(hf_dir, layout)
    try:
        report = {"replay": replay_report(model, arch, held, hf_dir)}
        report.update(_train_then_sync(model, arch, held, steps=2, bucket_bytes=32 << 10))
        if engine == "sglang_server" and held is not None:  # the same server, updated as a split trainer does
            report["disaggregated"] = distributed_update(held, hf_dir)
        return report
    finally:
        if held is not None:
            held.shutdown()


def replay_report(model, arch, held, hf_dir: str, noise: float = 5e-4, count: int = 8, new_tokens: int = 24) -> dict:
    """Engine vs Megatron log-prob mismatch without/with routing replay, identical and
    perturbed router weights; plus how many routing decisions the perturbation flipped.
    ``held``: the engine on rank 0 (None elsewhere), holding the weights of ``hf_dir`` as
    ``model`` does; the model's routers are restored at the end."""
    rollouts = report = None
    if held is not None:
        rollouts = _rollouts(held, arch.vocab_size, count, new_tokens)
        records = [r["routed"] for r in rollouts]
        report = {"rows_ok": all(r["routed"].shape[0] == len(r["tokens"]) - 1 for r in rollouts),
                  "engine_vs_hf_routing": _agreement(records, _hf_routing(hf_dir, rollouts, 0.0)),
                  "perturbed_routing_agreement": _agreement(records, _hf_routing(hf_dir, rollouts, noise))}
    rollouts, report = _share((rollouts, report))
    report["identical"] = {"no_replay": _mismatch(model, rollouts, replay=False),
                           "replay": _mismatch(model, rollouts, replay=True)}
    with _perturbed_routers(model, noise):
        report["perturbed"] = {"no_replay": _mismatch(model, rollouts, replay=False),
                               "replay": _mismatch(model, rollouts, replay=True)}
    return report
