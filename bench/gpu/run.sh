#!/usr/bin/env bash
# The GPU proof, run on the GPU machine from the repository root with .gpu-pack carried:
#   bash bench/gpu/run.sh [SIZE] [BUDGET_S] [STEPS]        (SIZE real|small; OUT: the folder that comes back)
# Installs the pack into /tmp/site with --no-index, then runs bench.gpu.proof, unbuffered, into $OUT.
set -uo pipefail
SIZE=${1:-real}
BUDGET=${2:-420}
STEPS=${3:-gpu_check,full,full-again,lora,trl}
OUT=${OUT:-/tmp/grpo-gpu-out}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{
  echo "== install the pack ($(ls .gpu-pack/*.whl | wc -l) wheels)"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${GRPO_GPU_SITE:-/tmp/site}" .gpu-pack/*.whl || exit 3
  export PYTHONPATH="$PWD:${GRPO_GPU_SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH}"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -m bench.gpu.proof "$OUT" --size "$SIZE" --budget-s "$BUDGET" --steps "$STEPS"
} 2>&1 | tee "$OUT/log"
exit "${PIPESTATUS[0]}"
