"""marsrl train: run an RL recipe (see megatron_marsrl.rl.loop for the loop itself).

    marsrl train --recipe tiny_arithmetic                      # launches its 2 CPU ranks itself
    marsrl train --recipe tiny_arithmetic run.steps=10 engine.kind=sglang
    marsrl train --recipe tiny_arithmetic --resume             # continue from the last checkpoint
    marsrl train --recipe qwen3_30b_a3b_h100x16 --nodes 2 --dry-run   # layout + per-GPU memory, no GPU
    torchrun --nproc-per-node 8 -m megatron_marsrl.cli train --recipe my.pkg:recipe

Without torchrun's environment, the command re-executes itself under torchrun with as many
local ranks as the layout needs (or --nproc-per-node).
"""
from __future__ import annotations

import json
import logging
import os
import sys


def add_arguments(parser) -> None:
    parser.add_argument("--recipe", required=True, help="built-in recipe name (tiny_arithmetic) or 'pkg.module:fn'")
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
                        help="validate the layout and print the per-GPU memory estimate, then exit "
                             "(no GPU, no Megatron, no engine); exit 2 when it does not fit")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the cluster, for --dry-run (default 1)")


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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from megatron_marsrl.rl.loop import train

    result = train(config, resume=args.resume)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "metrics"}), flush=True)
        print(f"TensorBoard: tensorboard --logdir {result['tensorboard']}\nCheckpoints: {result['checkpoints']}",
              flush=True)
    return 0


def _dry_run(args, config) -> int:
    """Print the layout check and memory plan of `config` (megatron_marsrl.rl.dry_run)."""
    from megatron_marsrl.rl.dry_run import plan

    result = plan(config, nodes=args.nodes, gpus_per_node=args.nproc_per_node or 8)
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
    print(f"[marsrl train] launching {nproc} rank(s): {' '.join(argv[1:])}", flush=True)
    sys.stdout.flush()
    os.execv(sys.executable, argv)
    return 1  # not reached
