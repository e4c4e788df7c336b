#!/usr/bin/env bash
# Installs the Debian packages shardopt needs, only those that are missing (apt-get update first).
# `setup.sh --print-packages` prints the list, one per line (scripts/platform.sh keys its cache on it).
set -euo pipefail
PACKAGES=(
  build-essential cmake ninja-build lld ccache pkg-config
  libtorch-dev python3-torch libopenblas0-openmp    # libtorch 1.13 CPU + an optimized BLAS
  libopenmpi-dev openmpi-bin libgloo-dev             # engines
  libfmt-dev nlohmann-json3-dev libcli11-dev zlib1g-dev  # formatting, JSON, CLI, CRC-32
  libgtest-dev libgmock-dev libbenchmark-dev python3-pytest pybind11-dev
  python3-matplotlib                                 # loss-curve and benchmark plots
  libutf8proc-dev                                    # the BERT tokenizer's Unicode tables
  doxygen                                            # the API reference (CTest docs_api)
  manpages-dev manpages-fr-dev manpages-de-dev manpages-es-dev  # the BERT example's default corpus
)
# Installed where the release has them: python3-safetensors (Debian 13; Debian 12 has none, and
# tests/python/check_hf_export.py then reads the format itself).
OPTIONAL=(python3-safetensors)
if [ "${1:-}" = "--print-packages" ]; then
  printf '%s\n' "${PACKAGES[@]}" "${OPTIONAL[@]}"
  exit 0
fi
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
for p in "${OPTIONAL[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" && continue
  apt-cache show "$p" >/dev/null 2>&1 && missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[setup] installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
