"""What int8 activations would buy the GGUF block product: Q5_0 at 1 row, one thread, three ways.

    float32 x (shipped)  kernels_numba.cpu_quant.linear: the run's q converted to float32, times x
    int8 x, generic IR   x rounded to int8 per block of 32 (scale max|x| / 127, as ggml's Q8 activations),
                         q . xq as integer products in plain LLVM vector IR (LLVM forms vpmullw + vphaddw)
    int8 x, vpmaddubsw   the same with AVX2's byte multiply-add (vpsignb, vpmaddubsw, vpmaddwd: llama.cpp's
                         method); x86 AVX2 only, left out elsewhere

Each is checked against a float64 product of the dequantized matrix (its relative error is printed:
int8 activations change the function, by ~1e-3 of the output's scale here), then timed by the calling
thread's CPU time (minimum of --calls calls; the matrix stays in cache, so this is the arithmetic).

    python scripts/bench_cpu_int8_activations.py [--calls 40]
"""
import argparse
import time

import numpy as np
import torch
from llvmlite import ir
from numba import njit
from numba.core.extending import intrinsic

from kernels_numba import cpu_quant
from kernels_numba.cpu_simd import (_B32, _F8, _I32, f32x8, load_u16, load_u32, vb_add, vb_bits, vb_load, vb_nibbles,
                                    vf_fma, vf_splat, vf_sum, vf_zero)


@intrinsic
def _dot_generic(typingctx, a, b):
    """Signed bytes a . b in 8 float32 lanes (4 products each), in target-independent IR."""
    def codegen(context, builder, sig, args):
        i16, i32 = ir.VectorType(ir.IntType(16), 32), ir.VectorType(ir.IntType(32), 16)
        a16, b16 = builder.sext(args[0], i16), builder.sext(args[1], i16)
        u = ir.Constant(i16, ir.Undefined)
        even = ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2)))
        odd = ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2)))
        pairs = builder.add(builder.mul(builder.sext(builder.shuffle_vector(a16, u, even), i32),
                                        builder.sext(builder.shuffle_vector(b16, u, even), i32)),
                            builder.mul(builder.sext(builder.shuffle_vector(a16, u, odd), i32),
                                        builder.sext(builder.shuffle_vector(b16, u, odd), i32)))
        u2 = ir.Constant(i32, ir.Undefined)
        lo = builder.shuffle_vector(pairs, u2, ir.Constant(ir.VectorType(_I32, 8), list(range(8))))
        hi = builder.shuffle_vector(pairs, u2, ir.Constant(ir.VectorType(_I32, 8), list(range(8, 16))))
        return builder.sitofp(builder.add(lo, hi), _F8)
    return f32x8(a, b), codegen


def _x86(module, name, ret, *params):
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, list(params)), name=name)


@intrinsic
def _dot_maddubs(typingctx, a, b):
    """The same with AVX2's vpsignb / vpmaddubsw / vpmaddwd (|a| unsigned times b with a's sign)."""
    def codegen(context, builder, sig, args):
        i16, i32 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(32), 8)
        m = builder.module
        sign = _x86(m, "llvm.x86.avx2.psign.b", _B32, _B32, _B32)
        p16 = builder.call(_x86(m, "llvm.x86.avx2.pmadd.ub.sw", i16, _B32, _B32),
                           [builder.call(sign, [args[0], args[0]]), builder.call(sign, [args[1], args[0]])])
        p32 = builder.call(_x86(m, "llvm.x86.avx2.pmadd.wd", i32, i16, i16), [p16, ir.Constant(i16, [1] * 16)])
        return builder.sitofp(p32, _F8)
    return f32x8(a, b), codegen


def _kernel(dot):
    @njit(nogil=True)
    def q5_0_int8(xq, dx, w, out, f16):
        """out[n] = sum over blocks b of d_b dx_b (q_b . xq_b): Q5_0 rows w, int8 activations xq."""
        nb = w.shape[1] // 22
        for n in range(w.shape[0]):
            row = w[n]
            acc = vf_zero()
            for b in range(nb):
                p = b * 22
                q = vb_add(vb_nibbles(row, p + 6), vb_bits(load_u32(row, p + 2), 0, 256 - 16))
                acc = vf_fma(vf_splat(f16[load_u16(row, p)] * dx[b]), dot(q, vb_load(xq, 32 * b)), acc)
            out[n] = vf_sum(acc)
    return q5_0_int8


def _has_avx2():
    import llvmlite.binding as ll

    return "+avx2" in ll.get_host_cpu_features().flatten().split(",")


def main(calls=40, N=4864, K=896):
    rng = np.random.default_rng(0)
    w = rng.integers(0, 256, (N, K // 32 * 22), dtype=np.uint8)
    for b in range(K // 32):                              # fp16 scales ~ 0.01 (any finite values time the same)
        w[:, 22 * b:22 * b + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    x = rng.standard_normal(K).astype(np.float32)
    dx = (np.abs(x.reshape(-1, 32)).max(1) / 127).astype(np.float32)                  # (K / 32,)
    xq = np.round(x.reshape(-1, 32) / dx[:, None]).astype(np.int8).reshape(-1).view(np.uint8)
    ref = cpu_quant.dequantize(w, "Q5_0").astype(np.float64) @ x.astype(np.float64)
    out = np.empty(N, np.float32)
    xt = torch.from_numpy(x[None])
    ways = {"float32 x (shipped)": lambda: out.__setitem__(slice(None), cpu_quant.linear(xt, w, "Q5_0", num_threads=1)[0])}
    ways["int8 x, generic IR"] = lambda k=_kernel(_dot_generic): k(xq, dx, w, out, cpu_quant._F16)
    if _has_avx2():
        ways["int8 x, vpmaddubsw"] = lambda k=_kernel(_dot_maddubs): k(xq, dx, w, out, cpu_quant._F16)
    print(f"Q5_0 {N} x {K}, 1 row, one thread, CPU time, minimum of {calls} calls")
    print("| product | ms | G values/s | max error / max |ref| |\n|---|---|---|---|")
    for name, run in ways.items():
        run()
        err = np.abs(out - ref).max() / np.abs(ref).max()
        best = float("inf")
        for _ in range(calls):
            t = time.thread_time()
            run()
            best = min(best, time.thread_time() - t)
        print(f"| {name} | {best * 1e3:.3f} | {N * K / best / 1e9:.1f} | {err:.1e} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=40)
    main(p.parse_args().calls)
