"""`marsrl eval`: avg@k / pass@k of the Solver alone and of the whole system.

Runs the Solver-Verifier-Corrector loop k times per problem of a JSONL dataset
(fields id, problem, answer), like `marsrl solve --runs k`, then scores it: the
Solver alone is the first solution of each run, the system is the answer each
run ends with (plus the answer voted over the k runs); also Verifier
precision / recall on wrong solutions and the Corrector's fix rate. See
`megatron_marsrl.agents.metrics` for the definitions.

    marsrl eval --input ../shared/data/aime2025.jsonl --solver-url http://127.0.0.1:30000 \\
        --k 32 --output runs/aime_eval.jsonl [--resume]
    marsrl eval --input ../shared/data/aime2025.jsonl --output runs/aime_eval.jsonl --score-only
    marsrl eval --input ../shared/data/aime2025.jsonl --serve outputs/smollm2_hf --output runs/smol.jsonl

Metrics are printed and written as JSON to --metrics (default: OUTPUT.metrics.json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from megatron_marsrl.agents.metrics import annotate, compute_metrics, format_metrics
from megatron_marsrl.agents.solve_cli import ResultsFile, add_run_arguments, read_problems, run_rows, serving


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", type=Path, required=True, help="JSONL dataset with fields id, problem, answer")
    parser.add_argument("--output", type=Path, required=True, help="results JSONL (whole trajectories)")
    parser.add_argument("--metrics", type=Path, help="metrics JSON (default: OUTPUT.metrics.json)")
    parser.add_argument("--score-only", action="store_true",
                        help="only score the results already in --output; no endpoint is called")
    add_run_arguments(parser)


def run(args: argparse.Namespace) -> int:
    rows = read_problems(args.input, args.limit, require_answer=True)  # rows without one are skipped
    results = ResultsFile(args.output, resume=args.resume or args.score_only, overwrite=args.overwrite)
    if not args.score_only:
        done = results.done_ids()
        todo = [r for r in rows if r.id not in done]
        print(f"eval: {len(todo)} problems to run ({len(done)} already in {args.output}), "
              f"k={args.runs}", file=sys.stderr)
        with serving(args):
            rc, _ = asyncio.run(run_rows(args, todo, results))
        if rc != 0:
            return rc
    references = {r.id: r.answer for r in rows}
    records = [annotate(rec, references[rec["id"]]) for rec in results.records if rec["id"] in references]
    if not records:
        raise SystemExit(f"error: {args.output} holds no results for the problems of {args.input}")
    metrics = compute_metrics(records)
    print(format_metrics(metrics))
    path = args.metrics or args.output.with_name(args.output.name + ".metrics.json")
    path.write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"metrics written to {path}", file=sys.stderr)
    return 0
