"""Parity checks between a Megatron model and the HF reference (transformers), per rank.

Used by ``marsrl selfcheck``, the tests and the GPU check. Megatron runs on the rank's device
(the CUDA device its LOCAL_RANK names when there is one) in the dtype asked for; the reference
is always transformers on CPU in fp32. On a GPU this compares CUDA logits with a CPU reference:

    python -m megatron_marsrl.megatron.verify --families qwen3_moe,qwen3 --dtypes float32,bfloat16 --out /tmp/v

runs one rank (launched like any job, so LOCAL_RANK picks the GPU) over tiny random checkpoints,
prints one JSON record per (family, dtype) and exits 0 when every difference is within its
dtype's tolerance.
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
from megatron_marsrl.megatron.launch import launch
from megatron_marsrl.megatron.model import build_model, have_transformer_engine
from megatron_marsrl.megatron.parallel import ParallelConfig, init_parallel
from megatron_marsrl.megatron.tiny import FAMILIES, make_hf_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
"""Max |Megatron - HF| of logits and log-probs that passes. fp32 agrees to ~5e-7 on CPU and is
the weight-mapping check: on the tiny models a mis-mapped tensor can move bf16 logits by as
little as 2.6e-2 (one expert's fc1 rows reversed, measured), inside bf16's own rounding noise of
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


def parity_reports(cases: list[dict]) -> list[dict]:
    """``parity_report(**case)`` for each case, in this one process (one start-up for all)."""
    return [parity_report(**case) for case in cases]


def check(families: list[str], dtypes: list[str], out: Path) -> list[dict]:
    """Make a tiny random checkpoint of each family under ``out``, launch one rank that checks
    every (family, dtype), and return the reports with the tolerance and the verdict."""
    cases = [{"family": f, "hf_dir": str(make_hf_checkpoint(f, out / f, seed=0)), "dtype": d}
             for f in families for d in dtypes]
    reports = launch("megatron_marsrl.megatron.verify:parity_reports", 1,
                     {"cases": [{"hf_dir": c["hf_dir"], "layout": {}, "dtype": c["dtype"]} for c in cases]})[0]
    records = []
    for case, report in zip(cases, reports):
        tolerance = TOLERANCE[case["dtype"]]
        passed = (report["logit_diff"] < tolerance and report["logprob_diff"] < tolerance
                  and not report["export_mismatched"] and report["export_seen"] == report["hf_total"])
        records.append({"family": case["family"], **report, "tolerance": tolerance, "passed": passed})
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_marsrl.megatron.verify",
                                     description="Megatron (this machine's device) vs transformers (CPU, fp32) "
                                                 "logit parity on tiny random checkpoints, world size 1")
    parser.add_argument("--families", default="qwen3_moe", help="comma-separated: qwen3_moe, qwen3, llama")
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    parser.add_argument("--out", required=True, help="working directory for the tiny checkpoints")
    parser.add_argument("--json", default=None, help="also write the records (a JSON list) to this file")
    args = parser.parse_args(argv)
    families, dtypes = args.families.split(","), args.dtypes.split(",")
    for value, allowed in [*((f, FAMILIES) for f in families), *((d, DTYPES) for d in dtypes)]:
        if value not in allowed:
            parser.error(f"{value!r}: choose from {', '.join(allowed)}")
    records = check(families, dtypes, Path(args.out))
    text = json.dumps(records, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text, flush=True)
    return 0 if all(r["passed"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
