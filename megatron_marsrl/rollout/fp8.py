"""FP8 rollout: SGLang engines that serve FP8 weights and follow the trainer's bf16 weight syncs.

    marsrl train --recipe R engine.kind=sglang_server engine.quantization=fp8     # GPU only

The trainer keeps sending bf16 tensors; the engine re-quantizes them into FP8 on every update.
The rollout/train gap this adds shows in the per-step train/mismatch_abs and train/mismatch_k3.

What SGLang 0.5.23 offers for FP8 with weight updates (read from its source; the one place
this project depends on it):
  * quantization="fp8" on a bf16 checkpoint quantizes once, at load
    (Fp8LinearMethod / Fp8MoEMethod.process_weights_after_loading): each weight Parameter is
    *replaced* by an FP8 one (linear layers transposed, per-channel scales where the cutlass
    FP8 GEMM is available, per-tensor otherwise). The replacements lose their weight_loader,
    and the FP8 methods have no restore_weights_before_loading, so a later
    update_weights_from_tensor of bf16 tensors is NOT re-quantized: fused weights (qkv,
    gate_up, experts) fail on the missing loader, the rest would be copied into FP8 storage
    without scales. Unusable for RL on its own.
  * load_format="flash_rl" (QuantizedRLModelLoader; implies quantization="fp8") is the path
    built for RL: at load it records every parameter's bf16 shape/stride and native loaders;
    on each update it runs the model's own load_weights with the FP8 writes deferred, stages
    each bf16 destination and quantizes it into the existing FP8 weight and scale buffers.
    With per-tensor scales every shard of a fused weight (q/k/v) must come in one update
    call; per-channel (H100/H200) takes rows in any call. begin/end_weight_update become
    no-ops. Only models whose load_weights is marked @supports_quantized_rl_reload qualify:
    Qwen2ForCausalLM and Qwen3ForCausalLM (dense). SGLang refuses every other class at load,
    Qwen3-MoE included, so this module refuses them first, with the reason.
  * Serialized FP8 checkpoints (128x128 blocks, e.g. Qwen3-30B-A3B-FP8) hold FP8 parameters;
    an update must then carry FP8 tensors and their weight_scale_inv, quantized on the trainer
    side. Neither that nor nvidia-modelopt (offline calibration plus export to an FP8
    checkpoint, which would also need trainer-side quantization on every sync) is used here.

Revisit when SGLang's flash_rl supports MoE classes: widen FP8_ARCHITECTURES.
"""
from __future__ import annotations

import json
from pathlib import Path

QUANTIZATIONS = (None, "fp8")
FP8_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
"""Model classes SGLang 0.5.23's flash_rl loader re-quantizes on weight updates."""


def check_kind(quantization: str | None, kind: str) -> None:
    """Config-time check: the value, and an engine kind that has an FP8 path."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"engine.quantization={quantization!r}: use null (the training dtype) or 'fp8'")
    if quantization and kind == "hf":
        raise ValueError("engine.quantization='fp8' needs an SGLang engine (engine.kind='sglang' or "
                         "'sglang_server'): the embedded 'hf' engine has no FP8 path")


def check_start(quantization: str | None, *, kind: str, model_dir: str | Path, cuda: bool | None = None) -> None:
    """Start-time check, before an engine is built: a GPU and a model class SGLang can
    re-quantize on update. ``cuda`` defaults to torch.cuda.is_available()."""
    check_kind(quantization, kind)
    if not quantization:
        return
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        raise ValueError("engine.quantization='fp8' needs a CUDA GPU: SGLang's FP8 weights run on FP8 GEMM "
                         "kernels (sgl-kernel / cutlass) that have no CPU implementation; leave "
                         "engine.quantization unset on CPU")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    archs = config.get("architectures") or [config.get("model_type")]
    if not set(archs) & set(FP8_ARCHITECTURES):
        raise ValueError(f"engine.quantization='fp8': {model_dir} is {'/'.join(map(str, archs))}, but SGLang "
                         f"re-quantizes synced weights into FP8 (load_format='flash_rl') only for "
                         f"{', '.join(FP8_ARCHITECTURES)}; plain quantization='fp8' would ignore the weight "
                         "syncs. Leave engine.quantization unset for this model")


def sglang_args(quantization: str | None) -> dict:
    """SGLang server arguments (Engine keyword names) for ``quantization``."""
    return {"quantization": "fp8", "load_format": "flash_rl"} if quantization == "fp8" else {}
