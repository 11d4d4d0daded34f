#!/usr/bin/env bash
# Builds the carry for the lent GPU machine: the wheels `scripts/gpu_check.sh` needs there, in
# gpu_wheels/ (git-ignored), downloaded for Python 3.12 on x86_64 Linux. That machine has Python
# 3.12, torch 2.11 and transformers 5.17 (with their own dependencies) and no network; everything
# else the trainer imports travels in this folder, at most 64 MiB with anything else carried.
#
#   scripts/gpu_carry.sh              # -> gpu_wheels/, prints each wheel and the total size
#   scripts/gpu_carry.sh --list       # the pinned requirements only (no network)
#   GPU_WHEELS=/tmp/w scripts/gpu_carry.sh
#
# Exit 1 if the download fails or the folder exceeds the limit. Network is needed here only.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${GPU_WHEELS:-$root/gpu_wheels}
python=${PYTHON:-python3}
LIMIT_MIB=64

# What `marsrl train` (embedded engine), `megatron.verify` and scripts/gpu_calibrate.py import
# beyond torch, transformers and their dependencies, found by running them with every other
# module blocked. Pins that requirements/*.txt also has equal them (tests/test_gpu_check.py checks).
CARRY=(
  megatron-core==0.19.2            # the trainer (its one compiled part, datasets helpers, is unused)
  math-verify==0.9.0               # rewards/math_match.py
  tensorboard==2.21.0              # rl/observe.py: torch.utils.tensorboard.SummaryWriter
  latex2sympy2_extended==1.11.0    # math-verify's parser
  antlr4-python3-runtime==4.13.2   # latex2sympy2_extended's runtime
  protobuf==7.36.2                 # tensorboard's event files
  absl-py==2.5.1                   # tensorboard's logging/flags import
  psutil==7.2.2                    # megatron-core's checkpoint writer (a compiled abi3 wheel)
)

if [ "${1:-}" = "--list" ]; then
  printf '%s\n' "${CARRY[@]}"
  exit 0
elif [ $# -gt 0 ]; then
  echo "usage: scripts/gpu_carry.sh [--list]   (destination: \$GPU_WHEELS, default gpu_wheels/)" >&2
  exit 2
fi

# Download into a fresh sibling and swap it in, so a failed download never leaves a partial carry.
# PIP_CONSTRAINT="": a machine-wide pip constraints file must not pin what is downloaded here.
tmp="$dest.partial"
rm -rf "$tmp"
mkdir -p "$tmp"
PIP_CONSTRAINT="" "$python" -m pip download --quiet --disable-pip-version-check --no-deps \
  --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --dest "$tmp" "${CARRY[@]}"
rm -rf "$dest"
mv "$tmp" "$dest"

ls -l "$dest" | awk 'NR > 1 {printf "%10d  %s\n", $5, $9}'
bytes=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
echo "gpu_carry: ${#CARRY[@]} wheels, $mib MiB in $dest (limit $LIMIT_MIB MiB)"
if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu_carry: over the $LIMIT_MIB MiB carry limit" >&2
  exit 1
fi
