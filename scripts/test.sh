#!/usr/bin/env bash
# Runs pytest inside the project environment (created on first use). Extra
# arguments go to pytest. pytest's exit code 5 ("no tests collected") is turned
# into a failure so an empty run can never pass.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
env=$("$root/scripts/env.sh") || { echo "test.sh: environment set-up failed" >&2; exit 1; }
cd "$root"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$env/bin/python" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "test.sh: pytest collected no tests; failing" >&2; exit 1; fi
exit "$rc"
