#!/usr/bin/env bash
# Stop the runs started by aws_run_batch.sh (by their pid files; nothing else is touched).
# usage: scripts/aws_kill.sh [--name NAME] [--signal KILL]
source "$(dirname "$0")/aws_env.sh"
exec "$PY" "$HERE/cluster_ssh.py" "${SSH_ARGS[@]}" kill --name train --run-dir .scattered/runs "$@"
