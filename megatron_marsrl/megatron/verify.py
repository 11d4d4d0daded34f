"""Parity checks between a Megatron model and the HF reference (transformers), per rank.

Used by ``marsrl selfcheck`` and the tests; each function runs on every rank of a launched job.
"""
from __future__ import annotations

import torch

from megatron_marsrl.megatron.forward import full_logits, token_logprobs
from megatron_marsrl.megatron.hf_checkpoint import HFCheckpointReader, export_hf_buckets, load_hf_weights
from megatron_marsrl.megatron.hf_config import ModelArch
from megatron_marsrl.megatron.model import build_model
from megatron_marsrl.megatron.parallel import ParallelConfig, init_parallel


def build_from_hf(hf_dir: str, layout: dict):
    arch = ModelArch.from_hf_dir(hf_dir)
    parallel = ParallelConfig(**layout)
    init_parallel(parallel, arch)
    model = build_model(arch, parallel)
    load_hf_weights(model, arch, hf_dir)
    return arch, parallel, model


def hf_reference_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def parity_report(hf_dir: str, layout: dict, seed: int = 0, temperature: float = 0.7) -> dict:
    """Max |Megatron - HF| of logits (last PP stage; None elsewhere) and of temperature-scaled
    log-probs (every rank), and the HF tensors whose export differs from the file."""
    arch, _, model = build_from_hf(hf_dir, layout)
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    ref = hf_reference_logits(hf_dir, tokens)
    logits = full_logits(model, tokens)
    ref_lp = torch.log_softmax(ref[:, :-1] / temperature, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    lp = token_logprobs(model, [tokens], temperature=temperature)[0]
    reader = HFCheckpointReader(hf_dir)
    mismatched, seen = [], 0
    for bucket in export_hf_buckets(model, arch, bucket_bytes=64 << 10):
        for name, tensor in bucket:
            seen += 1
            if not torch.equal(reader.read(name, None, 0, 1), tensor):
                mismatched.append(name)
    return {"logit_diff": None if logits is None else float((logits - ref).abs().max()),
            "logprob_diff": float((lp - ref_lp).abs().max()),
            "export_mismatched": mismatched, "export_seen": seen, "hf_total": len(reader.weight_map)}
