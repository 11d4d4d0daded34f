#!/usr/bin/env python3
"""Checkpoint conversion/export throughput benchmark; same as `marsrl bench convert` (see --help).

    python tools/bench_convert.py --size-mb 300 --repeats 3
"""
import sys

from megatron_marsrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "convert", *sys.argv[1:]]))
