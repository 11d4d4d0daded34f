"""`marsrl train` with SGLang engines: the server dying mid-step and the run resumed on the
in-process engine, and two torchrun node groups each starting their own server."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rl.runs import check_steps, command, run_env, step_metrics, train, wait_for


@pytest.mark.slow
def test_an_engine_dying_mid_step_aborts_the_step_and_a_resume_redoes_it(tmp_path):
    """The SGLang server killed while step 2 generates: its requests fail, the pool restarts it
    in the background, but a restarted server holds the initial weights, so the step is aborted
    at once on every rank (not after `wait_for_engine`), a checkpoint to redo it from is saved
    and the run exits with the failure; --resume redoes step 2 and goes on, on the other kind of
    SGLang engine: the in-process sglang.Engine (`--engine sglang`), synced from the checkpoint."""
    import psutil

    run = tmp_path / "run"
    args = ("run.steps=3", "run.checkpoint_every=0", "run.eval_every=0")
    proc = subprocess.Popen(command(run, "--engine", "sglang_server", *args), env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    # step 1's record is written after its weight sync: step 2's rollout is what runs next
    wait_for(lambda: max(step_metrics(run)) >= 1, proc)
    servers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if "sglang.launch_server" in " ".join(p.cmdline())]
    assert len(servers) == 1, servers
    for p in [servers[0], *servers[0].children(recursive=True)]:
        p.kill()
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0, out[-3000:]
    assert "initial weights, not version 1" in out, out[-5000:]
    assert sorted(step_metrics(run)) == [1]
    state = json.loads((run / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert state["step"] == 1  # saved by the abort: there are no periodic checkpoints
    train(run, "--engine", "sglang", *args, "--resume", timeout=900)
    check_steps(run, 3, filled=False)  # step 2 redone from version 1 by the new engine, then step 3


def _two_node_groups(run: Path, *args: str, timeout: float = 900) -> list[subprocess.CompletedProcess]:
    """`marsrl train` as two torchrun node groups of one rank each, rendezvousing on localhost
    (what `torchrun --nnodes 2 --node-rank N` does on two machines)."""
    from megatron_marsrl.net import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
                               *command(run, *args)[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=run_env())
             for node in range(2)]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    for node, proc in enumerate(done):
        assert proc.returncode == 0, f"node group {node}:\n" + proc.stdout[-3000:] + proc.stderr[-5000:]
    return done


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_two_node_groups_start_engines_on_both_and_train(tmp_path, placement):
    """Each node group starts its own SGLang server; rank 0's pool sends requests to both and
    the weights reach the other node's server by broadcast over gloo (every server, in the
    split placement); after each sync every server's log-probs equal Megatron's."""
    run = tmp_path / "run"
    _two_node_groups(run, "--engine", "sglang_server", f"engine.placement={placement}", "run.steps=2",
                     "run.checkpoint_every=0", "run.eval_every=0")
    metrics = check_steps(run, 2)  # includes: the probe scored by both servers matches Megatron
    for m in metrics.values():
        assert m["world/rollout_gpus"] == 2 and m["world/train_gpus"] == 2
        assert m["world/rollout_engines_serving"] == 2  # both node groups' engines generated this step
    assert "1 engine(s) on other nodes joined its pool" in (run / "train.log").read_text()
