#!/usr/bin/env bash
# Runs a command (default: scripts/test.sh) on another platform: a Debian root made with debootstrap,
# cached outside the clone and reused while scripts/setup.sh's package list and this recipe are
# unchanged. Usage: scripts/platform.sh debian13 [command args...]   (needs root: debootstrap, chroot)
#
# Note [platform mounts]: the script re-executes itself in a private mount namespace (unshare -m),
# so every mount it makes (proc, sys, dev, the clone) disappears with the process on any exit path,
# kill -9 included; the EXIT trap also unmounts explicitly. The clone is bind-mounted at its own
# path, and the platform builds in build-<platform>/ (ignored by git), so host and platform builds
# of one clone never share a build tree.
#
# The `pip` platform is no root but a virtual environment of this host's Python with PyPI's torch
# (scripts/pip-venv.sh, cached likewise): the command runs on the host with the venv first on PATH
# and CMake pointed at the wheel's libtorch, in build-pip/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PLATFORM="${1:-}"
case "$PLATFORM" in
  debian13) SUITE=trixie ;;
  pip) ;;
  *) echo "usage: scripts/platform.sh debian13|pip [command...]  (unknown platform '${PLATFORM}')" >&2
     exit 2 ;;
esac
shift

if [ "$PLATFORM" = pip ]; then
  VENV="$("$ROOT/scripts/pip-venv.sh")"
  PY="$VENV/bin/python"
  TORCH_PREFIX="$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  # The NCCL that the wheel's libtorch loads (nvidia-nccl-cu13), not /usr/local/cuda's: one
  # process, one libnccl.so.2. nvidia/nccl is a namespace package (no __init__.py, no __file__).
  NCCL_DIR="$("$PY" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)"
  # torch/ itself in the prefix path too: TorchConfig's find_library() would otherwise take the
  # system's libtorch (Debian's libtorch-dev) before the wheel's torch/lib.
  TORCH_ROOT="$("$PY" -c 'import torch, os; print(os.path.dirname(torch.__file__))')"
  args="-DCMAKE_PREFIX_PATH=$TORCH_PREFIX;$TORCH_ROOT -DSHARDOPT_PYTHON_EXECUTABLE=$PY"
  args+=" -Dpybind11_DIR=$("$PY" -m pybind11 --cmakedir)"
  # pip's torchrun works (Debian's does not): the real-torchrun tests; and the pip wheel test.
  args+=" -DSHARDOPT_TORCHRUN=$VENV/bin/torchrun -DSHARDOPT_TEST_PIP_WHEEL=ON"
  if [ -n "$NCCL_DIR" ] && [ -f "$NCCL_DIR/include/nccl.h" ]; then
    args+=" -DNCCL_INCLUDE_DIR=$NCCL_DIR/include -DNCCL_LIBRARY=$(ls "$NCCL_DIR"/lib/libnccl.so.* | head -1)"
  fi
  [ -x /usr/local/cuda/bin/nvcc ] && args+=" -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc"
  export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV" SHARDOPT_PLATFORM=pip
  export SHARDOPT_TORCH_PYTHON="$PY" SHARDOPT_BUILD_DIR="$ROOT/build-pip"
  export SHARDOPT_CMAKE_ARGS="$args${SHARDOPT_CMAKE_ARGS:+ $SHARDOPT_CMAKE_ARGS}"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
  [ $# -gt 0 ] || set -- scripts/test.sh
  echo "[platform pip] $("$PY" -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")') in $VENV, running: $*"
  cd "$ROOT"
  set +e
  "$@"
  rc=$?
  echo "[platform pip] exit status $rc"
  exit "$rc"
fi
# The mirror: SHARDOPT_DEBIAN_MIRROR, else the archive this host's own apt already uses for its
# release (sources.list or deb822 .sources, read through apt itself), else Debian's default.
host_mirror() {
  local codename
  codename=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
  [ -n "$codename" ] || return 0
  apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null |
    awk -v c="$codename" '$2 == c { sub("/$", "", $1); print $1; exit }'
}
MIRROR="${SHARDOPT_DEBIAN_MIRROR:-$(host_mirror)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
CACHE="${SHARDOPT_PLATFORM_CACHE:-/var/cache/shardopt/platforms}/$PLATFORM"
RECIPE=3   # bump when the way the root is made changes
[ "$(id -u)" -eq 0 ] || { echo "[platform] needs root (debootstrap, mount, chroot)" >&2; exit 2; }

# debootstrap is the one host tool the platforms need beyond scripts/setup.sh's list.
if ! command -v debootstrap >/dev/null; then
  echo "[platform] installing debootstrap"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null \
    || { echo "[platform] could not install debootstrap with apt-get" >&2; exit 1; }
fi

if [ -z "${SHARDOPT_PLATFORM_IN_NS:-}" ]; then
  export SHARDOPT_PLATFORM_IN_NS=1
  exec unshare --mount --propagation private -- "$0" "$PLATFORM" "$@"
fi

log() { echo "[platform $PLATFORM] $*"; }
MOUNTS=()
cleanup() {
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do umount -l "${MOUNTS[i]}" 2>/dev/null || true; done
  MOUNTS=()
}
trap cleanup EXIT
mount_into() {  # mount_into <root> : proc, sys, dev (with pts and shm), resolv.conf
  local r="$1"
  mount -t proc proc "$r/proc" && MOUNTS+=("$r/proc")
  mount --rbind /sys "$r/sys" && MOUNTS+=("$r/sys")
  mount --rbind /dev "$r/dev" && MOUNTS+=("$r/dev")
  cp -L /etc/resolv.conf "$r/etc/resolv.conf" 2>/dev/null || true
}
no_mounts_under() {  # never rm -rf a tree with something mounted inside it
  # grep without -q reads all of findmnt's output: -q's early exit can SIGPIPE findmnt, and
  # pipefail would then report "nothing mounted".
  ! findmnt -rn -o TARGET | grep "^$1\(/\|$\)" >/dev/null
}

KEY="$( { echo "recipe $RECIPE suite $SUITE mirror $MIRROR"; "$ROOT/scripts/setup.sh" --print-packages; } \
        | sha256sum | cut -c1-16)"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock -x 9
CHROOT="$CACHE/root"
if [ -f "$CHROOT/.shardopt-platform-key" ] && [ "$(cat "$CHROOT/.shardopt-platform-key")" = "$KEY" ]; then
  log "reusing cached root $CHROOT (key $KEY)"
else
  NEW="$CACHE/root.new"
  no_mounts_under "$NEW" || { echo "[platform] $NEW has mounts; refusing to delete it" >&2; exit 1; }
  rm -rf "$NEW"
  t0=$SECONDS
  log "creating a $SUITE root in $NEW (debootstrap from $MIRROR)"
  # iproute2: `ip netns` and `tc` for the emulated-hosts tests (tests/multihost), which skip without it.
  debootstrap --variant=minbase --include=ca-certificates,iproute2 "$SUITE" "$NEW" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log" >&2; echo "[platform] debootstrap failed (log: $CACHE/debootstrap.log)" >&2; exit 1; }
  t1=$SECONDS
  log "debootstrap took $((t1 - t0)) s; installing scripts/setup.sh's packages"
  printf '#!/bin/sh\nexit 101\n' >"$NEW/usr/sbin/policy-rc.d" && chmod +x "$NEW/usr/sbin/policy-rc.d"
  cp "$ROOT/scripts/setup.sh" "$NEW/tmp/setup.sh"
  mount_into "$NEW"
  chroot "$NEW" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    /bin/bash /tmp/setup.sh
  chroot "$NEW" apt-get clean
  cleanup
  log "packages took $((SECONDS - t1)) s"
  echo "$KEY" >"$NEW/.shardopt-platform-key"
  if [ -d "$CHROOT" ]; then
    no_mounts_under "$CHROOT" || { echo "[platform] $CHROOT has mounts; refusing to replace it" >&2; exit 1; }
    rm -rf "$CHROOT"
  fi
  mv "$NEW" "$CHROOT"
fi
flock -s 9   # other runs may share the root now; a rebuild waits for them

# The root bound onto itself, so that "/" inside is a mount point: `ip netns exec` / `ip -n` make "/"
# a slave mount (the emulated-hosts tests), which fails on a plain directory.
mount --bind "$CHROOT" "$CHROOT" && MOUNTS+=("$CHROOT")
mount_into "$CHROOT"
mkdir -p "$CHROOT$ROOT"
mount --bind "$ROOT" "$CHROOT$ROOT" && MOUNTS+=("$CHROOT$ROOT")
[ $# -gt 0 ] || set -- scripts/test.sh
log "$(chroot "$CHROOT" sh -c '. /etc/os-release; echo "$PRETTY_NAME"'), running: $*"
ENV=(PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}"
     SHARDOPT_BUILD_DIR="$ROOT/build-$PLATFORM")
for v in SHARDOPT_CMAKE_ARGS CTEST_PARALLEL_LEVEL CMAKE_BUILD_PARALLEL_LEVEL; do
  [ -z "${!v:-}" ] || ENV+=("$v=${!v}")
done
set +e
chroot "$CHROOT" /usr/bin/env -i "${ENV[@]}" /bin/bash -c 'cd "$1" && shift && exec "$@"' _ "$ROOT" "$@"
rc=$?
set -e
log "exit status $rc"
exit "$rc"
