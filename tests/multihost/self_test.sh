#!/usr/bin/env bash
# Checks the emulated hosts themselves: each rank runs on its own host (hostname, address), the
# bytes between hosts cross the link, a failing rank fails the run with its exit code, and no
# namespace, launch agent or rank outlives a run, failed or not. Exit 77 where hosts cannot be
# emulated.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
EH="$HERE/emulated_hosts.sh"
"$EH" check || exit $?
fail=0
check() {  # check DESCRIPTION CONDITION...
  local what="$1"
  shift
  if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; fail=1; fi
}
leftovers() {  # namespaces of this harness other than those of runs still going
  local ns pid n=0
  for ns in $(ip netns list | awk '{print $1}' | grep '^so-mh-[0-9]*-' || true); do
    pid="${ns#so-mh-}"
    pid="${pid%%-*}"
    kill -0 "$pid" 2>/dev/null || n=$((n + 1))
  done
  [ "$n" = 0 ]
}
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

"$EH" --link-bytes "$tmp/link" mpi -- sh -c 'echo "$(hostname) $OMPI_COMM_WORLD_RANK"' \
  >"$tmp/mpi.out" 2>&1
check "mpirun places ranks 0,1 on h0 and 2,3 on h1" \
  test "$(grep -E '^h[01] [0-3]$' "$tmp/mpi.out" | sort -k2 | awk '{print $1}' | tr '\n' ' ')" \
  = "h0 h0 h1 h1 "
check "the launch crossed the link (h1 sent bytes)" test "$(awk '$1 == "h1" {print $2}' "$tmp/link")" -gt 0

"$EH" --rate 500mbit gloo -- sh -c 'echo "$(hostname) $RANK $MASTER_ADDR"' >"$tmp/gloo.out" 2>&1
check "the torchrun-style launch sets RANK and MASTER_ADDR on each host" \
  test "$(grep -cE '^h[01] [0-3] 10\.217\.0\.1$' "$tmp/gloo.out")" = 4

"$EH" mpi -- sh -c 'exit 3' >/dev/null 2>&1
rc=$?
check "a failing mpirun run fails (exit $rc)" test "$rc" != 0
# The sleepers carry this run's pid in their duration, so other runs on the machine do not count.
tag="300.$$"
"$EH" gloo -- sh -c "[ \"\$RANK\" != 2 ] || exit 5; sleep $tag" >/dev/null 2>&1
rc=$?
check "a failing Gloo rank ends the run with its code (exit $rc)" test "$rc" = 5
check "no namespace is left" leftovers
check "no rank is left" test -z "$(pgrep -f "sleep $tag" || true)"
check "no host name file is left" test -z "$(ls /etc/netns 2>/dev/null | grep '^so-mh-' || true)"
exit "$fail"
