"""Seconds to compile one specialisation of each kernel function the engine runs (typing, NVVM's PTX and the
linked cubin), each in a fresh process as a precompile worker pays it (its device functions included; the
module's import apart): the estimates kernels_numba.precompile.COMPILE_SECONDS hands the tasks out by,
longest first. Prints a table and the COMPILE_SECONDS lines; --out writes the rows as JSON.

    python scripts/compile_seconds.py                  # on the GPU machine: the real compile
    python scripts/compile_seconds.py --no-device      # without a GPU (NO_DEVICE: sm_90, cubin by nvJitLink)

The argument types are those of the engine's launches (fp16, head_dim 64, block_size 16, 7 query heads per
KV head: Qwen2-0.5B); other shapes cost about the same (the same code, other constants).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# numba-cuda asks the driver only for the device's compute capability, the codegen's cache key (driver
# version, compute capability) and to load a linked cubin: without a GPU these answers let it compile real
# sm_90 code (PTX by NVVM, the cubin linked by nvJitLink) and load nothing. Run as sitecustomize, it
# reaches spawned worker processes too (tests/test_startup.py).
NO_DEVICE = """
import types
import numba.cuda.dispatcher as dispatcher
from numba import cuda
from numba.cuda import codegen
SM90 = (9, 0)
cuda.get_current_device = dispatcher.get_current_device = lambda: types.SimpleNamespace(id=0, compute_capability=SM90)
codegen.CUDACodeLibrary._ensure_cc = lambda self, cc: cc or (9, 0, "a")   # numba-cuda's own key for sm_90
codegen.JITCUDACodegen.magic_tuple = lambda self: ("no driver", SM90)
dispatcher._Kernel.bind = lambda self: self._codelibrary.get_cubin()     # link the cubin, load nothing
cuda.select_device = lambda device_id: None
"""


def kernels():
    """{name: (dispatcher, argument types)}: one specialisation of each kernel function the engine runs."""
    from numba import types

    from kernels_numba import activation, cache_ops, paged_attention, rmsnorm, rotary, sampling
    from kernels_numba import paged_prefill_fa2 as fa2

    u32, i32, i64, f32 = types.uint32[::1], types.int32[::1], types.int64, types.float32
    bt, i32_3 = types.int32[:, ::1], types.int32[:, :, ::1]
    decode = (i32_3, i32, i32, bt, i32, i32_3, u32, i32, f32, i64)
    prefill = (u32, u32, u32, bt, i32, i32, u32, types.float32[::1], types.float32[::1], i32, i64, i64, f32,
               types.int32)
    rows = (types.int32[::1], i64, types.float32[::1], i32, types.float32[::1], types.int64[::1], i32, i32, i32,
            types.float32[::1], types.int64[:, ::1], types.float32[:, ::1])      # sampling: float32 logits
    split = rows[:2] + (i64,) + rows[2:] + (types.int64[:, ::1], types.float32[:, ::1])
    norm = (u32, i64, u32, i64, u32, u32, i64, i64, i64, types.float64)
    return {
        "paged_attention.paged_attention_decode": (paged_attention.make_decode_kernel(64, 16, 7, False, 4), decode),
        "paged_attention.merge_decode_splits": (paged_attention.make_merge_kernel(64, 7, False),
                                                (u32, i32, i32_3, i64, i64)),
        "paged_prefill_fa2.paged_prefill_attention": (fa2.make_prefill_kernel(64, "f16", 16, fa2.STAGES), prefill),
        "paged_prefill_fa2.merge_prefill_splits": (fa2.make_merge_kernel("f16"),
                                                   (types.float32[::1], types.float32[::1], u32, i64, i64)),
        "paged_prefill_fa2.plan_work_list": (fa2.make_plan_kernel(), (i32, i64, i32)),
        "sampling.pass1": (sampling.make_split_kernels("f32", True)[0], split),
        "sampling.pass2": (sampling.make_split_kernels("f32", True)[1], split),
        "sampling.pass3": (sampling.make_split_kernels("f32", True)[2], split),
        "sampling.split_fallback": (sampling.make_fallback_kernel("f32", True, split=True), split),
        "rmsnorm.rms_norm_kernel": (rmsnorm._make_kernel(False, True), norm),
        "rotary.rotary_cache_kernel": (rotary._make_kernel(64, False),
                                       (types.int64[::1], u32, i64, u32, i64, u32, i64, u32, i64, u32, u32, u32,
                                        types.int64[::1], i64, i64, i64)),
        "activation.silu_and_mul_kernel": (activation._make_kernel(False), (u32, i64, u32, i64, i64)),
        "cache_ops._reshape_and_cache_kernel": (cache_ops._reshape_and_cache_kernel,
                                                (i32_3, i32_3, types.int32[:, :, :, ::1], types.int32[:, :, :, ::1],
                                                 types.int64[::1], i64)),
        "cache_ops._copy_blocks_kernel": (cache_ops._copy_blocks_kernel,
                                          (types.UniTuple(types.int32[:, ::1], 2), types.int64[:, ::1])),
    }


def child(name):
    """Compile one kernel (nothing read from or written to the disk cache); print its row as JSON."""
    kernel, argtypes = kernels()[name]
    kernel._cache.disable()
    t = time.perf_counter()
    kernel.compile(argtypes)
    seconds = time.perf_counter() - t
    f = kernel.py_func
    print(json.dumps(dict(name=name, function=f"{f.__module__}.{f.__qualname__}", seconds=seconds)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-device", action="store_true", help="compile for sm_90 without a GPU (NO_DEVICE)")
    ap.add_argument("--only", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    if args.no_device:
        exec(NO_DEVICE, {})
    if args.child:
        return child(args.child)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="numba_cache_")        # never the real cache
    names = args.only.split(",") if args.only else list(kernels())
    rows = []
    for name in names:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name] + ["--no-device"] * args.no_device
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if p.returncode:
            print(f"{name}: failed\n{p.stderr[-2000:]}", flush=True)
            continue
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(f"{rows[-1]['seconds']:7.1f} s  {name}", flush=True)
    print("\nCOMPILE_SECONDS = {")
    for r in sorted(rows, key=lambda r: -r["seconds"]):
        print(f"    \"{r['function']}\": {r['seconds']:.1f},")
    print("}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=not args.no_device, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
