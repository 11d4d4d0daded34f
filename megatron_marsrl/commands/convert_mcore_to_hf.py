"""marsrl convert mcore-to-hf: Megatron torch_dist checkpoint -> HF safetensors."""
from __future__ import annotations

from megatron_marsrl.commands._common import add_layout_arguments, guarded, layout_from_args


def add_arguments(parser) -> None:
    parser.add_argument("--input", required=True, help="Megatron checkpoint directory written by marsrl")
    parser.add_argument("--output", required=True, help="HF checkpoint directory to create")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --output")
    add_layout_arguments(parser, what="used to load the checkpoint for export (default: one process)")


def run(args) -> int:
    from megatron_marsrl.megatron.convert import mcore_to_hf

    return guarded(lambda: mcore_to_hf(args.input, args.output, layout_from_args(args), force=args.force) and 0)
