"""Static checks on the code numba generates for the decode kernels (no GPU needed).

Each version is compiled for sm_90 with `numba.cuda.compile_ptx` in a subprocess without
NUMBA_ENABLE_CUDASIM (conftest.py sets it for this process, and the simulator cannot compile),
with the argument types the CUDA launcher passes, and the PTX is checked for what each
version promises:

* v3+: warp shuffles (shfl.sync) for the reductions;
* v3: packed half math, fma.rn.f16x2 for fp16 pools and fma.rn.bf16x2 for bf16 pools
  (SASS: HFMA2 / HFMA2.BF16);
* v4-v7: 128-bit global loads of the pool (ld.global.v4.u32, SASS LDG.E.128); v8+: the pool is
  read only by 16-byte asynchronous copies into shared memory (cp.async.cg, SASS LDGSTS.E.BYPASS.128),
  at most 128 registers at d=64 (launch bounds: 16 warps per SM), v8 at most 48 KiB of shared memory;
* v9, v10: the ring in dynamic shared memory (sized per launch);
* v5+: tensor-core matrix multiply-accumulate (mma.sync.aligned.m16n8k16, SASS HMMA.16816);
* v10: the partitions' records merged by the last CTA (128-bit loads after an atomic and a fence),
  d=128 on the same ring (<= 255 registers); its merge kernel: 128-bit loads, shuffles;
* every kernel: no local memory (.local / ld.local / st.local): the per-thread q, score and
  accumulator arrays must live in registers; where ptxas is installed, also its report of
  0 bytes of spills and of stack.

The kernels that introduce a promise (v3, v4, v7, v8) and v10's run by default; the other versions,
shapes, dtypes and block sizes are `slow` (the module compiles only the configurations the run
selected, split over parallel subprocesses).

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
from helpers import compile_in_subprocesses

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, re, sys, time, types as _pytypes
import numba.cuda.dispatcher as _dispatcher
_dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, types
from kernels_numba import decode_journey_cuda_core as cc, decode_journey_tensor_core as tc, paged_attention as pa

i16_3, i16_4 = types.int16[:, :, ::1], types.int16[:, :, :, ::1]
i32_3, i32_4, i32_1 = types.int32[:, :, ::1], types.int32[:, :, :, ::1], types.int32[::1]
u32_1 = types.uint32[::1]
bt, cl = types.int32[:, ::1], types.int32[::1]
f32_3, f32_4 = types.float32[:, :, ::1], types.float32[:, :, :, ::1]
SPLIT_KV = (i32_3, i32_1, i32_1, bt, cl, i16_3, f32_4, f32_4, types.float32, types.int64)
SIGS = {
    1: (i16_3, i16_4, i16_4, bt, cl, i16_3, f32_3, types.float32),
    2: (i16_3, i16_4, i16_4, bt, cl, i16_3, f32_3, types.float32),
    3: (i32_3, i32_4, i32_4, bt, cl, i16_3, types.float32),
    4: (i16_3, i32_1, i32_1, bt, cl, i16_3, f32_4, f32_4, types.float32, types.int64),
    5: SPLIT_KV, 6: SPLIT_KV, 7: SPLIT_KV, 8: SPLIT_KV, 9: SPLIT_KV,
    10: (i32_3, i32_1, i32_1, bt, cl, i32_3, u32_1, i32_1, types.float32, types.int64),
    "v10_merge": (u32_1, cl, i32_3, types.int64, types.int64),
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
        "atomic": count("atom.") + count("red."),
        "membar": count("membar.gl") + count("fence.sc.gpu") + count("fence.acq_rel.gpu"),
        "local": bool(re.search(r"\.local\b|ld\.local|st\.local", ptx)),
        "f64_ops": sum(1 for o in ops if ".f64" in o),
        "calls": count("call"),
    }

def kernel_of(name, head_dim, block_size, group, bf16):
    # (kernel, launch bounds) as the launchers build them
    if name == "v10_merge":
        return pa.make_merge_kernel(head_dim, group, bf16), None
    version = int(name[1:])
    if version <= 4:
        args = (head_dim, block_size, group, bf16) if version == 4 else (head_dim, block_size, bf16)
        return getattr(cc, f"make_v{version}")(*args), None
    if version in (5, 6, 7):
        unroll = tc.v6_unroll_and_occupancy(head_dim)[0] if version == 6 else 1
        return tc.make_v5(head_dim, block_size, group, bf16, unroll, pipelined=version == 7), None
    if version == 8:
        return tc.make_v8(head_dim, block_size, group, bf16), tc.V8_LAUNCH_BOUNDS
    if version == 9:  # built with CTAs of 8 warps
        return tc.make_v9(head_dim, block_size, group, bf16), (256, 2)
    # v10: CTAs of 4 warps, fused merge
    return pa.make_decode_kernel(head_dim, block_size, group, bf16, 4), (128, 4 if head_dim == 64 else 2)

out = {}
for cfg in json.loads(sys.argv[1]):
    kernel_name, head_dim, block_size, group, kind = cfg
    t0 = time.time()
    kernel, bounds = kernel_of(kernel_name, head_dim, block_size, group, kind == "bf16")
    sig = SIGS[kernel_name if kernel_name == "v10_merge" else int(kernel_name[1:])]
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), launch_bounds=bounds)
    name = f"{kernel_name}_d{head_dim}_bs{block_size}_g{group}_{kind}"
    open(f"{sys.argv[2]}/{name}.ptx", "w").write(ptx)
    out[name] = dict(ops_of(ptx), seconds=round(time.time() - t0, 1))
print(json.dumps(out))
"""

# (kernel, head_dim, block_size, group, kind): "vN" as launch_vN builds it, "v10_merge" v10's merge kernel;
# by default the production kernel v10 (which keeps every promise of the journey: shuffles, 128-bit loads,
# mma, the cp.async ring, the atomic election) and its merge kernel; the journey's versions (v3 half2, v4
# 128-bit loads, v7 mma from registers, v8 the cp.async ring ...), shapes, dtypes and block sizes behind `slow`
DEFAULT = [
    ("v10", 64, 16, 7, "f16"),
    ("v10", 128, 8, 7, "bf16"),
    ("v10_merge", 64, 16, 7, "f16"),
]
SLOW = [
    ("v1", 64, 16, 7, "f16"),
    ("v3", 64, 16, 7, "f16"),
    ("v4", 64, 16, 7, "f16"),
    ("v7", 64, 16, 7, "f16"),
    ("v8", 64, 16, 7, "f16"),
    ("v2", 128, 8, 7, "bf16"),
    ("v3", 128, 32, 1, "bf16"),
    ("v4", 128, 8, 7, "bf16"),
    ("v4", 64, 32, 1, "f16"),
    ("v5", 64, 16, 7, "f16"),
    ("v5", 128, 32, 16, "bf16"),
    ("v5", 64, 8, 1, "bf16"),
    ("v6", 64, 16, 7, "f16"),
    ("v6", 128, 16, 7, "bf16"),
    ("v7", 64, 8, 16, "bf16"),
    ("v8", 64, 8, 16, "bf16"),
    ("v8", 64, 32, 1, "f16"),
    ("v9", 64, 8, 16, "bf16"),
    ("v9", 64, 16, 7, "f16"),
    ("v10", 64, 32, 20, "bf16"),
    ("v10", 128, 16, 16, "f16"),
    ("v10_merge", 128, 16, 20, "bf16"),
]
CONFIGS = DEFAULT + SLOW

# what each kernel's PTX must show (True: present, False: absent)
PROMISES = {
    "v1": dict(shfl=False, ld_global_v4=False, mma=False, cp_async=False, dynamic_smem=False),
    "v2": dict(shfl=False, ld_global_v4=False, mma=False, cp_async=False, dynamic_smem=False),
    "v3": dict(shfl=True, ld_global_v4=False, mma=False, cp_async=False, dynamic_smem=False, packed_fma=True),
    "v4": dict(shfl=True, ld_global_v4=True, mma=False, cp_async=False, dynamic_smem=False),
    "v5": dict(shfl=True, ld_global_v4=True, mma=True, cp_async=False, dynamic_smem=False),
    "v6": dict(shfl=True, ld_global_v4=True, mma=True, cp_async=False, dynamic_smem=False),
    "v7": dict(shfl=True, ld_global_v4=True, mma=True, cp_async=False, dynamic_smem=False),
    # v8+: the pool is read only through cp.async (no 128-bit global loads); v9+ ring: dynamic
    "v8": dict(shfl=True, ld_global_v4=False, mma=True, cp_async=True, dynamic_smem=False),
    "v9": dict(shfl=True, ld_global_v4=False, mma=True, cp_async=True, dynamic_smem=True),
    # v10: the last CTA reads the partitions' records with 128-bit loads, elected by an atomic after a fence
    "v10": dict(shfl=True, ld_global_v4=True, mma=True, cp_async=True, dynamic_smem=True, atomic=True, membar=True),
    "v10_merge": dict(shfl=True, ld_global_v4=True, mma=False, cp_async=False, dynamic_smem=False, atomic=False),
}
MAX_REGISTERS = {"v8": 128, "v9": 128, "v10": 128}  # 16 warps per SM (v10 at d=128: 8 warps, 255)


def _params(configs):
    return [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in configs]


def _name(cfg):
    kernel, head_dim, block_size, group, kind = cfg
    return f"{kernel}_d{head_dim}_bs{block_size}_g{group}_{kind}"


@pytest.fixture(scope="module")
def compiled(request):
    """PTX of every configuration this run selected (the slow ones only when `slow` tests run)."""
    picked = set()
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.module is request.module and spec is not None and "cfg" in spec.params:
            picked.add(spec.params["cfg"])
    wanted = [c for c in CONFIGS if c in picked]
    tmp = tempfile.mkdtemp(prefix="pa_ptx_")
    stats = {}
    for stdout in compile_in_subprocesses(_SCRIPT, wanted, lambda part: (json.dumps(part), tmp), timeout=1800):
        stats.update(json.loads(stdout.strip().splitlines()[-1]))
    yield stats, tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("cfg", _params(CONFIGS), ids=_name)
def test_no_local_memory_no_fp64(compiled, cfg):
    stats = compiled[0][_name(cfg)]
    assert not stats["local"], f"{_name(cfg)}: local memory in the PTX (a register array spilled)"
    assert stats["f64_ops"] == 0, f"{_name(cfg)}: {stats['f64_ops']} fp64 instructions"


@pytest.mark.parametrize("cfg", _params(CONFIGS), ids=_name)
def test_device_helpers_are_inlined(compiled, cfg):
    # inline_device helpers reach the kernel as separate device functions that NVVM must inline (alwaysinline)
    stats = compiled[0][_name(cfg)]
    assert stats["calls"] == 0, f"{_name(cfg)}: {stats['calls']} call instructions in the PTX"


@pytest.mark.parametrize("cfg", _params(CONFIGS), ids=_name)
def test_ptx_shows_what_the_version_promises(compiled, cfg):
    stats = compiled[0][_name(cfg)]
    promised = dict(PROMISES[cfg[0]])
    if promised.pop("packed_fma", False):  # v3: q.k as half pairs
        promised["fma_bf16x2" if cfg[4] == "bf16" else "fma_f16x2"] = True
    got = {key: stats[key] > 0 for key in promised}
    assert got == promised, f"{_name(cfg)}: {stats}"
    if promised["cp_async"]:
        # 2 K + 4 V pieces per lane at d=64 (twice at d=128), in the prologue and the steady-state loop
        assert stats["cp_async"] >= 2 * 6 * cfg[1] // 64 and stats["cp_async_wait"] >= 2, stats
    if promised["mma"]:  # S = Q K^T and O += P V: 2 (D/16) + D/8 per chunk body
        assert stats["mma"] >= 2 * (cfg[1] // 16) + cfg[1] // 8, stats


def _ptxas():
    return shutil.which("ptxas")


@pytest.mark.skipif(_ptxas() is None, reason="ptxas not installed")
@pytest.mark.parametrize("cfg", _params(CONFIGS), ids=_name)
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
    limit = 255 if cfg[0] == "v10" and cfg[1] == 128 else MAX_REGISTERS.get(cfg[0], 255)
    assert regs <= limit, report
    if cfg[0] == "v8":  # ... and, as 4 CTAs, <= 48 KiB of shared memory (the ring) each
        assert int(re.search(r"(\d+) bytes smem", report).group(1)) <= 48 * 1024, report


# ---------------------------------------------------------------------------------------------
# numba's on-disk cache: kernels built by factories are stored under keys a second process finds

_CACHE_KEYS_SCRIPT = r"""
import hashlib, json, pickle, types as _pytypes
import numba.cuda.dispatcher as _dispatcher
_dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(9, 0))
from numba import types
from kernels_numba import cache_ops, decode_journey_tensor_core as tc, paged_attention as pa, paged_prefill as pp

class Codegen:  # what the GPU would put in the key
    def magic_tuple(self):
        return ("nvptx64-nvidia-cuda", (9, 0), "")

kernels = {
    "v10": pa.make_decode_kernel(64, 16, 7, False, 4),
    "v10_again": pa.make_decode_kernel(64, 16, 7, False, 4),
    "v10_8_warps": pa.make_decode_kernel(64, 16, 7, False, 8),
    "v10_merge": pa.make_merge_kernel(64, 7, False),
    "v8": tc.make_v8(64, 16, 7, False),
    "prefill_v3": pp.get_kernel(3, 64, "f16", 16),
    "reshape_and_cache": cache_ops._reshape_and_cache_kernel,
}
sig = (types.int32[::1],)
out = {}
for name, kernel in kernels.items():
    cache = kernel._cache
    key = cache._index_key(sig, Codegen())
    out[name] = dict(cache=type(cache).__name__, key=hashlib.sha256(pickle.dumps(key)).hexdigest())
from kernels_numba import bridge
bridge.KERNEL_CACHE = False  # as PAGEDATTN_KERNEL_CACHE=0 sets it at import
out["switched_off"] = dict(cache=type(pa.make_decode_kernel(64, 16, 3, False, 2)._cache).__name__, key=None)
print(json.dumps(out))
"""


def _cache_keys(hash_seed):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONHASHSEED"] = hash_seed
    proc = subprocess.run([sys.executable, "-c", _CACHE_KEYS_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_disk_cache_keys_are_the_same_in_every_process():
    """numba's own key pickles a closure's cells (intrinsics pickle with a random uuid: a new key in
    every process); bridge.KernelCache keys a kernel by its factory's arguments and the sources.
    PAGEDATTN_KERNEL_CACHE=0 (bridge.KERNEL_CACHE) leaves numba's default, no cache."""
    first, second = _cache_keys("1"), _cache_keys("2")
    off = first.pop("switched_off")
    assert off["cache"] == "NullCache" and second.pop("switched_off")["cache"] == "NullCache"
    assert {v["cache"] for v in first.values()} == {"KernelCache"}, first
    assert {k: v["key"] for k, v in first.items()} == {k: v["key"] for k, v in second.items()}
    keys = [v["key"] for k, v in first.items() if k != "v10_again"]
    assert first["v10"]["key"] == first["v10_again"]["key"] and len(set(keys)) == len(keys)


_WARM_SCRIPT = r"""
import json, time
t0 = time.perf_counter()
import torch
from kernels_numba import bridge, cache_ops, paged_attention as pa, paged_prefill_fa2 as pf
g = torch.Generator(device="cuda").manual_seed(0)
for (batch, heads, kv_heads, dim, ctx) in [(1, 14, 2, 64, 8192), (8, 14, 2, 64, 2048), (64, 14, 2, 64, 512),
                                           (256, 14, 2, 64, 512), (4, 28, 4, 128, 1024)]:
    nb = batch * ctx // 16
    k = torch.randn(nb, kv_heads, 16, dim, device="cuda", generator=g).half()
    q = torch.randn(batch, heads, dim, device="cuda", generator=g).half()
    bt = torch.randperm(nb, device="cuda", generator=g).view(batch, -1).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    pa.paged_attention(q, k, k, bt, lens, max_context_len=ctx)
    cache_ops.reshape_and_cache(q[:, :kv_heads], q[:, :kv_heads], k, k, torch.arange(batch, device="cuda"))
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    pf.paged_prefill(q, k, k, bt, cu, lens)
torch.cuda.synchronize()
hits, misses = bridge.disk_cache_stats()
print(json.dumps(dict(seconds=time.perf_counter() - t0, hits=hits, misses=misses)))
"""


@pytest.mark.gpu
def test_gpu_second_process_loads_kernels_from_disk_cache(tmp_path):
    """A process that runs the engine's kernel variants compiles them; a second one loads them all
    from the disk cache (prints both times: the startup cost the cache removes)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT) + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _WARM_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1200)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"first process: {runs[0]}; second process: {runs[1]}")
    assert runs[0]["misses"] > 0 and runs[1]["misses"] == 0 and runs[1]["hits"] == runs[0]["misses"], runs
