"""FP8 rollout guards: the option is refused, with its name and the reason, wherever it cannot
work (the embedded engine, CPU, model classes SGLang cannot re-quantize on update), before any
engine process starts. The GPU path itself (SGLang flash_rl) needs a GPU and is not run here."""
from __future__ import annotations

import pytest
import torch

from megatron_marsrl.rollout import fp8
from megatron_marsrl.rollout.factory import RolloutEngineConfig, start_engines

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")


def test_config_refuses_fp8_with_the_embedded_engine_and_unknown_values():
    with pytest.raises(ValueError, match=r"engine.quantization='fp8'.*'hf' engine has no FP8 path"):
        RolloutEngineConfig(kind="hf", quantization="fp8")
    with pytest.raises(ValueError, match=r"engine.quantization='int4'"):
        RolloutEngineConfig(kind="sglang", quantization="int4")
    assert RolloutEngineConfig(kind="sglang", quantization="fp8").quantization == "fp8"


def test_train_override_names_the_option():
    from megatron_marsrl.rl.overrides import apply_overrides
    from megatron_marsrl.rl.recipes import get_recipe

    with pytest.raises(ValueError, match=r"engine.quantization='fp8'.*engine.kind='sglang'"):
        apply_overrides(get_recipe("tiny_arithmetic"), ["engine.quantization=fp8"])
    config = apply_overrides(get_recipe("tiny_arithmetic"), ["engine.kind=sglang", "engine.quantization=fp8"])
    assert config.engine.quantization == "fp8"


@cpu_only
@pytest.mark.parametrize("kind", ["sglang", "sglang_server"])
def test_starting_an_fp8_engine_on_cpu_fails_before_spawning(kind, tiny_hf, monkeypatch):
    import subprocess

    def no_spawn(*args, **kwargs):
        raise AssertionError("an engine process was started")

    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    with pytest.raises(ValueError, match=r"engine.quantization='fp8' needs a CUDA GPU"):
        start_engines(RolloutEngineConfig(kind=kind, quantization="fp8"), tiny_hf("qwen3"))


@cpu_only
def test_engine_constructors_guard_too(tiny_hf):
    from megatron_marsrl.rollout.sglang_engine import SGLangEngine
    from megatron_marsrl.rollout.sglang_server import SGLangServer, SGLangServerConfig

    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        SGLangEngine(tiny_hf("qwen3"), quantization="fp8")
    server = SGLangServer(SGLangServerConfig(model_path=tiny_hf("qwen3"), quantization="fp8"))
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        server.start()
    assert server.proc is None


def test_model_classes_sglang_cannot_requantize_are_refused(tiny_hf):
    # cuda=True: what a GPU machine would decide, checked here without one.
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM.*flash_rl.*Qwen2ForCausalLM, Qwen3ForCausalLM"):
        fp8.check_start("fp8", kind="sglang", model_dir=tiny_hf("qwen3_moe"), cuda=True)
    fp8.check_start("fp8", kind="sglang_server", model_dir=tiny_hf("qwen3"), cuda=True)
    fp8.check_start(None, kind="hf", model_dir=tiny_hf("qwen3_moe"), cuda=False)  # no quantization: no checks


def test_sglang_arguments():
    assert fp8.sglang_args(None) == {}
    assert fp8.sglang_args("fp8") == {"quantization": "fp8", "load_format": "flash_rl"}
