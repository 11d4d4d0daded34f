#!/usr/bin/env bash
# The GPU check, for the machine that is lent: one H200, Python 3.12 with torch 2.11 and
# transformers 5.17, no Transformer Engine, SGLang, Apex or megatron-core, no network, one
# command of at most 9m20s. What the trainer needs beyond torch and transformers travels
# as the carry gpu_wheels/ (built here with `scripts/gpu_carry.sh`, ~8 MiB) and is unpacked
# into a temporary directory; nothing is installed and nothing is written outside that
# directory and the output folder.
#
#   scripts/gpu_carry.sh                        # here, with network: gpu_wheels/
#   bash scripts/gpu_check.sh                   # there, in the checkout; figures in $OUT
#   bash scripts/gpu_check.sh --plan            # the stages and budgets; runs nothing
#   bash scripts/gpu_check.sh --only rl         # setup + the named stages (parity,rl,calibrate,timeshare)
#   RL_OVERRIDES="pipeline.time_shared=true scheduler.overlap=false" bash scripts/gpu_check.sh --only rl
#
# Stages, each under `timeout` (budgets in STAGES below; with the kill grace they stay < 560 s):
#   setup      unpack the wheels, record versions, GPU, compilers (env.json)
#   parity     Megatron (local layer spec) on CUDA vs transformers fp32 on CPU, tiny Qwen3-MoE
#              and dense Qwen3, fp32 (weight mapping, 1e-4) and bf16 (5e-2): parity.json
#   rl         `marsrl bench throughput`: 4 RL steps (first dropped) of a 28M-parameter
#              Qwen3-MoE shape, bf16 on CUDA, embedded engine, a weight sync with log-prob
#              probe every step: tokens/s, step parts, sync GB/s, train MFU (throughput.json)
#   calibrate  scripts/gpu_calibrate.py: measured train-phase memory of a small MoE shape next
#              to megatron/memory.py's estimate for it (calibration.json)
#   timeshare  scripts/gpu_time_share.py: a policy's parameters, gradients and Adam state to
#              pinned host memory and back between steps (time-shared colocation, trainer
#              side): memory freed, GB/s each way, training against policies that never moved
#              (time_share.json)
# A failing stage leaves the tail of its log in <stage>.log and the run goes on; summary.json
# lists every stage. Exit 0 only if all passed; 2 for bad arguments; 3 when this is no GPU machine.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

LIMIT_S=560     # the whole check must end within 9m20s (the device allows 600 s a command)
KILL_GRACE_S=5  # SIGKILL this long after a stage's SIGTERM
STAGES=(setup:30 parity:120 rl:210 calibrate:80 timeshare:90)   # name:budget in seconds

usage() {
  echo "usage: bash scripts/gpu_check.sh [--out DIR] [--wheels DIR] [--only STAGE[,STAGE]] [--plan]" >&2
  echo "  --out DIR     figures and logs (default: \$OUT, else gpu_check_out)" >&2
  echo "  --wheels DIR  the carried wheels (default: gpu_wheels, from scripts/gpu_carry.sh)" >&2
  echo "  --only LIST   run setup and these of parity,rl,calibrate,timeshare (default: all)" >&2
  echo "  --plan        print the stages and budgets, then exit without running anything" >&2
  echo "  PYTHON        the interpreter with torch and transformers (default python3)" >&2
}
die() { echo "gpu_check: $2" >&2; exit "$1"; }

out=${OUT:-gpu_check_out}
wheels=gpu_wheels
only=parity,rl,calibrate,timeshare
plan=0
while [ $# -gt 0 ]; do
  case $1 in
    --out) [ $# -ge 2 ] || { usage; exit 2; }; out=$2; shift 2 ;;
    --wheels) [ $# -ge 2 ] || { usage; exit 2; }; wheels=$2; shift 2 ;;
    --only) [ $# -ge 2 ] || { usage; exit 2; }; only=$2; shift 2 ;;
    --plan) plan=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1'" >&2; usage; exit 2 ;;
  esac
done
for s in ${only//,/ }; do
  case $s in parity|rl|calibrate|timeshare) ;; *) die 2 "--only: unknown stage '$s' (use parity, rl, calibrate, timeshare)" ;; esac
done
selected() { [ "$1" = setup ] || [[ ",$only," == *",$1,"* ]]; }

if [ "$plan" = 1 ]; then
  total=0
  for entry in "${STAGES[@]}"; do
    name=${entry%%:*} budget=${entry#*:}
    selected "$name" || continue
    total=$((total + budget + KILL_GRACE_S))
    printf 'stage %-10s budget %4d s\n' "$name" "$budget"
  done
  printf 'total %d s including %d s kill grace per stage (limit %d s)\n' "$total" "$KILL_GRACE_S" "$LIMIT_S"
  echo "out: $out"
  echo "wheels: $wheels"
  exit 0
fi

# Fail fast, before anything is written, where no stage could run.
command -v nvidia-smi >/dev/null || die 3 "no CUDA GPU: nvidia-smi not found (this check runs on the lent GPU machine; see README)"
nvidia-smi -L 2>/dev/null | grep -q GPU || die 3 "no CUDA GPU: nvidia-smi lists no device"
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import sys
try:
    import torch
except ImportError:
    sys.exit(4)
sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
case $? in
  0) ;;
  4) die 3 "$PYTHON cannot import torch: set PYTHON to the interpreter that has it" ;;
  *) die 3 "no CUDA GPU: $PYTHON's torch sees no CUDA device" ;;
esac
ls "$wheels"/*.whl >/dev/null 2>&1 || die 3 "no wheels in $wheels/: run scripts/gpu_carry.sh where there is network and carry gpu_wheels"

mkdir -p "$out"
out=$(cd "$out" && pwd)
wheels=$(cd "$wheels" && pwd)
work=$(mktemp -d -t marsrl-gpu-check.XXXXXX)
trap 'rm -rf "$work"' EXIT
# Everything the stages write besides $out goes under $work: unpacked wheels, runs, caches.
export PYTHON OUT="$out" WHEELS="$wheels" WORK="$work" TMPDIR="$work" PYTHONPATH="$root:$work/site"
export PYTHONPYCACHEPREFIX="$work/pycache" TRITON_CACHE_DIR="$work/triton" TORCHINDUCTOR_CACHE_DIR="$work/inductor"
export HF_HOME="$work/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

stage_setup() {
  mkdir -p "$WORK/site"
  for w in "$WHEELS"/*.whl; do "$PYTHON" -m zipfile -e "$w" "$WORK/site" || return 1; done
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv"
  "$PYTHON" - "$OUT/env.json" <<'EOF'
import importlib, json, platform, shutil, sys
import torch
env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name(0), "device_count": torch.cuda.device_count(),
       "c_compiler": shutil.which("cc") or shutil.which("gcc")}  # torch.compile's Triton launcher needs one
for mod in ("transformers", "megatron.core", "math_verify", "tensorboard", "triton", "transformer_engine", "apex"):
    try:
        env[mod] = getattr(importlib.import_module(mod), "__version__", "present")
    except ImportError:
        env[mod] = None
json.dump(env, open(sys.argv[1], "w"), indent=2)
print(json.dumps(env))
sys.exit(0 if env["megatron.core"] and env["math_verify"] and env["tensorboard"] else 1)
EOF
}

stage_parity() {
  "$PYTHON" -m megatron_marsrl.megatron.verify --families qwen3_moe,qwen3 --dtypes float32,bfloat16 \
    --out "$WORK/parity" --json "$OUT/parity.json"
}

stage_rl() {
  # A Qwen3-MoE of 28M parameters (16 experts top-4 x 4 layers) on the task tokenizer: big
  # enough for the GPU to do real work, small enough for four steps with their start-up
  # (imports, compiled fusions) to fit the budget.
  local shape=(task.tiny_model.hidden_size=512 task.tiny_model.num_hidden_layers=4
    task.tiny_model.num_attention_heads=8 task.tiny_model.num_key_value_heads=4 task.tiny_model.head_dim=64
    task.tiny_model.num_experts=16 task.tiny_model.num_experts_per_tok=4
    task.tiny_model.moe_intermediate_size=256 task.tiny_model.intermediate_size=1024)
  local args=() kv
  # RL_OVERRIDES: more config overrides, e.g. "pipeline.time_shared=true scheduler.overlap=false"
  for kv in "${shape[@]}" model.dtype=bfloat16 parallel.ep=1 engine.kind=hf ${RL_OVERRIDES:-}; do
    args+=(--override "$kv")
  done
  # Megatron's fused SwiGLU / bias-dropout functions go through torch.compile on GPU; every new
  # packed length can recompile them, which would eat the budget. The parity stage compiles them
  # (and so checks that this machine can); here and in calibrate they run eagerly (same
  # autograd functions, so the same saved activations).
  TORCH_COMPILE_DISABLE=1 "$PYTHON" -m megatron_marsrl.cli bench throughput --recipe tiny_arithmetic \
    --steps 4 --nproc-per-node 1 "${args[@]}" --output-dir "$WORK/rl" --json "$OUT/throughput.json"
  local rc=$?
  find "$WORK/rl" -name train.log -exec cp {} "$OUT/rl_train.log" \;  # the run's own log, phases included
  return $rc
}

stage_calibrate() {
  TORCH_COMPILE_DISABLE=1 "$PYTHON" scripts/gpu_calibrate.py --json "$OUT/calibration.json"
}
stage_timeshare() {
  TORCH_COMPILE_DISABLE=1 "$PYTHON" scripts/gpu_time_share.py --json "$OUT/time_share.json"
}
export -f stage_setup stage_parity stage_rl stage_calibrate stage_timeshare

failed=0
summary=()
for entry in "${STAGES[@]}"; do
  name=${entry%%:*} budget=${entry#*:}
  selected "$name" || continue
  echo "[gpu_check] $name: budget ${budget} s"
  start=$SECONDS
  timeout --kill-after="$KILL_GRACE_S" "$budget" bash -c "stage_$name" > "$work/$name.log" 2>&1
  rc=$?
  took=$((SECONDS - start))
  tail -n 300 "$work/$name.log" > "$out/$name.log"
  case $rc in
    0) status=passed ;;
    124|137) status="timed out after ${budget} s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  echo "[gpu_check] $name: $status in ${took} s"
  if [ "$rc" -ne 0 ]; then
    failed=$((failed + 1))
    echo "[gpu_check] the end of $name.log:"
    tail -n 25 "$work/$name.log" | sed 's/^/    /'
  fi
  summary+=("{\"stage\": \"$name\", \"budget_s\": $budget, \"seconds\": $took, \"status\": \"$status\"}")
done
{
  echo "{\"passed\": $([ "$failed" -eq 0 ] && echo true || echo false), \"stages\": ["
  (IFS=,; echo "${summary[*]}")
  echo "]}"
} > "$out/summary.json"

# The key figures, from whatever JSON the stages left.
"$PYTHON" - "$out" <<'EOF' || true
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else None
for r in load("parity.json") or []:
    print(f"parity {r['family']:9} {r['dtype']:8} on {r['device']} ({r['layer_spec']}): |logit| {r['logit_diff']:.2e} "
          f"|logprob| {r['logprob_diff']:.2e} tol {r['tolerance']:.0e} export {r['export_seen']}/{r['hf_total']} "
          f"-> {'ok' if r['passed'] else 'FAILED'}")
def g(x):
    return "n/a" if x is None else f"{x:.3g}"
if t := load("throughput.json"):
    print(f"rl: step {g(t['step_time_s'])} s, train {g(t['train']['tokens_per_s_per_gpu'])} tok/s/GPU, "
          f"MFU {g(t['train']['mfu'])}, rollout {g(t['rollout']['tokens_per_s_per_gpu'])} tok/s, "
          f"sync {g(t['weight_sync']['gb'])} GB at {g(t['weight_sync']['gb_per_s'])} GB/s")
if c := load("calibration.json"):
    m, e = c["measured"], c["estimate"]
    print(f"calibrate ({m['layer_spec']} layers): state {m['state_gib']:.2f} vs {e['state_gib']:.2f} GiB, "
          f"fwd/bwd transient {m['transient_gib']:.2f} vs {e['transient_gib']:.2f} GiB "
          f"(local attention scores {c['local_attention_scores_gib']:.2f}), optimizer-step peak "
          f"{m['optimizer_step_peak_gib']:.2f}, device used {m['device_used_gib']:.2f} vs train {e['train_gib']:.2f} GiB")
if t := load("time_share.json"):
    m = t["moves"][0]
    print(f"timeshare: moved {t['moved_gib']:.2f} GiB (planner state {t['planner_state_gib']:.2f}), freed "
          f"{m['freed_bytes'] / 2**30:.2f} GiB, out {m['offload_gb_per_s']:.1f} GB/s, in {m['onload_gb_per_s']:.1f} GB/s, "
          f"max param diff {t['max_param_diff']:.3g} (never-moved pair {t['noise_param_diff']:.3g})")
EOF
echo "[gpu_check] $([ "$failed" -eq 0 ] && echo "all stages passed" || echo "$failed stage(s) failed"); figures in $out"
[ "$failed" -eq 0 ]
