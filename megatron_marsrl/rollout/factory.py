"""Pick a rollout engine by name: the config switch between the two implementations."""
from __future__ import annotations

ENGINES = ("hf", "sglang")


def make_engine(kind: str, model_dir: str, *, max_total_tokens: int = 4096, seed: int = 0):
    """``"hf"``: the embedded transformers engine (CPU default, starts in seconds);
    ``"sglang"``: SGLang (the engine of record on GPU; real torch-native path on CPU)."""
    from pathlib import Path

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"model path {model_dir}: no config.json (need a local HF checkpoint directory)")
    if kind == "hf":
        from megatron_marsrl.rollout.hf_engine import TransformersEngine

        return TransformersEngine(model_dir, seed=seed, max_total_tokens=max_total_tokens)
    if kind == "sglang":
        from megatron_marsrl.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(model_dir, seed=seed, max_total_tokens=max_total_tokens)
    raise ValueError(f"engine={kind!r}: choose one of {', '.join(ENGINES)}")
