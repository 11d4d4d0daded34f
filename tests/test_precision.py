"""precision.py: "auto" resolved against the CPU's bf16 matrix instructions."""
from __future__ import annotations

import pytest
import torch

from megatron_marsrl import precision


def _cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 {flags}\n\n"
                    f"processor\t: 1\nflags\t\t: fpu sse2 {flags}\n")
    return path


def test_bf16_flags_are_read_from_cpuinfo(tmp_path):
    assert precision.cpu_bf16_flags(_cpuinfo(tmp_path, "avx512f avx512_bf16 amx_tile amx_bf16")) == \
        ["amx_bf16", "avx512_bf16"]
    assert precision.cpu_bf16_flags(_cpuinfo(tmp_path, "avx512f avx512_vnni")) == []
    assert precision.cpu_bf16_flags(tmp_path / "missing") == []


@pytest.mark.parametrize("flags, expected", [(["avx512_bf16"], torch.bfloat16), ([], torch.float32)])
def test_auto_follows_the_cpu(monkeypatch, flags, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: flags)
    choice = precision.choose_dtype("auto")
    assert choice.dtype == expected
    assert choice.name == str(expected).removeprefix("torch.")
    assert choice.reason.startswith("auto on a CPU " + ("with bf16" if flags else "without bf16"))


def test_explicit_names_win_and_bad_names_are_refused(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ["amx_bf16"])
    assert precision.choose_dtype("float32").dtype == torch.float32
    assert precision.choose_dtype("bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="use auto, float32 or bfloat16"):
        precision.choose_dtype("fp16")
