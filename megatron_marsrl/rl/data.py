"""Training and evaluation problems: JSONL files, a generated arithmetic task, and the
resumable stream that hands each RL step its problems.

Dataset specs (`dataset_from_spec`):
    /path/to/problems.jsonl                      a JSONL file (see `load_problems`)
    arithmetic:train?n=512&seed=0&max_operand=9  generated problems (see `arithmetic_problems`);
                                                 the split is "train" or "eval", every
                                                 query parameter is a keyword of that function

The evaluation sets under shared/data (AIME 2025, BeyondAIME) load with `load_problems`; they
are for evaluation only and must never be used as training data.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import math
import random
import re
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_marsrl.data_types import Problem

log = logging.getLogger(__name__)

EVAL_PERCENT = 10
"""Default share (in %) of arithmetic expressions that belong to the held-out split (the spec's
`holdout`), chosen by a hash of the expression so that train and eval never share one, whatever
the seeds and sizes, as long as both name the same share (`check_arithmetic_splits`)."""
ARITHMETIC_SPEC = "arithmetic:"
_TEMPLATES = ("What is {expr}?", "Compute {expr}.")
_TEMPLATE_PATTERNS = tuple(re.compile(re.escape(t).replace(re.escape("{expr}"), "(?P<expr>[0-9+*() -]+)"))
                           for t in _TEMPLATES)


class DataError(ValueError):
    """A dataset that cannot be used at all (missing file, no valid row, bad spec)."""


@dataclass(kw_only=True)
class LoadReport:
    """The outcome of loading one JSONL file."""

    path: str
    """The file read."""
    problems: list[Problem] = field(default_factory=list)
    """Valid rows, in file order."""
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """(1-based line number, reason) of every skipped row; reasons: not_utf8, not_json,
    not_object, missing_problem, missing_answer, bad_answer, bad_id, duplicate_id."""

    @property
    def counts(self) -> dict[str, int]:
        """Skipped rows per reason."""
        return dict(collections.Counter(reason for _, reason in self.skipped))


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


# ---- JSONL files ----------------------------------------------------------------------------------

def load_problems(path: str | Path, *, require_answer: bool = True) -> LoadReport:
    """Read problems from a JSONL file: one object per line with "problem" (or "question"),
    "answer" (string or number) and an optional "id" (default "<file stem>-<line>").

    The one dataset reader (training, evaluation, `marsrl solve` / `marsrl eval`). Without
    `require_answer` (solving needs none) a row may lack "answer": its answer is "".
    Blank lines are ignored. Each bad row is logged as a warning with its file and line,
    skipped, and listed in the report. Raises DataError when the file is missing or has no
    valid row."""
    path = Path(path)
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise DataError(f"cannot read problems from {path}: {exc.strerror or exc}") from exc
    report, first_line_of = LoadReport(path=str(path)), {}
    for line_no, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            problem = _parse_row(raw, path.stem, line_no, require_answer)
            if problem.id in first_line_of:
                raise _BadRow("duplicate_id", f"id {problem.id!r} already used on line {first_line_of[problem.id]}")
        except _BadRow as bad:
            log.warning("%s:%d: skipped row (%s): %s", path, line_no, bad.reason, bad)
            report.skipped.append((line_no, bad.reason))
            continue
        first_line_of[problem.id] = line_no
        report.problems.append(problem)
    if not report.problems:
        raise DataError(f"{path}: no usable problem (skipped rows by reason: {report.counts or 'file is empty'})")
    if report.skipped:
        log.warning("%s: loaded %d problems, skipped %d rows %s", path, len(report.problems),
                    len(report.skipped), report.counts)
    return report


def _parse_row(raw: bytes, stem: str, line_no: int, require_answer: bool) -> Problem:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _BadRow("not_utf8", str(exc)) from None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _BadRow("not_json", str(exc)) from None
    if not isinstance(row, dict):
        raise _BadRow("not_object", f"expected a JSON object, got {type(row).__name__}")
    problem = row.get("problem", row.get("question"))
    if not isinstance(problem, str) or not problem.strip():
        raise _BadRow("missing_problem", f'"problem" (or "question") must be non-empty text, got {problem!r}')
    answer = row.get("answer")
    if not require_answer and (answer is None or (isinstance(answer, str) and not answer.strip())):
        return Problem(id=_row_id(row, stem, line_no), problem=problem, answer="")
    return Problem(id=_row_id(row, stem, line_no), problem=problem, answer=_answer_text(answer))


def _answer_text(answer: Any) -> str:
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise _BadRow("missing_answer", f'"answer" is missing or empty: {answer!r}')
    if isinstance(answer, str):
        return answer.strip()
    if isinstance(answer, int) and not isinstance(answer, bool):
        return str(answer)
    if isinstance(answer, float) and math.isfinite(answer):
        return str(int(answer)) if answer.is_integer() else repr(answer)
    raise _BadRow("bad_answer", f'"answer" must be text or a finite number, got {answer!r}')


def _row_id(row: dict, stem: str, line_no: int) -> str:
    if "id" not in row:
        return f"{stem}-{line_no}"
    row_id = row["id"]
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)) or not str(row_id).strip():
        raise _BadRow("bad_id", f'"id" must be non-empty text or an integer, got {row_id!r}')
    return str(row_id)


# ---- generated arithmetic -------------------------------------------------------------------------

def arithmetic_split(expression: str, holdout: int = EVAL_PERCENT) -> str:
    """"eval" for the `holdout` percent of expressions whose hash falls there, else "train"."""
    digest = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big")
    return "eval" if digest % 100 < holdout else "train"


def arithmetic_problems(n: int, *, seed: int, split: str = "train", max_operand: int = 9,
                        max_terms: int = 3, ops: str = "+-*", allow_negative: bool = False,
                        holdout: int = EVAL_PERCENT) -> list[Problem]:
    """`n` distinct problems like "What is 7 + 5?" or "Compute 3 * 4 - 2." with integer answers.

    Each has 2..`max_terms` operands in 0..`max_operand` joined by operators from `ops`, with
    the usual precedence (* before + and -). Which split an expression belongs to depends only
    on the expression and `holdout`, the percent of expressions held out (`arithmetic_split`),
    so "train" and "eval" of one `holdout` never share one (phrasing aside). Deterministic in
    (`seed`, `split`); raises DataError when the split holds fewer than `n` distinct problems of
    this difficulty."""
    if split not in ("train", "eval"):
        raise DataError(f"arithmetic split {split!r}: use 'train' or 'eval'")
    if n < 1 or max_operand < 1 or max_terms < 2 or not ops or set(ops) - set("+-*") or not 0 < holdout < 100:
        raise DataError(f"arithmetic: need n >= 1, max_operand >= 1, max_terms >= 2, ops from '+-*' and "
                        f"holdout in 1..99 (got n={n}, max_operand={max_operand}, max_terms={max_terms}, "
                        f"ops={ops!r}, holdout={holdout})")
    rng = random.Random(f"arithmetic:{seed}:{split}")
    problems: dict[str, Problem] = {}
    for _ in range(50 * n + 1000):  # rejection sampling; the cap only bites on tiny pools
        if len(problems) == n:
            break
        operands = [rng.randint(0, max_operand) for _ in range(rng.randint(2, max_terms))]
        operators = [rng.choice(ops) for _ in operands[1:]]
        expr = " ".join([str(operands[0])] + [f"{o} {v}" for o, v in zip(operators, operands[1:])])
        value = _evaluate(operands, operators)
        if expr in problems or arithmetic_split(expr, holdout) != split or (value < 0 and not allow_negative):
            continue
        text = rng.choice(_TEMPLATES).format(expr=expr)
        problems[expr] = Problem(id=f"arith-{split}-{hashlib.sha1(expr.encode()).hexdigest()[:12]}",
                                 problem=text, answer=str(value))
    if len(problems) < n:
        raise DataError(f"arithmetic {split}: found only {len(problems)} distinct problems for n={n}; "
                        f"ask for fewer, or raise max_operand, max_terms or (for eval) holdout={holdout}")
    return list(problems.values())


def arithmetic_phrasings(problems: Sequence[Problem]) -> list[Problem]:
    """Each generated arithmetic problem in every wording the generator uses ("What is 7 + 5?"
    and "Compute 7 + 5."; same id and answer), any other problem as it is. The warm start's
    demonstrations cover both: a tiny model that sees each training expression in both wordings
    answers held-out expressions better than one trained as long on one wording (README)."""
    out: list[Problem] = []
    for p in problems:
        expr = next((m["expr"] for m in (pattern.fullmatch(p.problem) for pattern in _TEMPLATE_PATTERNS) if m), None)
        out.extend([dataclasses.replace(p, problem=t.format(expr=expr)) for t in _TEMPLATES] if expr else [p])
    return out


def _evaluate(operands: Sequence[int], operators: Sequence[str]) -> int:
    """Evaluate with * before + and - (left to right otherwise)."""
    terms, signs = [operands[0]], [1]
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms))


# ---- specs and the stream -------------------------------------------------------------------------

def dataset_from_spec(spec: str) -> list[Problem]:
    """Problems named by a spec string (see the module docstring)."""
    if not spec.startswith(ARITHMETIC_SPEC):
        return load_problems(spec).problems
    split, kwargs = _arithmetic_args(spec)
    return arithmetic_problems(split=split, **kwargs)


def check_arithmetic_splits(train: str, eval: str) -> None:
    """Raise DataError when the training and held-out specs are both generated arithmetic but
    hold out different shares: an expression held out under one would be trained under the
    other. Other specs pass."""
    if not (train.startswith(ARITHMETIC_SPEC) and eval.startswith(ARITHMETIC_SPEC)):
        return
    shares = [_arithmetic_args(spec)[1].get("holdout", EVAL_PERCENT) for spec in (train, eval)]
    if shares[0] != shares[1]:
        raise DataError(f"task.train holds out holdout={shares[0]}% of the expressions and task.eval "
                        f"holdout={shares[1]}%: the two would share problems; give both specs the same holdout")


def _arithmetic_args(spec: str) -> tuple[str, dict[str, Any]]:
    """The split and the `arithmetic_problems` keywords an "arithmetic:" spec names."""
    split, _, query = spec[len(ARITHMETIC_SPEC):].partition("?")
    kwargs: dict[str, Any] = {"n": 256, "seed": 0}
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise DataError(f"dataset spec {spec!r}: bad query {query!r} ({exc}); use key=value&key=value") from None
    for key, value in pairs:
        kwargs[key] = _spec_value(spec, key, value)
    return split or "train", kwargs


def _spec_value(spec: str, key: str, value: str) -> Any:
    kinds = {"n": int, "seed": int, "max_operand": int, "max_terms": int, "ops": str, "allow_negative": bool,
             "holdout": int}
    if key not in kinds:
        raise DataError(f"dataset spec {spec!r}: unknown parameter {key!r}; valid: {', '.join(kinds)}")
    try:
        if kinds[key] is bool:
            return {"true": True, "1": True, "false": False, "0": False}[value.lower()]
        return kinds[key](value)
    except (KeyError, ValueError):
        raise DataError(f"dataset spec {spec!r}: {key}={value!r} is not a valid {kinds[key].__name__}") from None


class ProblemStream:
    """Hands out `problems_per_step` problems per RL step, walking a freshly shuffled order
    of the problems each epoch (the order of epoch e depends only on `seed` and e).

    A step never spans two epochs: the last `len(problems) % problems_per_step` problems of
    an epoch's order are left out of it (a different few each epoch), so one step never holds
    the same problem twice. `state_dict()` / `load_state_dict()` save and restore the position
    exactly, so a resumed run sees the same problems as an uninterrupted one."""

    def __init__(self, problems: Sequence[Problem], *, problems_per_step: int, seed: int = 0):
        if not 1 <= problems_per_step <= len(problems):
            raise DataError(f"problems_per_step={problems_per_step} must be in 1..{len(problems)} "
                            "(the number of problems)")
        self.problems, self.problems_per_step, self.seed = list(problems), problems_per_step, seed
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def next_step(self) -> list[Problem]:
        """The next step's problems."""
        if self.position + self.problems_per_step > len(self.problems):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        start, self.position = self.position, self.position + self.problems_per_step
        return [self.problems[i] for i in self._order[start:self.position]]

    def __iter__(self) -> Iterator[list[Problem]]:
        while True:
            yield self.next_step()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position (plus what identifies the data and order)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_problems": len(self.problems), "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; raises DataError when the problems or seed differ."""
        mine = self.state_dict()
        for key in ("seed", "num_problems", "fingerprint"):
            if state.get(key) != mine[key]:
                raise DataError(f"cannot resume the problem stream: saved {key}={state.get(key)!r}, "
                                f"now {mine[key]!r} (the dataset or seed changed)")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(f"problem-stream:{self.seed}:{epoch}").shuffle(order)
        return order

    def _fingerprint(self) -> str:
        return hashlib.sha256("\n".join(p.id for p in self.problems).encode()).hexdigest()[:16]
