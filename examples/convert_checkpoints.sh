#!/usr/bin/env bash
# Convert a HF checkpoint to Megatron and back. Runs on CPU (one process per rank of the
# layout); on a GPU node the same commands work inside the NGC container.
#
#   examples/convert_checkpoints.sh /path/to/Qwen3-30B-A3B /scratch/qwen3-30b-a3b
set -euo pipefail
hf=${1:?usage: $0 HF_DIR OUT_PREFIX}
out=${2:?usage: $0 HF_DIR OUT_PREFIX}
marsrl convert hf-to-mcore --input "$hf" --output "$out-mcore" --tp 2 --ep 8
marsrl convert mcore-to-hf --input "$out-mcore" --output "$out-hf"
