"""The embedded transformers engine: records, bad input, weight updates, and the weight sync
from Megatron (TP2 / EP2 on gloo) with the train/rollout log-prob mismatch before and after."""
import pytest
import torch

from megatron_marsrl.megatron.launch import launch
from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling
from megatron_marsrl.rollout.hf_engine import TransformersEngine, UnknownWeightError


@pytest.fixture(scope="module")
def moe_engine(tiny_hf):
    return TransformersEngine(tiny_hf("qwen3_moe"), seed=0, max_total_tokens=64)


def _requests(n=3, temperature=0.9, max_new=5):
    gen = torch.Generator().manual_seed(3)
    return [EngineRequest(rid=f"r{i}", prompt_ids=torch.randint(0, 128, (2 + 2 * i,), generator=gen).tolist(),
                          sampling=EngineSampling(temperature=temperature, max_new_tokens=max_new)) for i in range(n)]


def test_records_and_their_logprobs_are_the_sampling_distribution(moe_engine):
    outs = moe_engine.generate(_requests())
    for req, out in zip(_requests(), outs):
        assert out.rid == req.rid and out.prompt_ids == req.prompt_ids
        assert 1 <= len(out.output_ids) == len(out.logprobs) <= 5
        assert out.finish_reason in ("stop", "length") and all(lp <= 0 for lp in out.logprobs)
    # Teacher-forced scoring of the same tokens gives the log-probs reported while sampling
    # (left-padded batched generation vs a right-padded forward).
    scored = moe_engine.score([o.prompt_ids + o.output_ids for o in outs], temperature=0.9)
    for out, lp in zip(outs, scored):
        got = torch.tensor(lp[len(out.prompt_ids) - 1:])
        assert torch.allclose(got, torch.tensor(out.logprobs), atol=1e-4)


def test_greedy_is_deterministic_and_sampling_is_seeded(tiny_hf, moe_engine):
    greedy = _requests(temperature=0.0)
    assert [o.output_ids for o in moe_engine.generate(greedy)] == [o.output_ids for o in moe_engine.generate(greedy)]
    a = TransformersEngine(tiny_hf("qwen3_moe"), seed=7).generate(_requests())
    b = TransformersEngine(tiny_hf("qwen3_moe"), seed=7).generate(_requests())
    assert [o.output_ids for o in a] == [o.output_ids for o in b]


@pytest.mark.parametrize("request_,needle", [
    (EngineRequest(prompt_ids=list(range(60)), sampling=EngineSampling(max_new_tokens=10)), "exceeds max_total_tokens=64"),
    (EngineRequest(prompt_ids=[1, 500], sampling=EngineSampling(max_new_tokens=4)), "outside the vocabulary"),
    (EngineRequest(prompt_ids=[], sampling=EngineSampling(max_new_tokens=4)), "empty prompt"),
])
def test_bad_requests_are_named(moe_engine, request_, needle):
    with pytest.raises(ValueError, match=needle):
        moe_engine.generate([request_])


@pytest.mark.parametrize("kwargs,needle", [
    ({"top_p": 0.0}, "top_p"), ({"temperature": -1}, "temperature"), ({"top_k": 0}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens")])
def test_invalid_sampling_params(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EngineSampling(**kwargs)


def test_checkpoint_named_expert_update_reaches_the_fused_tensor(tiny_hf):
    engine = TransformersEngine(tiny_hf("qwen3_moe"))
    seq = [[5, 9, 17, 33, 2, 8, 90, 11]]
    before = engine.score(seq)
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    applied = engine.update_weights([[(name, torch.zeros(32, 64))]], version=3)
    fused = dict(engine.model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    assert applied == 1 and engine.weight_version == 3
    assert torch.count_nonzero(fused[1, 32:]) == 0 and torch.count_nonzero(fused[1, :32]) > 0
    assert before != engine.score(seq)


def test_unknown_weight_name_is_an_error(moe_engine):
    with pytest.raises(UnknownWeightError, match="does not have"):
        moe_engine.update_weights([[("model.layers.0.mlp.experts.gate_up_proj.fused", torch.zeros(1))]], version=1)


@pytest.mark.parametrize("layout", [{"tp": 2}, pytest.param({"ep": 2}, marks=pytest.mark.slow)])
def test_megatron_sync_removes_the_stale_mismatch(tiny_hf, layout):
    reports = launch("tests.rollout.workers:train_then_sync", 2, {"hf_dir": tiny_hf("qwen3_moe"), "layout": layout})
    r = reports[0]
    assert r["rollout_vs_megatron"]["max"] < 1e-3        # fresh engine == Megatron (fp32)
    assert r["stale_vs_megatron"]["max"] > 1e-2          # after training, the engine is stale...
    assert r["synced_vs_megatron"]["max"] < 1e-3         # ...until the sync
    assert r["sync"]["tensors"] == 45 and r["engine_version"] == 1
    assert all(other["synced_vs_megatron"] == r["synced_vs_megatron"] for other in reports)


def test_sgl_kernel_stand_in_raises_and_leaves_a_trace(tmp_path, monkeypatch):
    import importlib.util

    from megatron_marsrl.rollout.sglang_engine import SHIM_DIR

    spec = importlib.util.spec_from_file_location("sgl_kernel_standin", SHIM_DIR / "sgl_kernel" / "__init__.py")
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("MARSRL_SGL_KERNEL_CALL_LOG", str(log))
    with pytest.raises(RuntimeError, match="import stand-in and must not be called"):
        shim.rmsnorm(1, 2)
    assert shim.CALLED == ["rmsnorm"] and log.read_text() == "rmsnorm\n"


@pytest.mark.parametrize("dtype,optimizer,lr", [("float32", "sgd", 0.5), ("bfloat16", "adam", 1e-6)])
def test_a_sync_that_changes_nothing_is_detected(tiny_hf, dtype, optimizer, lr):
    """Also in bf16 at lr 1e-6, where the log-probs barely move: the read-back compares bits."""
    args = {"hf_dir": tiny_hf("qwen3_moe"), "dtype": dtype, "optimizer": optimizer, "lr": lr}
    missed = launch("tests.rollout.workers:sync_that_misses_tensors", 1, args)[0]
    assert missed["error"] and "is not what Megatron sent" in missed["error"], missed
    taken = launch("tests.rollout.workers:sync_that_misses_tensors", 1, {**args, "forgetful": False})[0]
    assert taken["error"] is None and taken["readback"] == 2, taken


def test_batch_budget_holds_one_request_and_comes_from_the_config(tiny_hf):
    from megatron_marsrl.rollout.factory import RolloutEngineConfig, start_node_engines

    with pytest.raises(ValueError, match="max_batch_tokens=64 < max_total_tokens=128: a batch must hold one"):
        TransformersEngine(tiny_hf("qwen3"), max_total_tokens=128, max_batch_tokens=64)
    for asked, budget in ((64, 128), (512, 512)):  # raised to one whole request, or as asked
        cfg = RolloutEngineConfig(kind="hf", max_total_tokens=128, max_batch_tokens=asked)
        (engine,) = start_node_engines(cfg, tiny_hf("qwen3"))
        try:
            assert engine._batcher.token_budget == cfg.batch_tokens == budget
        finally:
            engine.shutdown()
