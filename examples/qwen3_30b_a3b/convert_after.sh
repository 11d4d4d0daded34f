#!/usr/bin/env bash
# After training: export a run checkpoint's policy to a HF directory (safetensors, config,
# tokenizer) for evaluation (`marsrl eval`) or serving with SGLang.
#
#   examples/qwen3_30b_a3b/convert_after.sh outputs/qwen3_30b_a3b_h100x16 /data/models/Qwen3-30B-A3B-Thinking-2507 /data/models/marsrl-qwen3-30b-a3b
#
# Takes the newest complete checkpoint (checkpoints/step_NNNNNN with trainer_state.json) and its
# shared policy; a torch_dist checkpoint loads under any layout, so the export runs on one node
# under TP4/EP8 whatever the training cluster size was (8 local ranks: GPUs or CPU processes).
# Run checkpoints record the HF config and the tokenizer (tested on CPU with the tiny recipe).
set -euo pipefail
run=${1:?usage: $0 RUN_DIR ORIGINAL_HF_DIR HF_OUT}
orig=${2:?usage: $0 RUN_DIR ORIGINAL_HF_DIR HF_OUT}
out=${3:?usage: $0 RUN_DIR ORIGINAL_HF_DIR HF_OUT}

step=""
for dir in "$run"/checkpoints/step_*; do
  [[ -f "$dir/trainer_state.json" ]] && step=$dir   # step_ names sort by number (zero-padded)
done
[[ -n "$step" ]] || { echo "no complete checkpoint under $run/checkpoints" >&2; exit 1; }
policy=$step/policy_shared
if ! grep -q '"hf_config"' "$policy/marsrl_checkpoint.json"; then
  echo "$policy: marsrl_checkpoint.json has no hf_config entry (written by an older version?)" >&2
  exit 1
fi

marsrl convert mcore-to-hf --input "$policy" --output "$out" --tp 4 --ep 8 --etp 1

# generation_config.json (sampling defaults) is not part of a checkpoint: take the original's.
for f in tokenizer.json tokenizer_config.json vocab.json merges.txt special_tokens_map.json generation_config.json; do
  if [[ -f "$orig/$f" && ! -f "$out/$f" ]]; then cp "$orig/$f" "$out/"; fi
done
echo "exported $policy -> $out"
