"""Static checks on the code numba generates for the prefill and cache-op kernels (no GPU needed).

Each kernel is compiled for sm_90 with `numba.cuda.compile_ptx` in a subprocess *without*
NUMBA_ENABLE_CUDASIM (conftest.py sets it for this process, and the simulator cannot compile),
and the PTX is checked for what each version's docstring promises:

* no local memory (.local / ld.local / st.local): the per-thread tiles (v1: S 4x4, O 4x8 at
  d=64; v2: the Q, S and O mma fragments) must live in registers;
* and, where a `ptxas` is installed, no spills once the PTX is assembled for sm_90 (the register
  allocator can spill what the PTX keeps in registers);
* no fp64 instruction (a stray Python float constant would silently make the math double);
* prefill: K/V tiles in shared memory, 128-bit global loads of the fp16/bf16 pool
  (ld.global.v4.u32), ex2 for the softmax; v1 does its math in fp32 FMAs, v2 in tensor-core
  mma.sync m16n8k16 with its row reductions by warp shuffles; v3 has fewer 64-bit divisions
  (compile-time block size) and its exponentials as ex2.approx;
* cache ops: the copies move 64-bit words.

d=64 fp16 of each version runs by default, the other head dims and dtypes under `slow` (the module
compiles only what the run selected, split over parallel subprocesses).
"""
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import compile_in_subprocesses

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, re, types as _pytypes
# device functions (inline_device) compile for the current device's compute capability: there is none here
import numba.cuda.dispatcher as _dispatcher
_dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda
from numba.core import types
from kernels_numba import cache_ops, paged_prefill, prefill_journey

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
        "div_s64": sum(1 for o in ops if o.startswith(("div.s64", "rem.s64"))),
        "mma": sum(1 for o in ops if o.startswith("mma.sync.aligned.m16n8k16")),
        "shfl": sum(1 for o in ops if o.startswith("shfl.sync")),
        "ld_u64": sum(1 for o in ops if re.fullmatch(r"ld(\.global)?\.u64", o) is not None),
        "st_u64": sum(1 for o in ops if re.fullmatch(r"st(\.global)?\.u64", o) is not None),
    }

import sys
ptx_dir, wanted = sys.argv[1], set(json.loads(sys.argv[2]))
out = {}
u32, i32_2d, i32 = types.uint32[::1], types.int32[:, ::1], types.int32[::1]
for version in sorted(v for v in prefill_journey.VERSIONS if v not in prefill_journey.FA2_VERSIONS):  # v1-v3
    for head_dim in paged_prefill.HEAD_DIMS:
        for kind in ("f16", "bf16"):
            name = f"prefill_v{version}_d{head_dim}_{kind}"
            if name not in wanted:
                continue
            kernel = paged_prefill.get_kernel(version, head_dim, kind, 16)
            sig = (u32, u32, u32, i32_2d, i32, i32, u32, types.int64, types.int64, types.int64, types.float32)
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
            out[name] = stats(ptx)
            open(f"{ptx_dir}/{name}.ptx", "w").write(ptx)
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
def ptx_dir():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@pytest.fixture(scope="module")
def ptx_stats(request, ptx_dir):
    """PTX statistics of the prefill variants this run selected (v3's tests also read v2's), and
    of the cache-op kernels."""
    wanted = set()
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.module is request.module and spec is not None and "name" in spec.params:
            wanted |= {spec.params["name"], spec.params["name"].replace("_v3_", "_v2_")}
    stats = {}
    for stdout in compile_in_subprocesses(_SCRIPT, sorted(wanted), lambda part: (ptx_dir, json.dumps(part)),
                                          timeout=1200):
        line = next(l for l in stdout.splitlines() if l.startswith("STATS"))
        stats.update(json.loads(line[len("STATS"):]))
    return stats


def _ptxas_info(ptx_path):
    """ptxas -v for sm_90: (registers, spill store bytes, spill load bytes)."""
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    if not Path(ptxas).exists():
        pytest.skip("no ptxas installed")
    text = ptx_path.read_text()
    for _ in range(2):
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "k.ptx"
            src.write_text(text)
            proc = subprocess.run([ptxas, "-arch=sm_90", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
                                  capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        # numba's bundled NVVM can declare a newer PTX ISA than the installed ptxas reads; the
        # kernels use nothing past PTX 8, so the declaration is lowered to what ptxas supports
        newest = re.search(r"current version is '([0-9.]+)'", log)
        if proc.returncode != 0 and newest:
            text = re.sub(r"^\.version [0-9.]+", f".version {newest.group(1)}", text, count=1, flags=re.M)
            continue
        break
    assert proc.returncode == 0, log[-2000:]
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    stores = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    loads = int(re.search(r"(\d+) bytes spill loads", log).group(1))
    return regs, stores, loads


PREFILL_VARIANTS = [f"prefill_v{v}_d{d}_{k}" for v in (1, 2, 3) for d in (64, 128) for k in ("f16", "bf16")]
# d=64 fp16 of each version by default; the other head dims and dtypes under `slow`
VARIANTS = [n if n.endswith("_d64_f16") else pytest.param(n, marks=pytest.mark.slow) for n in PREFILL_VARIANTS]


@pytest.mark.parametrize("name", VARIANTS + ["reshape_and_cache", "copy_blocks_24_layers"])
def test_no_local_memory_no_fp64(ptx_stats, name):
    s = ptx_stats[name]
    assert not s["local"], f"{name} uses local memory (register spill or a local array not promoted): {s}"
    assert s["f64_ops"] == 0, f"{name} has {s['f64_ops']} fp64 instructions: {s}"


@pytest.mark.parametrize("name", VARIANTS)
def test_prefill_no_spills_after_ptxas(ptx_dir, ptx_stats, name):
    regs, stores, loads = _ptxas_info(ptx_dir / f"{name}.ptx")
    assert stores == 0 and loads == 0, f"{name}: {regs} registers, {stores} B spill stores, {loads} B spill loads"


@pytest.mark.parametrize("name", VARIANTS)
def test_prefill_uses_shared_tiles_and_wide_loads(ptx_stats, name):
    s = ptx_stats[name]
    assert s["shared_decls"] >= 2, s  # K and V tiles (v1: + Q, P and the per-row softmax state)
    assert s["ld_shared"] > 0 and s["st_shared"] > 0, s
    assert s["ld_global_v4"] >= 2, s  # K/V tile loads (and v1's Q tile) are 128-bit
    assert s["ex2"] > 0, s
    if name.startswith("prefill_v1"):
        assert s["shared_decls"] >= 5 and s["fma_f32"] > 0, s
    else:  # tensor cores: S = Q K^T is (d/16) x 8 mma per 64-key tile, O += P V the same count
        head_dim = int(re.search(r"_d(\d+)_", name).group(1))
        assert s["mma"] == 2 * (head_dim // 16) * 8, s
        assert s["shfl"] >= 8, s  # row max per tile (2 rows x 2 steps), row sums at the end
    if name.startswith("prefill_v3"):
        # block size constant: the 3 block-table lookups per tile lose their 64-bit // and %
        v2 = ptx_stats[name.replace("v3", "v2")]
        assert s["div_s64"] <= v2["div_s64"] - 6, (s, v2)
        assert s["ex2"] >= 2 * 8 * 2 + 2, s  # every exponential of a tile is one ex2.approx


@pytest.mark.parametrize("name", ["reshape_and_cache", "copy_blocks_24_layers"])
def test_cache_ops_copy_64_bit_words(ptx_stats, name):
    s = ptx_stats[name]
    assert s["ld_u64"] > 0 and s["st_u64"] > 0, s
