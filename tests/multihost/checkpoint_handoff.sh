#!/usr/bin/env bash
# A checkpoint saved by one launch across 2 emulated hosts x 2 ranks (flat, then hybrid), resumed
# by another launch on 1 host x 3 ranks (tests/dist/handoff_dist_test.cpp).
#   checkpoint_handoff.sh DIST_TESTS_BINARY DIR
# Exit 77 (CTest skip) where hosts cannot be emulated.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="${1:?checkpoint_handoff.sh: no test binary given}"
dir="${2:?checkpoint_handoff.sh: no handoff directory given}"
export SHARDOPT_HANDOFF_DIR="$dir"
# Flat, then hybrid (shard groups of 2 = one per host): each saved by 2x2, resumed by 1x3.
for group in 0 2; do
  export SHARDOPT_HANDOFF_SHARD_GROUP="$group"
  echo "checkpoint_handoff: saving on 2 hosts x 2 ranks, shard group size $group (0: flat)"
  "$HERE/emulated_hosts.sh" --hosts 2 --per-host 2 --timeout 240 mpi -- \
    "$bin" --gtest_filter='CheckpointHandoff.Save'
  echo "checkpoint_handoff: resuming on 1 host x 3 ranks"
  env -u OMPI_MCA_btl timeout --kill-after=10 240 \
    mpirun --allow-run-as-root --oversubscribe --bind-to none -np 3 --mca btl self,vader \
    "$bin" --gtest_filter='CheckpointHandoff.Resume'
done
