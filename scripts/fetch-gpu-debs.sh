#!/usr/bin/env bash
# Downloads (apt-get download, no install) the Debian packages that scripts/gpu-check.sh unpacks on
# a GPU machine that has PyTorch, nvcc, cmake and ninja but no internet, into gpu-debs/ (ignored by
# git; carry it along). Prints the folder's size; it must stay under 64 MiB with the tree.
#   scripts/fetch-gpu-debs.sh [folder]
#
# Only what cannot bite the machine's own PyTorch: its libstdc++, glibc and C++ ABI flag
# (_GLIBCXX_USE_CXX11_ABI) may differ from Debian 12's, so nothing compiled against Debian's C++
# runtime is carried. fmt is used header-only (FMT_HEADER_ONLY), nlohmann-json and CLI11 are header-
# only, GoogleTest travels as sources (Debian's googletest package) and is built there with torch's
# flags, zlib and utf8proc are C. Not carried: Google Benchmark (the GPU benchmarks time with CUDA events) and
# OpenMPI (the GPU tests run NCCL at one rank and two ranks on one GPU as two processes over torch's
# Gloo; a carried MPI would have to match the machine's glibc and its own plugins).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/gpu-debs}"
PACKAGES=(libfmt-dev nlohmann-json3-dev libcli11-dev googletest zlib1g-dev zlib1g
          libutf8proc-dev libutf8proc2)  # utf8proc: the BERT example (bert_pretrain --device cuda)
if [ "${1:-}" = "--print-packages" ]; then
  printf '%s\n' "${PACKAGES[@]}"
  exit 0
fi
mkdir -p "$DEST"
cd "$DEST"
if ! apt-get download "${PACKAGES[@]}" 2>apt-download.err; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "[fetch-gpu-debs] apt-get download failed; updating the package lists once" >&2
  $SUDO apt-get update -qq
  apt-get download "${PACKAGES[@]}"
fi
rm -f apt-download.err
# Epochs appear as "%3a" in the file names: plain names travel more safely.
for f in *%3a*.deb; do [ -e "$f" ] && mv -f "$f" "${f//%3a/-}"; done
# One version per package: older downloads of the same package go.
for p in "${PACKAGES[@]}"; do
  ls -1t "${p}"_*.deb 2>/dev/null | tail -n +2 | xargs -r rm -f
done
ls -l "$DEST"/*.deb
echo "[fetch-gpu-debs] $(du -sh "$DEST" | cut -f1) in $DEST ($(ls "$DEST"/*.deb | wc -l) packages)"
