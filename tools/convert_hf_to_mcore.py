#!/usr/bin/env python3
"""Convert a checkpoint: HF safetensors -> Megatron torch_dist. Runs on CPU.

Same as `marsrl convert hf-to-mcore`; see --help. Example:
    python tools/convert_hf_to_mcore.py --input IN_DIR --output OUT_DIR --tp 2 --ep 2
"""
import sys

from megatron_marsrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-mcore", *sys.argv[1:]]))
