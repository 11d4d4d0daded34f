"""Parity checks between a Megatron model and the HF reference (transformers), per rank.

Used by ``marsrl selfcheck``, the tests and the GPU check. Megatron runs on the rank's device
(the CUDA device its LOCAL_RANK names when there is one) in the dtype asked for; the reference
is always transformers on CPU in fp32. On a GPU this compares CUDA logits with a CPU reference:

    python -m megatron_marsrl.megatron.verify --family qwen3_moe --dtype bfloat16 --out /tmp/v

runs one rank (launched like any job, so LOCAL_RANK picks the GPU) on a tiny random checkpoint,
prints one JSON record and exits 0 when the differences are within the dtype's tolerance.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_marsrl.megatron.forward import full_logits, token_logprobs
from megatron_marsrl.megatron.hf_checkpoint import HFCheckpointReader, export_hf_buckets, load_hf_weights
from megatron_marsrl.megatron.hf_config import ModelArch
from megatron_marsrl.megatron.model import build_model, have_transformer_engine
from megatron_marsrl.megatron.parallel import ParallelConfig, init_parallel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
"""Max |Megatron - HF| of logits and log-probs that passes. fp32 agrees to ~5e-7 on CPU and is
the weight-mapping check: on the tiny models a mis-mapped tensor can move bf16 logits by as
little as 3e-2 (one expert's fc1 rows reversed, measured), inside bf16's own rounding noise of
4e-3 to 7.5e-3 (CPU; qwen3_moe, qwen3, llama). The bf16 bound only says the bf16 path is sane,
with room for other kernels' rounding; run both dtypes."""


def build_from_hf(hf_dir: str, layout: dict, dtype: torch.dtype = torch.float32):
    arch = ModelArch.from_hf_dir(hf_dir)
    parallel = ParallelConfig(**layout)
    init_parallel(parallel, arch)
    model = build_model(arch, parallel, dtype=dtype)
    load_hf_weights(model, arch, hf_dir)
    return arch, parallel, model


def hf_reference_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits for ``tokens``, on CPU in fp32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens.cpu()).logits


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def parity_report(hf_dir: str, layout: dict, seed: int = 0, temperature: float = 0.7,
                  dtype: str = "float32") -> dict:
    """Max |Megatron - HF| of logits (last PP stage; None elsewhere) and of temperature-scaled
    log-probs (every rank), and the HF tensors whose export differs from the file (compared
    after rounding the file's tensor to ``dtype``, as loading does)."""
    arch, _, model = build_from_hf(hf_dir, layout, DTYPES[dtype])
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    ref = hf_reference_logits(hf_dir, tokens)
    logits = full_logits(model, tokens)
    ref_lp = torch.log_softmax(ref[:, :-1] / temperature, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    lp = token_logprobs(model, [tokens], temperature=temperature)[0].float().cpu()
    reader = HFCheckpointReader(hf_dir)
    mismatched, seen = [], 0
    for bucket in export_hf_buckets(model, arch, bucket_bytes=64 << 10):  # rank 0 receives, checks
        for name, tensor in bucket:
            seen += 1
            if not torch.equal(reader.read(name, None, 0, 1).to(tensor.dtype), tensor.cpu()):
                mismatched.append(name)
    device = next(model.parameters()).device
    return {"logit_diff": None if logits is None else float((logits.float().cpu() - ref).abs().max()),
            "logprob_diff": float((lp - ref_lp).abs().max()),
            "export_mismatched": mismatched, "export_seen": seen if _is_rank0() else None,
            "hf_total": len(reader.weight_map),
            "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": dtype, "layer_spec": "transformer_engine" if have_transformer_engine() else "local",
            "reference": "transformers fp32 on cpu"}


def check(family: str, dtype: str, out: Path) -> dict:
    """Make a tiny random ``family`` checkpoint under ``out``, launch one rank on it and return its
    parity report with the tolerance and the verdict (``passed``)."""
    from megatron_marsrl.megatron.launch import launch
    from megatron_marsrl.megatron.tiny import make_hf_checkpoint

    hf = make_hf_checkpoint(family, out / family, seed=0)
    report = launch("megatron_marsrl.megatron.verify:parity_report", 1, {"hf_dir": str(hf), "layout": {}, "dtype": dtype})[0]
    tolerance = TOLERANCE[dtype]
    passed = (report["logit_diff"] < tolerance and report["logprob_diff"] < tolerance
              and not report["export_mismatched"] and report["export_seen"] == report["hf_total"])
    return {"family": family, **report, "tolerance": tolerance, "passed": passed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_marsrl.megatron.verify",
                                     description="Megatron (this machine's device) vs transformers (CPU, fp32) "
                                                 "logit parity on a tiny random checkpoint, world size 1")
    parser.add_argument("--family", default="qwen3_moe", choices=("qwen3_moe", "qwen3", "llama"))
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    parser.add_argument("--out", required=True, help="working directory for the tiny checkpoint")
    parser.add_argument("--json", default=None, help="also write the record to this file")
    args = parser.parse_args(argv)
    record = check(args.family, args.dtype, Path(args.out))
    text = json.dumps(record, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text, flush=True)
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
