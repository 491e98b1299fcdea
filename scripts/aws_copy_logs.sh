#!/usr/bin/env bash
# Copy REMOTE_REPO/logs and the run logs back from every host into DEST/<user@host_port>/.
# usage: scripts/aws_copy_logs.sh DEST
source "$(dirname "$0")/aws_env.sh"
[ $# -eq 1 ] || { echo "usage: $0 DEST" >&2; exit 2; }
"$PY" "$HERE/cluster_ssh.py" "${SSH_ARGS[@]}" collect "$REMOTE_REPO/logs" --dest "$1" || rc=$?
"$PY" "$HERE/cluster_ssh.py" "${SSH_ARGS[@]}" collect .scattered/runs --dest "$1"
exit "${rc:-0}"
