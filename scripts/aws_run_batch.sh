#!/usr/bin/env bash
# Start the ranks of a plan on the hosts of IP_LIST, in the background (run name `train`).
# Host k (line k of IP_LIST, from 0) runs ranks k, k+N, k+2N, ... (N hosts) -- the same
# device -> host mapping as tc.py's default with a host list (--group-by modulo).
# Each rank logs to REMOTE_REPO/logs/rank<R>.log; stop with aws_kill.sh, fetch with aws_copy_logs.sh.
# usage: [GPUS_PER_HOST=N] scripts/aws_run_batch.sh PLAN.json tcp://MASTER:PORT [dist_runner.py options]
# With COORDINATOR=1 the ranks get --coordinator tcp://HOST:PORT instead of --dist-url: a
# scripts/coordinator.py started there hosts the store, so no rank is special.
source "$(dirname "$0")/aws_env.sh"
[ $# -ge 2 ] || { echo "usage: $0 PLAN.json tcp://HOST:PORT [dist_runner options]" >&2; exit 2; }
PLAN="$1"; URL="$2"; shift 2
STORE_FLAG=--dist-url
if [ "${COORDINATOR:-0}" = 1 ]; then STORE_FLAG=--coordinator; fi
WORLD=$("$PY" -c 'import json,sys; p=json.load(open(sys.argv[1])); print(sum(len(x) for x in p["pipelines"]))' "$PLAN")
HOSTS=$(grep -cvE '^[[:space:]]*(#|$)' "$IP_LIST")
PLAN_NAME=$(basename "$PLAN")
# every host must have the checkout and a REMOTE_PY with torch, or each rank would only fail in
# its log after this script said it started
if ! "$PY" "$HERE/cluster_ssh.py" "${SSH_ARGS[@]}" run -- \
    "cd $REMOTE_REPO && test -f dist_runner.py && $REMOTE_PY -c 'import torch'"; then
  echo "error: REMOTE_PY=$REMOTE_PY in REMOTE_REPO=$REMOTE_REPO cannot run dist_runner.py on" \
       "the hosts that failed above; sync the repository there, run 'bash scripts/setup_env.sh'" \
       "in it, and set REMOTE_PY=.venv/bin/python" >&2
  exit 2
fi
"$PY" "$HERE/cluster_ssh.py" "${SSH_ARGS[@]}" sync "$PLAN" --dest "$REMOTE_REPO"
# the run secret (docs/security.md): ST_RUN_SECRET / ST_RUN_SECRET_FILE here, else this user's
# ~/.config/st-runtime/run_secret; every host gets it as a private file (mode 600), never on a
# command line. Start a COORDINATOR=1 coordinator with the same secret.
SECRET_DIR=$(mktemp -d)
(umask 077 && cd "$ROOT" && "$PY" -c 'import sys; from modules.control.auth import load_secret; sys.stdout.write(load_secret().decode())' > "$SECRET_DIR/run_secret") \
  || { rm -rf "$SECRET_DIR"; exit 2; }
"$PY" "$HERE/cluster_ssh.py" "${SSH_ARGS[@]}" sync "$SECRET_DIR/run_secret" --dest "$REMOTE_REPO/.scattered" \
  || { rm -rf "$SECRET_DIR"; exit 1; }
rm -rf "$SECRET_DIR"
EXTRA=$(printf ' %q' "$@")
if [ -n "${GPUS_PER_HOST:-}" ] && ! [[ "$GPUS_PER_HOST" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: GPUS_PER_HOST: expected a positive number of CUDA devices per host, got '$GPUS_PER_HOST'" >&2
  exit 2
fi
# GPUS_PER_HOST=N: the ranks of a host take its CUDA devices round robin (--cuda-device i % N)
GPU_ARG=${GPUS_PER_HOST:+ --cuda-device \$((i % $GPUS_PER_HOST))}
CMD="cd $REMOTE_REPO && export ST_RUN_SECRET_FILE=$REMOTE_REPO/.scattered/run_secret && mkdir -p logs && i=0 && for r in \$(seq \$SCATTERED_HOST_INDEX $HOSTS $((WORLD - 1))); do \
$REMOTE_PY dist_runner.py --plan $PLAN_NAME --rank \$r --world-size $WORLD $STORE_FLAG $URL$EXTRA$GPU_ARG \
> logs/rank\$r.log 2>&1 & i=\$((i + 1)); done; wait"
exec "$PY" "$HERE/cluster_ssh.py" "${SSH_ARGS[@]}" start --name train -- "$CMD"
