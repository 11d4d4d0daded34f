"""`marsrl solve` and `marsrl eval` as subprocesses against local scripted servers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import ScriptedServer, oracle_handler, oracle_respond, request_prompt, role_of

# marker -> (reference, solver answer, corrector answer)
ANSWERS = {"p1": ("5", "5", "5"), "p2": ("12", "7", "12"), "p3": ("3", "4", "9")}
LOOP = ["--accept-after", "2", "--max-failures", "2", "--retries", "1", "--retry-backoff", "0.01",
        "--concurrency", "1"]


def marsrl(*args: str | Path, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "megatron_marsrl", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"marsrl {args} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "mini.jsonl"
    rows = [{"id": m, "problem": f"[{m}] Compute the thing.", "answer": ref} for m, (ref, _, _) in ANSWERS.items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_solve_with_separate_solver_and_verifier_endpoints(dataset, tmp_path):
    respond = oracle_respond(ANSWERS)
    out = tmp_path / "results.jsonl"
    with ScriptedServer(oracle_handler(respond)) as solver, ScriptedServer(oracle_handler(respond)) as checker:
        marsrl("solve", "--input", dataset, "--output", out, "--solver-url", solver.url, "--solver-model", "S",
               "--verifier-url", checker.url, "--verifier-model", "V", *LOOP)
    assert {role_of(request_prompt(p, b)) for p, b in solver.requests} == {"solver"}
    assert {role_of(request_prompt(p, b)) for p, b in checker.requests} == {"verifier", "corrector"}
    assert {b["model"] for _, b in solver.requests} == {"S"} and {b["model"] for _, b in checker.requests} == {"V"}
    assert all(b["temperature"] == 0.6 and b["top_p"] == 0.95 for _, b in solver.requests + checker.requests)
    records = {r["id"]: r for r in read_jsonl(out)}
    assert set(records) == {"p1", "p2", "p3"}
    p2 = records["p2"]
    assert p2["final_answer"] == "12" and p2["final_correct"] is True
    assert [s["role"] for s in p2["runs"][0]["steps"]] == ["solver", "verifier", "corrector", "verifier", "verifier"]
    assert p2["runs"][0]["steps"][0]["reasoning"] == "scratch work"  # kept in the record, not passed on
    assert records["p3"]["runs"][0]["outcome"] == "gave_up" and records["p3"]["final_correct"] is False


def test_solve_one_problem_prints_the_answer(tmp_path):
    with ScriptedServer(oracle_handler(oracle_respond({"q": ("5", "5", "5")}))) as server:
        proc = marsrl("solve", "--problem", "[q] What is 2+3?", "--solver-url", server.url, *LOOP)
    assert proc.stdout.strip() == "5"


def test_eval_prints_and_writes_metrics(dataset, tmp_path):
    out = tmp_path / "eval.jsonl"
    with ScriptedServer(oracle_handler(oracle_respond(ANSWERS))) as server:
        proc = marsrl("eval", "--input", dataset, "--output", out, "--solver-url", server.url, "--k", "2",
                      "--api", "completions", *LOOP)
    assert all(p == "/v1/completions" for p, _ in server.requests)
    metrics = json.loads((tmp_path / "eval.jsonl.metrics.json").read_text())
    assert metrics["k"] == 2 and metrics["problems"] == 3
    assert metrics["solver"]["avg@2"] == pytest.approx(1 / 3)      # only p1's first solution is right
    assert metrics["system"]["avg@2"] == pytest.approx(2 / 3)      # p2 gets fixed, p3 does not
    assert metrics["system"]["vote_accuracy"] == pytest.approx(2 / 3)
    assert metrics["verifier"]["precision_wrong"] == 1.0 and metrics["verifier"]["recall_wrong"] == 1.0
    assert metrics["corrector"]["fix_rate"] == pytest.approx(0.5)   # p2 fixed twice, p3 never
    assert "system   avg@2 66.7" in proc.stdout
    # scoring again needs no server
    again = marsrl("eval", "--input", dataset, "--output", out, "--score-only")
    assert "system   avg@2 66.7" in again.stdout


def test_endpoint_failure_keeps_finished_results_and_resume_completes(dataset, tmp_path):
    out = tmp_path / "partial.jsonl"
    healthy = oracle_handler(oracle_respond(ANSWERS))

    def flaky(path, body):
        return (500, "engine crashed") if "[p3]" in request_prompt(path, body) else healthy(path, body)

    with ScriptedServer(flaky) as server:
        proc = marsrl("solve", "--input", dataset, "--output", out, "--solver-url", server.url, *LOOP, check=False)
    assert proc.returncode == 1
    assert "failed after 2 attempts: HTTP 500" in proc.stderr and "rerun with --resume" in proc.stderr
    assert [r["id"] for r in read_jsonl(out)] == ["p1", "p2"]

    refused = marsrl("solve", "--input", dataset, "--output", out, "--solver-url", "http://127.0.0.1:9", check=False)
    assert refused.returncode != 0 and "pass --resume" in refused.stderr

    with ScriptedServer(healthy) as server:
        marsrl("solve", "--input", dataset, "--output", out, "--solver-url", server.url, "--resume", *LOOP)
    assert all("[p3]" in request_prompt(p, b) for p, b in server.requests)  # done ids were skipped
    assert [r["id"] for r in read_jsonl(out)] == ["p1", "p2", "p3"]


def test_resume_drops_a_half_written_line(dataset, tmp_path):
    out = tmp_path / "cut.jsonl"
    with ScriptedServer(oracle_handler(oracle_respond(ANSWERS))) as server:
        marsrl("solve", "--input", dataset, "--output", out, "--solver-url", server.url, "--limit", "1", *LOOP)
        with out.open("a") as f:
            f.write('{"id": "p2", "runs": [')  # a crash in the middle of a write
        proc = marsrl("solve", "--input", dataset, "--output", out, "--solver-url", server.url, "--resume", *LOOP)
    assert "dropping an incomplete last line" in proc.stderr
    assert [r["id"] for r in read_jsonl(out)] == ["p1", "p2", "p3"]


def test_bad_dataset_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "?"}\n')
    proc = marsrl("solve", "--input", bad, "--output", tmp_path / "o.jsonl", "--solver-url", "http://x", check=False)
    assert proc.returncode != 0 and "no usable problem" in proc.stderr
    assert f"{bad}:1: skipped row (missing_problem)" in proc.stderr  # the one dataset reader: rl/data.py
