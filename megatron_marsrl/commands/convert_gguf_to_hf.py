"""marsrl convert gguf-to-hf: a GGUF file -> HF safetensors + tokenizer + chat template."""
from __future__ import annotations

from megatron_marsrl.commands._common import guarded


def add_arguments(parser) -> None:
    parser.add_argument("--input", required=True,
                        help="a .gguf file (any architecture and quantisation transformers' GGUF loader reads)")
    parser.add_argument("--output", required=True, help="HF checkpoint directory to create")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="dtype the weights are dequantised to (default float32)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --output written by marsrl")


def run(args) -> int:
    from megatron_marsrl.gguf import gguf_to_hf

    return guarded(lambda: gguf_to_hf(args.input, args.output, dtype=args.dtype, force=args.force) and 0)
