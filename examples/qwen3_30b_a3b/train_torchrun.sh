#!/usr/bin/env bash
# MarsRL training of Qwen3-30B-A3B(-Thinking-2507) on 1, 2, 4 or 8 nodes of 8 x H100-80GB with
# plain torchrun. Run it once on every node, with the same NNODES and MASTER_ADDR:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node-a examples/qwen3_30b_a3b/train_torchrun.sh   # on node-a
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node-a examples/qwen3_30b_a3b/train_torchrun.sh   # on node-b
#
# The recipe follows the cluster size (qwen3_30b_a3b_h100x8/x16/x32/x64; with PLACEMENT=split on
# 4 or 8 nodes qwen3_30b_a3b_h100x32_split/x64_split, where GPUs 0-1 of each node train and 2-7
# generate); extra arguments are config overrides (e.g. run.steps=50) or --resume. Rank 0 is on
# the node with NODE_RANK=0 (static rendezvous keeps that order, c10d would not); every node
# starts its own SGLang engines, which rank 0 reaches over the network: on more than one node,
# export the same secret MARSRL_SGLANG_API_KEY on every node (e.g. from openssl rand -hex 16).
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=8
MODEL=${MODEL:-/data/models/Qwen3-30B-A3B-Thinking-2507}   # local HF checkpoint, same path on every node
TRAIN=${TRAIN:-/data/marsrl/train.jsonl}
EVAL=${EVAL:-/data/marsrl/aime2025.jsonl}
OUT=${OUT:-}   # default outputs/<recipe>; on a shared filesystem: checkpoints are collective

case "$NNODES" in
  1|2|4|8) ;;
  *) echo "NNODES=$NNODES: the recipes cover 1, 2, 4 or 8 nodes of 8 GPUs" >&2; exit 1 ;;
esac
PLACEMENT=${PLACEMENT:-colocated}
case "$PLACEMENT" in
  colocated) RECIPE=qwen3_30b_a3b_h100x$((NNODES * GPUS_PER_NODE)); TRAIN_RANKS=$GPUS_PER_NODE ;;
  split) [[ "$NNODES" == 4 || "$NNODES" == 8 ]] || { echo "PLACEMENT=split: recipes for 4 or 8 nodes" >&2; exit 1; }
         RECIPE=qwen3_30b_a3b_h100x$((NNODES * GPUS_PER_NODE))_split; TRAIN_RANKS=2 ;;   # GPUs 0-1 train
  *) echo "PLACEMENT=$PLACEMENT: colocated or split" >&2; exit 1 ;;
esac
overrides=(model.path="$MODEL" task.train="$TRAIN" task.eval="$EVAL" run.output_dir="${OUT:-outputs/$RECIPE}")
if (( NNODES > 1 )); then
  : "${MARSRL_SGLANG_API_KEY:?on more than one node, export the same secret MARSRL_SGLANG_API_KEY on every node}"
  overrides+=(engine.host=0.0.0.0)
fi

# Host Adam (optim.cpu_offload_fraction > 0 on 8 and 16 GPUs) runs on these threads: 8 ranks
# x 8 threads suits a 64+ core host.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# Growable allocator segments: micro-batches change shape every round (rows x longest), which
# fragments fixed-size blocks (the dry run keeps a 6 GiB reserve for what is left). The SGLang
# servers each node starts inherit it. Not yet run on GPU: the weight sync hands CUDA IPC handles of
# the trainer's buckets to the servers, which takes another IPC path for these segments; if the
# first sync fails, export PYTORCH_CUDA_ALLOC_CONF= (empty) before launching.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}
# torchrun SIGKILLs its ranks 30 s after forwarding SIGTERM by default; the checkpoint written on
# SIGTERM (~430 GB with Adam state) needs longer.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}

# Validate the layout and the per-GPU memory plan first (no GPU touched; exits 2 if it does not fit).
python -m megatron_marsrl.cli train --recipe "$RECIPE" --nodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
  --dry-run "${overrides[@]}" "$@"

exec torchrun \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$TRAIN_RANKS" \
  --rdzv-backend static --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-marsrl-$RECIPE}" \
  -m megatron_marsrl.cli train --recipe "$RECIPE" "${overrides[@]}" "$@"
