"""Does a predicted final answer match the reference? (math-verify, with guards)

Order of checks:
  1. both texts normalised (spaces, $...$, \\boxed{}, \\text{}, degree marks,
     trailing period) and compared as strings: equal -> match. This settles
     integer answers like AIME's without sympy and makes "336^\\circ" equal "336".
  2. otherwise math_verify.parse both (wrapped in $...$) and math_verify.verify.

math_verify's own timeouts use SIGALRM, which only works in the main thread.
There they are on (`timeout_s`); in other threads they are off, and the only
guard is `max_chars` (longer answers are not parsed: no match). Every call's
outcome is one of `MatchOutcome`, so callers can count timeouts and failures.
"""
from __future__ import annotations

import enum
import math
import re
import threading
from dataclasses import dataclass

MAX_ANSWER_CHARS = 1000  # AIME-style answers are short; huge ones can make sympy run for minutes


class MatchOutcome(str, enum.Enum):
    """Why `match_answer` returned what it did."""

    SAME_TEXT = "same_text"              # normalised strings equal
    EQUIVALENT = "equivalent"            # math_verify proved equivalence
    DIFFERENT = "different"              # math_verify parsed both, not equivalent (or timed out)
    UNPARSABLE = "unparsable"            # math_verify could not parse one side
    NO_PREDICTION = "no_prediction"      # predicted answer missing or empty
    TOO_LONG = "too_long"                # longer than max_chars; not parsed


@dataclass(frozen=True)
class MatchResult:
    matched: bool
    outcome: MatchOutcome


_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_WRAPPERS = re.compile(r"\\(?:boxed|text|textbf|mathrm|displaystyle)\s*\{([^{}]*)\}")


def normalize_answer(text: str) -> str:
    """Cheap textual normal form used for the fast path (not a full canonicaliser)."""
    s = text.strip()
    for _ in range(3):  # unwrap nested \boxed{\text{...}}
        s = _WRAPPERS.sub(r"\1", s)
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    s = _DEGREES.sub("", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    return s.lower()


def match_answer(predicted: str | None, reference: str, *, timeout_s: float = 5.0,
                 max_chars: int = MAX_ANSWER_CHARS) -> MatchResult:
    """Compare a predicted final answer with the reference answer (see module docstring)."""
    if predicted is None or not predicted.strip():
        return MatchResult(False, MatchOutcome.NO_PREDICTION)
    if normalize_answer(predicted) == normalize_answer(reference):
        return MatchResult(True, MatchOutcome.SAME_TEXT)
    if len(predicted) > max_chars or len(reference) > max_chars:
        return MatchResult(False, MatchOutcome.TOO_LONG)
    return _math_verify(predicted, reference, timeout_s)


def answers_match(predicted: str | None, reference: str, *, timeout_s: float = 5.0) -> bool:
    """True when `predicted` matches `reference` (see `match_answer`)."""
    return match_answer(predicted, reference, timeout_s=timeout_s).matched


def _as_latex(text: str) -> str:
    text = text.strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def _math_verify(predicted: str, reference: str, timeout_s: float) -> MatchResult:
    import math_verify  # deferred: pulls in sympy and latex2sympy (about a second)

    # math_verify takes whole seconds and uses SIGALRM, usable only in the main thread.
    seconds = max(1, math.ceil(timeout_s)) if threading.current_thread() is threading.main_thread() else None
    gold = math_verify.parse(_as_latex(reference), parsing_timeout=seconds)
    pred = math_verify.parse(_as_latex(predicted), parsing_timeout=seconds)
    if not gold or not pred:
        return MatchResult(False, MatchOutcome.UNPARSABLE)
    if math_verify.verify(gold, pred, timeout_seconds=seconds):
        return MatchResult(True, MatchOutcome.EQUIVALENT)
    return MatchResult(False, MatchOutcome.DIFFERENT)
