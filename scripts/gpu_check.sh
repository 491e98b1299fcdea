#!/usr/bin/env bash
# The one command to run first on a GPU host: does the GPU path of the runtime work here?
#
#   bash scripts/gpu_check.sh [--python PY] [--gpus N] [--out DIR] [--steps 10] [--peak-tflops X]
#
# Offline and as found: it uses an interpreter that already imports CUDA torch and cupy
# (--python PY; default: the first `python3` on PATH that does) and never makes a venv or calls
# pip. With >= 1 NVIDIA GPU (nvidia-smi lists it) it runs scripts/gpu_check.py's GPU rows: the
# int8 kernel's bytes against the CPU codec (compiled through cupy, denormals included), its
# bandwidth against the device's copy bandwidth (WARN, not FAIL), the NCCL stream ordering on
# one GPU, every `-m gpu` test, GPU vs CPU losses (2-stage pipeline, DiLoCo int8 with --overlap
# and fragments, --pipeline-compression int8, bf16/fp16, --compile, a resume), and with >= 2
# GPUs the `multi-gpu: ...` rows (scripts/gpu_multi.py: NCCL all-reduce and pipeline, the int8
# mean across ranks, DiLoCo --overlap, a D = 2 shard group, fp16 across a pipeline, a killed
# rank and --resume; SKIP with one GPU) over all visible GPUs, or the first N with --gpus N.
# A missing optional dependency (paramiko, tensorboard, tokenizers) is a SKIP naming it; any
# other skip on a GPU host fails the verdict. Without a GPU: imports and the kernel's PTX under cupy's flags (NVCC=path).
# DIR/results.json and DIR/logs.tar are rewritten after every row (default out/gpu_check);
# the whole run stays under 9 minutes on one GPU. Exit 1 when the verdict is FAILED.
set -uo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."

usage() {  # this wrapper's help: the header above and the flags it passes on
  sed -n '2,/^set -uo/p' "$self" | sed '$d' | sed 's/^# \{0,1\}//'
  cat <<'EOF'

Options:
  --python PY        the interpreter to run the checks with (default: chosen as above)
  --gpus N           GPUs the multi-GPU rows use (default: every GPU nvidia-smi lists)
  --out DIR          where results.json, logs.tar and summary.md go (default out/gpu_check)
  --steps N          steps of each training run
  --budget-s S       the whole run's time limit
  --peak-tflops X    the GPU's peak TFLOP/s, for the MFU column
All but --python and --gpus go to scripts/gpu_check.py (the kernel is compiled with $NVCC,
default nvcc).
EOF
}

py=""
want=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) py="${2:-}"; shift 2 ;;
    --python=*) py="${1#--python=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    --gpus) want="${2:-}"; shift 2 ;;
    --gpus=*) want="${1#--gpus=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ -n "$want" ]; then
  if ! [[ "$want" =~ ^[0-9]+$ ]] || [ "$want" -gt "$gpus" ]; then
    echo "gpu_check: --gpus $want: expected a count of 0..$gpus (nvidia-smi lists $gpus)" >&2
    exit 2
  fi
  gpus=$want
fi

imports() {  # imports PY CODE: whether PY runs CODE
  "$1" -c "$2" >/dev/null 2>&1
}

pick_python() {  # the first python3 on PATH with CUDA torch and cupy, else one with torch
  local cand
  for cand in $(type -ap python3); do
    if imports "$cand" 'import sys, torch, cupy; sys.exit(0 if torch.version.cuda else 1)'; then
      echo "$cand"; return
    fi
  done
  for cand in $(type -ap python3) .venv/bin/python; do
    if [ -x "$cand" ] && imports "$cand" 'import torch'; then echo "$cand"; return; fi
  done
}

if [ -z "$py" ]; then
  py=$(pick_python)
  if [ -z "$py" ]; then
    echo "gpu_check: no python3 on PATH imports torch; pass --python with one that does" >&2
    exit 2
  fi
elif ! imports "$py" 'import torch'; then
  echo "gpu_check: --python $py does not import torch" >&2
  exit 2
fi

if [ "$gpus" -eq 0 ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then why="nvidia-smi lists none"; else why="no nvidia-smi"; fi
  echo "gpu_check: no GPU on this machine ($why): checking imports and the kernel's compilation only ($py)"
else
  echo "gpu_check: $gpus GPU(s), $py:"
  nvidia-smi -L
fi
exec "$py" scripts/gpu_check.py --gpus "$gpus" --nvcc "${NVCC:-nvcc}" ${args[@]+"${args[@]}"}
