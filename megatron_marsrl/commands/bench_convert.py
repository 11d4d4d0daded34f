"""marsrl bench convert: checkpoint conversion and export throughput on CPU.

Makes a synthetic Qwen3-MoE-shaped HF checkpoint of about --size-mb (fp32, two safetensors
shards), then measures in one process, each --repeats times (median reported):
  raw      read + copy every tensor with safetensors (the floor to compare against)
  load     HF safetensors -> Megatron parameters (load_hf_weights, slice reads)
  export   Megatron parameters -> HF-named buckets (export_hf_buckets; what weight sync uses)
  save     Megatron parameters -> torch_dist checkpoint
and prints bytes moved, seconds, GB/s and the ratio to the raw read measured in the same run.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--size-mb", type=int, default=300, help="approximate checkpoint size (default 300)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per phase (default 3)")
    parser.add_argument("--bucket-mb", type=int, default=128, help="export bucket size (default 128)")
    parser.add_argument("--workdir", default=None, help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")


def synthetic_config(size_mb: int) -> dict:
    """A Qwen3-MoE config whose fp32 checkpoint is about ``size_mb`` MB."""
    hidden, vocab, experts, moe_ffn = 1024, 8192, 16, 512
    per_layer = 4 * (2 * hidden * hidden + 2 * 256 * hidden + experts * 3 * moe_ffn * hidden + experts * hidden)
    fixed = 4 * 2 * vocab * hidden
    layers = max(1, round((size_mb * 1e6 - fixed) / per_layer))
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": 2048, "moe_intermediate_size": moe_ffn,
            "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
            "num_experts": experts, "num_experts_per_tok": 4, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu"}


def write_synthetic_checkpoint(path: Path, config: dict) -> int:
    """Random fp32 tensors for every expected name, in two shards with an index. Returns bytes."""
    import torch
    from safetensors.torch import save_file

    from megatron_marsrl.megatron.hf_config import ModelArch
    from megatron_marsrl.megatron.hf_mapping import hf_shapes

    path.mkdir(parents=True, exist_ok=True)
    shapes = hf_shapes(ModelArch.from_hf_dict(config))
    names = list(shapes)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: torch.randn(shapes[n], generator=gen) * 0.02 for n in part}, str(path / fname))
        weight_map.update({n: fname for n in part})
    total = sum((path / f).stat().st_size for f in set(weight_map.values()))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return total


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args) -> int:
    from megatron_marsrl.commands._common import guarded

    if args.workdir:
        return guarded(lambda: _bench(args, Path(args.workdir)))
    with tempfile.TemporaryDirectory(prefix="marsrl-bench-convert-") as tmp:  # removed on any exit
        return guarded(lambda: _bench(args, Path(tmp)))


def _bench(args, work: Path) -> int:
    from safetensors import safe_open

    from megatron_marsrl.megatron import dist_checkpoint
    from megatron_marsrl.megatron.hf_checkpoint import export_hf_buckets, load_hf_weights
    from megatron_marsrl.megatron.hf_config import ModelArch
    from megatron_marsrl.megatron.model import build_model
    from megatron_marsrl.megatron.parallel import ParallelConfig, init_parallel

    hf_dir = work / "hf"
    config = synthetic_config(args.size_mb)
    nbytes = write_synthetic_checkpoint(hf_dir, config)
    arch = ModelArch.from_hf_dict(config)
    init_parallel(ParallelConfig(), arch)
    model = build_model(arch, ParallelConfig())

    def raw():
        for fname in sorted({p.name for p in hf_dir.glob("*.safetensors")}):
            with safe_open(str(hf_dir / fname), framework="pt") as f:
                for name in f.keys():
                    # get_tensor maps the file lazily; clone() makes it a real read + copy,
                    # which is what the load phase does into the parameters.
                    f.get_tensor(name).clone()

    def export():
        for _ in export_hf_buckets(model, arch, bucket_bytes=args.bucket_mb << 20):
            pass

    def save():
        target = work / "mcore"
        dist_checkpoint.save_checkpoint(target, model, meta={"bench": True})

    raw()  # warm the page cache so every phase reads from memory alike
    phases = {"raw": raw, "load": lambda: load_hf_weights(model, arch, hf_dir), "export": export, "save": save}
    seconds = {name: _median_seconds(fn, args.repeats) for name, fn in phases.items()}
    result = {"bytes": nbytes, "layers": config["num_hidden_layers"], "repeats": args.repeats,
              "phases": {name: {"seconds": s, "gb_per_s": nbytes / s / 1e9, "ratio_to_raw": seconds["raw"] / s}
                         for name, s in seconds.items()}}
    print(f"bench convert: {nbytes / 1e6:.1f} MB fp32 Qwen3-MoE-shaped checkpoint "
          f"({config['num_hidden_layers']} layers x {config['num_experts']} experts), median of {args.repeats}")
    print(f"{'phase':<8}{'seconds':>10}{'GB/s':>10}{'x raw':>10}")
    for name, row in result["phases"].items():
        print(f"{name:<8}{row['seconds']:>10.3f}{row['gb_per_s']:>10.3f}{row['ratio_to_raw']:>10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
