#!/usr/bin/env python3
"""Convert a checkpoint: Megatron torch_dist -> HF safetensors. Runs on CPU.

Same as `marsrl convert mcore-to-hf`; see --help. Example:
    python tools/convert_mcore_to_hf.py --input IN_DIR --output OUT_DIR
"""
import sys

from megatron_marsrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "mcore-to-hf", *sys.argv[1:]]))
