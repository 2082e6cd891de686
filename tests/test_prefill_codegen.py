"""Static checks on the code numba generates for the prefill and cache-op kernels (no GPU needed).

Each kernel is compiled for sm_90 with `numba.cuda.compile_ptx` in a subprocess *without*
NUMBA_ENABLE_CUDASIM (conftest.py sets it for this process, and the simulator cannot compile),
and the PTX is checked for what the design promises:

* no local memory (.local / ld.local / st.local): the per-thread tiles (S 4x4, O 4x8 at d=64)
  must live in registers, or the kernel spills;
* no fp64 instruction (a stray Python float constant would silently make the math double);
* prefill: the Q, K/V and P tiles in shared memory, 128-bit global loads of the fp16/bf16 pool
  (ld.global.v4.u32), fp32 FMAs, ex2 for the softmax;
* cache ops: the copies move 64-bit words.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, re
from numba import cuda
from numba.core import types
from kernels_numba import cache_ops, paged_prefill

def stats(ptx):
    ops = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", ptx, re.M)
    return {
        "local": bool(re.search(r"\.local\b|ld\.local|st\.local", ptx)),
        "f64_ops": sum(1 for o in ops if ".f64" in o),
        "shared_decls": len(re.findall(r"^\s*(?:\.visible\s+)?\.shared\s", ptx, re.M)),
        "ld_shared": sum(1 for o in ops if o.startswith("ld.shared")),
        "st_shared": sum(1 for o in ops if o.startswith("st.shared")),
        "ld_global_v4": sum(1 for o in ops if o.startswith("ld.global.v4")),
        "fma_f32": sum(1 for o in ops if o == "fma.rn.f32"),
        "ex2": sum(1 for o in ops if o.startswith("ex2")),
        "ld_u64": sum(1 for o in ops if re.fullmatch(r"ld(\.global)?\.u64", o) is not None),
        "st_u64": sum(1 for o in ops if re.fullmatch(r"st(\.global)?\.u64", o) is not None),
    }

out = {}
u32, i32_2d, i32 = types.uint32[::1], types.int32[:, ::1], types.int32[::1]
for head_dim in paged_prefill.HEAD_DIMS:
    for kind in ("f16", "bf16"):
        kernel = paged_prefill.get_kernel(head_dim, kind)
        sig = (u32, u32, u32, i32_2d, i32, i32, u32, types.int64, types.int64, types.int64, types.float32)
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
        out[f"prefill_d{head_dim}_{kind}"] = stats(ptx)
w3, w4 = types.int64[:, :, ::1], types.int64[:, :, :, ::1]
ptx, _ = cuda.compile_ptx(cache_ops._reshape_and_cache_kernel.py_func,
                          (w3, w3, w4, w4, types.int64[::1], types.int64), cc=(9, 0))
out["reshape_and_cache"] = stats(ptx)
ptx, _ = cuda.compile_ptx(cache_ops._copy_blocks_kernel.py_func,
                          (types.UniTuple(types.int64[:, ::1], 48), types.int64[:, ::1]), cc=(9, 0))
out["copy_blocks_24_layers"] = stats(ptx)
print("STATS" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx_stats():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("STATS"))
    return json.loads(line[len("STATS"):])


PREFILL_VARIANTS = [f"prefill_d{d}_{k}" for d in (64, 128) for k in ("f16", "bf16")]


@pytest.mark.parametrize("name", PREFILL_VARIANTS + ["reshape_and_cache", "copy_blocks_24_layers"])
def test_no_local_memory_no_fp64(ptx_stats, name):
    s = ptx_stats[name]
    assert not s["local"], f"{name} uses local memory (register spill or a local array not promoted): {s}"
    assert s["f64_ops"] == 0, f"{name} has {s['f64_ops']} fp64 instructions: {s}"


@pytest.mark.parametrize("name", PREFILL_VARIANTS)
def test_prefill_uses_shared_tiles_and_wide_loads(ptx_stats, name):
    s = ptx_stats[name]
    assert s["shared_decls"] >= 3, s  # Q, K/V and P tiles (+ the per-row softmax state)
    assert s["ld_shared"] > 0 and s["st_shared"] > 0, s
    assert s["ld_global_v4"] >= 2, s  # Q tile and K/V tile loads are 128-bit
    assert s["fma_f32"] > 0, s
    assert s["ex2"] > 0, s


@pytest.mark.parametrize("name", ["reshape_and_cache", "copy_blocks_24_layers"])
def test_cache_ops_copy_64_bit_words(ptx_stats, name):
    s = ptx_stats[name]
    assert s["ld_u64"] > 0 and s["st_u64"] > 0, s
