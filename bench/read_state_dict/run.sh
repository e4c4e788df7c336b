#!/usr/bin/env bash
# Peak memory and time of reading one torch.save state dict of N float parameters (default 110M,
# 440 MB), the bounded reader against the earlier path, alternating, ROUNDS times. Host platform:
# scripts/build.sh first; the file is written by torch::pickle_save.
#   bench/read_state_dict/run.sh [N] [ROUNDS]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
N="${1:-110000000}"; ROUNDS="${2:-2}"
BUILD="${SHARDOPT_BUILD_DIR:-$ROOT/build}"
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
inc=(-I"$ROOT/include" -I"$BUILD/include" -I/usr/include/torch/csrc/api/include)
g++ -std=c++17 -O2 "${inc[@]}" "$ROOT/bench/read_state_dict/read_new.cpp" -L"$BUILD" -lshardopt \
  -ltorch_cpu -lc10 -lfmt -Wl,-rpath,"$BUILD" -o "$TMP/read_new"
g++ -std=c++17 -O2 "${inc[@]}" "$ROOT/bench/read_state_dict/read_old.cpp" -ltorch_cpu -lc10 -o "$TMP/read_old"
"$TMP/read_new" --write "$N" "$TMP/model.pt"
echo "file: $(stat -c %s "$TMP/model.pt") bytes; $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg)"
for r in $(seq "$ROUNDS"); do
  for which in new old; do
    /usr/bin/time -o "$TMP/t" -f "%M KB peak RSS, %e s" "$TMP/read_$which" "$TMP/model.pt" >/dev/null
    echo "round $r $which: $(cat "$TMP/t")"
  done
done
