"""The console of `marsrl train` (rl/observe.py): step and evaluation lines, the results table."""
from __future__ import annotations

from megatron_marsrl.rl.observe import Observer, results_table


def _eval(role_rewards: dict[str, float]) -> dict[str, float]:
    return {f"eval/{role}/{name}": value for role, reward in role_rewards.items()
            for name, value in (("accuracy", 0.5), ("reward_mean", reward))}


def test_lines_and_before_after_table(tmp_path, capsys):
    observer = Observer(tmp_path, total_steps=2, start_step=0, progress=True)
    assert observer.bar is None  # not a terminal: the step lines alone
    observer.log(0, _eval({"verifier": -0.4, "solver": -0.3}))
    for step in (1, 2):
        observer.log(step, {"rollout/solver/reward_mean": -0.25, "train/loss": 0.5, "time/step": 1.5,
                            "rollout/solver/samples": 8.0, "shared/grad_norm": float("nan")})
    observer.log(2, _eval({"verifier": 0.9, "solver": 0.0}))
    observer.close()
    assert capsys.readouterr().out.splitlines() == [
        "eval @ step 0  solver reward -0.3 acc 0.5  verifier reward -0.4 acc 0.5",
        "step 1/2  solver -0.25  loss 0.5  s 1.5",  # non-finite figures left out
        "step 2/2  solver -0.25  loss 0.5  s 1.5",
        "eval @ step 2  solver reward 0 acc 0.5  verifier reward 0.9 acc 0.5"]
    table = results_table(tmp_path).splitlines()
    assert table[0].split() == ["held-out", "evaluation", "step", "0", "step", "2"]
    # roles in pipeline order, reward before accuracy
    assert [row.split() for row in table[1:5]] == [["solver", "reward_mean", "-0.3", "0"],
                                                    ["solver", "accuracy", "0.5", "0.5"],
                                                    ["verifier", "reward_mean", "-0.4", "0.9"],
                                                    ["verifier", "accuracy", "0.5", "0.5"]]
    assert table[5].split() == ["last", "step", "(2)"]
    assert [row.split() for row in table[6:]] == [["solver", "reward_mean", "-0.25"], ["train", "loss", "0.5"],
                                                  ["seconds", "per", "step", "1.5"]]


def test_table_with_one_evaluation_or_none(tmp_path):
    observer = Observer(tmp_path, total_steps=1, start_step=0, progress=False)
    observer.log(1, {"train/loss": 0.5, "time/step": 1.0})
    observer.close()
    assert "held-out" not in results_table(tmp_path)
    observer = Observer(tmp_path, total_steps=1, start_step=1, progress=False)  # resumed: same logs
    observer.log(1, _eval({"solver": 0.25}))
    observer.close()
    assert results_table(tmp_path).splitlines()[:2] == ["held-out evaluation" + " " * 11 + "      step 1",
                                                        "  solver reward_mean" + " " * 10 + "        0.25"]
    assert results_table(tmp_path / "missing") == ""
