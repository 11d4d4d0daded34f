"""marsrl bench learning: final held-out figures of algorithm variants x seeds on a recipe
(megatron_marsrl.rl.bench_learning).

    marsrl bench learning                                   # the "advantages" grid, 2 seeds, 150 steps
    marsrl bench learning --grid selection --seeds 1,2,3
    marsrl bench learning --variant at_grpo --override loss.old_logprobs=rollout \
                          --variant custom:loss.ratio=sequence,loss.clip_low=3e-4,loss.clip_high=4e-4

Each (variant, seed) is one `marsrl train` run (one after the other; the later runs of a seed
reuse a copy of its first run's warm start); the table (mean +- std over seeds) is printed and
written with a bar chart to --output.
"""
from __future__ import annotations

import sys
from pathlib import Path


def add_arguments(parser) -> None:
    from megatron_marsrl.rl.bench_learning import GRIDS, VARIANTS

    parser.add_argument("--recipe", default="tiny_arithmetic_sft_rl",
                        help="recipe every run trains (default tiny_arithmetic_sft_rl, the CPU main job)")
    parser.add_argument("--steps", type=int, default=150, help="RL steps of each run (run.steps; default 150)")
    parser.add_argument("--grid", default="advantages", choices=sorted(GRIDS),
                        help="a named group of variants (default advantages: " + ", ".join(GRIDS["advantages"]) + ")")
    parser.add_argument("--variant", action="append", default=[],
                        help="a variant instead of --grid (repeatable): " + ", ".join(VARIANTS)
                        + ", or custom:key=value,key=value")
    parser.add_argument("--seeds", default="1234,1235", help="comma-separated run.seed values (default 1234,1235)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="train config override applied to every run (repeatable)")
    parser.add_argument("--output", default="outputs/bench_learning", help="where the runs and the report go")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")


def run(args) -> int:
    from megatron_marsrl.commands._common import guarded

    return guarded(lambda: _bench(args))


def _bench(args) -> int:
    from megatron_marsrl.rl import bench_learning as bl

    variants = list(args.variant) or list(bl.GRIDS[args.grid])
    for v in variants:
        bl.variant_overrides(v)  # unknown names fail before anything runs
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        raise ValueError(f"--seeds {args.seeds!r}: give integers separated by commas") from None
    out = Path(args.output)
    bl.check_new(out, variants, seeds)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    warm_starts: dict[int, Path] = {}  # seed -> its first run's warm start directory
    for variant in variants:
        for seed in seeds:
            overrides = [f"run.steps={args.steps}", *args.override]
            result = bl.run_one(args.recipe, variant, seed, out, overrides, timeout=args.timeout,
                                warm_start=warm_starts.get(seed))
            warm_starts.setdefault(seed, Path(result.run_dir) / "warm_start")
            figures = "  ".join(f"{k[len('eval/'):]} {v:.3f}" for k, v in result.final.items())
            warm = f", warm start {result.warm_start_seconds / 60:.1f} min" if result.warm_start_seconds else ""
            print(f"{variant} seed {seed}: {figures}  ({result.seconds / 60:.1f} min{warm})", flush=True)
            results.append(result)
    command = "marsrl " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "marsrl bench learning"
    print(bl.write_report(results, out, seeds=seeds, command=command))
    print(f"report: {out / 'learning.md'}, chart: {out / 'learning.png'}", flush=True)
    return 0
