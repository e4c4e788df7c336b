#!/usr/bin/env bash
# Makes (once) the pip platform's virtual environment and prints its path: Debian 12's
# /usr/bin/python3 with PyPI's torch and what the tests need, every wheel pinned by hash in
# scripts/pip-requirements.txt, then the source-only packages of scripts/pip-requirements-sdist.txt
# (DeepSpeed) built against that torch. Cached under /var/cache/shardopt/platforms/pip/venv-KEY,
# KEY hashing both files, the interpreter and this recipe: a change of any makes a new directory
# beside the old ones and never removes them (another clone may be using its venv at that moment;
# `rm -rf /var/cache/shardopt/platforms/pip/venv*` when none is). Wheels and archives pass through a
# wheelhouse (/var/cache/shardopt/pip/wheels, SHARDOPT_PIP_CACHE) that later runs reuse but never
# need: a missing file is downloaded again and checked against its hash.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ="$ROOT/scripts/pip-requirements.txt"
SDIST="$ROOT/scripts/pip-requirements-sdist.txt"
PY="${SHARDOPT_PIP_PYTHON:-/usr/bin/python3}"
CACHE="${SHARDOPT_PLATFORM_CACHE:-/var/cache/shardopt/platforms}/pip"
WHEELS="${SHARDOPT_PIP_CACHE:-/var/cache/shardopt/pip}/wheels"
RECIPE=2   # bump when the way the venv is made changes
log() { echo "[pip-venv] $*" >&2; }

# Debian splits venv (ensurepip) and the C headers the bindings build against out of python3.
need=()
"$PY" -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
[ -f "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] ||
  need+=(python3-dev)
if ((${#need[@]})); then
  log "installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi

KEY="$( { echo "recipe $RECIPE"; "$PY" -VV; cat "$REQ" "$SDIST"; } | sha256sum | cut -c1-16)"
VENV="$CACHE/venv-$KEY"
mkdir -p "$CACHE" "$WHEELS"
# One lock per key: making a new venv never blocks a clone that uses another one.
exec 9>"$CACHE/.lock-$KEY"
flock -x 9
if [ -f "$VENV/.shardopt-platform-key" ] && [ "$(cat "$VENV/.shardopt-platform-key")" = "$KEY" ]; then
  log "reusing $VENV (key $KEY, $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
else
  rm -rf "$VENV"
  t0=$SECONDS
  "$PY" -m venv "$VENV"
  before=$(du -sb "$WHEELS" | cut -f1)
  # Downloads only what the wheelhouse lacks; every file is checked against its pinned hash.
  "$VENV/bin/pip" download --disable-pip-version-check --no-cache-dir --only-binary=:all: \
    --require-hashes -r "$REQ" -d "$WHEELS" -q >&2
  after=$(du -sb "$WHEELS" | cut -f1)
  t1=$SECONDS
  log "downloaded $(((after - before) / 1000000)) MB in $((t1 - t0)) s (wheelhouse $WHEELS: $((after / 1000000)) MB)"
  "$VENV/bin/pip" install --disable-pip-version-check --no-cache-dir --no-index \
    --find-links "$WHEELS" --only-binary=:all: --require-hashes -r "$REQ" -q >&2
  "$VENV/bin/python" -c 'import torch; print("[pip-venv] torch", torch.__version__, "CUDA",
      torch.version.cuda, "cxx11 ABI", torch.compiled_with_cxx11_abi())' >&2
  t2=$SECONDS
  log "wheels installed in $((t2 - t1)) s"
  # Source archives: their metadata step imports torch, so they come after the wheels, built
  # without isolation; --no-deps because every dependency is a pinned wheel above (pip check).
  "$VENV/bin/pip" download --disable-pip-version-check --no-cache-dir --no-deps \
    --no-build-isolation --no-binary=:all: --require-hashes -r "$SDIST" -d "$WHEELS" -q >&2
  DS_BUILD_OPS=0 "$VENV/bin/pip" install --disable-pip-version-check --no-cache-dir --no-index \
    --find-links "$WHEELS" --no-deps --no-build-isolation --use-pep517 --require-hashes \
    -r "$SDIST" -q >&2
  "$VENV/bin/pip" check --disable-pip-version-check >&2
  log "source packages built and installed in $((SECONDS - t2)) s"
  log "installed in $((SECONDS - t1)) s ($(du -sh "$VENV" | cut -f1)); venv made in $((SECONDS - t0)) s"
  echo "$KEY" >"$VENV/.shardopt-platform-key"
fi
echo "$VENV"
