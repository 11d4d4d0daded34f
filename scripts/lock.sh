#!/usr/bin/env bash
# Regenerates requirements/cpu.lock, every package and version the CPU environment installs,
# from the top-level pins in requirements/cpu.txt, with uv's resolver (uv is fetched into the
# environment cache on first use). Versions already in the lock are kept unless a pin forces a
# change, so the lock moves only where you moved it; pass uv's own flags to do more, e.g.
#   scripts/lock.sh --upgrade-package aiohttp
# scripts/env.sh installs the lock (it is part of the environment's key) and then runs pip check.
# megatron.txt is not locked: its two packages are installed without their dependencies.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
uv_version=0.13.9
tools=${MARSRL_ENV_ROOT:-$HOME/.cache/megatron_marsrl}/uv-$uv_version
if [ ! -x "$tools/bin/uv" ]; then
  python3 -m pip install -q --target "$tools" "uv==$uv_version" >&2
fi
cd "$root"
"$tools/bin/uv" pip compile requirements/cpu.txt --python-version 3.11 -o requirements/cpu.lock "$@"
