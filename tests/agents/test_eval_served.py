"""`marsrl eval` through SGLang's own OpenAI-compatible server serving a real pretrained model
(SmolLM2-135M-Instruct, chat template from its checkpoint), started by `--serve` on loopback:
the client path users point at their clusters. Accuracy on AIME is ~0; the path is the test."""
from __future__ import annotations

import json

import psutil
import pytest

from tests.rl.test_data import eval_data_dir

from .test_solve_eval_cli import marsrl, read_jsonl


def test_serve_refuses_urls_and_missing_checkpoints(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}) + "\n")
    proc = marsrl("eval", "--input", data, "--output", tmp_path / "o.jsonl", "--serve", tmp_path,
                  "--solver-url", "http://127.0.0.1:1", check=False)
    assert proc.returncode != 0 and "--serve starts its own server" in proc.stderr
    proc = marsrl("eval", "--input", data, "--output", tmp_path / "o.jsonl", "--serve", tmp_path / "nope", check=False)
    assert proc.returncode != 0 and "no config.json" in proc.stderr


def _servers_of(model_dir: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "sglang.launch_server" in cmd and model_dir in cmd:
            found.append(p)
    return found


@pytest.mark.slow
def test_eval_on_aime_through_sglang_server(smollm2_hf, tmp_path):
    out = tmp_path / "aime.jsonl"
    proc = marsrl("eval", "--input", eval_data_dir() / "aime2025.jsonl", "--output", out, "--serve", smollm2_hf,
                  "--limit", "2", "--max-tokens", "24", "--max-rounds", "1", "--retries", "0", timeout=600)
    assert "serving" in proc.stderr and "with SGLang at http://127.0.0.1:" in proc.stderr
    records = read_jsonl(out)
    assert sorted(r["id"] for r in records) == ["aime2025-0", "aime2025-1"]
    solver_steps = [s for r in records for run in r["runs"] for s in run["steps"] if s["role"] == "solver"]
    assert solver_steps and all(s["text"].strip() for s in solver_steps)  # the model wrote through chat
    metrics = json.loads(out.with_name(out.name + ".metrics.json").read_text())
    assert metrics["problems"] == 2 and metrics["k"] == 1
    # the printed figures are the records' own: each run's first Solver answer and final answer
    from megatron_marsrl.agents.metrics import annotate

    answers = {r["id"]: r["answer"] for r in read_jsonl(eval_data_dir() / "aime2025.jsonl")}
    marked = [annotate(r, answers[r["id"]]) for r in records]
    assert metrics["solver"]["avg@1"] == sum(r["runs"][0]["solver_correct"] for r in marked) / 2
    assert metrics["system"]["avg@1"] == sum(r["runs"][0]["correct"] for r in marked) / 2
    assert "solver   avg@1" in proc.stdout
    assert not _servers_of(smollm2_hf)  # stopped at exit
