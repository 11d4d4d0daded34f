"""Problem loading (bad rows, eval sets), the arithmetic task, spec strings, and the stream."""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest

from megatron_marsrl.data_types import Problem
from megatron_marsrl.rl.data import (DataError, ProblemStream, arithmetic_phrasings, arithmetic_problems,
                                     arithmetic_split, check_arithmetic_splits, dataset_from_spec, load_problems)

_ROOT = Path(__file__).resolve().parents[2]
_EVAL_DIRS = [_ROOT.parent / "shared" / "data", _ROOT / "shared" / "data"]
EVAL_DATA = next((d for d in _EVAL_DIRS if (d / "aime2025.jsonl").exists()), None)


def eval_data_dir() -> Path:
    """The shared eval sets. CI has them (and sets CI=true): there a missing directory fails
    instead of silently skipping; a local checkout without them skips."""
    if EVAL_DATA is None:
        searched = ", ".join(str(d) for d in _EVAL_DIRS)
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"CI={os.environ['CI']}: the eval sets are missing (looked for aime2025.jsonl in {searched})")
        pytest.skip(f"shared/data eval sets not present (looked in {searched}); CI is unset")
    return EVAL_DATA


def write_lines(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


def _expression(problem) -> str:
    """The expression of a generated problem, without its wording."""
    return problem.problem.removeprefix("What is ").removeprefix("Compute ").rstrip("?.")


def test_bad_rows_reported_with_line_numbers_and_counted(tmp_path, caplog):
    path = write_lines(tmp_path / "mixed.jsonl", [
        json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}),          # 1 ok
        "{not json",                                                        # 2
        json.dumps(["a", "list"]),                                          # 3
        json.dumps({"answer": "3"}),                                        # 4
        json.dumps({"problem": "  ", "answer": "3"}),                       # 5
        json.dumps({"problem": "x?"}),                                      # 6
        json.dumps({"problem": "x?", "answer": ""}),                        # 7
        json.dumps({"problem": "x?", "answer": [1, 2]}),                    # 8
        json.dumps({"problem": "x?", "answer": True}),                      # 9
        json.dumps({"id": "a", "problem": "again?", "answer": "1"}),        # 10
        json.dumps({"id": ["no"], "problem": "x?", "answer": "1"}),         # 11
        b"\xff\xfe",                                                        # 12
        "",                                                                 # 13 blank: ignored
        json.dumps({"question": "2*3?", "answer": 6}),                      # 14 ok, default id
        json.dumps({"id": 7, "problem": "half?", "answer": 0.5}),           # 15 ok
    ])
    with caplog.at_level(logging.WARNING, logger="megatron_marsrl.rl.data"):
        report = load_problems(path)
    assert report.problems == [Problem(id="a", problem="1+1?", answer="2"),
                               Problem(id="mixed-14", problem="2*3?", answer="6"),
                               Problem(id="7", problem="half?", answer="0.5")]
    assert report.skipped == [(2, "not_json"), (3, "not_object"), (4, "missing_problem"),
                              (5, "missing_problem"), (6, "missing_answer"), (7, "missing_answer"),
                              (8, "bad_answer"), (9, "bad_answer"), (10, "duplicate_id"), (11, "bad_id"),
                              (12, "not_utf8")]
    assert report.counts == {"not_json": 1, "not_object": 1, "missing_problem": 2, "missing_answer": 2,
                             "bad_answer": 2, "duplicate_id": 1, "bad_id": 1, "not_utf8": 1}
    for line, reason in report.skipped:
        assert any(f"{path}:{line}:" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    assert any("line 1" in r.getMessage() for r in caplog.records)  # the duplicate names the first use


def test_answer_optional_when_solving(tmp_path):
    path = write_lines(tmp_path / "solve.jsonl", [json.dumps({"problem": "1+1?"}),
                                                  json.dumps({"problem": "2+2?", "answer": " "}),
                                                  json.dumps({"problem": "3+3?", "answer": [6]})])
    report = load_problems(path, require_answer=False)
    assert report.problems == [Problem(id="solve-1", problem="1+1?", answer=""),
                               Problem(id="solve-2", problem="2+2?", answer="")]
    assert report.skipped == [(3, "bad_answer")]


def test_all_bad_empty_and_missing_files_raise(tmp_path):
    bad = write_lines(tmp_path / "bad.jsonl", ["{", json.dumps({"problem": "x"})])
    with pytest.raises(DataError, match=r"bad\.jsonl.*no usable problem.*not_json.*missing_answer"):
        load_problems(bad)
    with pytest.raises(DataError, match="empty"):
        load_problems(write_lines(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(DataError, match="missing.jsonl"):
        load_problems(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("name,count", [("aime2025", 30), ("beyond_aime", 100)])
def test_eval_sets_load_cleanly(name, count):
    path = eval_data_dir() / f"{name}.jsonl"
    raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    report = load_problems(path)
    assert len(raw) == count and not report.skipped
    # every line loads, in file order, with the file's own id, problem text and answer
    assert report.problems == [Problem(id=r["id"], problem=r["problem"], answer=r["answer"]) for r in raw]
    assert [p.id for p in report.problems] == [f"{name}-{i}" for i in range(count)]
    assert all(p.problem.strip() == p.problem and len(p.problem) > 50 for p in report.problems)
    answers = {p.id: p.answer for p in report.problems}
    if name == "aime2025":  # AIME answers are integers 0..999, except one released as "336^\\circ"
        assert answers["aime2025-0"] == "204" and answers["aime2025-20"] == "336^\\circ"
        assert all(a.isdigit() and int(a) < 1000 for i, a in answers.items() if i != "aime2025-20")
    else:  # BeyondAIME's integer answers, written as decimal strings
        assert all(re.fullmatch(r"-?\d+", a) for a in answers.values())


def test_arithmetic_is_deterministic_and_well_formed():
    a = arithmetic_problems(300, seed=3)
    assert a == arithmetic_problems(300, seed=3)
    assert a != arithmetic_problems(300, seed=4)
    assert len({p.problem for p in a}) == len({p.id for p in a}) == 300
    for p in a:
        expr = _expression(p)
        assert int(p.answer) == eval(expr) >= 0  # noqa: S307 - our own digits and + - * only
        assert all(int(tok) <= 9 for tok in expr.split() if tok.isdigit())
    small = arithmetic_problems(50, seed=0, max_terms=2, ops="+")
    assert all(p.problem.count("+") == 1 for p in small)


def test_arithmetic_fits_the_embedded_task_vocabulary():
    from megatron_marsrl.agents.arithmetic import VOCAB

    problems = arithmetic_problems(500, seed=0) + arithmetic_problems(100, seed=0, split="eval")
    words = {w for p in problems for w in re.findall(r"\d|[^\W\d]+|[^\w\s]", p.problem)}
    assert words <= set(VOCAB)
    assert all(p.answer.isdigit() for p in problems)  # the task's parser reads leading digits only


def test_arithmetic_splits_are_disjoint():
    train = arithmetic_problems(2000, seed=0, split="train")
    evals = arithmetic_problems(300, seed=0, split="eval") + arithmetic_problems(300, seed=1, split="eval")
    assert not {_expression(p) for p in train} & {_expression(p) for p in evals}
    assert not {p.problem for p in train} & {p.problem for p in evals}
    assert all(arithmetic_split(_expression(p)) == "eval" for p in evals)
    with pytest.raises(DataError, match="only"):
        arithmetic_problems(100, seed=0, split="eval", max_terms=2)
    with pytest.raises(DataError, match="split"):
        arithmetic_problems(10, seed=0, split="test")


def test_a_larger_holdout_moves_expressions_from_train_to_eval_only():
    """`holdout` is the percent held out: the two splits of one holdout are disjoint and cover
    the difficulty's expressions, and raising it moves expressions out of training into the
    held-out split, never back."""
    every = {f"{a} + {b}" for a in range(10) for b in range(10)} | \
        {f"{a} - {b}" for a in range(10) for b in range(a + 1)}

    def split(name, holdout):
        size = sum(arithmetic_split(e, holdout) == name for e in every)
        problems = arithmetic_problems(size, seed=0, split=name, max_operand=9, max_terms=2, ops="+-", holdout=holdout)
        return {_expression(p) for p in problems}

    train10, eval10, train65, eval65 = split("train", 10), split("eval", 10), split("train", 65), split("eval", 65)
    assert train10 | eval10 == train65 | eval65 == every and not train10 & eval10 and not train65 & eval65
    assert eval10 < eval65 and train65 < train10 and len(eval65) >= 100
    with pytest.raises(DataError, match="only 101 distinct.*holdout=65"):
        arithmetic_problems(102, seed=0, split="eval", max_operand=9, max_terms=2, ops="+-", holdout=65)
    for holdout in (0, 100):
        with pytest.raises(DataError, match="holdout in 1..99"):
            arithmetic_problems(5, seed=0, holdout=holdout)


def test_train_and_eval_specs_must_hold_out_the_same_share(tmp_path):
    check_arithmetic_splits("arithmetic:train?n=50&holdout=65", "arithmetic:eval?n=100&holdout=65")
    check_arithmetic_splits("arithmetic:train?n=50&holdout=10", "arithmetic:eval?n=10")  # 10 is the default
    check_arithmetic_splits(str(tmp_path / "train.jsonl"), "arithmetic:eval?n=10&holdout=65")  # a file: no split
    with pytest.raises(DataError, match="holdout=10% .* holdout=65%.*same holdout"):
        check_arithmetic_splits("arithmetic:train?n=50", "arithmetic:eval?n=100&holdout=65")


def test_each_arithmetic_problem_in_both_wordings_and_others_as_they_are():
    problems = arithmetic_problems(30, seed=0, max_terms=3)
    other = Problem(id="x", problem="What is the capital of France?", answer="Paris")
    out = arithmetic_phrasings([*problems, other])
    assert out[-1] == other and len(out) == 2 * len(problems) + 1
    for p, (a, b) in zip(problems, zip(out[0:-1:2], out[1:-1:2])):
        expr = _expression(p)
        assert (a.problem, b.problem) == (f"What is {expr}?", f"Compute {expr}.")
        assert a.id == b.id == p.id and a.answer == b.answer == p.answer
        assert p in (a, b)


def test_dataset_from_spec(tmp_path):
    assert dataset_from_spec("arithmetic:train?n=20&seed=5&max_terms=2") == \
        arithmetic_problems(20, seed=5, max_terms=2)
    assert len(dataset_from_spec("arithmetic:eval?n=8")) == 8
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"problem": "q", "answer": "1"})])
    assert dataset_from_spec(str(path)) == [Problem(id="p-1", problem="q", answer="1")]
    with pytest.raises(DataError, match="unknown parameter 'size'.*valid: n, seed"):
        dataset_from_spec("arithmetic:train?size=3")
    with pytest.raises(DataError, match="n='x'"):
        dataset_from_spec("arithmetic:train?n=x")
    with pytest.raises(DataError, match="bad query"):
        dataset_from_spec("arithmetic:train?n")


def test_stream_resume_matches_uninterrupted_run():
    problems = arithmetic_problems(23, seed=0)
    straight = ProblemStream(problems, problems_per_step=4, seed=7)
    expected = [straight.next_step() for _ in range(20)]

    first = ProblemStream(problems, problems_per_step=4, seed=7)
    got = [first.next_step() for _ in range(9)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = ProblemStream(problems, problems_per_step=4, seed=7)
    resumed.load_state_dict(state)
    got += [resumed.next_step() for _ in range(11)]
    assert got == expected


def test_stream_epochs_shuffle_and_never_repeat_within_a_step():
    problems = arithmetic_problems(10, seed=0)
    stream = ProblemStream(problems, problems_per_step=4, seed=0)
    steps = [stream.next_step() for _ in range(6)]  # 2 steps per epoch: 3 epochs
    assert stream.epoch == 2
    assert all(len({p.id for p in step}) == 4 for step in steps)
    epochs = [steps[i] + steps[i + 1] for i in (0, 2, 4)]
    assert len({tuple(p.id for p in e) for e in epochs}) == 3  # a different order each epoch
    with pytest.raises(DataError, match="problems_per_step"):
        ProblemStream(problems, problems_per_step=11)


def test_stream_refuses_state_of_other_data_or_seed():
    state = ProblemStream(arithmetic_problems(10, seed=0), problems_per_step=2, seed=0).state_dict()
    with pytest.raises(DataError, match="fingerprint"):
        ProblemStream(arithmetic_problems(10, seed=1), problems_per_step=2, seed=0).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        ProblemStream(arithmetic_problems(10, seed=0), problems_per_step=2, seed=1).load_state_dict(state)
