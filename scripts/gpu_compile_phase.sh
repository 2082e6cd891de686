#!/usr/bin/env bash
# The empty-cache compile phase on the GPU machine, in one call (~6 min):
#   OUT=/path bash scripts/gpu_compile_phase.sh
# 1. validates: an empty kernel cache compiled by the workers (one task per specialisation) and saved by the
#    engine's process, its own warm-up and a second process then load every kernel from disk (GPU test), and
#    the recording -> workers -> save -> load round trip on real sm_90 code (the CPU test, run here too);
# 2. times one specialisation of each engine kernel function in a fresh process: compile_seconds.json (the
#    figures kernels_numba.precompile.COMPILE_SECONDS orders the tasks by);
# 3. profile_startup.py --only startup (needs the real checkpoint, see scripts/gpu_env.sh): startup.json, whose
#    startup_empty.startup_phases holds compile_kernels, compile_slowest, compile_slowest_s, compile_workers and
#    startup_empty.precompile every task's seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out/compile_phase}
mkdir -p "$OUT/details"
source scripts/gpu_env.sh
{ nvidia-smi -L; echo "cores: $(nproc)"; } | tee "$OUT/env.txt"
timeout 420 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" tests/test_startup.py \
    -k "second_process_finds_every_kernel or workers_compile_and_this_process_saves" 2>&1 | tail -30 \
    | tee "$OUT/pytest.log"
timeout 400 python3 scripts/compile_seconds.py --out "$OUT/compile_seconds.json" 2>&1 | tee "$OUT/compile_seconds.log"
if [ "$MODEL" = random ]; then
    echo "no real checkpoint: profile_startup.py skipped (copy its pieces to /tmp/m)"
else
    python3 scripts/profile_startup.py --model "$MODEL" --out "$OUT/details" --only startup 2>&1 \
        | tee "$OUT/profile_startup.log"
    cp "$OUT/details/startup.json" "$OUT/" 2>/dev/null
fi
tar czf "$OUT/details.tgz" -C "$OUT" details && rm -rf "$OUT/details"
