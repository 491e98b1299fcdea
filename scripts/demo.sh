#!/usr/bin/env bash
# The README's demo command: set up (idempotent), then plan GPT3-XL on the DT-FM world-wide
# scenario (64 V100s in 8 cities) and print our plan beside the baselines.
# Outputs land in out/: the cluster file, the plan and a picture of it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=${VENV:-.venv}/bin/python
mkdir -p out
"$PY" scheduler/scheduler.py scenario worldwide --seed 0 --out out/worldwide.json
"$PY" scheduler/scheduler.py plan --cluster out/worldwide.json --model gpt3-xl \
  --stages 8 --replicas 8 --out out/worldwide-plan.json --plot out/worldwide-plan.png
"$PY" scheduler/scheduler.py evaluate --cluster out/worldwide.json --plan out/worldwide-plan.json
