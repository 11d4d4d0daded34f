"""marsrl bench rollout: generated tokens/s of each engine, two ways, side by side.

- "batch": the requests handed to the engine as one batch (the engine's own speed);
- "pool": the same requests sent one by one through the EnginePool, each with its own
  sampling seed, as the trainer's agents send them (the speed the trainer gets).
The ratio pool / batch is what the trainer's path costs. Same model, prompts and sampling
for each engine; start-up time is reported apart. The model is a tiny random checkpoint
(--family) unless --model points at one.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--engines", default="hf,sglang",
                        help="comma-separated: hf, sglang, sglang_server (default hf,sglang)")
    parser.add_argument("--model", default=None, help="HF checkpoint directory (default: a tiny random one)")
    parser.add_argument("--family", default="qwen3", choices=("qwen3", "qwen3_moe", "llama"))
    parser.add_argument("--batch", type=int, default=32, help="requests per batch (default 32)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per engine (median reported)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")


def run(args) -> int:
    from megatron_marsrl.commands._common import guarded

    with tempfile.TemporaryDirectory(prefix="marsrl-bench-") as tmp:  # the generated model goes with it
        return guarded(lambda: _bench(args, Path(tmp)))


def _bench(args, workdir: Path) -> int:
    import torch

    from megatron_marsrl.megatron.tiny import make_hf_checkpoint
    from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling
    from megatron_marsrl.rollout.factory import RolloutEngineConfig, start_engines

    model = args.model or str(make_hf_checkpoint(args.family, workdir / "hf"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    requests = [EngineRequest(rid=str(i), prompt_ids=torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist(),
                              sampling=EngineSampling(temperature=1.0, max_new_tokens=args.new_tokens, seed=1000 + i))
                for i in range(args.batch)]
    results = {}
    for kind in [e.strip() for e in args.engines.split(",") if e.strip()]:
        start = time.perf_counter()
        pool = start_engines(RolloutEngineConfig(
            kind=kind, max_total_tokens=max(4096, 2 * (args.prompt_len + args.new_tokens) * args.batch)), model)
        startup = time.perf_counter() - start
        engine = pool.engines[0]
        try:
            engine.generate(requests[:1])  # warm-up
            batch, one_by_one, tokens = [], [], 0
            for _ in range(args.repeats):  # alternate, so that machine noise hits both alike
                tokens, rate = _timed(lambda: engine.generate(requests))
                batch.append(rate)
                one_by_one.append(_timed(lambda: asyncio.run(_one_by_one(pool, requests)))[1])
        finally:
            pool.shutdown()
        results[kind] = {"startup_s": startup, "tokens_per_batch": tokens, "batch_tokens_per_s": statistics.median(batch),
                         "pool_tokens_per_s": statistics.median(one_by_one),
                         "pool_over_batch": statistics.median(p / b for p, b in zip(one_by_one, batch))}
    _print(args, model, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _timed(run) -> tuple[int, float]:
    """(tokens generated, tokens/s) of one run."""
    start = time.perf_counter()
    tokens = sum(len(o.output_ids) for o in run())
    return tokens, tokens / (time.perf_counter() - start)


async def _one_by_one(pool, requests):
    """Each request its own pool.generate call, as the agents send them."""
    return await asyncio.gather(*(pool.generate(r) for r in requests))


def _print(args, model, results) -> None:
    print(f"bench rollout: {model}, {args.batch} requests x {args.new_tokens} new tokens, median of {args.repeats}")
    print(f"{'engine':<15}{'start-up s':>11}{'batch tok/s':>13}{'pool tok/s':>12}{'pool/batch':>12}")
    for kind, row in results.items():
        print(f"{kind:<15}{row['startup_s']:>11.1f}{row['batch_tokens_per_s']:>13.1f}{row['pool_tokens_per_s']:>12.1f}"
              f"{row['pool_over_batch']:>12.2f}")
