#!/usr/bin/env bash
# The one command to run first on a GPU host: does the GPU path of the runtime work here?
#
#   bash scripts/gpu_check.sh [--peak-tflops X] [--steps 20] [--out-dir DIR]
#
# With >= 1 NVIDIA GPU (nvidia-smi lists it): sets up a virtualenv (VENV, default .venv-gpu,
# made with --system-site-packages so a CUDA torch and cupy already on the host are used; a CUDA
# build of torch from PyPI and the `gpu` extra are installed only when missing), then runs
# scripts/gpu_check.py: every `-m gpu` test, the int8 kernels' GB/s against the memory's peak,
# gpt-small runs on the GPU against the same plans on CPU (2 ranks on one GPU over gloo, 1x2
# DiLoCo with int8), bf16/fp16 and --compile runs, and with >= 2 GPUs the NCCL all-reduce and a
# 2-stage NCCL pipeline. One summary table; exit 1 if anything failed.
# Without a GPU: says so, checks that everything imports (VENV, default .venv) and that the
# kernel compiles to PTX with nvcc (NVCC=path; skipped, and said, when there is no nvcc), exit 0
# unless one of those failed.
set -uo pipefail
cd "$(dirname "$0")/.."

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi

if [ "$gpus" -eq 0 ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then why="nvidia-smi lists none"; else why="no nvidia-smi"; fi
  echo "gpu_check: no GPU on this machine ($why): checking imports and the kernel's compilation only"
  VENV=${VENV:-.venv}
  if [ ! -x "$VENV/bin/python" ]; then
    VENV="$VENV" bash scripts/setup_env.sh || exit 1
  fi
  exec "$VENV/bin/python" scripts/gpu_check.py --gpus 0 --nvcc "${NVCC:-nvcc}" "$@"
fi

echo "gpu_check: $gpus GPU(s):"
nvidia-smi -L
VENV=${VENV:-.venv-gpu}
t0=$(date +%s)
if [ "$(id -u)" = 0 ] && ! dpkg-query -W -f='${Status}' fortunes 2>/dev/null | grep -q "ok installed"; then
  echo "gpu_check: installing Debian's fortunes (the training text)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      fortunes fortunes-min >/dev/null; } || echo "gpu_check: could not install fortunes: runs use --fake-data"
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv --system-site-packages "$VENV" || { echo "gpu_check: cannot create $VENV" >&2; exit 1; }
fi
py="$VENV/bin/python"
log="$VENV/gpu-check-install.log"
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  echo "gpu_check: installing a CUDA build of torch into $VENV (PyPI's Linux default; several GB)"
  "$py" -m pip install --upgrade torch >"$log" 2>&1 || { tail -n 20 "$log"; exit 1; }
fi
"$py" -m pip install -e ".[dev]" >>"$log" 2>&1 || { tail -n 20 "$log"; exit 1; }
if ! "$py" -c 'import cupy' 2>/dev/null; then
  echo "gpu_check: installing the gpu extra (cupy)"
  "$py" -m pip install -e ".[gpu]" >>"$log" 2>&1 || { tail -n 20 "$log"; exit 1; }
fi
echo "gpu_check: environment ready in $(( $(date +%s) - t0 )) s ($py)"
exec "$py" scripts/gpu_check.py --gpus "$gpus" --nvcc "${NVCC:-nvcc}" "$@"
