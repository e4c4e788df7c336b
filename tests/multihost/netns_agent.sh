#!/usr/bin/env bash
# OpenMPI's launch agent for emulated hosts (plm_rsh_agent): stands in for ssh. mpirun calls it as
# `netns_agent.sh [ssh options] HOST COMMAND...`; it runs COMMAND through `sh -c`, as sshd would,
# inside HOST's network namespace and under HOST's own hostname (a fresh UTS namespace), so that
# OpenMPI sees one node per namespace. SHARDOPT_MH_HOSTS maps hosts to namespaces:
# "h0=ns0 h1=ns1".
set -euo pipefail
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
  case "$1" in
    -x|-q|-T|-t|-n) shift ;;
    -o|-p|-l|-i) shift 2 ;;
    *) shift ;;
  esac
done
host="${1:?netns_agent.sh: no host given}"
shift
ns=""
for pair in ${SHARDOPT_MH_HOSTS:-}; do
  if [ "${pair%%=*}" = "$host" ]; then ns="${pair#*=}"; fi
done
if [ -z "$ns" ]; then
  echo "netns_agent.sh: host '$host' is not an emulated host; known: ${SHARDOPT_MH_HOSTS:-none}" >&2
  exit 255
fi
exec ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$1"; shift; exec sh -c "$*"' \
  agent "$host" "$@"
