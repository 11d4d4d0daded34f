"""marsrl bench rollout: generated tokens/s of both engines on the same batch, side by side.

Same model, prompts and sampling for each engine; start-up time is reported separately from
generation. The model is a tiny random checkpoint (--family) unless --model points at one.
Every token is generated to the limit (random weights, no EOS), so the work is identical.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--engines", default="hf,sglang", help="comma-separated: hf, sglang (default both)")
    parser.add_argument("--model", default=None, help="HF checkpoint directory (default: a tiny random one)")
    parser.add_argument("--family", default="qwen3", choices=("qwen3", "qwen3_moe", "llama"))
    parser.add_argument("--batch", type=int, default=8, help="prompts per batch (default 8)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per engine (median reported)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")


def run(args) -> int:
    from megatron_marsrl.commands._common import guarded

    return guarded(lambda: _bench(args))


def _bench(args) -> int:
    import torch

    from megatron_marsrl.megatron.tiny import make_hf_checkpoint
    from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling
    from megatron_marsrl.rollout.factory import make_engine

    model = args.model or str(make_hf_checkpoint(args.family, Path(tempfile.mkdtemp(prefix="marsrl-bench-")) / "hf"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    requests = [EngineRequest(rid=str(i), prompt_ids=torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist(),
                              sampling=EngineSampling(temperature=1.0, max_new_tokens=args.new_tokens))
                for i in range(args.batch)]
    results = {}
    for kind in [e.strip() for e in args.engines.split(",") if e.strip()]:
        start = time.perf_counter()
        engine = make_engine(kind, model, max_total_tokens=max(4096, 2 * (args.prompt_len + args.new_tokens) * args.batch))
        startup = time.perf_counter() - start
        engine.generate(requests[:1])  # warm-up
        rates, tokens = [], 0
        for _ in range(args.repeats):
            t = time.perf_counter()
            outs = engine.generate(requests)
            tokens = sum(len(o.output_ids) for o in outs)
            rates.append(tokens / (time.perf_counter() - t))
        engine.shutdown()
        results[kind] = {"startup_s": startup, "tokens_per_batch": tokens, "tokens_per_s": statistics.median(rates)}
    _print(args, model, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _print(args, model, results) -> None:
    print(f"bench rollout: {model}, batch {args.batch} x {args.new_tokens} new tokens, median of {args.repeats}")
    base = next(iter(results.values()))["tokens_per_s"]
    print(f"{'engine':<8}{'start-up s':>12}{'tok/s':>10}{'ratio':>8}")
    for kind, row in results.items():
        print(f"{kind:<8}{row['startup_s']:>12.1f}{row['tokens_per_s']:>10.1f}{row['tokens_per_s'] / base:>8.2f}")
