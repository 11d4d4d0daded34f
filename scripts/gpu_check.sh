#!/usr/bin/env bash
# The prepared GPU check (issue 6): one short script for a lent H100/H200, about 10 minutes.
# Run it inside the image built from ./Dockerfile (the device machine has no network, so the
# stack must already be there); figures land in $OUT (default ./gpu_check_out).
#
#   OUT=/tmp/out bash scripts/gpu_check.sh
#
# 1. Transformer Engine layer path: HF <-> Megatron parity with TE layers (selfcheck picks TE
#    when TE and CUDA are present).
# 2. SGLang CUDA engine: rollout throughput, then weight sync into it (GB/s) on a ~1.3B-parameter
#    Qwen3-MoE-shaped model (the trainer keeps engine memory resident: no release/resume yet).
# 3. A few RL steps of that model (marsrl bench throughput): tokens/s/GPU, step parts, MFU.
# Never run so far: no GPU was lent to this project.
set -euo pipefail
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv"

# A Qwen3-MoE shape of ~1.3B parameters (64 experts x 12 layers) on the task tokenizer.
SHAPE=(task.tiny_model.hidden_size=1024 task.tiny_model.num_hidden_layers=12
       task.tiny_model.num_attention_heads=16 task.tiny_model.num_key_value_heads=4
       task.tiny_model.head_dim=64 task.tiny_model.num_experts=64 task.tiny_model.num_experts_per_tok=8
       task.tiny_model.moe_intermediate_size=512 task.tiny_model.intermediate_size=2048)

timeout 120 marsrl selfcheck --family qwen3_moe 2>&1 | tail -20 > "$OUT/selfcheck_te.txt" || echo "selfcheck failed" >> "$OUT/selfcheck_te.txt"
timeout 150 marsrl bench rollout --engines hf,sglang --batch 32 --new-tokens 256 --json "$OUT/rollout.json" \
  > "$OUT/rollout.txt" 2>&1 || true
timeout 150 marsrl bench weight-sync --engine sglang --size-mb 2000 --json "$OUT/weight_sync.json" \
  > "$OUT/weight_sync.txt" 2>&1 || true
overrides=()
for kv in "${SHAPE[@]}" engine.kind=sglang model.dtype=bfloat16 parallel.ep=1 run.steps=4; do
  overrides+=(--override "$kv")
done
timeout 240 marsrl bench throughput --recipe tiny_arithmetic --nproc-per-node 1 "${overrides[@]}" \
  --json "$OUT/throughput.json" > "$OUT/throughput.txt" 2>&1 || true
ls -l "$OUT"
