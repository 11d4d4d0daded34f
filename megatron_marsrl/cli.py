"""The `marsrl` command.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs, so
``marsrl --help`` stays fast and needs neither Megatron nor SGLang.

    marsrl --help
    marsrl train --recipe tiny_arithmetic   # the embedded CPU main job: RL on 2 CPU ranks
    marsrl sft --model HF_DIR --data chats.jsonl   # supervised fine-tuning (a warm start for RL)
    marsrl selfcheck                 # HF <-> Megatron round trip with logit parity (TP2/EP2/PP2)
    marsrl convert hf-to-mcore ...   # also tools/convert_hf_to_mcore.py
    marsrl convert gguf-to-hf ...    # a GGUF file -> HF checkpoint (weights, tokenizer, chat template)
    marsrl bench convert ...         # conversion/export throughput
    marsrl solve / marsrl eval       # the Solver-Verifier-Corrector system on a dataset
"""
from __future__ import annotations

import argparse
import importlib
import sys

from megatron_marsrl import __version__

# name -> (module, one-line help). Nested groups use "group name".
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "selfcheck": ("megatron_marsrl.commands.selfcheck", "tiny Qwen3-MoE HF -> Megatron (TP2/EP2/PP2) -> HF round trip with logit parity"),
    "convert hf-to-mcore": ("megatron_marsrl.commands.convert_hf_to_mcore", "convert a HF safetensors checkpoint to a Megatron torch_dist checkpoint"),
    "convert gguf-to-hf": ("megatron_marsrl.commands.convert_gguf_to_hf", "convert a GGUF file (e.g. a llama.cpp model) to an HF checkpoint with its tokenizer and chat template"),
    "convert mcore-to-hf": ("megatron_marsrl.commands.convert_mcore_to_hf", "convert a Megatron torch_dist checkpoint back to HF safetensors"),
    "bench convert": ("megatron_marsrl.commands.bench_convert", "HF load / export throughput (GB/s) versus a raw safetensors read"),
    "bench weight-sync": ("megatron_marsrl.commands.bench_weight_sync", "Megatron -> engine weight sync (GB/s) versus an in-memory copy"),
    "bench rollout": ("megatron_marsrl.commands.bench_rollout", "generated tokens/s of the embedded and SGLang engines, side by side"),
    "train": ("megatron_marsrl.commands.train", "RL training of the Solver-Verifier-Corrector system (a recipe + key=value overrides)"),
    "sft": ("megatron_marsrl.commands.sft", "supervised fine-tuning on Megatron from JSONL chat data (loss on assistant replies); writes an HF checkpoint marsrl train starts from"),
    "bench learning": ("megatron_marsrl.commands.bench_learning", "final held-out figures (solver accuracy, verifier balanced accuracy, corrector fix rate, system accuracy) of algorithm variants x seeds, mean +- std, table and chart"),
    "bench pipeline": ("megatron_marsrl.commands.bench_pipeline", "agentic pipeline + overlapping scheduler vs synchronous RL steps (real run, or --simulate at cluster scale)"),
    "bench throughput": ("megatron_marsrl.commands.bench_throughput", "end-to-end RL step benchmark: tokens/s/GPU (rollout, train), step time parts, weight sync, train MFU (one JSON record)"),
    "solve": ("megatron_marsrl.agents.solve_cli", "run the Solver-Verifier-Corrector loop on a problem or a JSONL file"),
    "eval": ("megatron_marsrl.agents.eval_cli", "avg@k / pass@k of solver-only and the whole system on a JSONL dataset"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marsrl", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"megatron_marsrl {__version__}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        *group, leaf = name.split()
        where = top
        if group:
            if group[0] not in groups:
                gp = top.add_parser(group[0], help=f"{group[0]} subcommands")
                groups[group[0]] = gp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            where = groups[group[0]]
        sub = where.add_parser(leaf, help=help_text, description=help_text)
        sub.set_defaults(_module=module, _lazy_sub=sub)
    return parser


def _groups() -> set[str]:
    """The names that group subcommands ("convert", "bench")."""
    return {name.split()[0] for name in SUBCOMMANDS if " " in name}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # First pass finds the subcommand; its module then adds its own arguments.
    # Help flags are held back in that pass so `marsrl X --help` lists X's own options.
    first = [a for a in argv if a not in ("-h", "--help")]
    if len(first) < len(argv) and first and first[0] in _groups() and " ".join(first[:2]) not in SUBCOMMANDS:
        parser.parse_args(argv)  # `marsrl bench --help`: the group's help, listing its subcommands; exits
    known, _ = parser.parse_known_args(first) if first and not first[0].startswith("-") else (None, None)
    if known is None or getattr(known, "_module", None) is None:
        parser.parse_args(argv)  # prints help / version / the usage error and exits
        parser.print_help()
        return 0
    module = importlib.import_module(known._module)
    module.add_arguments(known._lazy_sub)
    args, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides may follow options (`train --recipe r --engine sglang run.steps=2`);
    # argparse stops collecting positionals after an option, so pick the rest up here.
    if extra and isinstance(getattr(args, "overrides", None), list) and \
            all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.parse_args(argv)  # prints the usage error and exits
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
