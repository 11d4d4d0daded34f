"""Functions run on each rank by megatron_marsrl.megatron.launch in the multi-rank tests."""
from __future__ import annotations

import torch

from megatron_marsrl.megatron.forward import full_logits, token_logprobs
from megatron_marsrl.megatron.hf_checkpoint import export_hf_buckets, load_hf_weights
from megatron_marsrl.megatron.hf_config import ModelArch
from megatron_marsrl.megatron.model import build_model
from megatron_marsrl.megatron.parallel import ParallelConfig, init_parallel


def _setup(hf_dir: str, layout: dict):
    arch = ModelArch.from_hf_dir(hf_dir)
    parallel = ParallelConfig(**layout)
    init_parallel(parallel, arch)
    model = build_model(arch, parallel)
    load_hf_weights(model, arch, hf_dir)
    return arch, parallel, model


def parity(hf_dir: str, layout: dict, seed: int = 0) -> dict:
    """Max |Megatron - HF| over logits and log-probs, and exact export round trip."""
    from safetensors import safe_open

    from tests.megatron.tiny_models import hf_logits

    arch, parallel, model = _setup(hf_dir, layout)
    torch.manual_seed(seed)
    tokens = torch.randint(0, arch.vocab_size, (2, 12))
    ref = hf_logits(hf_dir, tokens)
    logits = full_logits(model, tokens)
    logit_diff = None if logits is None else float((logits - ref).abs().max())
    ref_lp = torch.log_softmax(ref[:, :-1] / 0.7, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    lp = token_logprobs(model, [tokens], temperature=0.7)[0]
    lp_diff = float((lp - ref_lp).abs().max())
    mismatched, seen = [], 0
    with safe_open(f"{hf_dir}/model.safetensors", framework="pt") as f:
        for bucket in export_hf_buckets(model, arch, bucket_bytes=64 << 10):
            for name, tensor in bucket:
                seen += 1
                if not torch.equal(f.get_tensor(name), tensor):
                    mismatched.append(name)
        total = len(list(f.keys()))
    return {"logit_diff": logit_diff, "logprob_diff": lp_diff, "export_mismatched": mismatched,
            "export_seen": seen, "hf_total": total}
