"""marsrl train: run an RL recipe (see megatron_marsrl.rl.loop for the loop itself).

    marsrl train --recipe tiny_arithmetic                      # launches its 2 CPU ranks itself
    marsrl train --recipe tiny_arithmetic run.steps=10 engine.kind=sglang
    marsrl train --recipe tiny_arithmetic --resume             # continue from the last checkpoint
    marsrl train --recipe qwen3_30b_a3b_h100x16 --nodes 2 --dry-run   # layout + per-GPU memory, no GPU
    torchrun --nproc-per-node 8 -m megatron_marsrl.cli train --recipe my.pkg:recipe

Without torchrun's environment, the command re-executes itself under torchrun with as many
local ranks as the layout needs (or --nproc-per-node).

The console shows a progress bar, one line per step (and per evaluation) and a results table
at the end; library logs of every rank (Megatron's INFO, warnings, prints) go to
<run>/train.log, and to the console too with --verbose (megatron_marsrl.rl.console).
"""
from __future__ import annotations

import json
import os
import sys


def add_arguments(parser) -> None:
    from megatron_marsrl.rl.recipes import RECIPES

    parser.add_argument("--recipe", required=True,
                        help="a built-in recipe (tiny_arithmetic_sft_rl: the main job, `make run`; "
                             f"all: {', '.join(RECIPES)}) or 'pkg.module:fn', a function returning a TrainConfig")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. run.steps=10 optim.lr=1e-5 parallel.tp=2 loss.tis={}")
    parser.add_argument("--config", action="append", default=[], metavar="FILE.yaml",
                        help="YAML file of overrides (nested mapping); applied before KEY=VALUE pairs")
    parser.add_argument("--engine", choices=("hf", "sglang", "sglang_server"), default=None,
                        help="shortcut for engine.kind")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="ranks to launch when not under torchrun (default: the layout's minimum); "
                             "GPUs per node for --dry-run (default 8)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the layout and print the per-GPU memory estimate and, with SGLang "
                             "engines on the GPUs, the projected step time of every mode x placement that fits; "
                             "then exit (no GPU, no Megatron, no engine); exit 2 when it does not fit")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the cluster, for --dry-run (default 1)")
    parser.add_argument("--verbose", action="store_true",
                        help="show every rank's library output (Megatron's INFO logs, warnings, prints) on "
                             "the console, logs in <run>/train.log too; by default that output goes to "
                             "<run>/train.log only and the console shows a line per step, the held-out results "
                             "table at the end, marsrl's warnings and errors")


def resolve_config(args):
    from megatron_marsrl.rl.overrides import apply_overrides, apply_yaml
    from megatron_marsrl.rl.recipes import get_recipe

    config = get_recipe(args.recipe)
    for path in args.config:
        config = apply_yaml(config, path)
    overrides = list(args.overrides) + ([f"engine.kind={args.engine}"] if args.engine else [])
    return apply_overrides(config, overrides)


def run(args) -> int:
    from megatron_marsrl.commands._common import guarded

    return guarded(lambda: _train(args))


def _train(args) -> int:
    from megatron_marsrl.rl.overrides import config_to_dict

    config = resolve_config(args)
    if args.print_config:
        print(json.dumps(config_to_dict(config), indent=2))
        return 0
    if args.dry_run:
        return _dry_run(args, config)
    if "WORLD_SIZE" not in os.environ:
        return _relaunch(args, config)
    from megatron_marsrl.rl import console

    rank = int(os.environ.get("RANK", 0))
    log_path = console.setup(config.run.output_dir, rank=rank, verbose=args.verbose)  # before Megatron's imports
    try:
        from megatron_marsrl.rl.loop import train

        result = train(config, resume=args.resume)
    except Exception as exc:
        console.report_failure(exc)
        raise
    if rank == 0:
        from megatron_marsrl.rl.observe import plot_held_out, results_table

        out = console.terminal()
        print(f"\nmarsrl train: {result['step']} of {config.run.steps} steps in {result['run_dir']}", file=out)
        print(results_table(result["run_dir"]), file=out)
        chart = plot_held_out(result["run_dir"])
        if chart is not None:
            print(f"Held-out curves: {chart}", file=out)
        print(f"TensorBoard: tensorboard --logdir {result['tensorboard']}\nCheckpoints: {result['checkpoints']}\n"
              f"Log: {log_path}", file=out, flush=True)
    return 0


def _dry_run(args, config) -> int:
    """Print the layout check, memory plan and mode x placement projection of `config`
    (megatron_marsrl.rl.dry_run)."""
    from megatron_marsrl.rl.dry_run import plan

    result = plan(config, nodes=args.nodes, gpus_per_node=args.nproc_per_node or 8, with_projection=True)
    print(result.report)
    print(result.verdict, flush=True)
    if result.problems:
        print("error: " + "; ".join(result.problems), file=sys.stderr)
        return 2
    return 0


def _relaunch(args, config) -> int:
    """exec torchrun with the layout's ranks (signals then reach torchrun and the ranks directly)."""
    from megatron_marsrl.megatron.convert import min_world_size

    nproc = args.nproc_per_node or min_world_size(config.parallel)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "megatron_marsrl.cli", *sys.argv[1:]]
    if args.verbose:
        print(f"[marsrl train] launching {nproc} rank(s): {' '.join(argv[1:])}", flush=True)
    os.execv(sys.executable, argv)
    return 1  # not reached
