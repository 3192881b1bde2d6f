#!/usr/bin/env bash
# The GPU proof, run on the GPU machine from the repository root, once per part of the pack:
#   bash bench/gpu/run.sh [SIZE] [BUDGET_S] [STEPS]        (SIZE real|small; OUT: the folder that comes back)
# Each device call carries one part of `python -m bench.gpu pack` (.gpu-pack/part-NN) and
# .gpu-pack/parts.sha256. This script moves the part out of the call's copy of the tree to $PARTS,
# which stays on the machine while it is warm, and says which parts are still to come; in the call
# that brings the last one it joins and checks them, installs the wheels into $SITE with --no-index
# --no-deps, and runs bench.gpu.proof, unbuffered, into $OUT. The order of the calls does not matter.
set -uo pipefail
SIZE=${1:-real}
BUDGET=${2:-420}
STEPS=${3:-}
OUT=${OUT:-/tmp/grpo-gpu-out}
PY=${PY:-python3}
PARTS=${GRPO_GPU_PARTS:-/var/tmp/grpo-gpu-parts}
SITE=${GRPO_GPU_SITE:-/tmp/site}
mkdir -p "$OUT" "$PARTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the pack carries no flashinfer: vLLM's sampler must not reach for it (its engines here ask for
# processed logprobs, which already keeps it on the native sampler)
export VLLM_USE_FLASHINFER_SAMPLER=0
{
  for f in .gpu-pack/part-*; do [ -f "$f" ] && mv -f "$f" "$PARTS/" && echo "== pack: $(basename "$f") stored in $PARTS"; done
  if [ -f .gpu-pack/parts.sha256 ]; then cp -f .gpu-pack/parts.sha256 "$PARTS/"; fi
  [ -f "$PARTS/parts.sha256" ] || { echo "== pack: no .gpu-pack/parts.sha256 carried (python -m bench.gpu pack)"; exit 3; }
  want=$(awk '$2 ~ /^part-/ {print $2}' "$PARTS/parts.sha256")
  missing=""
  for p in $want; do
    if [ ! -f "$PARTS/$p" ]; then missing="$missing $p"
    elif [ "$(sha256sum "$PARTS/$p" | cut -d' ' -f1)" != "$(awk -v p="$p" '$2 == p {print $1}' "$PARTS/parts.sha256")" ]; then
      echo "== pack: $p is not the part parts.sha256 names (an older pack?): removed"; rm -f "$PARTS/$p"; missing="$missing $p"
    fi
  done
  if [ -n "$missing" ]; then
    echo "== pack: $(( $(echo $want | wc -w) - $(echo $missing | wc -w) )) of $(echo $want | wc -w) parts here; still to send:$missing"
    echo "== pack: send the next call now (the machine stays warm 30 s)"
    exit 0
  fi
  sum=$(awk '$2 == "pack.tar.xz" {print $1}' "$PARTS/parts.sha256")
  if [ -f "$SITE/.grpo-pack" ] && [ "$(cat "$SITE/.grpo-pack")" = "$sum" ]; then
    echo "== pack: already installed in $SITE"
  else
    echo "== pack: every part here; join, check, install into $SITE"
    t0=$(date +%s)
    wheels=$(mktemp -d)
    for p in $want; do cat "$PARTS/$p"; done > "$wheels/pack.tar.xz"
    got=$(sha256sum "$wheels/pack.tar.xz" | cut -d' ' -f1)
    [ "$got" = "$sum" ] || { echo "== pack: the joined parts' sha256 $got is not the pack's $sum"; exit 3; }
    xz -dc "$wheels/pack.tar.xz" | tar -x -C "$wheels" && rm "$wheels/pack.tar.xz" || exit 3
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$wheels"/*.whl || exit 3
    echo "$sum" > "$SITE/.grpo-pack"
    rm -rf "$wheels"
    echo "== pack: $(ls "$SITE" | grep -c dist-info) packages installed in $(( $(date +%s) - t0 )) s"
  fi
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -m bench.gpu.proof "$OUT" --size "$SIZE" --budget-s "$BUDGET" ${STEPS:+--steps "$STEPS"}
} 2>&1 | tee -a "$OUT/log"
exit "${PIPESTATUS[0]}"
