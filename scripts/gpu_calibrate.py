"""Memory calibration: the measured train-phase memory of a small Qwen3-MoE shape on one GPU, next
to the memory planner's estimate (megatron_marsrl/megatron/memory.py) for the same shape, layout
and micro-batch, so the planner's terms can be checked against a real allocator.

    python scripts/gpu_calibrate.py --json out.json     # on a CUDA machine (about a minute)
    python scripts/gpu_calibrate.py --estimate-only     # the planner's side only, on any machine

One process, world size 1, bf16, random weights, AdamW; the micro-batch goes through the
trainer's own functions (forward.backward_micro_batch with the entropy metric, then
forward.finish_accumulation). A first step allocates everything lazy (Adam moments, cuBLAS
workspaces, compiled fusions); the second is measured with torch.cuda.max_memory_allocated:
  * state: allocated after the first step = parameters + fp32 gradient buffers + optimizer
    (fp32 main parameters and Adam moments); the planner's params + grads + optimizer;
  * forward/backward peak minus state: the planner's activations + logits + buffers;
  * optimizer-step peak minus state: not modelled by the planner (torch's multi-tensor AdamW
    temporaries when neither Transformer Engine nor Apex is installed).
The planner's framework term (CUDA context, NCCL, fragmentation) is invisible to the allocator;
the device's used memory (total - free, after the step) is reported beside it. Without
Transformer Engine, Megatron's local attention keeps the b x heads x s x s score matrices the
planner leaves out (it assumes flash attention); that term is reported separately.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

GIB = 2**30

SHAPE = dict(model_type="qwen3_moe", vocab_size=32000, hidden_size=1024, intermediate_size=2048,
             moe_intermediate_size=512, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
             head_dim=64, num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
             mlp_only_layers=[], max_position_embeddings=4096, tie_word_embeddings=False,
             rope_theta=1000000.0, rms_norm_eps=1e-6)
"""A ~0.28B-parameter Qwen3-MoE (HF config.json values): every planner term is non-trivial
(a 32k vocabulary for the logits, 32 experts top-4 for the routed copies)."""

BATCH, SEQ = 16, 256
"""Micro-batch: BATCH rows of SEQ tokens (the planner's micro_batch_tokens = BATCH x SEQ).
Short rows keep the local attention's s^2 score matrices small next to the planner's terms.
Rows, not the trainer's packed layout: on the local path a packed micro-batch attends through
one [T, T] block-diagonal mask, quadratic in all its T tokens, which neither Transformer
Engine's THD attention nor the planner has."""

SCORE_BYTES = 6
"""Bytes per attention-score element Megatron's local attention keeps for backward: the fp32
softmax output (attention_softmax_in_fp32) and its bf16 copy that multiplies V."""


def _arch():
    from megatron_marsrl.megatron.hf_config import ModelArch

    return ModelArch.from_hf_dict(SHAPE, source="gpu_calibrate.SHAPE")


def planner_estimate(gpu_memory_gib: float = 141.0) -> dict:
    """The planner's per-GPU train-phase figures (GiB) for SHAPE, world size 1, bf16, no engines."""
    from megatron_marsrl.megatron.memory import MemoryConfig, estimate_memory
    from megatron_marsrl.megatron.parallel import ParallelConfig

    est = estimate_memory(_arch(), ParallelConfig(),
                          MemoryConfig(world_size=1, micro_batch_tokens=BATCH * SEQ, param_bytes=2,
                                       gpu_memory_gib=gpu_memory_gib))
    state = est.params_gib + est.grads_gib + est.optimizer_gib
    transient = est.activations_gib + est.logits_gib + est.buffers_gib
    return {"model": est.model, "layout": est.layout, "params_gib": est.params_gib, "grads_gib": est.grads_gib,
            "optimizer_gib": est.optimizer_gib, "state_gib": state, "activations_gib": est.activations_gib,
            "logits_gib": est.logits_gib, "buffers_gib": est.buffers_gib, "transient_gib": transient,
            "framework_gib": est.framework_gib, "allocated_peak_gib": state + transient, "train_gib": est.train_gib}


def local_attention_scores_gib() -> float:
    """What the local (non-TE) attention keeps beyond the planner's flash-attention terms."""
    return SHAPE["num_hidden_layers"] * BATCH * SHAPE["num_attention_heads"] * SEQ * SEQ * SCORE_BYTES / GIB


def _one_step(model, optimizer, batch) -> tuple[float, float]:
    """Forward/backward and optimizer step as the trainer runs them; the allocator's peak (GiB)
    of each part, measured from a reset just before it."""
    import torch

    from megatron_marsrl.megatron import forward

    def loss_fn(logprobs, entropy, data):
        return -logprobs.mean(), {}

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    forward.backward_micro_batch(model, batch, loss_fn, with_entropy=True)
    torch.cuda.synchronize()
    fwd_bwd = torch.cuda.max_memory_allocated() / GIB
    torch.cuda.reset_peak_memory_stats()
    forward.finish_accumulation(model, optimizer)
    torch.cuda.synchronize()
    return fwd_bwd, torch.cuda.max_memory_allocated() / GIB


def measure() -> dict:
    """Build SHAPE on this process's GPU, run two steps, return the allocator's figures (GiB)."""
    import torch

    from megatron_marsrl.megatron.model import build_model, have_transformer_engine
    from megatron_marsrl.megatron.optim import OptimConfig, wrap_ddp_and_optimizer
    from megatron_marsrl.megatron.parallel import ParallelConfig, init_parallel

    arch, parallel = _arch(), ParallelConfig()
    init_parallel(parallel, arch)
    model, optimizer = wrap_ddp_and_optimizer(build_model(arch, parallel, dtype=torch.bfloat16),
                                              OptimConfig(lr=1e-5))
    tokens = torch.randint(0, arch.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens}  # SEQ + 1 tokens: SEQ next-token positions per sequence
    start = time.perf_counter()
    _one_step(model, optimizer, batch)  # allocates Adam moments, workspaces, compiled fusions
    torch.cuda.synchronize()
    state = torch.cuda.memory_allocated() / GIB
    fwd_bwd, opt = _one_step(model, optimizer, batch)
    free, total = torch.cuda.mem_get_info()
    return {"device": torch.cuda.get_device_name(), "device_total_gib": total / GIB,
            "layer_spec": "transformer_engine" if have_transformer_engine() else "local",
            "state_gib": state, "fwd_bwd_peak_gib": fwd_bwd, "transient_gib": fwd_bwd - state,
            "optimizer_step_peak_gib": opt, "max_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
            "device_used_gib": (total - free) / GIB, "seconds": time.perf_counter() - start}


def compare(measured: dict, estimate: dict) -> dict:
    """Measured / estimated for the parts both sides see."""
    extra = local_attention_scores_gib() if measured["layer_spec"] == "local" else 0.0
    return {"state": measured["state_gib"] / estimate["state_gib"],
            "transient": measured["transient_gib"] / estimate["transient_gib"],
            "transient_less_local_attention_scores": (measured["transient_gib"] - extra) / estimate["transient_gib"],
            "allocated_peak": measured["fwd_bwd_peak_gib"] / estimate["allocated_peak_gib"],
            "device_used_vs_train_gib": measured["device_used_gib"] / estimate["train_gib"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--estimate-only", action="store_true",
                        help="print the planner's estimate for the shape and exit (no GPU needed)")
    parser.add_argument("--json", default=None, help="also write the record to this file")
    args = parser.parse_args(argv)
    record = {"shape": SHAPE, "micro_batch": {"sequences": BATCH, "tokens_per_sequence": SEQ,
                                              "micro_batch_tokens": BATCH * SEQ},
              "local_attention_scores_gib": local_attention_scores_gib()}
    if args.estimate_only:
        record["estimate"] = planner_estimate()
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_calibrate: no CUDA device (use --estimate-only for the planner's side)", file=sys.stderr)
            return 2
        record["measured"] = measure()
        record["estimate"] = planner_estimate(gpu_memory_gib=record["measured"]["device_total_gib"])
        record["measured_over_estimate"] = compare(record["measured"], record["estimate"])
    text = json.dumps(record, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
