#!/usr/bin/env bash
# Before training: check the Qwen3-30B-A3B(-Thinking-2507) checkpoint against the recipes and
# write a Megatron torch_dist copy of it under the training split.
#
#   examples/qwen3_30b_a3b/convert_before.sh /data/models/Qwen3-30B-A3B-Thinking-2507 /data/mcore/qwen3-30b-a3b
#
# The trainer itself reads the HF safetensors of model.path directly, so the Megatron copy is
# optional: the conversion proves that every tensor maps under TP4/EP8 (the training split of
# the x8 recipe; a torch_dist checkpoint loads under any other layout, so EP16/32/64 runs need
# no other copy) and gives Megatron-native tools a checkpoint. It launches 8 local ranks
# (TP4 x EP8 = 8 GPUs, or 8 CPU processes with ~130 GB of host memory in fp32): run it on one
# node, e.g. inside the NGC container (`srun -N1 --gpus-per-node=8 --container-image=...`).
set -euo pipefail
hf=${1:?usage: $0 HF_DIR MCORE_OUT}
mcore=${2:?usage: $0 HF_DIR MCORE_OUT}

# 1. The plan of every cluster size against the checkpoint's own config.json (no GPU needed).
for nodes in 1 2 4 8; do
  marsrl train --recipe "qwen3_30b_a3b_h100x$((nodes * 8))" --nodes "$nodes" --dry-run \
    model.path="$hf" | tail -n 2
done

# 2. HF -> Megatron under the training split: TP4 (4 KV heads), EP8, ETP1.
marsrl convert hf-to-mcore --input "$hf" --output "$mcore" --tp 4 --ep 8 --etp 1

# 3. Back to HF under another split: proves the export path on this checkpoint before a long
#    run depends on it (marsrl selfcheck proves the round trip bit-exact on a tiny model).
marsrl convert mcore-to-hf --input "$mcore" --output "$mcore-roundtrip-hf" --tp 2 --ep 4
