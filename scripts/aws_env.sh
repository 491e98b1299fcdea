# Shared settings of the aws_*.sh wrappers (sourced, not run). Override by environment:
#   IP_LIST      host list, one user@host[:port] per line      (./ip_list)
#   KNOWN_HOSTS  known_hosts filled by `cluster_ssh.py accept-keys` (./known_hosts)
#   SSH_KEY      private key file (default: ssh agent / ~/.ssh keys)
#   REMOTE_REPO  checkout of this repository on every host (scattered-train, relative to ~)
#   REMOTE_PY    python on the hosts (python3)
#   SUDO=1       run tc/iptables through passwordless sudo
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
PY="${PY:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
IP_LIST="${IP_LIST:-ip_list}"
KNOWN_HOSTS="${KNOWN_HOSTS:-known_hosts}"
REMOTE_REPO="${REMOTE_REPO:-scattered-train}"
REMOTE_PY="${REMOTE_PY:-python3}"
SSH_ARGS=(--hosts "$IP_LIST" --known-hosts "$KNOWN_HOSTS")
if [ -n "${SSH_KEY:-}" ]; then SSH_ARGS+=(--key "$SSH_KEY"); fi
TC_SUDO=()
if [ "${SUDO:-0}" = 1 ]; then TC_SUDO=(--sudo); fi
