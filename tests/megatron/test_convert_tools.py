"""The conversion tools as a user runs them: subprocesses, exit codes, messages, outputs."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_marsrl.megatron.convert import hf_to_mcore, mcore_to_hf
from megatron_marsrl.megatron.parallel import ParallelConfig

ROOT = Path(__file__).resolve().parents[2]


def _tool(name, *args):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def _no_partial_outputs(out: Path):
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


@pytest.mark.slow
def test_round_trip_tp2_ep2_then_pp2_is_bit_exact(tiny_hf, tmp_path):
    hf = Path(tiny_hf("qwen3_moe"))
    code, log = _tool("convert_hf_to_mcore.py", "--input", hf, "--output", tmp_path / "mc", "--tp", 2, "--ep", 2)
    assert code == 0, log
    assert "layout tp=2 pp=1 ep=2" in log
    meta = json.loads((tmp_path / "mc" / "marsrl_checkpoint.json").read_text())
    assert meta["layout"]["tp"] == 2 and meta["hf_config"]["model_type"] == "qwen3_moe"
    code, log = _tool("convert_mcore_to_hf.py", "--input", tmp_path / "mc", "--output", tmp_path / "hf2", "--pp", 2)
    assert code == 0, log
    a, b = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "hf2" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())


@pytest.mark.slow
def test_sharded_index_input_is_read(tiny_hf, tmp_path):
    from megatron_marsrl.megatron.tiny import make_hf_checkpoint

    hf = make_hf_checkpoint("llama", tmp_path / "sharded", max_shard_size="20KB")
    assert (hf / "model.safetensors.index.json").is_file()
    code, log = _tool("convert_hf_to_mcore.py", "--input", hf, "--output", tmp_path / "mc", "--tp", 2)
    assert code == 0, log
    mcore_to_hf(tmp_path / "mc", tmp_path / "back")  # (the tool's own run: the round-trip test above)
    ref = {}
    for f in hf.glob("*.safetensors"):
        ref.update(load_file(str(f)))
    got = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_missing_input_directory(tmp_path):
    code, log = _tool("convert_hf_to_mcore.py", "--input", tmp_path / "nope", "--output", tmp_path / "out")
    assert code == 2
    assert "config.json not found" in log
    _no_partial_outputs(tmp_path / "out")


def test_missing_weights_file(tiny_hf, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf("qwen3"), hf)
    (hf / "model.safetensors").unlink()
    code, log = _tool("convert_hf_to_mcore.py", "--input", hf, "--output", tmp_path / "out")
    assert code == 2 and "no model.safetensors or model.safetensors.index.json" in log
    _no_partial_outputs(tmp_path / "out")


def test_config_that_does_not_match_the_weights(tiny_hf, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf("qwen3_moe"), hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # the weights have 2
    (hf / "config.json").write_text(json.dumps(cfg))
    code, log = _tool("convert_hf_to_mcore.py", "--input", hf, "--output", tmp_path / "out")
    assert code == 2 and "does not match its config.json" in log and "missing" in log
    _no_partial_outputs(tmp_path / "out")


def test_wrong_tensor_shape_is_named(tiny_hf, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf("llama"), hf)
    tensors = load_file(str(hf / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:, :10].contiguous()
    save_file(tensors, str(hf / "model.safetensors"))
    code, log = _tool("convert_hf_to_mcore.py", "--input", hf, "--output", tmp_path / "out")
    assert code == 2 and "model.layers.1.mlp.down_proj.weight has shape (64, 10)" in log


def test_unknown_architecture(tiny_hf, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf("llama"), hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    (hf / "config.json").write_text(json.dumps(cfg))
    code, log = _tool("convert_hf_to_mcore.py", "--input", hf, "--output", tmp_path / "out")
    assert code == 2 and "unknown architecture model_type='mixtral'" in log


@pytest.mark.parametrize("flags,needle", [
    (["--tp", 3], "num_attention_heads=4 not divisible by tp=3"),
    (["--ep", 3], "num_experts=4 not divisible by ep=3"),
    (["--pp", 4], "num_hidden_layers=2 not divisible by pp=4"),
])
def test_layout_that_does_not_divide_the_model(tiny_hf, tmp_path, flags, needle):
    code, log = _tool("convert_hf_to_mcore.py", "--input", tiny_hf("qwen3_moe"), "--output", tmp_path / "out", *flags)
    assert code == 2 and needle in log
    _no_partial_outputs(tmp_path / "out")


def test_existing_output_is_not_overwritten(tiny_hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    code, log = _tool("convert_hf_to_mcore.py", "--input", tiny_hf("llama"), "--output", out)
    assert code == 2 and "--force" in log
    assert (out / "precious.txt").read_text() == "keep me"


def test_mcore_input_must_be_a_complete_checkpoint(tmp_path):
    (tmp_path / "half" / "dist").mkdir(parents=True)  # what a killed save could leave
    code, log = _tool("convert_mcore_to_hf.py", "--input", tmp_path / "half", "--output", tmp_path / "out")
    assert code == 2 and "not a complete marsrl checkpoint" in log
    _no_partial_outputs(tmp_path / "out")


def test_corrupt_safetensors_file_leaves_no_output(tiny_hf, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf("llama"), hf)
    data = bytearray((hf / "model.safetensors").read_bytes())
    (hf / "model.safetensors").write_bytes(bytes(data[: len(data) - 64]))  # truncated payload
    code, log = _tool("convert_hf_to_mcore.py", "--input", hf, "--output", tmp_path / "out", "--tp", 2)
    assert code == 2 and "not a readable safetensors file" in log
    _no_partial_outputs(tmp_path / "out")


@pytest.mark.slow
def test_failure_inside_the_ranks_is_reported_and_leaves_nothing(tiny_hf, tmp_path):
    hf_to_mcore(tiny_hf("llama"), tmp_path / "mc", ParallelConfig())
    for f in (tmp_path / "mc" / "dist").iterdir():  # the metadata survives, the tensors do not
        if f.suffix == ".distcp":
            f.write_bytes(b"garbage")
    code, log = _tool("convert_mcore_to_hf.py", "--input", tmp_path / "mc", "--output", tmp_path / "hf")
    assert code == 2 and "conversion failed; no output was written" in log and "rank 0 exited" in log
    _no_partial_outputs(tmp_path / "hf")
