"""marsrl convert hf-to-mcore: HF safetensors -> Megatron torch_dist checkpoint."""
from __future__ import annotations

from megatron_marsrl.commands._common import add_convert_arguments, guarded, layout_from_args


def add_arguments(parser) -> None:
    add_convert_arguments(parser, source="HF checkpoint directory (config.json + *.safetensors)",
                          target="Megatron checkpoint directory to create",
                          layout_what="the checkpoint is written under (any layout can load it later)")


def run(args) -> int:
    from megatron_marsrl.megatron.convert import hf_to_mcore

    return guarded(lambda: hf_to_mcore(args.input, args.output, layout_from_args(args), force=args.force) and 0)
