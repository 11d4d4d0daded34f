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
    assert table[0].split() == ["held-out", "evaluation", "(95%", "interval)", "step", "0", "step", "2"]
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
    assert [row.split() for row in results_table(tmp_path).splitlines()[:2]] == [
        ["held-out", "evaluation", "(95%", "interval)", "step", "1"], ["solver", "reward_mean", "0.25"]]
    assert results_table(tmp_path / "missing") == ""


def test_table_prints_each_figure_with_its_interval_and_the_chart_draws_bands(tmp_path):
    from PIL import Image

    from megatron_marsrl.rl.observe import plot_held_out

    observer = Observer(tmp_path, total_steps=10, start_step=0, progress=False, quiet=True)
    for step, (acc, low, high) in ((0, (0.3, 0.25, 0.36)), (10, (0.6, 0.54, 0.66))):
        observer.log(step, {"eval/solver/accuracy": acc, "eval/solver/accuracy/ci_low": low,
                            "eval/solver/accuracy/ci_high": high, "eval/corrector/fix_rate": 0.5})
    observer.close()
    rows = [row.split() for row in results_table(tmp_path).splitlines()]
    assert rows[1] == ["solver", "accuracy", "0.300", "[0.250,", "0.360]", "0.600", "[0.540,", "0.660]"]
    assert rows[2] == ["corrector", "fix_rate", "0.5", "0.5"]  # no interval logged: the value alone
    assert len(rows) == 3  # the interval keys are not rows of their own
    image = Image.open(plot_held_out(tmp_path)).convert("RGB")
    # the band is shaded between the interval's ends, beside (not on) the line
    shaded = [image.getpixel((x, y)) for x in range(image.width) for y in range(image.height)
              if image.getpixel((x, y)) not in ((255, 255, 255), (230, 230, 230), (0, 0, 0))
              and all(c > 180 for c in image.getpixel((x, y)))]
    assert len(shaded) > 1000


def test_the_eval_line_shows_the_accuracy_interval_where_one_was_logged():
    from megatron_marsrl.rl.observe import eval_line

    scalars = {"eval/solver/reward_mean": 0.5, "eval/solver/accuracy": 0.6, "eval/solver/accuracy/ci_low": 0.5,
               "eval/solver/accuracy/ci_high": 0.7, "eval/verifier/reward_mean": 0.25, "eval/verifier/accuracy": 0.5}
    assert eval_line(3, scalars) == "eval @ step 3  solver reward 0.5 acc 0.6 [0.5, 0.7]  verifier reward 0.25 acc 0.5"
