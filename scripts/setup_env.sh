#!/usr/bin/env bash
# Set up everything the project needs on a fresh machine, idempotently:
# system packages (when root), a virtualenv in .venv, and the project with CPU torch.
# Usage: bash scripts/setup_env.sh        (VENV=path to put the venv elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

# System packages: iproute2/iptables for the emulated network, openssh-server for the SSH
# tests, wireguard-go/wireguard-tools for the NAT tunnel, fortunes for real training text,
# libnetfilter-queue-dev to build the NFQUEUE delay line.
APT_PACKAGES="iproute2 iptables openssh-server wireguard-go wireguard-tools conntrack iperf3
 fortunes fortunes-min libnetfilter-queue-dev procps"
missing=""
for p in $APT_PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing system packages:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
  else
    echo "setup: not root, cannot install:$missing (tests that need them will skip and say so)"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  # Debian's python3 ships venv/ensurepip separately (python3-venv)
  if ! python3 -c "import ensurepip, venv" 2>/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "setup: installing python3-venv"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    else
      echo "setup: python3 cannot create a virtualenv (install python3-venv)" >&2; exit 1
    fi
  fi
  echo "setup: creating virtualenv $VENV"
  python3 -m venv "$VENV"
fi
stamp="$VENV/.installed-$(cat setup.py constraints-cpu.txt | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing the project and CPU torch into $VENV (about a minute)"
  log="$VENV/pip-install.log"
  if ! { "$VENV/bin/pip" install --upgrade pip \
         && "$VENV/bin/pip" install -c constraints-cpu.txt -e ".[dev,netem,track,hivemind]"; } >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "setup: pip install failed (full log: $log)" >&2
    exit 1
  fi
  "$VENV/bin/python" -c "import torch, numpy, scipy, networkx, paramiko, pytest, tokenizers, pyarrow, safetensors, transformers, hivemind" \
    || { echo "setup: the installed packages do not import (log: $log)" >&2; exit 1; }
  touch "$stamp"
fi

# Bytecode for the project's own modules: pip compiles what it installs, not an editable
# project's sources, and where PYTHONDONTWRITEBYTECODE is set (as on these machines) Python
# never caches them, so every command compiled ~140 modules again (0.4 s of the planner's
# 1.4 s on a 2-core AMD EPYC). Python still reads up-to-date .pyc files with that set, and
# ignores stale ones (it checks each source's mtime and size).
"$VENV/bin/python" -m compileall -q formats scheduler modules scripts testkit benchmarks \
  dist_runner.py >/dev/null || echo "setup: compiling the project's modules failed (harmless: slower start)" >&2
