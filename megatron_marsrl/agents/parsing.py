"""Parsing model outputs: reasoning blocks, final answers and verdicts.

Every output gets a `ParseStatus`; the rules, and what the system does with
each outcome (the loop in `system.py`, the rollout in `rollout.py`):

  TRUNCATED       finish_reason "length": the text stopped mid-way, so neither
                  its answer nor its verdict is trusted (value None). Checked first.
  UNCLOSED_THINK  "<think>" opened and never closed: there is no answer text.
  EMPTY           nothing left after removing the reasoning block.
  NO_ANSWER       Solver/Corrector text with no \\boxed{} and no "final answer" line.
  NO_VERDICT      Verifier text with no recognisable verdict.
  CONFLICTING_VERDICTS  both "Correct" and "Wrong" verdicts appear; the LAST one
                  is used (the prompt asks for the verdict at the very end), and
                  the case is counted. This is the only non-failure besides OK.

In the inference loop a failed solution parse means "rejected without a
verifier call" and a failed verdict parse means "not confirmed" (treated as
Wrong, never as Correct). In training both score 0 (minus any format penalty).
"""
from __future__ import annotations

import collections
import re
from dataclasses import dataclass

from megatron_marsrl.data_types import ParseStatus, Verdict

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True, kw_only=True)
class ParsedOutput:
    """What a role's parser extracted from one output."""

    value: str | None
    """The answer text, or the verdict ("correct" / "wrong"); None on failure."""
    status: ParseStatus
    """How parsing went."""
    passed_on: str
    """The text the next agent sees: the output without its reasoning block."""
    reasoning: str | None = None
    """The reasoning block's content, when there was one."""


def split_reasoning(text: str) -> tuple[str | None, str, bool]:
    """(reasoning, visible text, closed) for an output that may hold a <think> block.

    Qwen3 thinking templates put "<think>" in the prompt, so an output can
    contain only the closing tag; everything before the last "</think>" is
    reasoning. An opened but unclosed block leaves no visible text.
    """
    if THINK_CLOSE in text:
        reasoning, _, visible = text.rpartition(THINK_CLOSE)
        return reasoning.replace(THINK_OPEN, "", 1).strip(), visible.strip(), True
    if THINK_OPEN in text:
        before, _, reasoning = text.partition(THINK_OPEN)
        return reasoning.strip(), before.strip(), False
    return None, text.strip(), True


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_BARE = re.compile(r"\\boxed\s+([^\s$\\{}]+)")  # "\boxed 5"


def extract_boxed(text: str) -> list[str]:
    """Contents of every \\boxed{...} / \\fbox{...} with balanced braces, in order.

    An unbalanced trailing box (truncated text) is skipped; "\\boxed 5" is accepted.
    """
    found: list[tuple[int, str]] = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append((match.start(), text[start:i].strip()))
                break
    found.extend((m.start(), m.group(1)) for m in _BOXED_BARE.finditer(text))
    return [content for _, content in sorted(found) if content]


# A separator is required so that "before the final answer, check..." is not an answer.
_FINAL_ANSWER = re.compile(r"final\s+answer\s*(?:is\s*:?|:|=|\n)\s*(.+)", re.IGNORECASE)


def _clean_answer_line(line: str) -> str:
    """Drop markdown, math delimiters ($, \\( \\), \\[ \\]) and a trailing period."""
    line = line.strip().strip("*_` ").strip()
    line = re.sub(r"^(?:\$+|\\[(\[])|(?:\$+|\\[)\]])$", "", line.rstrip(".").strip()).strip()
    return line.rstrip(".").strip()


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: the last boxed content, else the last
    "final answer ..." line (markdown, $ and a trailing period removed)."""
    boxed = extract_boxed(text)
    if boxed:
        return boxed[-1]
    matches = _FINAL_ANSWER.findall(text.replace("**", ""))
    for candidate in reversed(matches):
        cleaned = _clean_answer_line(candidate)
        if cleaned:
            return cleaned
    return None


_MARKDOWN = re.compile(r"[*_`#>~|]")
_VERDICT_WORD = r"(not\s+correct|incorrect|correct|wrong)"
_VERDICT_PATTERNS = (
    re.compile(r"verdict\W{0,6}(?:is\W{0,3})?(?:the\s+(?:solution|proof|answer)\s+is\W{0,3})?"
               + _VERDICT_WORD + r"\b"),
    re.compile(r"\\boxed\{\s*(?:\\(?:text|textbf|mathrm|mathbf)\s*\{)?\s*" + _VERDICT_WORD + r"\b"),
)


def _verdict_of(word: str) -> Verdict:
    return Verdict.CORRECT if word == "correct" else Verdict.WRONG


def find_verdicts(text: str) -> list[Verdict]:
    """All verdicts in `text`, in order: "Verdict: X" forms and \\boxed{X}; if
    none, a last line consisting of the single word Correct / Wrong / Incorrect."""
    norm = _MARKDOWN.sub("", text).lower()
    hits: list[tuple[int, str]] = []
    for pattern in _VERDICT_PATTERNS:
        hits.extend((m.start(), re.sub(r"\s+", " ", m.group(1))) for m in pattern.finditer(norm))
    if hits:
        return [_verdict_of(word) for _, word in sorted(hits)]
    lines = [line for line in norm.splitlines() if line.strip()]
    last = re.sub(r"[^a-z ]", "", lines[-1]).strip() if lines else ""
    if last in ("correct", "wrong", "incorrect", "not correct"):
        return [_verdict_of(last)]
    return []


def _precheck(text: str, finish_reason: str) -> ParsedOutput | None:
    """The failure outcomes shared by every role, or None when the text is usable."""
    reasoning, visible, closed = split_reasoning(text)
    status = None
    if finish_reason == "length":
        status = ParseStatus.TRUNCATED
    elif not closed:
        status = ParseStatus.UNCLOSED_THINK
    elif not visible:
        status = ParseStatus.EMPTY
    if status is None:
        return None
    return ParsedOutput(value=None, status=status, passed_on=visible if closed else "", reasoning=reasoning)


def parse_solution(text: str, finish_reason: str = "stop") -> ParsedOutput:
    """Parser of the Solver and Corrector: the final answer."""
    failed = _precheck(text, finish_reason)
    if failed is not None:
        return failed
    reasoning, visible, _ = split_reasoning(text)
    answer = extract_answer(visible)
    status = ParseStatus.OK if answer is not None else ParseStatus.NO_ANSWER
    return ParsedOutput(value=answer, status=status, passed_on=visible, reasoning=reasoning)


def parse_review(text: str, finish_reason: str = "stop") -> ParsedOutput:
    """Parser of the Verifier: the verdict ("correct" / "wrong")."""
    failed = _precheck(text, finish_reason)
    if failed is not None:
        return failed
    reasoning, visible, _ = split_reasoning(text)
    verdicts = find_verdicts(visible)
    if not verdicts:
        return ParsedOutput(value=None, status=ParseStatus.NO_VERDICT, passed_on=visible, reasoning=reasoning)
    status = ParseStatus.OK if len(set(verdicts)) == 1 else ParseStatus.CONFLICTING_VERDICTS
    return ParsedOutput(value=verdicts[-1].value, status=status, passed_on=visible, reasoning=reasoning)


class ParseCounter:
    """Counts parse outcomes per role, so failures show up in logs and metrics."""

    def __init__(self) -> None:
        self._counts: collections.Counter[tuple[str, ParseStatus]] = collections.Counter()

    def record(self, role: str, status: ParseStatus) -> None:
        self._counts[(role, status)] += 1

    def count(self, role: str, status: ParseStatus) -> int:
        return self._counts[(role, status)]

    def as_dict(self) -> dict[str, dict[str, int]]:
        """{role: {status: count}} for JSON output."""
        out: dict[str, dict[str, int]] = {}
        for (role, status), n in sorted(self._counts.items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
            out.setdefault(role, {})[status.value] = n
        return out
