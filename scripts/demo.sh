#!/usr/bin/env bash
# The README's demo command: set up (idempotent), then the end-to-end run: plan the `lab`
# cluster (the DT-FM regional setting scaled to 8 CPU ranks), take a random plan beside it,
# emulate the cluster's links with network namespaces (root; loopback otherwise, and it says
# so), train both plans, ours with DiLoCo + int8 and the planner's `--sync auto` choice on real
# text, and print predicted vs measured step time. Outputs land in out/e2e/ (plans, metrics, end_to_end.png, results.json).
# Extra arguments go to benchmarks/end_to_end.py (e.g. --steps 40).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=${VENV:-.venv}/bin/python
"$PY" benchmarks/end_to_end.py --out-dir out/e2e "$@"
