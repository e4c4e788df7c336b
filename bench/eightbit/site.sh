#!/usr/bin/env bash
# Installs (once) the 8-bit AdamW peers of bench/eightbit/requirements.txt into a cached directory
# for PYTHONPATH and prints its path; they run on the CI pip venv's torch (scripts/pip-venv.sh).
# Cached under /var/cache/shardopt/platforms/eightbit/site-KEY, KEY hashing the requirements, the
# venv's interpreter and this recipe; wheels pass through the shared wheelhouse
# (/var/cache/shardopt/pip/wheels, SHARDOPT_PIP_CACHE), each checked against its pinned hash.
#   PYTHONPATH=build-pip/python:$(bench/eightbit/site.sh) <venv>/bin/python bench/optimizer_kernels.py \
#       --impls shardopt_fused,shardopt_adamw8bit,torchao_adamw8bit,bnb_adamw8bit,torch_fused
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REQ="$HERE/requirements.txt"
VENV="$("$HERE/../../scripts/pip-venv.sh")"
PY="$VENV/bin/python"
CACHE="${SHARDOPT_PLATFORM_CACHE:-/var/cache/shardopt/platforms}/eightbit"
WHEELS="${SHARDOPT_PIP_CACHE:-/var/cache/shardopt/pip}/wheels"
RECIPE=1   # bump when the way the directory is made changes
KEY="$( { echo "recipe $RECIPE"; "$PY" -VV; cat "$REQ"; } | sha256sum | cut -c1-16)"
SITE="$CACHE/site-$KEY"
mkdir -p "$CACHE" "$WHEELS"
exec 9>"$CACHE/.lock-$KEY"
flock -x 9
if [ ! -f "$SITE/.shardopt-key" ] || [ "$(cat "$SITE/.shardopt-key")" != "$KEY" ]; then
  rm -rf "$SITE"
  "$PY" -m pip download --disable-pip-version-check --no-cache-dir --no-deps --only-binary=:all: \
    --require-hashes -r "$REQ" -d "$WHEELS" -q >&2
  "$PY" -m pip install --disable-pip-version-check --no-cache-dir --no-index --no-deps \
    --find-links "$WHEELS" --only-binary=:all: --require-hashes -r "$REQ" --target "$SITE" -q >&2
  PYTHONPATH="$SITE" "$PY" -c 'import torchao, bitsandbytes
print("[eightbit-site] torchao", torchao.__version__, "bitsandbytes", bitsandbytes.__version__)' >&2
  echo "$KEY" >"$SITE/.shardopt-key"
fi
echo "$SITE"
