"""marsrl convert mcore-to-hf: Megatron torch_dist checkpoint -> HF safetensors."""
from __future__ import annotations

from megatron_marsrl.commands._common import add_convert_arguments, guarded, layout_from_args


def add_arguments(parser) -> None:
    add_convert_arguments(parser, source="Megatron checkpoint directory written by marsrl",
                          target="HF checkpoint directory to create",
                          layout_what="used to load the checkpoint for export (default: one process)")


def run(args) -> int:
    from megatron_marsrl.megatron.convert import mcore_to_hf

    return guarded(lambda: mcore_to_hf(args.input, args.output, layout_from_args(args), force=args.force) and 0)
