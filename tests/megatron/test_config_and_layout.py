"""HF config reading and layout validation: fast, no processes, no Megatron import."""
import json

import pytest

from megatron_marsrl.megatron.hf_config import ModelArch, UnsupportedModelError
from megatron_marsrl.megatron.hf_mapping import hf_shapes, units
from megatron_marsrl.megatron.parallel import LayoutError, ParallelConfig
from megatron_marsrl.megatron.tiny import FAMILIES


def _arch(family="qwen3_moe", **overrides):
    return ModelArch.from_hf_dict({"model_type": family, **FAMILIES[family], **overrides})


def test_reads_both_transformers_generations_of_qwen3_moe_config():
    v4 = _arch(num_experts=8)  # transformers 4.x spelling
    v5 = ModelArch.from_hf_dict({"model_type": "qwen3_moe", **{k: v for k, v in FAMILIES["qwen3_moe"].items() if k != "num_experts"},
                                 "num_local_experts": 8, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    assert v4.num_experts == v5.num_experts == 8
    assert v5.rope_theta == 5e5
    assert v4.moe_layers == (True, True)


def test_sparse_step_and_mlp_only_layers_make_dense_layers():
    arch = _arch(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert arch.moe_layers == (False, True, False, False)
    names = hf_shapes(arch)
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.1.mlp.experts.0.up_proj.weight" in names


def test_unknown_architecture_is_named():
    with pytest.raises(UnsupportedModelError, match="unknown architecture model_type='gpt2'"):
        ModelArch.from_hf_dict({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize("option,value,needle", [
    ("attention_bias", True, "attention_bias"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4}, "yarn"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_unsupported_options_are_rejected(option, value, needle):
    with pytest.raises(UnsupportedModelError, match=needle):
        _arch("qwen3", **{option: value})


def test_missing_required_field(tmp_path):
    cfg = {"model_type": "llama", **FAMILIES["llama"]}
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'hidden_size' is missing"):
        ModelArch.from_hf_dir(tmp_path)


def test_tied_embeddings_have_no_lm_head_unit():
    assert all(u.key != "output_layer.weight" for u in units(_arch("llama")))
    assert any(u.key == "output_layer.weight" for u in units(_arch("qwen3_moe")))


@pytest.mark.parametrize("layout,world,needle", [
    (dict(tp=3), 3, "num_attention_heads=4 not divisible by tp=3"),
    (dict(ep=3), 3, "num_experts=4 not divisible by ep=3"),
    (dict(pp=3), 3, "num_hidden_layers=2 not divisible by pp=3"),
    (dict(tp=2), 3, "world size 3 is not divisible by tp\\*pp"),
])
def test_layout_errors_name_the_problem(layout, world, needle):
    with pytest.raises(LayoutError, match=needle):
        ParallelConfig(**layout).validate(_arch(), world)


def test_padded_vocab_size():
    from megatron_marsrl.megatron.hf_mapping import padded_vocab_size

    assert [padded_vocab_size(v, 4) for v in (128, 129, 131, 132)] == [128, 132, 132, 132]


def test_expert_parallel_on_dense_model_is_rejected():
    with pytest.raises(LayoutError, match="expert parallelism needs experts"):
        ParallelConfig(ep=2).validate(_arch("llama"), 2)


def test_bad_field_values():
    with pytest.raises(LayoutError, match="tp=0"):
        ParallelConfig(tp=0)
    with pytest.raises(LayoutError, match="sequence_parallel=True needs tp > 1"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(LayoutError, match="recompute='some'"):
        ParallelConfig(recompute="some")
