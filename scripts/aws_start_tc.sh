#!/usr/bin/env bash
# Shape every host of IP_LIST like CLUSTER (htb + netem or the delay line), then show the rules.
# usage: scripts/aws_start_tc.sh CLUSTER.json [extra tc.py options, e.g. --iface ens5 --link-gbps 10]
source "$(dirname "$0")/aws_env.sh"
[ $# -ge 1 ] || { echo "usage: $0 CLUSTER.json [tc.py options]" >&2; exit 2; }
CLUSTER="$1"; shift
"$PY" "$HERE/tc.py" apply --cluster "$CLUSTER" "${SSH_ARGS[@]}" "${TC_SUDO[@]}" \
    --remote-python "$REMOTE_PY" "$@"
exec "$PY" "$HERE/tc.py" show --cluster "$CLUSTER" "${SSH_ARGS[@]}" "${TC_SUDO[@]}" "$@"
