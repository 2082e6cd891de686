"""Static checks on the code numba generates for the decode kernels (no GPU needed).

Each version is compiled for sm_90 with `numba.cuda.compile_ptx` in a subprocess without
NUMBA_ENABLE_CUDASIM (conftest.py sets it for this process, and the simulator cannot compile),
with the argument types the CUDA launcher passes, and the PTX is checked for what each
version promises:

* v3+: warp shuffles (shfl.sync) for the reductions;
* v3: packed half math, fma.rn.f16x2 for fp16 pools and fma.rn.bf16x2 for bf16 pools
  (SASS: HFMA2 / HFMA2.BF16);
* v4-v7: 128-bit global loads of the pool (ld.global.v4.u32, SASS LDG.E.128); v8, v9: the pool is
  read only by 16-byte asynchronous copies into shared memory (cp.async.cg, SASS LDGSTS.E.BYPASS.128),
  at most 128 registers (its launch bounds: 4 CTAs per SM) and at most 48 KiB of shared memory;
* v9: v8's kernel with its ring in dynamic shared memory (sized per launch);
* v5+: tensor-core matrix multiply-accumulate (mma.sync.aligned.m16n8k16, SASS HMMA.16816);
* every version: no local memory (.local / ld.local / st.local): the per-thread q, score and
  accumulator arrays must live in registers; where ptxas is installed, also its report of
  0 bytes of spills and of stack.

Without a GPU, numba asks the driver for the compute capability when it compiles a device
function (common.warp_sum ...); the subprocess answers (9, 0) in its place.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, re, sys, types as _pytypes
import numba.cuda.dispatcher as _dispatcher
_dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, types
from kernels_numba import paged_attention as pa

i16_3, i16_4 = types.int16[:, :, ::1], types.int16[:, :, :, ::1]
i32_3, i32_4, i32_1 = types.int32[:, :, ::1], types.int32[:, :, :, ::1], types.int32[::1]
bt, cl = types.int32[:, ::1], types.int32[::1]
f32_3, f32_4 = types.float32[:, :, ::1], types.float32[:, :, :, ::1]
SIGS = {
    1: (i16_3, i16_4, i16_4, bt, cl, i16_3, f32_3, types.float32),
    2: (i16_3, i16_4, i16_4, bt, cl, i16_3, f32_3, types.float32),
    3: (i32_3, i32_4, i32_4, bt, cl, i16_3, types.float32),
    4: (i16_3, i32_1, i32_1, bt, cl, i16_3, f32_4, f32_4, types.float32, types.int64),
    5: (i32_3, i32_1, i32_1, bt, cl, i16_3, f32_4, f32_4, types.float32, types.int64),
    6: (i32_3, i32_1, i32_1, bt, cl, i16_3, f32_4, f32_4, types.float32, types.int64),
    7: (i32_3, i32_1, i32_1, bt, cl, i16_3, f32_4, f32_4, types.float32, types.int64),
    8: (i32_3, i32_1, i32_1, bt, cl, i16_3, f32_4, f32_4, types.float32, types.int64),
    9: (i32_3, i32_1, i32_1, bt, cl, i16_3, f32_4, f32_4, types.float32, types.int64),
}

def ops_of(ptx):
    ops = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", ptx, re.M)
    count = lambda prefix: sum(1 for o in ops if o.startswith(prefix))
    return {
        "shfl": count("shfl.sync"),
        "fma_f16x2": count("fma.rn.f16x2"),
        "fma_bf16x2": count("fma.rn.bf16x2"),
        "ld_global_v4": count("ld.global.v4"),
        "mma": count("mma.sync.aligned.m16n8k16"),
        "cp_async": len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)),
        "cp_async_wait": len(re.findall(r"cp\.async\.wait_group", ptx)),
        "dynamic_smem": bool(re.search(r"\.extern \.shared", ptx)),
        "local": bool(re.search(r"\.local\b|ld\.local|st\.local", ptx)),
        "f64_ops": sum(1 for o in ops if ".f64" in o),
    }

out = {}
for cfg in json.loads(sys.argv[1]):
    version, head_dim, block_size, group, kind = cfg
    bf16 = kind == "bf16"
    if version == 6:  # v6 is v5's kernel with two sub-chunks per step (d=64)
        kernel = pa._make_v5(head_dim, block_size, group, bf16, pa._v6_unroll_and_occupancy(head_dim)[0])
    elif version >= 4:
        kernel = getattr(pa, f"_make_v{version}")(head_dim, block_size, group, bf16)
    else:
        kernel = getattr(pa, f"_make_v{version}")(head_dim, block_size, bf16)
    bounds = {8: pa.V8_LAUNCH_BOUNDS, 9: (256, 2)}.get(version)  # v9 built with its default: CTAs of 8 warps
    ptx, _ = cuda.compile_ptx(kernel.py_func, SIGS[version], cc=(9, 0), launch_bounds=bounds)
    name = f"v{version}_d{head_dim}_bs{block_size}_g{group}_{kind}"
    open(f"{sys.argv[2]}/{name}.ptx", "w").write(ptx)
    out[name] = ops_of(ptx)
print(json.dumps(out))
"""

# (version, head_dim, block_size, group, kind)
CONFIGS = [
    (1, 64, 16, 7, "f16"),
    (2, 128, 8, 7, "bf16"),
    (3, 64, 16, 7, "f16"),
    (3, 128, 32, 1, "bf16"),
    (4, 64, 16, 7, "f16"),
    (4, 128, 8, 7, "bf16"),
    (4, 64, 32, 1, "f16"),
    (5, 64, 16, 7, "f16"),
    (5, 128, 32, 16, "bf16"),
    (5, 64, 8, 1, "bf16"),
    (6, 64, 16, 7, "f16"),
    (6, 128, 16, 7, "bf16"),
    (7, 64, 16, 7, "f16"),
    (7, 64, 8, 16, "bf16"),
    (8, 64, 16, 7, "f16"),
    (8, 64, 8, 16, "bf16"),
    (8, 64, 32, 1, "f16"),
    (9, 64, 16, 7, "f16"),
    (9, 64, 8, 16, "bf16"),
]


@pytest.fixture(scope="module")
def compiled():
    tmp = tempfile.mkdtemp(prefix="pa_ptx_")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CONFIGS), tmp], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and "CUDA toolkit" in proc.stderr + proc.stdout:
        pytest.skip("no CUDA toolkit (NVVM) to compile with")
    assert proc.returncode == 0, proc.stderr[-4000:]
    yield json.loads(proc.stdout.strip().splitlines()[-1]), tmp
    shutil.rmtree(tmp, ignore_errors=True)


def _name(cfg):
    version, head_dim, block_size, group, kind = cfg
    return f"v{version}_d{head_dim}_bs{block_size}_g{group}_{kind}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=_name)
def test_no_local_memory_no_fp64(compiled, cfg):
    stats = compiled[0][_name(cfg)]
    assert not stats["local"], f"{_name(cfg)}: local memory in the PTX (a register array spilled)"
    assert stats["f64_ops"] == 0, f"{_name(cfg)}: {stats['f64_ops']} fp64 instructions"


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c[0] >= 3], ids=_name)
def test_warp_shuffles_from_v3(compiled, cfg):
    assert compiled[0][_name(cfg)]["shfl"] > 0


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c[0] == 3], ids=_name)
def test_v3_uses_packed_half_fma(compiled, cfg):
    stats = compiled[0][_name(cfg)]
    key = "fma_bf16x2" if cfg[4] == "bf16" else "fma_f16x2"
    assert stats[key] > 0, stats


@pytest.mark.parametrize("cfg", CONFIGS, ids=_name)
def test_128_bit_loads_from_v4(compiled, cfg):
    n = compiled[0][_name(cfg)]["ld_global_v4"]
    assert (n > 0) == (4 <= cfg[0] <= 7), f"{_name(cfg)}: {n} ld.global.v4"


@pytest.mark.parametrize("cfg", CONFIGS, ids=_name)
def test_v8_reads_the_pool_by_cp_async(compiled, cfg):
    stats = compiled[0][_name(cfg)]
    if cfg[0] >= 8:
        # d=64: 2 K + 4 V pieces per lane, issued in the prologue and in the steady-state loop
        assert stats["cp_async"] >= 2 * 6 and stats["cp_async_wait"] >= 2, stats
    else:
        assert stats["cp_async"] == 0, stats


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c[0] >= 8], ids=_name)
def test_v9_ring_is_dynamic_shared_memory(compiled, cfg):
    # v9 sizes its ring at launch (beyond the 48 KiB of a static array); v8's is static
    assert compiled[0][_name(cfg)]["dynamic_smem"] == (cfg[0] == 9)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_name)
def test_tensor_cores_from_v5(compiled, cfg):
    n = compiled[0][_name(cfg)]["mma"]
    assert (n > 0) == (cfg[0] >= 5), f"{_name(cfg)}: {n} mma.sync"


def _ptxas():
    return shutil.which("ptxas")


@pytest.mark.skipif(_ptxas() is None, reason="ptxas not installed")
@pytest.mark.parametrize("cfg", CONFIGS, ids=_name)
def test_ptxas_reports_no_spills(compiled, cfg):
    ptx = Path(compiled[1], _name(cfg) + ".ptx").read_text()
    # NVVM may emit a newer PTX ISA than the installed ptxas knows; these kernels use nothing new
    ver = subprocess.run([_ptxas(), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", ver)
    if m:
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {int(m.group(1)) - 4}.{m.group(2)}", ptx, flags=re.M)
    src = Path(compiled[1], _name(cfg) + ".fixed.ptx")
    src.write_text(ptx)
    proc = subprocess.run([_ptxas(), "-arch=sm_90", "-v", str(src), "-o", os.devnull],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = proc.stderr + proc.stdout
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert "0 bytes stack frame" in report, report
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    assert regs <= 255
    if cfg[0] >= 8:  # 16 resident warps per SM need <= 128 registers
        assert regs <= 128, report
    if cfg[0] == 8:  # ... and, as 4 CTAs, <= 48 KiB of shared memory (the ring) each
        assert int(re.search(r"(\d+) bytes smem", report).group(1)) <= 48 * 1024, report
