"""marsrl convert hf-to-mcore: HF safetensors -> Megatron torch_dist checkpoint."""
from __future__ import annotations

from megatron_marsrl.commands._common import add_layout_arguments, guarded, layout_from_args


def add_arguments(parser) -> None:
    parser.add_argument("--input", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("--output", required=True, help="Megatron checkpoint directory to create")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --output")
    add_layout_arguments(parser, what="the checkpoint is written under (any layout can load it later)")


def run(args) -> int:
    from megatron_marsrl.megatron.convert import hf_to_mcore

    return guarded(lambda: hf_to_mcore(args.input, args.output, layout_from_args(args), force=args.force) and 0)
