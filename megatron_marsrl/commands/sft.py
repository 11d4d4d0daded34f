"""marsrl sft: supervised fine-tuning on Megatron from JSONL chat data (megatron_marsrl.sft).

    marsrl sft --model HF_DIR --data chats.jsonl --output outputs/sft
    marsrl sft --model HF_DIR --data chats.jsonl --eval held_out.jsonl epochs=2 optim.lr=1e-5 parallel.pp=2
    torchrun --nproc-per-node 8 -m megatron_marsrl.cli sft --model ... parallel.tp=4

Without torchrun's environment the command re-executes itself under torchrun with as many
local ranks as the layout needs (or --nproc-per-node). The fine-tuned checkpoint is written
to <output>/hf: start RL from it with `marsrl train --recipe R model.path=<output>/hf`.
"""
from __future__ import annotations

import os
import sys


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="starting HF checkpoint directory")
    parser.add_argument("--data", required=True, help='training conversations: JSONL of {"messages": [...]}')
    parser.add_argument("--eval", default="", help="held-out conversations (same form) for eval/loss")
    parser.add_argument("--output", default="outputs/sft", help="run directory (hf/, metrics.jsonl, tensorboard/)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --output written by marsrl")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="ranks to launch when not under torchrun (default: the layout's minimum)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="SFTConfig overrides, e.g. epochs=2 batch_sequences=64 optim.lr=1e-5 parallel.tp=2")


def resolve_config(args):
    from megatron_marsrl.rl.overrides import apply_overrides
    from megatron_marsrl.sft import SFTConfig

    base = SFTConfig(model=args.model, data=args.data, eval=args.eval, output_dir=args.output, force=args.force)
    return apply_overrides(base, list(args.overrides))


def run(args) -> int:
    from megatron_marsrl.commands._common import guarded

    return guarded(lambda: _sft(args))


def _sft(args) -> int:
    from megatron_marsrl.sft import preflight, run_rank

    config = resolve_config(args)
    if "WORLD_SIZE" not in os.environ:
        preflight(config)  # bad data or paths fail here, before any rank starts
        from megatron_marsrl.megatron.convert import min_world_size

        nproc = args.nproc_per_node or min_world_size(config.parallel)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "-m", "megatron_marsrl.cli", *sys.argv[1:]]
        os.execv(sys.executable, argv)
    summary = run_rank(config)
    if int(os.environ.get("RANK", 0)) == 0:
        losses = "  ".join(f"{k} {v:.4g}" for k, v in summary.items() if "loss" in k)
        print(f"marsrl sft: {summary['steps']} steps on {summary['train_examples']} conversations  {losses}\n"
              f"checkpoint: {summary['hf_dir']}  (marsrl train ... model.path={summary['hf_dir']})", flush=True)
    return 0
