#!/usr/bin/env bash
# Makes (once) the torchft benchmark's virtual environment and prints its path: Debian 12's
# /usr/bin/python3 with torchft 0.2.0 and the CI venv's torch, every wheel pinned by hash in
# bench/torchft/requirements.txt. Cached under /var/cache/shardopt/platforms/torchft/venv-KEY, KEY
# hashing that file, the interpreter and this recipe (a change makes a new directory beside the
# old ones). Wheels pass through scripts/pip-venv.sh's wheelhouse (/var/cache/shardopt/pip/wheels,
# SHARDOPT_PIP_CACHE): torch and its CUDA wheels are usually there already; a missing file is
# downloaded from PyPI and checked against its hash.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REQ="$HERE/requirements.txt"
PY="${SHARDOPT_PIP_PYTHON:-/usr/bin/python3}"
CACHE="${SHARDOPT_PLATFORM_CACHE:-/var/cache/shardopt/platforms}/torchft"
WHEELS="${SHARDOPT_PIP_CACHE:-/var/cache/shardopt/pip}/wheels"
RECIPE=1   # bump when the way the venv is made changes
log() { echo "[torchft-venv] $*" >&2; }

"$PY" -c 'import ensurepip, venv' 2>/dev/null ||
  { echo "[torchft-venv] $PY lacks venv: apt-get install python3-venv (or run scripts/pip-venv.sh)" >&2; exit 1; }
KEY="$( { echo "recipe $RECIPE"; "$PY" -VV; cat "$REQ"; } | sha256sum | cut -c1-16)"
VENV="$CACHE/venv-$KEY"
mkdir -p "$CACHE" "$WHEELS"
exec 9>"$CACHE/.lock-$KEY"
flock -x 9
if [ -f "$VENV/.shardopt-platform-key" ] && [ "$(cat "$VENV/.shardopt-platform-key")" = "$KEY" ]; then
  log "reusing $VENV (key $KEY)"
else
  rm -rf "$VENV"
  t0=$SECONDS
  "$PY" -m venv "$VENV"
  # Downloads only what the wheelhouse lacks; every file is checked against its pinned hash.
  "$VENV/bin/pip" download --disable-pip-version-check --no-cache-dir --only-binary=:all: \
    --require-hashes -r "$REQ" -d "$WHEELS" -q >&2
  "$VENV/bin/pip" install --disable-pip-version-check --no-cache-dir --no-index \
    --find-links "$WHEELS" --only-binary=:all: --require-hashes -r "$REQ" -q >&2
  "$VENV/bin/pip" check --disable-pip-version-check >&2
  "$VENV/bin/python" -c 'import torch, torchft.manager; from importlib.metadata import version
print("[torchft-venv] torch", torch.__version__, "torchft", version("torchft"))' >&2
  [ -x "$VENV/bin/torchft_lighthouse" ] || { log "no torchft_lighthouse in $VENV/bin"; exit 1; }
  log "venv made in $((SECONDS - t0)) s ($(du -sh "$VENV" | cut -f1))"
  echo "$KEY" >"$VENV/.shardopt-platform-key"
fi
echo "$VENV"
