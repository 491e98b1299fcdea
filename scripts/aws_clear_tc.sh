#!/usr/bin/env bash
# Remove the tc rules, stop the delay lines and remove any NFQUEUE rules a killed one left
# (delay_line.py --cleanup, run with REMOTE_PY) on every host of IP_LIST.
# usage: scripts/aws_clear_tc.sh CLUSTER.json [tc.py options, e.g. --iface ens5]
source "$(dirname "$0")/aws_env.sh"
[ $# -ge 1 ] || { echo "usage: $0 CLUSTER.json [tc.py options]" >&2; exit 2; }
CLUSTER="$1"; shift
exec "$PY" "$HERE/tc.py" reset --cluster "$CLUSTER" "${SSH_ARGS[@]}" "${TC_SUDO[@]}" \
    --remote-python "$REMOTE_PY" "$@"
