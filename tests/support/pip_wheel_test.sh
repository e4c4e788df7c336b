#!/usr/bin/env bash
# The package as Python users get it: `pip wheel` of the repository (pyproject.toml,
# scikit-build-core) against the torch of <python>'s venv, installed into a second venv that shares
# that torch (a .pth file onto the first venv's site-packages: no second multi-GB download), then
# train_bert.py on 2 ranks under that venv's `python -m torch.distributed.run` (torchrun), importing
# shardopt from the installed wheel, never from the build tree.
#   pip_wheel_test.sh <python> <repo> <work dir>
set -uo pipefail
PY=$1 REPO=$2 WORK=$3
fail() { echo "[pip_wheel] FAIL: $*" >&2; exit 1; }
rm -rf "$WORK"
mkdir -p "$WORK/dist"
unset PYTHONPATH
# The same ccache as scripts/build.sh: the library's objects come from the platform's own build.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(dirname "$REPO")}"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
# The compilers CMake picks by itself (scikit-build-core would take Python's sysconfig CXX,
# x86_64-linux-gnu-g++, and every ccache lookup would miss).
export CC="${CC:-cc}" CXX="${CXX:-c++}"

t0=$SECONDS
"$PY" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps --no-index \
  -w "$WORK/dist" "$REPO" >"$WORK/wheel.log" 2>&1 || { tail -40 "$WORK/wheel.log"; fail "pip wheel"; }
wheel=$(ls "$WORK"/dist/shardopt-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || fail "pip wheel made no shardopt wheel"
echo "[pip_wheel] built $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB) in $((SECONDS - t0)) s"
"$PY" -m zipfile -l "$wheel" | awk 'NR > 1 {print "[pip_wheel]   " $1}'

# The second venv: its own site-packages, plus the first venv's (torch and its nvidia-* wheels).
"$PY" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' ||
  fail "$PY is not in a venv"
base=$("$PY" -c 'import sys; print(sys.base_prefix)')
"$base/bin/python3" -m venv "$WORK/venv2" || fail "python3 -m venv"
PY2="$WORK/venv2/bin/python"
site1=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site2=$("$PY2" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site1" >"$site2/shared-torch.pth"
"$PY2" -m pip install --disable-pip-version-check --no-index --no-deps "$wheel" >"$WORK/install.log" 2>&1 ||
  { cat "$WORK/install.log"; fail "pip install of the wheel into the second venv"; }

cd "$WORK"  # away from the repository, whose python_bindings/shardopt has no _C
"$PY2" - "$site2" <<'EOF' || fail "import from the second venv"
import sys, torch, shardopt
where = shardopt.__file__
print(f"[pip_wheel] shardopt {shardopt.__version__} from {where}; torch {torch.__version__}")
assert where.startswith(sys.argv[1]), f"shardopt imported from {where}, not the installed wheel"
EOF
"$PY2" -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 \
  --master-port "$("$PY2" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" \
  --max-restarts 0 "$REPO/python_bindings/examples/train_bert.py" --launcher torchrun --preset tiny \
  --stage 2 --steps 12 --batch 4 --log-every 4 --check-loss-decreases >"$WORK/smoke.log" 2>&1 ||
  { cat "$WORK/smoke.log"; fail "2-rank smoke run from the second venv"; }
cat "$WORK/smoke.log"
grep -q "2 ranks (gloo)" "$WORK/smoke.log" || fail "the smoke run did not run on 2 ranks over Gloo"
echo "[pip_wheel] ok in $((SECONDS - t0)) s"
