"""marsrl bench weight-sync: Megatron -> engine weight sync throughput vs a plain memory copy.

Builds a synthetic Qwen3-MoE-shaped checkpoint of about --size-mb, loads it into Megatron
(one process) and into the engine, then times, each --repeats times (median):
  copy   copying the same bytes between preallocated tensors in memory (the floor)
  sync   export_hf_buckets -> engine.update_weights in --bucket-mb buckets
and prints bytes, seconds, GB/s and sync/copy. On GPU (SGLang engine) the same command with
--size-mb 61000 gives the Qwen3-30B-A3B-sized figure.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--engine", default="hf", choices=("hf", "sglang"))
    parser.add_argument("--size-mb", type=int, default=150, help="approximate checkpoint size (default 150)")
    parser.add_argument("--bucket-mb", type=int, default=64, help="sync bucket size (default 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")


def run(args) -> int:
    from megatron_marsrl.commands._common import guarded

    with tempfile.TemporaryDirectory(prefix="marsrl-bench-sync-") as tmp:  # the generated model goes with it
        return guarded(lambda: _bench(args, Path(tmp)))


def _bench(args, workdir: Path) -> int:
    import torch

    from megatron_marsrl.commands.bench_convert import _median_seconds, synthetic_config, write_synthetic_checkpoint
    from megatron_marsrl.megatron.hf_config import ModelArch
    from megatron_marsrl.megatron.parallel import ParallelConfig
    from megatron_marsrl.megatron.verify import build_from_hf
    from megatron_marsrl.megatron.weight_sync import sync_weights
    from megatron_marsrl.rollout.factory import make_engine

    hf_dir = workdir / "hf"
    config = synthetic_config(args.size_mb)
    write_synthetic_checkpoint(hf_dir, config)
    engine = make_engine(args.engine, str(hf_dir))  # before Megatron's CPU patches touch torch
    arch, _, model = build_from_hf(str(hf_dir), {})
    params = [p.detach() for p in model.parameters()]
    targets = [torch.empty_like(p) for p in params]
    nbytes = sum(p.numel() * p.element_size() for p in params)

    def copy():
        for dst, src in zip(targets, params):
            dst.copy_(src)

    version = iter(range(1, 10**6))
    seconds = {"copy": _median_seconds(copy, args.repeats),
               "sync": _median_seconds(lambda: sync_weights(model, arch, engine, version=next(version),
                                                             bucket_bytes=args.bucket_mb << 20), args.repeats)}
    engine.shutdown()
    result = {"engine": args.engine, "bytes": nbytes, "bucket_mb": args.bucket_mb,
              **{k: {"seconds": s, "gb_per_s": nbytes / s / 1e9} for k, s in seconds.items()},
              "sync_over_copy": seconds["sync"] / seconds["copy"]}
    print(f"bench weight-sync: {args.engine} engine, {nbytes / 1e6:.1f} MB, {args.bucket_mb} MB buckets, median of {args.repeats}")
    for k in ("copy", "sync"):
        print(f"  {k:<5}{result[k]['seconds']:>9.3f} s{result[k]['gb_per_s']:>9.3f} GB/s")
    print(f"  sync takes {result['sync_over_copy']:.1f}x the in-memory copy of the same bytes")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
