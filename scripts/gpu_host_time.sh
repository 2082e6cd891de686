#!/usr/bin/env bash
# The host side of eager steps on the GPU machine, in one call: the launch-plan GPU test, the start-up and
# lifecycle GPU tests, then profile_startup.py's prefill child (a 8 x 1024 prefill step, a mixed step of 64
# decoding streams + one 512-token prompt, the pure decode step) with the kernels' launch plans and with
# numba's own launches, and through the piecewise graphs. Random weights of the 0.5B config unless the real
# checkpoint is there (gpu_env.sh).
#   OUT=/path bash scripts/gpu_host_time.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out/host_time}
mkdir -p "$OUT/details"
source scripts/gpu_env.sh
if [ "$MODEL" = random ]; then
    MODEL=$(python3 -c "from scripts import benchlib; print(benchlib.random_checkpoint('0.5b'))")
fi
nvidia-smi -L | tee "$OUT/env.txt"
export NUMBA_CACHE_DIR=/tmp/numba_cache_host_time
timeout 420 python3 -m pytest -q -m gpu ${TESTS:-tests/test_launcher.py tests/test_piecewise_graph.py tests/test_startup.py tests/test_lifecycle.py} \
    -p no:cacheprovider > "$OUT/details/pytest_full.log" 2>&1
tail -30 "$OUT/details/pytest_full.log" | tee "$OUT/pytest.log"
python3 scripts/profile_startup.py --model "$MODEL" --out "$OUT/details" --only prefill --piecewise 2>&1 | tee "$OUT/profile.log"
cp "$OUT/details/startup.json" "$OUT/host_time.json" 2>/dev/null
tar czf "$OUT/details.tgz" -C "$OUT" details && rm -rf "$OUT/details"
