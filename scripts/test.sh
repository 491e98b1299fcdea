#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint, then run the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
echo "== ruff"
"$VENV/bin/ruff" check .
echo "== pytest"
exec "$VENV/bin/python" -m pytest --durations=10 "$@"
