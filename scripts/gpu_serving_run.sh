#!/usr/bin/env bash
# The serving benchmark on the GPU machine in one call (about 8 minutes at most):
#   1-2. scripts/gpu_env.sh: installs the carried wheels (.whl/: numpy, FastAPI, uvicorn, pyzmq, msgspec, httpx,
#      opentelemetry-api ...) into /tmp/site and finds the model ($MODEL, /tmp/model, or the real checkpoint's
#      pieces in /tmp/m joined, checked and converted once; else random weights);
#   3. scripts/bench_serving.py within the time left: the server through the launcher (1, 2, 4 API servers)
#      and the in-process one, beside LLM.generate on the same requests; table + JSON + server logs in $OUT.
#
#   OUT=/path bash scripts/gpu_serving_run.sh [extra bench_serving.py options]
#   OUT=/path bash scripts/gpu_serving_run.sh --servers mp1,mp4,mp4@0,mp1@0   # the admission rule on and off
#                                                                            # (@0: --prefill-delay-factor 0)
#   INSTALL_WHEELS=0 MODEL=DIR OUT=/tmp/x bash scripts/gpu_serving_run.sh --smoke      # a dry run on a CPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out/serving}
mkdir -p "$OUT"
t0=$SECONDS
source scripts/gpu_env.sh                         # the wheels, PYTHONPATH, MODEL (INSTALL_WHEELS=0: a CPU dry run)
{ nvidia-smi -L; python3 -c "import torch, numpy, fastapi, uvicorn, zmq, msgspec, httpx; print(torch.__version__, \
numpy.__version__, fastapi.__version__, uvicorn.__version__, zmq.__version__, msgspec.__version__)"; } 2>&1 \
    | tee "$OUT/env.txt"
echo "model: $MODEL ($((SECONDS - t0)) s spent before the benchmark)" | tee -a "$OUT/env.txt"

# 8 minutes in all: what the install and the conversion took comes off the benchmark's budget
left=$((470 - (SECONDS - t0)))
timeout $((left + 20)) python3 scripts/bench_serving.py --model "$MODEL" --out "$OUT" \
    --time-budget $((left - 40)) "$@" 2>&1 | tee "$OUT/bench_serving.log"
rc=${PIPESTATUS[0]}
echo "bench_serving rc=$rc, $((SECONDS - t0)) s in all" | tee -a "$OUT/env.txt"
exit "$rc"
