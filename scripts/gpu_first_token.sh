#!/usr/bin/env bash
# Start-up, first-call determinism, lifecycle and the prefill step's host time on the GPU machine, in one call,
# then the start-up and lifecycle GPU tests:
#   OUT=/path bash scripts/gpu_first_token.sh [profile_startup.py options, e.g. --only startup,repeat]
# (scripts/gpu_env.sh: the carried wheels, the real checkpoint from /tmp/m when its pieces are there.)
# The per-run logs and cProfile listings come back as one details.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out/first_token}
mkdir -p "$OUT/details"
source scripts/gpu_env.sh
[ "$MODEL" = random ] && { echo "the real checkpoint is needed (copy its pieces to /tmp/m)"; exit 2; }
nvidia-smi -L | tee "$OUT/env.txt"
python3 scripts/profile_startup.py --model "$MODEL" --out "$OUT/details" "$@" 2>&1 | tee "$OUT/profile_startup.log"
cp "$OUT/details/startup.json" "$OUT/" 2>/dev/null
timeout 300 python3 -m pytest -q -m gpu tests/test_startup.py tests/test_lifecycle.py -p no:cacheprovider 2>&1 \
    | tail -30 | tee "$OUT/pytest_startup.log"
tar czf "$OUT/details.tgz" -C "$OUT" details && rm -rf "$OUT/details"
