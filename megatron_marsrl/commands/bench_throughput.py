"""marsrl bench throughput: tokens/s/GPU (rollout and train), step time and its parts, weight
sync GB/s and train MFU of a real `marsrl train` run, as one JSON record in NeMo-RL's terms.

    marsrl bench throughput                                   # tiny_arithmetic, 6 steps, on CPU
    marsrl bench throughput --recipe my.pkg:recipe --nproc-per-node 8 --steps 10 --json out.json

The record goes to stdout (progress to stderr), OUTPUT/record.json and --json; TensorBoard
scalars `bench/...` to OUTPUT/tensorboard. See megatron_marsrl.rl.bench_throughput.
"""
from __future__ import annotations

import json
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--recipe", default="tiny_arithmetic", help="recipe to train (default tiny_arithmetic)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="train config override (repeatable), e.g. --override engine.kind=sglang")
    parser.add_argument("--steps", type=int, default=6, help="RL steps to run; the first is dropped (default 6)")
    parser.add_argument("--output-dir", default=None,
                        help="where the run, record.json and tensorboard/ go "
                             "(default outputs/bench_throughput/RECIPE-TIMESTAMP)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="ranks per node for `marsrl train` (default: the layout's minimum)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak TFLOP/s per GPU for MFU (default: datasheet table on H100/H200, measured on CPU)")
    parser.add_argument("--json", default=None, help="also write the record to this file")


def run(args) -> int:
    from megatron_marsrl.commands._common import guarded

    return guarded(lambda: _bench(args))


def _bench(args) -> int:
    from megatron_marsrl.rl.bench_throughput import run_bench

    record = run_bench(recipe=args.recipe, overrides=list(args.override), steps=args.steps,
                       output_dir=args.output_dir, nproc_per_node=args.nproc_per_node, peak_tflops=args.peak_tflops)
    text = json.dumps(record, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text, flush=True)
    return 0
