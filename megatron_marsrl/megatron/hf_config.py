"""Read a Hugging Face ``config.json`` into the architecture facts the Megatron provider needs.

Supported families: Qwen3-MoE (``qwen3_moe``), Qwen3 dense (``qwen3``) and Llama
(``llama``, e.g. SmolLM2). Everything the model provider or the checkpoint mapping depends on
is an explicit field here, so a config that would silently build the wrong model (attention
bias, sliding windows, RoPE scaling we do not implement) is rejected with a clear message.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3", "llama")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not supported."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArch:
    """Architecture of a decoder-only HF model, in the terms of both HF and Megatron."""

    model_type: str
    """HF ``model_type``: one of SUPPORTED_MODEL_TYPES."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    """Per-head dimension (Qwen3 sets it explicitly; Llama derives hidden/heads)."""
    ffn_hidden_size: int
    """Intermediate size of the dense MLP layers."""
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    """Qwen3 applies RMSNorm to each query/key head before RoPE."""
    num_experts: int = 0
    """0 for dense models."""
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to one (Qwen3-MoE: true)."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer: True where the MLP is the MoE block (Qwen3-MoE ``mlp_only_layers`` and
    ``decoder_sparse_step`` can make some layers dense)."""
    router_aux_loss_coef: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelArch":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{cfg_path} not found: a HF checkpoint directory needs config.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cfg_path} is not valid JSON: {exc}") from exc
        return cls.from_hf_dict(cfg, source=str(cfg_path))

    @classmethod
    def from_hf_dict(cls, cfg: dict, *, source: str = "config") -> "ModelArch":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{source}: unknown architecture model_type={model_type!r} "
                f"(architectures={cfg.get('architectures')}); supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        _reject_unsupported_options(cfg, source)
        heads = _require(cfg, "num_attention_heads", source)
        hidden = _require(cfg, "hidden_size", source)
        layers = _require(cfg, "num_hidden_layers", source)
        # transformers 4.x writes num_experts, 5.x num_local_experts.
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if model_type == "qwen3_moe" else 0
        return cls(
            model_type=model_type,
            vocab_size=_require(cfg, "vocab_size", source),
            hidden_size=hidden,
            num_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            ffn_hidden_size=_require(cfg, "intermediate_size", source),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            num_experts=experts,
            moe_topk=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            moe_layers=_moe_layers(cfg, layers) if experts else (),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef") or 0.0) if experts else 0.0,
        )


def _require(cfg: dict, key: str, source: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{source}: required field {key!r} is missing")
    return int(cfg[key])


def _rope_theta(cfg: dict) -> float:
    # transformers 5 moved rope settings into `rope_parameters`; 4.x kept `rope_theta`/`rope_scaling`.
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _reject_unsupported_options(cfg: dict, source: str) -> None:
    scaling = cfg.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or (cfg.get("rope_parameters") or {}).get("rope_type")
    if rope_type not in (None, "default"):
        raise UnsupportedModelError(f"{source}: rope scaling type {rope_type!r} is not supported (only plain RoPE)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias/mlp_bias=true is not supported")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError(f"{source}: use_sliding_window=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act={cfg.get('hidden_act')!r}; only silu (SwiGLU) is supported")
    if int(cfg.get("shared_expert_intermediate_size") or 0) > 0:
        raise UnsupportedModelError(f"{source}: shared experts are not supported")


def _moe_layers(cfg: dict, layers: int) -> tuple[bool, ...]:
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
