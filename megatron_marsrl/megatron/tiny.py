"""Tiny random HF checkpoints made with transformers (no hub access): for the self-check,
the tests and the benchmarks."""
from __future__ import annotations

from pathlib import Path

import torch

# Shapes chosen so every layout under test divides them: heads 4, kv groups 2, experts 4,
# layers 2 (PP=2), vocab 128; head_dim differs from hidden/heads like real Qwen3.
FAMILIES = {
    "qwen3_moe": dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], max_position_embeddings=128, tie_word_embeddings=False,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, router_aux_loss_coef=0.0),
    "qwen3": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "llama": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5),
}


def make_hf_checkpoint(family: str, out_dir: str | Path, *, seed: int = 0, overrides: dict | None = None,
                       max_shard_size: str | None = None) -> Path:
    """Save a randomly initialised tiny ``family`` model (fp32) to ``out_dir``."""
    import transformers

    cls_cfg, cls_model = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[family]
    config = cls_cfg(**{**FAMILIES[family], **(overrides or {})})
    torch.manual_seed(seed)
    model = cls_model(config).float()
    with torch.no_grad():  # norms start at 1.0; randomise them so a mis-mapped norm is visible
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    out_dir = Path(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir
