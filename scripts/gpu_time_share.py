"""Time-shared colocation on a GPU, the trainer's side: between Adam steps a policy moves its
parameters, gradient buffers and optimizer state to pinned host memory and back in place
(PolicyActor.offload/onload, megatron/offload.py), as rl/time_share.py does around every
rollout, while two identical policies that never move train next to it (fp32).

    python scripts/gpu_time_share.py --json out.json     # on a CUDA machine (about a minute)

Reports, per move: the bytes moved, the GPU memory it freed (torch.cuda.memory_allocated
before and after), the copy rates in GB/s each way (rl/projection.py assumes SWAP_GIB_PER_S per
GPU), the planner's parameters + gradients + optimizer state for the same shape
(megatron/memory.py) beside the bytes moved, and the largest parameter difference from a
policy that never moved after three steps, next to the difference between the two that never
moved (the GPU's run-to-run noise: MoE backward accumulates with atomics). Exit 0 when the
storages were emptied, the memory came free and came back, and the moved policy is within
that noise.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

GIB = 2**30
SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
             num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
             num_experts_per_tok=4, max_position_embeddings=4096, tie_word_embeddings=False)
"""A ~0.28B-parameter Qwen3-MoE (the shape gpu_calibrate.py measures): ~3 GiB of trainer state."""
STEPS = 3


def measure() -> dict:
    import torch

    from megatron_marsrl.megatron.actor import PolicyActor, Sequence, pack_sequences
    from megatron_marsrl.megatron.hf_config import ModelArch
    from megatron_marsrl.megatron.memory import MemoryConfig, estimate_memory
    from megatron_marsrl.megatron.optim import OptimConfig
    from megatron_marsrl.megatron.parallel import ParallelConfig, init_parallel
    from megatron_marsrl.megatron.tiny import make_hf_checkpoint

    hf_dir = make_hf_checkpoint("qwen3_moe", tempfile.mkdtemp(prefix="marsrl-time-share-"), overrides=SHAPE)
    arch, parallel = ModelArch.from_hf_dir(hf_dir), ParallelConfig()
    init_parallel(parallel, arch)
    optim = OptimConfig(lr=1e-4, clip_grad=1.0)
    # fp32, so that a round trip that loses anything (Adam moments: ~lr per step) stands out from
    # the GPU's own run-to-run noise (MoE backward accumulates with atomics), which the pair of
    # policies that never move measures
    still, twin, moving = (PolicyActor(name, arch, parallel, optim, hf_dir=str(hf_dir), dtype=torch.float32)
                           for name in ("still", "twin", "moving"))
    gen = torch.Generator().manual_seed(0)
    moves = []
    for step in range(STEPS):
        seqs = [Sequence(prompt_ids=torch.randint(0, arch.vocab_size, (64,), generator=gen).tolist(),
                         response_ids=torch.randint(0, arch.vocab_size, (192,), generator=gen).tolist(),
                         advantage=float(torch.randn((), generator=gen)), reward=0.0) for _ in range(8)]
        for actor in (still, twin, moving):
            actor.train_micro_batch(pack_sequences(seqs), lambda logp, ent, b: (-logp.mean(), {}), with_entropy=False)
            actor.finish_step(grad_scale=1.0, max_grad_norm=None)
        if step == STEPS - 1:
            break
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        state = moving.offload("state")
        params = moving.offload("params")
        out_s = time.perf_counter() - start
        emptied = all(p.untyped_storage().nbytes() == 0 for p in moving.model.parameters())
        after = torch.cuda.memory_allocated()
        start = time.perf_counter()
        back = moving.onload("params") + moving.onload("state")
        in_s = time.perf_counter() - start
        torch.cuda.synchronize()
        moves.append({"state_bytes": state, "params_bytes": params, "restored_bytes": back,
                      "freed_bytes": before - after, "emptied": emptied,
                      "allocated_back_minus_before": torch.cuda.memory_allocated() - before,
                      "offload_s": out_s, "onload_s": in_s,
                      "offload_gb_per_s": (state + params) / out_s / 1e9, "onload_gb_per_s": back / in_s / 1e9})

    def max_diff(a, b):
        return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a.model.parameters(),
                                                                              b.model.parameters()))

    est = estimate_memory(arch, parallel, MemoryConfig(world_size=1, micro_batch_tokens=2048, param_bytes=4))
    return {"device": torch.cuda.get_device_name(0), "model": est.model, "dtype": "float32", "moves": moves,
            "max_param_diff": max_diff(still, moving), "noise_param_diff": max_diff(still, twin),
            "planner_state_gib": est.params_gib + est.grads_gib + est.optimizer_gib,
            "moved_gib": (moves[0]["state_bytes"] + moves[0]["params_bytes"]) / GIB}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_time_share: no CUDA device (the moves are GPU-only; the CPU round trip is tested in "
              "tests/megatron/test_training_parity.py)", file=sys.stderr)
        return 3
    result = measure()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    # exact, or within the GPU's own noise (the policies that never moved differ by it too)
    exact = result["max_param_diff"] <= 2 * result["noise_param_diff"] + 1e-7
    ok = exact and all(m["emptied"] and m["freed_bytes"] >= 0.9 * (m["state_bytes"] + m["params_bytes"])
                       and abs(m["allocated_back_minus_before"]) <= 0.01 * m["restored_bytes"]
                       for m in result["moves"])
    print(f"gpu_time_share: moved {result['moved_gib']:.2f} GiB (planner: {result['planner_state_gib']:.2f}), "
          f"freed {result['moves'][0]['freed_bytes'] / GIB:.2f} GiB, out {result['moves'][0]['offload_gb_per_s']:.1f} "
          f"GB/s, in {result['moves'][0]['onload_gb_per_s']:.1f} GB/s, max param diff {result['max_param_diff']:.3g} "
          f"(two policies that never moved: {result['noise_param_diff']:.3g}) "
          f"-> {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
