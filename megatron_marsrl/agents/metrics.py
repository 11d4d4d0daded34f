"""Scoring inference results against reference answers.

`annotate` marks a result record (the JSON of a `ProblemResult`) with
correctness; `compute_metrics` turns annotated records into:

  solver avg@k / pass@k   the first Solver answer of each of the k runs
  system avg@k / pass@k   the answer each run ends with
  system vote accuracy    the final answer voted over the k runs
  verifier                precision / recall of flagging wrong solutions (a
                          review without a verdict counts as a flag, as in the
                          loop), over every verification
  corrector               fix rate: wrong input -> correct output; break rate:
                          correct input -> wrong output
  outcomes, parse         run outcomes and parse statuses per role
  intervals               95% intervals of the solver's and the system's avg@k, of their paired
                          difference (system - solver, the loop's gain on the same runs), of the
                          verifier's precision / recall and the corrector's fix rate (bootstrap
                          over problems, megatron_marsrl/stats.py), and of the vote accuracy
                          (Wilson: one vote per problem)

pass@k uses the unbiased estimator 1 - C(n-c, k) / C(n, k) for n runs, c correct.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from megatron_marsrl.rewards.math_match import answers_match
from megatron_marsrl.stats import bootstrap_figures, wilson_interval


def annotate(record: dict[str, Any], reference: str,
             match: Callable[[str | None, str], bool] = answers_match) -> dict[str, Any]:
    """Add "reference", "final_correct", and per run / candidate / step correctness (in place)."""
    record["reference"] = reference
    record["final_correct"] = match(record["final_answer"], reference)
    for run in record["runs"]:
        for cand in run["candidates"]:
            cand["correct"] = match(cand["answer"], reference)
        run["correct"] = match(run["answer"], reference)
        run["solver_correct"] = run["candidates"][0]["correct"]
        for step in run["steps"]:
            if step["role"] == "verifier":
                step["judged_correct"] = run["candidates"][step["candidate"]]["correct"]
                step["verdict_right"] = (step["parsed"] == "correct") == step["judged_correct"]
    return record


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k runs drawn from n (c correct) is correct."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def _accuracy_block(correct_per_problem: Sequence[Sequence[bool]], k: int) -> dict[str, float]:
    avg = sum(sum(c[:k]) / k for c in correct_per_problem) / len(correct_per_problem)
    pk = sum(pass_at_k(len(c), sum(c), k) for c in correct_per_problem) / len(correct_per_problem)
    return {f"avg@{k}": avg, f"pass@{k}": pk}


def _role_stats(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    v, corr, outcomes, parse = Counter(), Counter(), Counter(), Counter()
    for record in records:
        for run in record["runs"]:
            outcomes[run["outcome"]] += 1
            cands = run["candidates"]
            for step in run["steps"]:
                parse[(step["role"], step["parse_status"])] += 1
                if step["role"] == "verifier":
                    flagged = step["parsed"] != "correct"
                    v[("tp" if flagged else "fn") if not step["judged_correct"] else ("fp" if flagged else "tn")] += 1
                elif step["role"] == "corrector":
                    before, after = cands[step["candidate"] - 1]["correct"], cands[step["candidate"]]["correct"]
                    corr["wrong_inputs" if not before else "correct_inputs"] += 1
                    corr["fixed"] += (not before) and after
                    corr["broken"] += before and not after
    parse_table: dict[str, dict[str, int]] = {}
    for (role, status), n in sorted(parse.items()):
        parse_table.setdefault(role, {})[status] = n
    return {
        "verifier": {**{key: v[key] for key in ("tp", "fp", "fn", "tn")},
                     "precision_wrong": _ratio(v["tp"], v["tp"] + v["fp"]),
                     "recall_wrong": _ratio(v["tp"], v["tp"] + v["fn"])},
        "corrector": {"calls": corr["wrong_inputs"] + corr["correct_inputs"],
                      "fix_rate": _ratio(corr["fixed"], corr["wrong_inputs"]),
                      "break_rate": _ratio(corr["broken"], corr["correct_inputs"])},
        "outcomes": dict(outcomes),
        "parse": parse_table,
    }


def _problem_tally(record: dict[str, Any], k: int) -> Counter:
    """One problem's additive counts behind `_interval_figures` (its first k runs)."""
    t = Counter(runs=k, solver=sum(run["solver_correct"] for run in record["runs"][:k]),
                system=sum(run["correct"] for run in record["runs"][:k]))
    for run in record["runs"]:
        cands = run["candidates"]
        for step in run["steps"]:
            if step["role"] == "verifier":
                flagged = step["parsed"] != "correct"
                t["tp" if flagged else "fn"] += not step["judged_correct"]
                t["fp"] += flagged and step["judged_correct"]
            elif step["role"] == "corrector" and not cands[step["candidate"] - 1]["correct"]:
                t["wrong_inputs"] += 1
                t["fixed"] += cands[step["candidate"]]["correct"]
    return t


def _interval_figures(sums) -> dict[str, float]:
    t = Counter(sums)  # a count no problem had is 0
    # every problem counts its first k runs, so avg@k is right runs over runs
    out = {"solver_avg": t["solver"] / t["runs"], "system_avg": t["system"] / t["runs"],
           "system_minus_solver": (t["system"] - t["solver"]) / t["runs"]}
    for name, num, den in (("verifier_precision_wrong", t["tp"], t["tp"] + t["fp"]),
                           ("verifier_recall_wrong", t["tp"], t["tp"] + t["fn"]),
                           ("corrector_fix_rate", t["fixed"], t["wrong_inputs"])):
        if den:
            out[name] = num / den
    return out


def _intervals(scored: Sequence[dict[str, Any]], k: int) -> dict[str, dict[str, float]]:
    estimates = bootstrap_figures([_problem_tally(r, k) for r in scored], _interval_figures, seed="marsrl-eval")
    estimates["vote_accuracy"] = wilson_interval(sum(bool(r["final_correct"]) for r in scored), len(scored))
    return {name: {"value": e.value, "low": e.low, "high": e.high} for name, e in estimates.items()}


def compute_metrics(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Metrics of annotated records (see module docstring); k = fewest runs of any problem."""
    scored = [r for r in records if "final_correct" in r]
    if not scored:
        raise ValueError("no annotated records: results need reference answers to be scored")
    k = min(len(r["runs"]) for r in scored)
    solver = [[run["solver_correct"] for run in r["runs"]] for r in scored]
    system = [[run["correct"] for run in r["runs"]] for r in scored]
    return {
        "problems": len(scored),
        "k": k,
        "solver": _accuracy_block(solver, k),
        "system": {**_accuracy_block(system, k),
                   "vote_accuracy": sum(r["final_correct"] for r in scored) / len(scored)},
        **_role_stats(scored),
        "intervals": _intervals(scored, k),
    }


def format_metrics(m: dict[str, Any]) -> str:
    """A short human-readable table of `compute_metrics` output."""
    k = m["k"]

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}"

    lines = [f"problems: {m['problems']}   runs per problem (k): {k}",
             f"solver   avg@{k} {pct(m['solver'][f'avg@{k}'])}   pass@{k} {pct(m['solver'][f'pass@{k}'])}",
             f"system   avg@{k} {pct(m['system'][f'avg@{k}'])}   pass@{k} {pct(m['system'][f'pass@{k}'])}"
             f"   vote {pct(m['system']['vote_accuracy'])}",
             f"verifier precision(wrong) {pct(m['verifier']['precision_wrong'])}"
             f"   recall(wrong) {pct(m['verifier']['recall_wrong'])}",
             f"corrector fix rate {pct(m['corrector']['fix_rate'])}   break rate {pct(m['corrector']['break_rate'])}"
             f"   calls {m['corrector']['calls']}",
             f"outcomes {m['outcomes']}",
             "95% intervals (bootstrap over problems; vote: Wilson):"]
    for name, e in m["intervals"].items():
        lines.append(f"  {name:<26} {pct(e['value'])} [{pct(e['low'])}, {pct(e['high'])}]")
    return "\n".join(lines)
