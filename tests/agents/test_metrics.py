"""Scoring: pass@k against brute force, per-role statistics on hand-made trajectories."""
from __future__ import annotations

import itertools

import pytest

from megatron_marsrl.agents.metrics import annotate, compute_metrics, format_metrics, pass_at_k


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_equals_brute_force_over_subsets(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(2, 1, 3)


def step(role, candidate, parsed, status="ok"):
    return {"role": role, "candidate": candidate, "parsed": parsed, "parse_status": status, "text": "",
            "passed_on": "", "finish_reason": "stop", "reasoning": None}


def run(candidates, steps, outcome, answer):
    return {"run": 0, "outcome": outcome, "answer": answer,
            "candidates": [{"answer": a, "confirmations": c} for a, c in candidates], "steps": steps}


def test_metrics_on_hand_made_trajectories():
    # run A: solver wrong (7), verifier flags it (TP), corrector fixes to 5, verifier passes it (TN) -> accepted
    run_a = run([("7", 0), ("5", 1)], [step("solver", 0, "7"), step("verifier", 0, "wrong"),
                                       step("corrector", 1, "5"), step("verifier", 1, "correct")], "accepted", "5")
    # run B: solver right (5), verifier wrongly flags it (FP), corrector breaks it to 8, verifier
    # misses that (FN), then gives no verdict (counts as a flag: TP) -> gave up
    run_b = run([("5", 0), ("8", 1)], [step("solver", 0, "5"), step("verifier", 0, "wrong"),
                                       step("corrector", 1, "8"), step("verifier", 1, "correct"),
                                       step("verifier", 1, None, "no_verdict")], "gave_up", "8")
    rec1 = annotate({"id": "a", "final_answer": "5", "runs": [run_a, run_b]}, "5")
    # problem 2: both runs end wrong, the solver never right
    run_c = run([("1", 2)], [step("solver", 0, "1"), step("verifier", 0, "correct")], "accepted", "1")
    rec2 = annotate({"id": "b", "final_answer": "1", "runs": [run_c, dict(run_c)]}, "2")
    m = compute_metrics([rec1, rec2])
    assert m["problems"] == 2 and m["k"] == 2
    assert m["solver"] == {"avg@2": pytest.approx((0.5 + 0) / 2), "pass@2": pytest.approx(0.5)}
    assert m["system"]["avg@2"] == pytest.approx(0.25) and m["system"]["pass@2"] == pytest.approx(0.5)
    assert m["system"]["vote_accuracy"] == pytest.approx(0.5)
    v = m["verifier"]
    # problem b: each run's verifier passes a wrong solution -> two more FN
    assert (v["tp"], v["fp"], v["fn"], v["tn"]) == (2, 1, 3, 1)
    assert v["precision_wrong"] == pytest.approx(2 / 3) and v["recall_wrong"] == pytest.approx(2 / 5)
    assert m["corrector"] == {"calls": 2, "fix_rate": 1.0, "break_rate": 1.0}
    assert m["outcomes"] == {"accepted": 3, "gave_up": 1}
    assert m["parse"]["verifier"] == {"no_verdict": 1, "ok": 6}
    assert rec1["runs"][0]["steps"][1]["verdict_right"] is True
    assert rec1["runs"][1]["steps"][1]["verdict_right"] is False
    iv = m["intervals"]  # each interval's value is the figure above
    assert iv["solver_avg"]["value"] == pytest.approx(0.25) and iv["system_avg"]["value"] == pytest.approx(0.25)
    assert iv["system_minus_solver"]["value"] == 0.0
    assert iv["verifier_precision_wrong"]["value"] == pytest.approx(2 / 3)
    assert iv["verifier_recall_wrong"]["value"] == pytest.approx(2 / 5) and iv["corrector_fix_rate"]["value"] == 1.0
    # one vote per problem: Wilson's interval of 1 in 2
    assert iv["vote_accuracy"] == {"value": 0.5, "low": pytest.approx(0.0945, abs=1e-4),
                                   "high": pytest.approx(0.9055, abs=1e-4)}
    text = format_metrics(m)
    assert "solver   avg@2 25.0" in text and "recall(wrong) 40.0" in text
    assert "system_minus_solver        0.0 [" in text


def test_the_loops_gain_over_the_solver_is_measured_on_the_same_runs():
    """60 problems, the Solver right on half; the loop fixes 6 of the wrong ones and keeps the
    rest: the paired difference's interval is far narrower than two separate intervals allow."""
    def record(i: int) -> dict:
        first = "5" if i % 2 else "4"
        final = "5" if i % 2 or i % 10 == 0 else "4"
        r = run([(first, 0), (final, 1)], [step("solver", 0, first)], "accepted", final)
        return annotate({"id": str(i), "final_answer": final, "runs": [r]}, "5")

    iv = compute_metrics([record(i) for i in range(60)])["intervals"]
    gain = iv["system_minus_solver"]
    assert gain["value"] == pytest.approx(0.1) and 0 < gain["low"] < 0.1 < gain["high"]
    separate = (iv["solver_avg"]["high"] - iv["solver_avg"]["low"] + iv["system_avg"]["high"] - iv["system_avg"]["low"])
    assert gain["high"] - gain["low"] < separate / 3


def test_unscored_records_are_an_error():
    with pytest.raises(ValueError, match="need reference answers"):
        compute_metrics([{"id": "x", "runs": []}])
