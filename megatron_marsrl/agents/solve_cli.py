"""`marsrl solve`: run the Solver-Verifier-Corrector loop on one problem or a JSONL file.

Unlike a plain solver, every solution is checked by the Verifier and revised
by the Corrector until it is confirmed `--accept-after` times in a row (see
`megatron_marsrl.agents.system`). Any OpenAI-compatible server works (SGLang:
`python -m sglang.launch_server --model-path ... --port 30000`); the Solver
and the Verifier / Corrector can use different servers and models.

    marsrl solve --solver-url http://127.0.0.1:30000 --problem "Find 2+2."
    marsrl solve --solver-url http://127.0.0.1:30000 --input ../shared/data/aime2025.jsonl \\
        --output runs/aime.jsonl --runs 4 [--resume]

Each finished problem is appended to --output at once (one JSON line with the
whole trajectory), so an error keeps what finished; --resume skips those ids.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_marsrl.agents.client import EndpointConfig, EndpointError, OpenAIClient, SamplingParams
from megatron_marsrl.agents.client import chat_template_renderer, render_plain
from megatron_marsrl.agents.metrics import annotate
from megatron_marsrl.agents.roles import role_set
from megatron_marsrl.agents.system import SLOTS, ReasoningSystem, SystemConfig
from megatron_marsrl.data_types import Problem
from megatron_marsrl.rl.data import DataError, load_problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("problems")
    one = src.add_mutually_exclusive_group(required=True)
    one.add_argument("--problem", help="solve this one problem text")
    one.add_argument("--input", type=Path, help="JSONL file with fields id, problem[, answer]")
    src.add_argument("--output", type=Path, help="results JSONL (required with --input)")
    add_run_arguments(parser)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by `marsrl solve` and `marsrl eval`."""
    io = parser.add_argument_group("results file")
    io.add_argument("--resume", action="store_true", help="skip ids already in --output and append")
    io.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    io.add_argument("--limit", type=int, help="only the first N problems of --input")
    io.add_argument("--concurrency", type=int, default=8, help="problems in flight at once (default 8)")
    ep = parser.add_argument_group("endpoints (OpenAI-compatible)")
    ep.add_argument("--serve", type=Path, metavar="HF_DIR",
                    help="start SGLang's OpenAI-compatible server for this local HF checkpoint on 127.0.0.1 "
                         "(stopped at exit) and use it for every role, instead of the --*-url options")
    ep.add_argument("--solver-url", help="Solver server, e.g. http://127.0.0.1:30000")
    ep.add_argument("--verifier-url", help="Verifier server (default: --solver-url)")
    ep.add_argument("--corrector-url", help="Corrector server (default: --verifier-url)")
    ep.add_argument("--solver-model", default="default", help="model name sent to the Solver server")
    ep.add_argument("--verifier-model", help="default: --solver-model")
    ep.add_argument("--corrector-model", help="default: --verifier-model")
    ep.add_argument("--api", choices=("chat", "completions"), default="chat", help="endpoint kind (default chat)")
    ep.add_argument("--tokenizer", help="HF tokenizer whose chat template renders prompts for --api completions")
    ep.add_argument("--timeout", type=float, default=3600.0, help="seconds per request (default 3600)")
    ep.add_argument("--retries", type=int, default=3, help="retries per request (default 3)")
    ep.add_argument("--retry-backoff", type=float, default=1.0, help="first retry delay in s, doubled each time")
    ep.add_argument("--request-concurrency", type=int, default=64, help="requests in flight per endpoint")
    sp = parser.add_argument_group("sampling (MarsRL evaluation defaults)")
    sp.add_argument("--temperature", type=float, default=0.6)
    sp.add_argument("--top-p", type=float, default=0.95)
    sp.add_argument("--max-tokens", type=int, default=65536, help="new tokens per call (default 65536)")
    loop = parser.add_argument_group("loop")
    loop.add_argument("--runs", "--k", type=int, default=1, help="independent runs per problem (default 1)")
    loop.add_argument("--accept-after", type=int, default=4, help="consecutive Correct verdicts to accept")
    loop.add_argument("--max-failures", type=int, default=10, help="consecutive Wrong verdicts to give up")
    loop.add_argument("--max-rounds", type=int, default=40, help="most verifications per run")
    for slot in SLOTS:
        loop.add_argument(f"--{slot}-role", default=slot, help=f"role for the {slot} slot: name or pkg.module:attr")


@contextlib.contextmanager
def serving(args: argparse.Namespace):
    """With ``--serve HF_DIR``: SGLang's own server (``sglang.launch_server``, tokenizer and chat
    template loaded) for that checkpoint on loopback while the block runs; every role calls it
    through the same OpenAI-compatible client as a remote cluster endpoint."""
    if args.serve is None:
        yield
        return
    if args.solver_url or args.verifier_url or args.corrector_url:
        raise SystemExit("error: --serve starts its own server; drop --solver-url/--verifier-url/--corrector-url")
    from megatron_marsrl.rollout.sglang_server import EngineStartError, SGLangServer, SGLangServerConfig

    try:
        server = SGLangServer(SGLangServerConfig(model_path=str(args.serve), openai_api=True)).start()
    except (FileNotFoundError, EngineStartError) as exc:
        raise SystemExit(f"error: --serve {args.serve}: {exc}") from exc
    print(f"serving {args.serve} with SGLang at {server.url} (log {server.log_path})", file=sys.stderr)
    args.solver_url = server.url
    try:
        yield
    finally:
        server.stop()


def endpoint_configs(args: argparse.Namespace) -> dict[str, EndpointConfig]:
    """One endpoint per slot; the Verifier defaults to the Solver's, the Corrector to the Verifier's."""
    if not args.solver_url:
        raise SystemExit("error: --solver-url is required (an OpenAI-compatible server, e.g. SGLang)")
    urls = {"solver": args.solver_url}
    urls["verifier"] = args.verifier_url or urls["solver"]
    urls["corrector"] = args.corrector_url or urls["verifier"]
    models = {"solver": args.solver_model}
    models["verifier"] = args.verifier_model or models["solver"]
    models["corrector"] = args.corrector_model or models["verifier"]
    return {slot: EndpointConfig(base_url=urls[slot], model=models[slot], api=args.api, timeout_s=args.timeout,
                                 max_retries=args.retries, backoff_s=args.retry_backoff,
                                 max_concurrency=args.request_concurrency,
                                 api_key=os.environ.get("MARSRL_API_KEY"))
            for slot in SLOTS}


def build_system(args: argparse.Namespace) -> tuple[ReasoningSystem, list[OpenAIClient]]:
    """The system described by the command line, and the clients to close afterwards."""
    render = chat_template_renderer(args.tokenizer) if args.tokenizer else render_plain
    clients = {slot: OpenAIClient(cfg, render=render) for slot, cfg in endpoint_configs(args).items()}
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    config = SystemConfig(accept_after=args.accept_after, max_failures=args.max_failures,
                          max_rounds=args.max_rounds, runs=args.runs)
    roles = role_set(args.solver_role, args.verifier_role, args.corrector_role)
    system = ReasoningSystem(roles=roles, generators=clients, sampling={s: sampling for s in SLOTS}, config=config)
    return system, list(clients.values())


def read_problems(path: Path, limit: int | None = None, *, require_answer: bool = False) -> list[Problem]:
    """The problems of a JSONL dataset (rl/data.py `load_problems`: "problem", optional
    "answer" and "id"; each bad row is skipped with a warning naming its file and line)."""
    try:
        problems = load_problems(path, require_answer=require_answer).problems
    except DataError as exc:
        raise SystemExit(f"error: {exc}") from exc
    return problems[:limit] if limit is not None else problems


class ResultsFile:
    """Append-only JSONL of finished problems; each line is flushed and fsynced."""

    def __init__(self, path: Path, *, resume: bool, overwrite: bool) -> None:
        self.path = path
        exists = path.exists() and path.stat().st_size > 0
        if exists and not (resume or overwrite):
            raise SystemExit(f"error: {path} already holds results; pass --resume to continue it "
                             "or --overwrite to replace it")
        path.parent.mkdir(parents=True, exist_ok=True)
        if overwrite and not resume:
            path.write_text("")
        self.records = self._read() if path.exists() else []

    def _read(self) -> list[dict[str, Any]]:
        text = self.path.read_text()
        lines = text.split("\n")
        if not text.endswith("\n") and lines[-1]:  # a line cut by a crash: drop it, re-run that problem
            print(f"warning: dropping an incomplete last line of {self.path}", file=sys.stderr)
            self.path.write_text("\n".join(lines[:-1]) + ("\n" if len(lines) > 1 else ""))
            lines = lines[:-1]
        return [json.loads(line) for line in lines if line.strip()]

    def done_ids(self) -> set[str]:
        return {str(r["id"]) for r in self.records}

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)


async def _solve_one(system: ReasoningSystem, problem: Problem) -> dict[str, Any]:
    result = await system.solve(problem.id, problem.problem)
    record = {"id": problem.id, **result.to_json()}
    del record["problem_id"]
    if problem.answer:
        annotate(record, problem.answer)
    return record


async def solve_rows(system: ReasoningSystem, rows: Sequence[Problem], results: ResultsFile | None,
                     concurrency: int) -> list[dict[str, Any]]:
    """Solve `rows` (at most `concurrency` at once), appending each record as it finishes.

    On an endpoint failure the other problems are cancelled and the error re-raised;
    what finished before stays in the results file.
    """
    semaphore, done = asyncio.Semaphore(concurrency), []

    async def one(row: Problem) -> dict[str, Any]:
        async with semaphore:
            return await _solve_one(system, row)

    tasks = [asyncio.create_task(one(row)) for row in rows]
    try:
        for finished in asyncio.as_completed(tasks):
            record = await finished
            if results is not None:
                results.append(record)
            done.append(record)
            _progress(record, len(done), len(rows))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return done


def _progress(record: dict[str, Any], n: int, total: int) -> None:
    accepted = sum(r["outcome"] == "accepted" for r in record["runs"])
    mark = {True: " (correct)", False: " (wrong)"}.get(record.get("final_correct"), "")
    print(f"[{n}/{total}] {record['id']}: final answer {record['final_answer']!r}{mark}, "
          f"accepted {accepted}/{len(record['runs'])} runs", file=sys.stderr, flush=True)


async def run_rows(args: argparse.Namespace, rows: list[Problem],
                   results: ResultsFile | None) -> tuple[int, list[dict[str, Any]]]:
    """Build the system and solve `rows`: (exit code, finished records); 1 on an endpoint error."""
    system, clients = build_system(args)
    try:
        records = await solve_rows(system, rows, results, args.concurrency)
        if records:
            print(f"parse outcomes per role: {json.dumps(system.counter.as_dict())}", file=sys.stderr)
        return 0, records
    except EndpointError as exc:
        kept = (f"; {len(results.records)} finished problems are in {results.path} (rerun with --resume)"
                if results is not None else "")
        print(f"error: {exc}{kept}", file=sys.stderr)
        return 1, []
    finally:
        for client in clients:
            await client.aclose()


def run(args: argparse.Namespace) -> int:
    if args.problem is not None:
        rows = [Problem(id="problem", problem=args.problem, answer="")]
        results = ResultsFile(args.output, resume=False, overwrite=True) if args.output else None
    else:
        if args.output is None:
            raise SystemExit("error: --output is required with --input")
        results = ResultsFile(args.output, resume=args.resume, overwrite=args.overwrite)
        done = results.done_ids()
        rows = [p for p in read_problems(args.input, args.limit) if p.id not in done]
        if done:
            print(f"resuming: {len(done)} problems already in {args.output}, {len(rows)} to go", file=sys.stderr)
    with serving(args):
        rc, records = asyncio.run(run_rows(args, rows, results))
    if args.problem is not None and records:
        print(records[0]["final_answer"])  # the one answer on stdout; the trajectory is in --output
    return rc
