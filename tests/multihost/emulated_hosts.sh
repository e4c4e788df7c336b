#!/usr/bin/env bash
# Emulated hosts: H network namespaces ("hosts" h0..h{H-1}, each with its own hostname and address
# 10.217.0.{1..H}/24) joined by veth pairs to a bridge in a switch namespace, optionally shaped
# with tc; runs a command across them with mpirun (OpenMPI: TCP between hosts, shared memory
# within), torchrun-style (Gloo, TCPStore on h0), or through the stand-in for torchrun's agent
# (tests/support/torchrun_env.sh on every host, the store served by h0's agent). Everything it
# made is removed on exit, also on failure or a signal; namespaces left by a killed run are removed
# by the next one.
#
#   emulated_hosts.sh check                      exit 0 if namespaces can be made, else 77 + reason
#   emulated_hosts.sh [options] mpi   -- CMD...  mpirun -np H*L across the hosts
#   emulated_hosts.sh [options] gloo  -- CMD...  H*L processes with RANK, WORLD_SIZE, MASTER_ADDR..
#   emulated_hosts.sh [options] torchrun -- CMD...  torchrun_env.sh --nnodes H on every host
#   emulated_hosts.sh [options] real-torchrun -- ARGS...  PyTorch's own torchrun (SHARDOPT_TORCHRUN,
#                                                else the first on PATH) --nnodes H on every host;
#                                                ARGS: `--no-python EXE args` or `SCRIPT.py args`
# options:
#   --hosts H (2)  --per-host L (2)  --rate R (tc tbf on every link, e.g. 1gbit; none by default)
#   --delay D (netem, e.g. 100us; where the kernel lacks netem the run fails, naming it)
#   --timeout S (600: the command is stopped after S seconds, so teardown runs before CTest's kill)
#   --link-bytes FILE (writes "host tx_bytes rx_bytes" of each host's link after the command)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HOSTS=2 PER_HOST=2 RATE="" DELAY="" TIMEOUT=600 LINK_BYTES=""
PREFIX="so-mh"
TAG="$PREFIX-$$"
SUBNET="10.217.0"
PORT=29517
SKIP=77

die() { echo "emulated_hosts: $*" >&2; exit 1; }
ns_of() { echo "$TAG-h$1"; }
switch_ns() { echo "$TAG-sw"; }

# Reasons a namespace cannot be made here (not root, no ip/unshare, no veth/bridge support).
can_make_namespaces() {
  [ "$(id -u)" = 0 ] || { echo "needs root (ip netns), running as uid $(id -u)"; return 1; }
  for tool in ip unshare mpirun; do
    command -v "$tool" >/dev/null || { echo "'$tool' is not installed"; return 1; }
  done
  local probe="$PREFIX-probe-$$" out
  if ! out=$(ip netns add "$probe" 2>&1); then echo "ip netns add failed: $out"; return 1; fi
  if ! out=$(ip -n "$probe" link add mhp0 type veth peer name mhp1 2>&1 &&
             ip -n "$probe" link add mhbr type bridge 2>&1); then
    ip netns del "$probe" 2>/dev/null || true
    echo "veth/bridge devices cannot be made: $out"
    return 1
  fi
  ip netns del "$probe"
}

# Namespaces of earlier runs whose script is gone (killed by a timeout): remove them.
reap_stale() {
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$PREFIX-[0-9]*-" || true); do
    pid="${ns#"$PREFIX"-}"
    pid="${pid%%-*}"
    if ! kill -0 "$pid" 2>/dev/null; then
      delete_ns "$ns"
      rm -rf "/tmp/$PREFIX-$pid".*
    fi
  done
}

wait_gone() {  # wait_gone PID...: returns once every one has exited (or after 5 s)
  python3 - "$@" <<'PY'
import os, select, sys
fds = []
for p in sys.argv[1:]:
    try:
        fds.append(os.pidfd_open(int(p)))
    except (ProcessLookupError, ValueError):
        pass  # already gone
poller = select.poll()
for fd in fds:
    poller.register(fd, select.POLLIN)
left = len(fds)
while left:
    events = poller.poll(5000)
    if not events:
        break
    for fd, _ in events:
        poller.unregister(fd)
        left -= 1
PY
}

delete_ns() {
  local ns="$1" pid
  # Processes still inside the namespace were started by the run that made it. Repeat until none
  # is left: one being killed may just have forked (a rank's timeout starting its command).
  # No sleep: after each round it waits for exactly those processes to be gone (pidfds, which
  # become readable when a process exits), at most 5 s, then looks again.
  local pids round
  for round in $(seq 50); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] || break
    for pid in $pids; do kill -KILL "$pid" 2>/dev/null || true; done
    wait_gone $pids
  done
  ip netns del "$ns" 2>/dev/null || true
  rm -rf "/etc/netns/$ns"
}

LAUNCHED=()
teardown() {
  local rc=$? pid h
  trap - EXIT INT TERM
  for pid in "${LAUNCHED[@]:-}"; do [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null || true; done
  for ((h = 0; h < HOSTS; h++)); do delete_ns "$(ns_of "$h")"; done
  delete_ns "$(switch_ns)"
  rm -rf "${RUN_TMP:-/nonexistent}"
  exit "$rc"
}

shape() {  # shape NAMESPACE DEVICE: egress rate (tbf) and delay (netem)
  local ns="$1" dev="$2" out
  if [ -n "$DELAY" ]; then
    local rate_arg=()
    [ -n "$RATE" ] && rate_arg=(rate "$RATE")
    out=$(ip netns exec "$ns" tc qdisc add dev "$dev" root netem delay "$DELAY" "${rate_arg[@]}" \
          limit 100000 2>&1) || die "--delay $DELAY needs the kernel's netem qdisc: $out"
  elif [ -n "$RATE" ]; then
    out=$(ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$RATE" burst 256kb \
          latency 50ms 2>&1) || die "--rate $RATE: tc tbf failed: $out"
  fi
}

up() {
  local sw h ns
  sw="$(switch_ns)"
  ip netns add "$sw"
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  ip -n "$sw" link set lo up
  for ((h = 0; h < HOSTS; h++)); do
    ns="$(ns_of "$h")"
    ip netns add "$ns"
    ip -n "$ns" link add mh0 type veth peer name "port$h" netns "$sw"
    ip -n "$ns" addr add "$SUBNET.$((h + 1))/24" dev mh0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set mh0 up
    ip -n "$sw" link set "port$h" master br0
    ip -n "$sw" link set "port$h" up
    shape "$ns" mh0               # host -> switch
    shape "$sw" "port$h"          # switch -> host
    # `ip netns exec` bind-mounts /etc/netns/NS/* over /etc: each host resolves every host's name.
    mkdir -p "/etc/netns/$ns"
    { echo "127.0.0.1 localhost"
      for ((j = 0; j < HOSTS; j++)); do echo "$SUBNET.$((j + 1)) h$j"; done
    } >"/etc/netns/$ns/hosts"
  done
}

# on_host H CMD...: CMD inside host H's namespace under hostname hH.
on_host() {
  local h="$1"
  shift
  ip netns exec "$(ns_of "$h")" unshare --uts -- sh -c 'hostname "$1"; shift; exec "$@"' \
    on_host "h$h" "$@"
}

link_bytes() {
  [ -n "$LINK_BYTES" ] || return 0
  local h ns
  : >"$LINK_BYTES"
  for ((h = 0; h < HOSTS; h++)); do
    ns="$(ns_of "$h")"
    echo "h$h $(ip netns exec "$ns" cat /sys/class/net/mh0/statistics/tx_bytes)" \
         "$(ip netns exec "$ns" cat /sys/class/net/mh0/statistics/rx_bytes)" >>"$LINK_BYTES"
  done
}

run_mpi() {
  local hostlist="" h map=""
  for ((h = 0; h < HOSTS; h++)); do
    hostlist+="${hostlist:+,}h$h:$PER_HOST"
    map+="${map:+ }h$h=$(ns_of "$h")"
  done
  # OMPI_MCA_* from the caller (e.g. btl=self,vader for one host) would forbid TCP between hosts.
  on_host 0 env -u OMPI_MCA_btl SHARDOPT_MH_HOSTS="$map" TMPDIR="$RUN_TMP" \
    timeout --kill-after=10 "$TIMEOUT" \
    mpirun --allow-run-as-root --oversubscribe --bind-to none --map-by slot \
      -H "$hostlist" -np $((HOSTS * PER_HOST)) \
      --mca plm_rsh_agent "$HERE/netns_agent.sh" \
      --mca pml ob1 --mca btl self,vader,tcp --mca mpi_yield_when_idle 1 \
      --mca btl_tcp_if_include "$SUBNET.0/24" --mca oob_tcp_if_include "$SUBNET.0/24" \
      "$@"
}

run_gloo() {
  local world=$((HOSTS * PER_HOST)) h l rank
  local pids=()
  for ((h = 0; h < HOSTS; h++)); do
    for ((l = 0; l < PER_HOST; l++)); do
      rank=$((h * PER_HOST + l))
      on_host "$h" env RANK="$rank" WORLD_SIZE="$world" LOCAL_RANK="$l" \
        LOCAL_WORLD_SIZE="$PER_HOST" GROUP_RANK="$h" NODE_RANK="$h" \
        MASTER_ADDR="$SUBNET.1" MASTER_PORT="$PORT" GLOO_SOCKET_IFNAME=mh0 \
        SHARDOPT_BACKEND=gloo TMPDIR="$RUN_TMP" \
        timeout --kill-after=10 "$TIMEOUT" "$@" &
      pids+=("$!")
      LAUNCHED+=("$!")
    done
  done
  first_failure_ends_all "${pids[@]}"
}

# torchrun-style through the stand-in for torchrun's agent (tests/support/torchrun_env.sh): one
# agent per host, as `torchrun --nnodes H --node-rank h` on each host; h0's serves the store.
run_torchrun() {
  local h pids=()
  for ((h = 0; h < HOSTS; h++)); do
    on_host "$h" env GLOO_SOCKET_IFNAME=mh0 TMPDIR="$RUN_TMP" \
      timeout --kill-after=10 "$TIMEOUT" "$HERE/../support/torchrun_env.sh" --nnodes "$HOSTS" \
      --node-rank "$h" --master-addr "$SUBNET.1" --master-port "$PORT" "$PER_HOST" "$@" &
    pids+=("$!")
    LAUNCHED+=("$!")
  done
  first_failure_ends_all "${pids[@]}"
}

# PyTorch's torchrun itself (pip's; Debian's does not start workers, README "torchrun on Debian"):
# one agent per host, static rendezvous, h0's agent serves the TCPStore on PORT.
run_real-torchrun() {
  local h pids=() torchrun="${SHARDOPT_TORCHRUN:-torchrun}"
  for ((h = 0; h < HOSTS; h++)); do
    on_host "$h" env GLOO_SOCKET_IFNAME=mh0 TMPDIR="$RUN_TMP" \
      timeout --kill-after=10 "$TIMEOUT" "$torchrun" --nnodes "$HOSTS" --node-rank "$h" \
      --master-addr "$SUBNET.1" --master-port "$PORT" --nproc-per-node "$PER_HOST" \
      --max-restarts 0 "$@" &
    pids+=("$!")
    LAUNCHED+=("$!")
  done
  first_failure_ends_all "${pids[@]}"
}

# first_failure_ends_all PID...: waits for all; the first failure stops the others, as torchrun's
# agent does, and is the result.
first_failure_ends_all() {
  local left=$# rc pid
  while [ "$left" -gt 0 ]; do
    if wait -n; then
      left=$((left - 1))
    else
      rc=$?
      echo "emulated_hosts: a rank failed (exit $rc); stopping the others" >&2
      for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
      wait || true
      return "$rc"
    fi
  done
}

main() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --hosts) HOSTS="$2"; shift 2 ;;
      --per-host) PER_HOST="$2"; shift 2 ;;
      --rate) RATE="$2"; shift 2 ;;
      --delay) DELAY="$2"; shift 2 ;;
      --timeout) TIMEOUT="$2"; shift 2 ;;
      --link-bytes) LINK_BYTES="$2"; shift 2 ;;
      check|mpi|gloo|torchrun|real-torchrun) break ;;
      *) die "unknown option '$1' (see the header of $0)" ;;
    esac
  done
  local mode="${1:-}"
  [ -n "$mode" ] || die "no mode given: check, mpi, gloo, torchrun or real-torchrun"
  shift
  local reason
  if ! reason="$(can_make_namespaces)"; then
    echo "emulated_hosts: SKIP: cannot emulate hosts here: $reason"
    exit "$SKIP"
  fi
  [ "$mode" = check ] && exit 0
  [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || die "no command given after '$mode --'"
  [ "$HOSTS" -ge 2 ] && [ "$HOSTS" -le 200 ] || die "--hosts must lie in [2, 200], got $HOSTS"
  [ "$PER_HOST" -ge 1 ] || die "--per-host must be at least 1, got $PER_HOST"
  reap_stale
  RUN_TMP="$(mktemp -d "/tmp/$TAG.XXXXXX")"
  trap teardown EXIT
  trap 'exit 143' INT TERM
  up
  echo "emulated_hosts: $HOSTS hosts x $PER_HOST ranks, link ${RATE:-unshaped}${DELAY:+, delay $DELAY}"
  local rc=0
  "run_$mode" "$@" || rc=$?
  link_bytes
  return "$rc"
}

main "$@"
