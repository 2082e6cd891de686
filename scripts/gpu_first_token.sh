#!/usr/bin/env bash
# Start-up, first-call determinism, lifecycle and the prefill step's host time on the GPU machine, in one call:
#   OUT=/path bash scripts/gpu_first_token.sh [--only startup,repeat,lifecycle,prefill]
# (scripts/gpu_env.sh: the carried wheels, the real checkpoint from /tmp/m when its pieces are there.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out/first_token}
mkdir -p "$OUT"
source scripts/gpu_env.sh
[ "$MODEL" = random ] && { echo "the real checkpoint is needed (copy its pieces to /tmp/m)"; exit 2; }
nvidia-smi -L | tee "$OUT/env.txt"
python3 scripts/profile_startup.py --model "$MODEL" --out "$OUT" "$@" 2>&1 | tee "$OUT/profile_startup.log"
