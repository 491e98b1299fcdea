# Shared settings of the aws_*.sh wrappers (sourced, not run). Override by environment:
#   IP_LIST      host list, one user@host[:port] per line      (./ip_list)
#   KNOWN_HOSTS  known_hosts filled by `cluster_ssh.py accept-keys` (./known_hosts)
#   SSH_KEY      private key file (default: ssh agent / ~/.ssh keys)
#   REMOTE_REPO  checkout of this repository on every host (scattered-train, relative to ~)
#   REMOTE_PY    python on the hosts (python3); aws_run_batch.sh checks it imports torch
#   SUDO=1       run tc/iptables through passwordless sudo
#   PY           the local python with the project's packages (ROOT/.venv/bin/python); the
#                wrappers stop (exit 2) with what to do when it is missing or lacks them
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
PY="${PY:-$ROOT/.venv/bin/python}"
if [ ! -x "$PY" ]; then
  echo "error: PY=$PY: no such Python; create the project's environment with" \
       "'bash $ROOT/scripts/setup_env.sh', or set PY to a Python that has the project" >&2
  exit 2
fi
# what cluster_ssh.py and tc.py import; run from ROOT, as they put ROOT on sys.path
if ! _why=$(cd "$ROOT" && "$PY" -c "import numpy, paramiko, formats.cluster, scripts.netemu.sshctl" 2>&1); then
  echo "error: PY=$PY lacks the project's packages (${_why##*$'\n'}); run" \
       "'bash $ROOT/scripts/setup_env.sh', or set PY to a Python that has the project" >&2
  exit 2
fi
IP_LIST="${IP_LIST:-ip_list}"
KNOWN_HOSTS="${KNOWN_HOSTS:-known_hosts}"
REMOTE_REPO="${REMOTE_REPO:-scattered-train}"
REMOTE_PY="${REMOTE_PY:-python3}"
SSH_ARGS=(--hosts "$IP_LIST" --known-hosts "$KNOWN_HOSTS")
if [ -n "${SSH_KEY:-}" ]; then SSH_ARGS+=(--key "$SSH_KEY"); fi
TC_SUDO=()
if [ "${SUDO:-0}" = 1 ]; then TC_SUDO=(--sudo); fi
