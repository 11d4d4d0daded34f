"""Shared bits of the subcommands: layout flags and turning expected errors into messages."""
from __future__ import annotations

import argparse
import sys
from typing import Callable


def add_layout_arguments(parser: argparse.ArgumentParser, *, what: str) -> None:
    group = parser.add_argument_group(f"parallel layout {what}")
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    group.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    group.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1)")
    group.add_argument("--etp", type=int, default=None,
                       help="expert-tensor-parallel size (default: 1 when EP>1, else TP)")


def layout_from_args(args):
    from megatron_marsrl.megatron.parallel import ParallelConfig

    return ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)


def guarded(body: Callable[[], int | None]) -> int:
    """Run ``body``; expected failures print ``error: ...`` on stderr and return 2."""
    try:
        return int(body() or 0)
    except (FileNotFoundError, FileExistsError, ValueError, NotImplementedError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def add_convert_arguments(parser: argparse.ArgumentParser, *, source: str, target: str, layout_what: str) -> None:
    parser.add_argument("--input", required=True, help=source)
    parser.add_argument("--output", required=True, help=target)
    parser.add_argument("--force", action="store_true", help="replace a non-empty --output")
    add_layout_arguments(parser, what=layout_what)
