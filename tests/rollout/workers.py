"""Run on each rank by the rollout tests (via megatron_marsrl.megatron.launch)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_marsrl.megatron.optim import OptimConfig, wrap_ddp_and_optimizer
from megatron_marsrl.megatron.verify import build_from_hf
from megatron_marsrl.megatron.weight_sync import logprob_mismatch, sync_and_verify, sync_weights
from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling
from megatron_marsrl.rollout.hf_engine import TransformersEngine
from megatron_marsrl.rollout.pool import EnginePool
from tests.megatron.reference_step import train_step

TEMPERATURE = 0.8


def _engine(kind: str, hf_dir: str, routed_experts: bool = False):
    """A rollout engine of ``kind`` on ``hf_dir``; ``routed_experts``: SGLang started so that it
    can return each token's experts (the embedded engine always can)."""
    if kind == "sglang":
        from megatron_marsrl.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(hf_dir, max_total_tokens=2048, seed=1, enable_return_routed_experts=routed_experts)
    if kind == "sglang_server":
        from megatron_marsrl.rollout.sglang_server import SGLangServer, SGLangServerConfig

        return SGLangServer(SGLangServerConfig(model_path=hf_dir, max_total_tokens=2048, seed=1,
                                               enable_return_routed_experts=routed_experts)).start()
    return TransformersEngine(hf_dir, seed=1)


def train_then_sync(hf_dir: str, layout: dict, steps: int = 2, bucket_bytes: int = 32 << 10, engine: str = "hf") -> dict:
    """Rank 0 holds an engine. Generate, compare with Megatron, train, compare the stale
    engine, sync, compare again. The probes score whole sequences at temperature 1."""
    engine = _engine(engine, hf_dir) if int(__import__("os").environ["RANK"]) == 0 else None
    arch, parallel, model = build_from_hf(hf_dir, layout)
    try:
        return _train_then_sync(model, arch, engine, steps, bucket_bytes)
    finally:
        if engine is not None:
            engine.shutdown()


def _train_then_sync(model, arch, engine, steps, bucket_bytes) -> dict:
    report = {}
    seqs = starts = gen_lp = None
    if engine is not None:
        gen = torch.Generator().manual_seed(5)
        requests = [EngineRequest(rid=str(i), prompt_ids=torch.randint(0, arch.vocab_size, (3 + i,), generator=gen).tolist(),
                                  sampling=EngineSampling(temperature=TEMPERATURE, max_new_tokens=6)) for i in range(3)]
        outs = engine.generate(requests)
        seqs = [o.prompt_ids + o.output_ids for o in outs]
        starts = [len(o.prompt_ids) for o in outs]
        gen_lp = [o.logprobs for o in outs]
        report["finish_reasons"] = [o.finish_reason for o in outs]
    report["rollout_vs_megatron"] = logprob_mismatch(model, seqs, gen_lp, temperature=TEMPERATURE, response_starts=starts)
    ddp, optimizer = wrap_ddp_and_optimizer(model, OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0))
    for _ in range(steps):
        micro = [{"tokens": torch.randint(0, arch.vocab_size, (1, 12), generator=torch.Generator().manual_seed(9))}]
        train_step(ddp, optimizer, micro, lambda logp, b: (-logp.mean(), {}))
    stale = engine.score(seqs) if engine else None
    report["stale_vs_megatron"] = logprob_mismatch(model, seqs, stale)
    pool = EnginePool([engine]) if engine is not None else None
    report["sync"] = sync_and_verify(model, arch, pool, version=1, probe=seqs, bucket_bytes=bucket_bytes)
    report["synced_vs_megatron"] = report["sync"]["mismatch"]
    report["engine_version"] = engine.weight_version if engine else None
    return report


def distributed_update(server, hf_dir: str) -> dict:
    """This process as a disaggregated trainer: it broadcasts the weights of ``hf_dir``, scaled,
    to the SGLang server ``server`` (whatever it holds) over a gloo group; the server's log-probs
    must then equal the embedded engine's holding the same weights. Closing the sender frees the
    group on both sides; a new group then carries ``hf_dir``'s own weights back."""
    from megatron_marsrl.megatron.hf_checkpoint import HFCheckpointReader
    from megatron_marsrl.rollout.weight_sync import DistributedWeightSender

    reader = HFCheckpointReader(hf_dir)
    bucket = [(n, reader.read(n, None, 0, 1) * 0.7) for n in reader.weight_map]
    seq = [[3, 17, 42, 5, 99, 8, 1, 64]]
    before = server.score(seq)
    sender = DistributedWeightSender([server])
    report = sender.send([bucket[: len(bucket) // 2], bucket[len(bucket) // 2:]], version=4)
    after = server.score(seq)
    reference = TransformersEngine(hf_dir)
    original = reference.score(seq)
    reference.update_weights([bucket], version=4)
    expected = reference.score(seq)
    # the group freed on both sides (the server no longer knows it), then a new one works
    sender.close()
    try:
        server.destroy_weights_group(sender.group_name)
        freed_on_server = False
    except ValueError as exc:  # SGLang answers 400
        freed_on_server = "does not exist" in str(exc)
    renewed = DistributedWeightSender([server], group_name="marsrl_weights_again")
    renewed.send([[(n, t / 0.7) for n, t in bucket]], version=5)
    restored = server.score(seq)
    renewed.close()
    return {"changed": max(abs(a - b) for a, b in zip(before[0], after[0])),
            "vs_reference": max(abs(a - b) for a, b in zip(after[0], expected[0])),
            "version": server.weight_version, "bytes": report["bytes"], "freed_on_server": freed_on_server,
            "freed_here": sender.group not in dist.distributed_c10d._world.pg_map,
            "restored": max(abs(a - b) for a, b in zip(original[0], restored[0]))}


def sync_that_misses_tensors(hf_dir: str, dtype: str = "float32", optimizer: str = "sgd", lr: float = 0.5,
                             forgetful: bool = True) -> dict:
    """Train one step, then sync into an engine that ignores every tensor (like SGLang with
    unknown names) or a correct one; report what sync_and_verify says."""
    from megatron_marsrl.megatron.weight_sync import WeightSyncError

    torch_dtype = getattr(torch, dtype)
    arch, parallel, model = build_from_hf(hf_dir, {}, dtype=torch_dtype)

    class Forgetful(TransformersEngine):
        def update_weights(self, buckets, *, version):
            self.weight_version = version
            return sum(len(b) for b in buckets)

    engine = (Forgetful if forgetful else TransformersEngine)(hf_dir, dtype=torch_dtype)
    ddp, opt = wrap_ddp_and_optimizer(model, OptimConfig(optimizer=optimizer, lr=lr, clip_grad=0.0))
    train_step(ddp, opt, [{"tokens": torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))}],
               lambda lp, b: (-lp.mean(), {}))
    tolerance = 1e-3 if dtype == "float32" else 0.1
    try:
        report = sync_and_verify(model, arch, EnginePool([engine]), version=1, probe=[[1, 2, 3, 4, 5, 6]],
                                 tolerance=tolerance)
    except WeightSyncError as exc:
        return {"error": str(exc)}
    return {"error": None, "readback": report["readback"], "mismatch": report["mismatch"]}

