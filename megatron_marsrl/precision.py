"""The dtype a run trains and generates in: "auto" resolved against the machine.

No Megatron or SGLang here: the trainer (megatron/) and the embedded engine (rollout/) both
read it, so that the engine samples in the dtype the policy trains in.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""/proc/cpuinfo flags of bf16 matrix instructions (Intel AMX tiles, AVX-512 bf16 dot products):
oneDNN runs bf16 linear layers on them at 2-6x the fp32 rate (PLATFORM.md)."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpuinfo_field(key: str, cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """The value of the first ``key`` line of ``cpuinfo`` ("flags", "model name"); None when
    there is none or the file cannot be read (not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.split(":", 1)[0].strip() == key), None)


def cpu_bf16_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> list[str]:
    """The bf16 matrix instructions this machine's CPU reports (`BF16_CPU_FLAGS`), [] if none
    or if ``cpuinfo`` cannot be read."""
    flags = (cpuinfo_field("flags", cpuinfo) or "").split()
    return [f for f in BF16_CPU_FLAGS if f in flags]


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a run trains (and the embedded engine generates) in, and why."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def choose_dtype(name: str) -> DtypeChoice:
    """Resolve a config's dtype name. "auto": bfloat16 on a GPU and on a CPU with bf16 matrix
    instructions, float32 on other CPUs. bf16 means Megatron's mixed precision: bf16 parameters
    and activations, fp32 main parameters, gradients and Adam state (optim.py); log-probs,
    entropy and the loss are computed in fp32 (forward.token_stats)."""
    if name not in ("auto", *_DTYPES):
        raise ValueError(f"dtype {name!r}: use auto, float32 or bfloat16")
    if name != "auto":
        return DtypeChoice(_DTYPES[name], f"set by the config ({name})")
    if torch.cuda.is_available():
        return DtypeChoice(torch.bfloat16, "auto on a GPU")
    flags = cpu_bf16_flags()
    if flags:
        return DtypeChoice(torch.bfloat16, f"auto on a CPU with bf16 matrix instructions ({', '.join(flags)})")
    return DtypeChoice(torch.float32, f"auto on a CPU without bf16 matrix instructions (none of "
                                      f"{', '.join(BF16_CPU_FLAGS)} in /proc/cpuinfo)")
