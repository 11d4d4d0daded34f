"""The real SGLang engine on CPU (torch-native path, import-only kernel stand-in): generation
log-probs equal Megatron's, a Megatron TP2 training step makes it stale, the bucketed weight
sync makes it agree again, and no stand-in kernel was ever called; the engine's routed experts,
replayed in Megatron, remove the mismatch that flipped routing causes."""
import subprocess

import psutil
import pytest

from megatron_marsrl.megatron.launch import launch
from tests.rollout.test_routing_replay_engines import assert_replay_helps

pytestmark = pytest.mark.slow  # SGLang start-up (~20 s) plus 2 Megatron ranks


@pytest.mark.parametrize("engine,layout", [("sglang", {"tp": 2}), ("sglang_server", {"ep": 2})])
def test_sglang_routing_replay_then_sync_from_megatron(tiny_hf, tmp_path, engine, layout):
    """In-process sglang.Engine under TP2 (with sequence parallel), and the HTTP server process
    under EP2: one engine start and one launch for all proofs (routing replay, then
    train-then-sync, then for the server a disaggregated trainer's updates over a gloo group;
    tests/rollout/routing_workers.py)."""
    calls = tmp_path / "sgl_kernel_calls.log"
    reports = launch("tests.rollout.routing_workers:replay_then_train_sync", 2,
                     {"hf_dir": tiny_hf("qwen3_moe"), "layout": layout, "engine": engine, "call_log": str(calls)},
                     env={"OMP_NUM_THREADS": "1"})  # the fork server's environment: ranks forked, not started
    r = reports[0]
    assert_replay_helps(r["replay"])
    assert r["rollout_vs_megatron"]["max"] < 1e-3 and r["rollout_vs_megatron"]["tokens"] == 18
    assert r["stale_vs_megatron"]["max"] > 1e-2
    assert r["synced_vs_megatron"]["max"] < 1e-3
    assert r["sync"]["tensors"] == 45 and r["engine_version"] == 1
    assert not calls.exists(), f"stand-in kernels were called: {calls.read_text()}"
    if engine == "sglang_server":  # a disaggregated trainer's update over a gloo group
        d = r["disaggregated"]
        assert d["changed"] > 1e-3 and d["vs_reference"] < 1e-4 and d["bytes"] > 0
        assert d["freed_on_server"] and d["freed_here"]  # close() frees the group on both sides...
        assert d["restored"] < 1e-4 and d["version"] == 5  # ...and a new group carries the next update


def test_concurrent_requests_are_batched_and_weights_read_back(tiny_hf):
    """Requests sent one by one through the pool reach the in-process engine as batches; the
    sync check's read-back returns the engine's weights bit for bit (SGLang implements
    get_weights_by_name for Llama, not for Qwen3 in 0.5.23); shutting it down stops its own
    processes and no other child of this process."""
    import asyncio
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling
    from megatron_marsrl.rollout.pool import EnginePool
    from megatron_marsrl.rollout.sglang_engine import SGLangEngine

    hf = tiny_hf("llama")
    older = subprocess.Popen(["sleep", "300"])  # e.g. the launch fork server, started before the engine
    engine = SGLangEngine(hf, max_total_tokens=4096, seed=0)
    newer = subprocess.Popen(["sleep", "300"])  # e.g. a rank's SGLang server, started after it
    try:
        requests = [EngineRequest(rid=f"r{i}", prompt_ids=[1 + i, 2, 3],
                                  sampling=EngineSampling(temperature=1.0, max_new_tokens=8, seed=i)) for i in range(12)]
        outs = asyncio.run(EnginePool([engine]).generate_many(requests))
        assert [o.rid for o in outs] == [r.rid for r in requests] and all(o.output_ids for o in outs)
        assert sum(engine.batch_sizes) == 12 and max(engine.batch_sizes) > 1, list(engine.batch_sizes)
        name = "model.layers.0.self_attn.q_proj.weight"
        held = engine.read_weights([name], 8)[name]
        assert torch.equal(held, load_file(str(Path(hf) / "model.safetensors"))[name][:8].float())
        # SGLang's own shutdown SIGKILLs every process below this one; ours stops only the engine's
        assert engine.processes
        engine.shutdown()
        assert older.poll() is None and newer.poll() is None
        assert not [pid for pid in engine.processes if _running(pid)]
    finally:
        engine.shutdown()
        for proc in (older, newer):
            proc.kill()
            proc.wait()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
