"""`marsrl train` end to end on CPU with the embedded engine: what a run logs, prints and saves,
resuming, signals, skipped updates, the pipeline's variants (tests/rl/runs.py runs them)."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_marsrl.megatron.convert import mcore_to_hf
from tests.rl.runs import (ROLES, assert_same_steps, check_steps, command, run_env, step_metrics, tensorboard_tags,
                           train, wait_for)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One 3-step run of the embedded engine with MoE routing replay (the engine records each
    token's experts, Megatron replays them) and held-out evaluation at steps 0 and 3, read by
    the tests below that only look at what a run leaves behind."""
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = train(run, "run.steps=3", "run.checkpoint_every=0", "run.eval_every=3", "engine.routed_experts=true")
    return run, proc


@pytest.mark.slow
def test_train_end_to_end_embedded_engine(reference_run, tmp_path):
    run, proc = reference_run
    metrics = check_steps(run, 3)
    # every token x layer the engine recorded was routed from the record in training
    assert all(m["train/routing_replayed"] == 1.0 for m in metrics.values()), [m["train/routing_replayed"] for m in metrics.values()]
    assert metrics[3]["rollout/pending_stage_inputs"] > 0  # the pipeline carries stage inputs over
    assert metrics[3]["rollout/corrector/samples"] > 0  # every stage ran by step 3
    tags = tensorboard_tags(run)
    for role in ROLES:
        for name in ("reward_mean", "accuracy", "response_len", "advantage_std"):
            assert f"rollout/{role}/{name}" in tags
        assert f"train/{role}/mismatch_abs" in tags and f"train/{role}/entropy" in tags
        assert f"eval/{role}/reward_mean" in tags
    for tag in ("train/loss", "train/pg_loss", "train/clip_high_fraction", "shared/grad_norm", "time/rollout",
                "time/train", "time/sync", "time/overlap_fraction", "time/train_idle_fraction",
                "throughput/rollout_tokens_per_s", "rollout/verifier/precision", "rollout/verifier/recall"):
        assert tag in tags, tag
    assert (run / "checkpoints" / "step_000003" / "trainer_state.json").is_file()  # saved at the end
    assert (run / "config.json").is_file()
    assert f"tensorboard --logdir {run / 'tensorboard'}" in proc.stdout
    # the trained policy exports to HF like any converted checkpoint
    out = subprocess.run([sys.executable, "-m", "megatron_marsrl.cli", "convert", "mcore-to-hf", "--input",
                          str(run / "checkpoints" / "step_000003" / "policy_shared"), "--output", str(tmp_path / "hf")],
                         capture_output=True, text=True, env=run_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()


def test_time_shared_colocation_refuses_overlap(tmp_path):
    proc = subprocess.run(command(tmp_path / "run", "pipeline.time_shared=true"), capture_output=True, text=True,
                          env=run_env(), timeout=120)
    assert proc.returncode != 0
    assert "pipeline.time_shared needs scheduler.overlap=false" in proc.stderr


# Library chatter that belongs in <run>/train.log, not on the console.


CHATTER = ("Params for bucket", "param.main_grad.dtype",  # Megatron's gradient-buffer lists
           "OptimizerConfig(", "DistributedDataParallelConfig(",  # ...and config dumps
           "Warning", "WARNING", "is not installed", "DEPRECATED", "Timeout is disabled")  # warnings, math-verify


@pytest.mark.slow
def test_console_shows_progress_and_results_and_the_log_keeps_the_rest(reference_run, tmp_path):
    run, proc = reference_run
    console = proc.stdout + proc.stderr
    for chatter in CHATTER:
        assert chatter not in console, (chatter, console[-3000:])
    assert proc.stderr.strip() == ""  # rank 1 prints nothing, rank 0 nothing but stdout
    lines = proc.stdout.splitlines()
    for step in (1, 2, 3):
        assert any(line.startswith(f"step {step}/3  solver ") and " s " in line for line in lines), lines
    # the held-out results table, before and after training
    assert re.search(r"^held-out evaluation \(95% interval\) +step 0 +step 3$", proc.stdout, re.M), proc.stdout
    for role in ROLES:
        with_interval = r"-?[\d.]+ \[-?[\d.]+, -?[\d.]+\]"  # e.g. 0.250 [0.125, 0.375]
        assert re.search(rf"^  {role} reward_mean +{with_interval} +{with_interval}$", proc.stdout, re.M), proc.stdout
    assert f"Log: {run / 'train.log'}" in proc.stdout
    log = (run / "train.log").read_text()
    for chatter in ("Params for bucket", "OptimizerConfig(", "is not installed", "Timeout is disabled"):
        assert chatter in log, chatter
    assert " rank0 " in log and " rank1 " in log  # every rank logs there

    # A failing run shows its traceback and the log's path on the console.
    failed = subprocess.run(command(tmp_path / "failed", "run.steps=2", f"model.path={tmp_path / 'no_model'}"),
                            capture_output=True, text=True, timeout=300, env=run_env())
    assert failed.returncode != 0
    assert "in _initial_model" in failed.stderr  # the rank's traceback
    assert "FileNotFoundError: model.path=" in failed.stderr
    assert f"full log: {tmp_path / 'failed' / 'train.log'}" in failed.stderr


@pytest.mark.slow
def test_skipped_updates_pruned_checkpoints_and_a_run_directory_kept_from_a_second_run(tmp_path):
    run = tmp_path / "run"
    # a gradient-norm ceiling no update passes: every step is skipped and nothing moves
    train(run, "run.steps=3", "run.checkpoint_every=1", "run.keep_checkpoints=2", "policy.max_grad_norm=1e-12",
          "run.eval_every=0")
    metrics = step_metrics(run)
    assert [metrics[s]["shared/update_skipped"] for s in (1, 2, 3)] == [1.0, 1.0, 1.0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    hf = tmp_path / "hf"  # (the convert command's own run: test_train_end_to_end_embedded_engine)
    mcore_to_hf(run / "checkpoints" / "step_000003" / "policy_shared", hf)
    from safetensors.torch import load_file

    def tensors(d):
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    start, end = tensors(run / "initial_model"), tensors(hf)
    assert start.keys() == end.keys() and all(torch.equal(start[k], end[k]) for k in start)
    # the same directory again without --resume: refused, nothing of the first run touched
    before = (run / "metrics.jsonl").read_text()
    proc = subprocess.run(command(run, "run.steps=3"), capture_output=True, text=True, timeout=600, env=run_env())
    assert proc.returncode != 0 and "pass --resume" in proc.stdout + proc.stderr
    assert (run / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    # --resume with another config: it goes on from step 3, the first config kept as config.0.json
    train(run, "run.steps=4", "run.checkpoint_every=1", "run.keep_checkpoints=2", "run.eval_every=0", "--resume")
    assert json.loads((run / "config.0.json").read_text())["policy"]["max_grad_norm"] == 1e-12
    assert json.loads((run / "config.json").read_text())["policy"]["max_grad_norm"] is None
    metrics = step_metrics(run)
    assert sorted(metrics) == [1, 2, 3, 4] and metrics[4]["shared/update_skipped"] == 0.0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003", "step_000004"]


@pytest.mark.slow
def test_sigterm_saves_and_sigkill_loses_only_uncheckpointed_steps(tmp_path):
    """Stopped by SIGTERM, killed by SIGKILL, resumed twice with other run.steps: the same run as an
    uninterrupted one, DMMPT's per-step gate included (it comes from the previous step's entropy,
    so the checkpoints must carry it)."""
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    same = ("loss.dmmpt={}", "loss.dmmpt.entropy_target=50", "run.eval_every=0")  # every run of the four
    # SIGTERM: no periodic checkpoints, so one exists only if the signal handler saved it.
    proc = subprocess.Popen(command(run, "run.steps=50", "run.checkpoint_every=0", *same), env=run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for(lambda: len(step_metrics(run)) >= 1 if (run / "metrics.jsonl").exists() else False, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    saved = sorted(p.name for p in ckpts.glob("step_*"))
    assert len(saved) == 1, out[-3000:]
    stopped_at = int(saved[0].split("_")[1])
    assert stopped_at == max(step_metrics(run))  # it finished the running step, then saved

    # SIGKILL mid-run, after checkpoints: the resumed run starts from the newest complete one.
    proc = subprocess.Popen(command(run, "run.steps=50", "run.checkpoint_every=1", "--resume", *same), env=run_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    tree: dict[int, float] = {}  # every process of the run seen while it ran (pid -> start time)
    wait_for(lambda: _collect_tree(proc.pid, tree) and max(step_metrics(run)) >= stopped_at + 2, proc)
    _collect_tree(proc.pid, tree)
    assert len(tree) >= 3, tree  # torchrun and its two ranks, at least
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher only: torchrun starts ranks in new sessions
    proc.wait(timeout=60)
    _wait_until_gone(run)  # ...and the ranks notice and exit
    _assert_tree_gone(tree)  # ...with every process they started (checkpoint writers, engines)
    (ckpts / f".step_{stopped_at + 99:06d}.partial").mkdir()  # as if killed while saving
    last = max(int(p.name.split("_")[1]) for p in ckpts.glob("step_*") if (p / "trainer_state.json").exists())
    assert last >= stopped_at + 1
    train(run, f"run.steps={last + 1}", "run.checkpoint_every=1", "--resume", *same)
    resumed = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
               if "train/loss" in line]
    assert resumed[-1] == last + 1  # exactly the one step after the last complete checkpoint
    assert not list(ckpts.glob(".*.partial"))  # the next save cleared the leftover
    # Stopped by SIGTERM, killed by SIGKILL, resumed twice: the same run as an uninterrupted one.
    full = tmp_path / "full"
    train(full, f"run.steps={last + 1}", "run.checkpoint_every=1", *same)
    a, b = step_metrics(full), step_metrics(run)
    assert sorted(b) == sorted(a) == list(range(1, last + 2))
    assert_same_steps(a, b, range(1, last + 2))
    # the first step of each resume found the gate the checkpoint carried (a lost one reads 0)
    assert b[stopped_at + 1]["train/dmmpt_active"] == b[last + 1]["train/dmmpt_active"] == 1.0


def _collect_tree(pid: int, tree: dict[int, float]) -> bool:
    """Add `pid` and every process below it to `tree` (pid -> create time); True."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return True
    for p in procs:
        try:
            tree.setdefault(p.pid, p.create_time())
        except psutil.NoSuchProcess:
            pass
    return True


def _assert_tree_gone(tree: dict[int, float], grace: float = 30) -> None:
    """No process of `tree` is alive after `grace` seconds (a reused pid does not count)."""
    import psutil

    def alive() -> list[psutil.Process]:
        out = []
        for pid, created in tree.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    deadline = time.time() + grace
    while alive() and time.time() < deadline:
        time.sleep(0.5)
    left = alive()
    described = [f"{p.pid} ppid={p.ppid()} {' '.join(p.cmdline())[:120]}" for p in left]
    for p in left:
        p.kill()
    assert not left, f"processes of the killed run outlived it: {described}"


def _wait_until_gone(run: Path, timeout: float = 30) -> None:
    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = [p for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
        if not alive:
            return
        time.sleep(0.5)
    for p in alive:
        p.kill()
    raise AssertionError(f"ranks outlived their killed launcher: {[p.pid for p in alive]}")


@pytest.mark.slow
def test_segment_rollout_continues_unfinished_samples_next_step(tmp_path):
    """pipeline.segment_tokens=1: outputs of up to 3 tokens take up to 3 steps; their earlier
    tokens come from older weights and are masked; groups train when their last sample ends."""
    run = tmp_path / "run"
    train(run, "run.steps=4", "run.checkpoint_every=0", "run.eval_every=0", "pipeline.segment_tokens=1")
    metrics = step_metrics(run)
    assert sorted(metrics) == [1, 2, 3, 4]
    assert metrics[1]["rollout/samples"] == 0  # nothing finished within one 1-token segment...
    assert metrics[1]["shared/trained_nothing"] == 1.0  # ...so no update
    assert sum(m["rollout/continued_samples"] for m in metrics.values()) > 0  # ...they finished later
    trained = [m for m in metrics.values() if "train/loss" in m]
    assert trained and all(math.isfinite(m["train/loss"]) for m in trained)
    # --resume mid-flight runs on (test_segment_rollout.py checks that in-flight stages are regenerated)
    train(run, "run.steps=5", "run.checkpoint_every=0", "run.eval_every=0", "pipeline.segment_tokens=1", "--resume")
    assert 5 in step_metrics(run)


@pytest.mark.slow
def test_ppo_mini_batches_against_the_behaviour_policy_with_gspo_drmas_and_a_per_step_dmmpt_gate(tmp_path):
    """Several optimizer updates per RL step whose later mini-batches see ratios != 1 (measured
    against the engine's log-probs), so GSPO's tight sequence clips act; Dr. MAS pools the two
    verifier calls (sync mode, 4 stages); DMMPT's gate is one decision per step, off in step 1
    (nothing measured yet), then on (the target is above any entropy here)."""
    run = tmp_path / "run"
    train(run, "run.steps=3", "run.checkpoint_every=0", "run.eval_every=0", "pipeline.mode=sync",
          "pipeline.problems_per_step=4", "rollout.max_stages=4", "advantage.estimator=drmas",
          "loss.old_logprobs=rollout", "loss.ratio=sequence", "loss.clip_low=0.0003", "loss.clip_high=0.0004", "policy.mini_batch_sequences=32",
          "loss.dmmpt={}", "loss.dmmpt.entropy_target=50")
    m = step_metrics(run)
    assert sorted(m) == [1, 2, 3]
    for step in (1, 2, 3):
        assert m[step]["shared/updates"] >= 2, m[step]["shared/updates"]
        assert m[step]["shared/update_skipped"] == 0.0 and math.isfinite(m[step]["train/loss"])
        assert m[step]["rollout/verifier/samples"] > 0 and "rollout/verifier/advantage_share" in m[step]
        assert m[step]["train/dmmpt_active"] == (0.0 if step == 1 else 1.0)
    # the ratio moved between the mini-batches of a step: the clips acted
    assert sum(m[s]["train/clip_high_fraction"] + m[s]["train/clip_low_fraction"] for s in m) > 0


@pytest.mark.slow
def test_one_policy_per_role_with_reference_kl_time_shared(tmp_path):
    """policy.sharing=per_role: a Megatron model, optimizer and engine per role, each synced;
    resumed from a checkpoint taken before the Corrector's first update (its optimizer had no
    state to save).

    pipeline.time_shared: the trainer leaves the GPU before the engines start; each step
    releases the engines and brings the trainer back after the rollout, and offloads the trainer
    and resumes the engines around the weight sync, on every rank in the same order; a resume
    loads the checkpoint and syncs as a step does (on CPU the moves are skipped and logged)."""
    run = tmp_path / "run"
    per_role = ("run.checkpoint_every=0", "run.eval_every=0", "policy.sharing=per_role", "policy.reference=true",
                "loss.kl_coef=0.01", "pipeline.time_shared=true", "scheduler.overlap=false")
    train(run, "run.steps=2", *per_role)
    train(run, "run.steps=3", *per_role, "--resume")
    log = (run / "train.log").read_text()
    assert "no GPU, so the trainer's offload and SGLang's memory release are skipped" in log

    def step(n):
        return [(str(n), "to_training"), (str(n), "to_sync"), (str(n), "to_rollout")]
    for rank in (0, 1):
        phases = re.findall(rf"rank{rank} INFO .*time-shared step (\d+): (\w+)", log)
        assert phases == [("0", "start"), *step(0), *step(1),  # the first run's two steps
                          ("0", "start"), *step(0),  # the resume: checkpoint loaded, weights synced
                          *step(1)], phases
    # in both runs the engines start after the trainer left the GPU
    order = re.findall(r"rank0 INFO .*(time-shared step 0: start|rollout engines started)", log)
    assert order == ["time-shared step 0: start", "rollout engines started"] * 2, order
    m = step_metrics(run)
    assert m[1]["verifier/trained_nothing"] == 1.0  # no verifier samples before step 2
    for role in ROLES:
        assert math.isfinite(m[3][f"{role}/grad_norm"])
        assert m[3][f"{role}/sync_probe_mismatch"] < 1e-4  # each engine got its own policy's weights
    assert m[3]["train/kl"] > 0  # the policies moved away from the frozen reference
    assert sorted(p.name for p in (run / "checkpoints" / "step_000003").glob("policy_*")) == \
        ["policy_corrector", "policy_solver", "policy_verifier"]
    # resumed with one shared policy instead: refused by name, the run left as it was
    before, saved = (run / "metrics.jsonl").read_text(), sorted((run / "checkpoints").iterdir())
    proc = subprocess.run(command(run, "run.steps=4", "run.checkpoint_every=0", "--resume"), capture_output=True,
                          text=True, timeout=600, env=run_env())
    assert proc.returncode != 0
    assert "has no checkpoint of policies ['shared']" in proc.stderr and "policy.sharing changed?" in proc.stderr
    assert (run / "metrics.jsonl").read_text() == before and sorted((run / "checkpoints").iterdir()) == saved
