"""What ggml's grid for the K-quants would buy the int8 option's `ffn_down` products: x rounded per 256
values (Q8_K: one float32 scale a super-block) instead of per 32, the integer sub-block scales applied in
the integers, one float conversion a super-block. A measurement, not a kernel of the engine (x86 AVX2 only).

    per super-block b of a weight row:  I = sum over runs r of b: sum over its sub-blocks s of
                                            sc[s] * (q . xq over s)      (int32 lanes, vpmaddwd by sc)
                                        acc += (d * d8[b]) * float(I)                 (Q6_K, q signed)
                                        - (Q4_K) dmin * d8[b] * sum_s m[s] * sum(xq over s)
    Q6_K's q . xq as (q + 32) . xq - 32 * (pair sums of xq), in 16 bits before vpmaddwd, as ggml does

Printed, on the bundled model's down matrices (896 x 4864, Q6_K and Q4_K):

    error   on the down projections' real inputs (the float32 HF model's, on bench_cpu's prompt, every
            layer, every prompt token): max |y - y_f32| / max |y_f32| of each grid against the float32-x
            product of the same blocks (cpu_quant.linear), the worst layer and the median
    speed   Q6_K: this tree's per-32 kernel (kernels_numba.cpu_quant_int8) against the per-256 one,
            alternating in one process, 2 threads, 1 row, the first Q6_K matrix called --calls times (in
            cache); min / median over --rounds rounds, ms. (The Q4_K copy here gives the right numbers but
            runs ~4x slower than the per-32 kernel, a cause not found: its time says nothing of the grid.)

    python scripts/bench_cpu_int8_q8k.py [--rounds 7] [--calls 40]
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core.extending import intrinsic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kernels_numba import cpu_quant, cpu_quant_int8  # noqa: E402
from kernels_numba.cpu_quant import _F16  # noqa: E402
from kernels_numba.cpu_quant_int8 import _kq_half, _prefetch_in_step  # noqa: E402
from kernels_numba.cpu_simd import (_B32, _F8, _I32, _declare, _load, _ptr, f32x8, load_u16, load_u32,  # noqa: E402
                                    u8x32, vf_fma, vf_splat, vf_sum, vf_zero)
from kernels_numba.cpu_linear import numba_threads  # noqa: E402

_I16x16, _I32x8 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(_I32, 8)


@intrinsic
def _scaled_dot(typingctx, isum, u, xq, o, sub, o2, sc):
    """isum + vpmaddwd(vpmaddubsw(u, xq[o:o + 32]) - sub[o2:o2 + 16], sc): int32 lanes carried in an F32x8
    (bits, not values); sub: int16 pair sums x 32 (Q6_K) or an empty array (none); sc: 16 int16 scales
    carried in a U8x32."""
    def codegen(context, builder, sig, args):
        m = builder.module
        b = _load(builder, _ptr(context, builder, sig.args[2], args[2], args[3], _B32))
        p16 = builder.call(_declare(m, "llvm.x86.avx2.pmadd.ub.sw", _I16x16, _B32, _B32), [args[1], b])
        if sig.args[4].dtype == types.int16:
            p16 = builder.sub(p16, _load(builder, _ptr(context, builder, sig.args[4], args[4], args[5], _I16x16)))
        p32 = builder.call(_declare(m, "llvm.x86.avx2.pmadd.wd", _I32x8, _I16x16, _I16x16),
                           [p16, builder.bitcast(args[6], _I16x16)])
        return builder.bitcast(builder.add(builder.bitcast(args[0], _I32x8), p32), _F8)
    return f32x8(isum, u, xq, o, sub, o2, sc), codegen


@intrinsic
def _int_lanes(typingctx, isum):
    """The int32 lanes carried in an F32x8, converted to float32 (the one conversion a super-block)."""
    def codegen(context, builder, sig, args):
        return builder.sitofp(builder.bitcast(args[0], _I32x8), _F8)
    return f32x8(isum), codegen


@intrinsic
def _q6_scales16(typingctx, ary, idx):
    """The 8 signed bytes ary[idx:idx + 8] (a half's Q6_K sub-block scales) as four int16 vectors, the k-th
    [sc[2k] x8, sc[2k + 1] x8] (carried in U8x32)."""
    def codegen(context, builder, sig, args):
        b = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.IntType(8), 8)))
        w = builder.sext(b, ir.VectorType(ir.IntType(16), 8))
        u = ir.Constant(w.type, ir.Undefined)
        out = [builder.bitcast(builder.shuffle_vector(w, u, ir.Constant(ir.VectorType(_I32, 16),
                                                                        [2 * k] * 8 + [2 * k + 1] * 8)), _B32)
               for k in range(4)]
        return context.make_tuple(builder, sig.return_type, out)
    return types.UniTuple(u8x32, 4)(ary, idx), codegen


@intrinsic
def _q4_scales16(typingctx, word):
    """Bytes 0-3 of the uint64 word (four Q4_K sub-block scales, 0..63) each in 16 int16 lanes."""
    def codegen(context, builder, sig, args):
        w = builder.bitcast(context.cast(builder, args[0], sig.args[0], types.uint64), ir.VectorType(ir.IntType(8), 8))
        w = builder.zext(w, ir.VectorType(ir.IntType(16), 8))
        u = ir.Constant(w.type, ir.Undefined)
        out = [builder.bitcast(builder.shuffle_vector(w, u, ir.Constant(ir.VectorType(_I32, 16), [k] * 16)), _B32)
               for k in range(4)]
        return context.make_tuple(builder, sig.return_type, out)
    return types.UniTuple(u8x32, 4)(word), codegen


@njit(nogil=True, cache=True)
def quantize_q8k(x, xq, d8, x16, bs):
    """x float32 [K] per 256: d8 = amax / 127 (float32), xq = rint(x / d8); x16 = 32 x each pair's sum of xq
    (int16, Q6_K's - 32), bs = each 32 values' sum of xq (Q4_K's mins)."""
    for b in range(x.shape[0] // 256):
        amax = np.float32(0)
        for j in range(256):
            amax = max(amax, abs(x[256 * b + j]))
        inv = np.float32(127) / amax if amax > 0 else np.float32(0)
        d8[b] = amax / np.float32(127)
        for j in range(256):
            xq[256 * b + j] = np.int32(np.rint(x[256 * b + j] * inv))
    for i in range(x.shape[0] // 2):
        x16[i] = 32 * (np.int32(xq[2 * i]) + np.int32(xq[2 * i + 1]))
    for s in range(x.shape[0] // 32):
        t = 0
        for j in range(32):
            t += np.int32(xq[32 * s + j])
        bs[s] = t


def _rows_of(fmt):
    def rows(xq, d8, x16, bs, w, out, n0, n1, f16):
        B = d8.shape[0]
        none = np.zeros(0, np.uint8)
        for n in range(n0, n1):
            row, ahead = w[n], w[min(n + 2, n1 - 1)]
            acc = vf_zero()
            mins = np.float32(0)
            for b in range(B):
                isum = vf_zero()
                if fmt == cpu_quant._Q6_K:
                    d = f16[load_u16(row, b * 210 + 208)]
                    for h in range(2):
                        _prefetch_in_step(ahead, 2 * b + h)
                        q = _kq_half(fmt, row, 2 * b + h)
                        sc = _q6_scales16(row, b * 210 + 192 + 8 * h)
                        o = 256 * b + 128 * h
                        for i in range(4):
                            isum = _scaled_dot(isum, q[i], xq, o + 32 * i, x16, (o + 32 * i) >> 1, sc[i])
                else:
                    p = b * 144
                    d, dmin = f16[load_u16(row, p)], f16[load_u16(row, p + 2)]
                    w0, w1, w2 = load_u32(row, p + 4), load_u32(row, p + 8), load_u32(row, p + 12)
                    lo6, nib, top2 = np.uint64(0x3F3F3F3F), np.uint64(0x0F0F0F0F), np.uint64(0x30303030)
                    sc8 = (w0 & lo6) | (((w2 & nib) | ((w0 >> np.uint64(2)) & top2)) << np.uint64(32))
                    m8 = (w1 & lo6) | ((((w2 >> np.uint64(4)) & nib) | ((w1 >> np.uint64(2)) & top2)) << np.uint64(32))
                    for h in range(2):
                        _prefetch_in_step(ahead, 2 * b + h)
                        q = _kq_half(fmt, row, 2 * b + h)
                        sc = _q4_scales16(sc8 >> np.uint64(32 * h))
                        o = 256 * b + 128 * h
                        for i in range(4):
                            isum = _scaled_dot(isum, q[i], xq, o + 32 * i, none, 0, sc[i])
                    t = 0
                    for s in range(8):
                        t += np.int64((m8 >> np.uint64(8 * s)) & np.uint64(255)) * bs[8 * b + s]
                    mins += dmin * d8[b] * np.float32(t)
                acc = vf_fma(vf_splat(d * d8[b]), _int_lanes(isum), acc)
            out[n] = vf_sum(acc) - mins
    return njit(nogil=True, cache=True)(rows)


_ROWS6, _ROWS4 = _rows_of(cpu_quant._Q6_K), _rows_of(cpu_quant._Q4_K)


@njit(parallel=True, nogil=True, cache=True)
def _run(nt, fmt, w, x, out, f16):
    K = x.shape[0]
    xq, d8 = np.empty(K, np.int8), np.empty(K // 256, np.float32)
    x16, bs = np.empty(K // 2, np.int16), np.empty(K // 32, np.int32)
    quantize_q8k(x, xq, d8, x16, bs)
    N = w.shape[0]
    per = -(-N // nt)
    for t in prange(nt):
        if fmt == cpu_quant._Q6_K:
            _ROWS6(xq, d8, x16, bs, w, out, t * per, min(N, (t + 1) * per), f16)
        else:
            _ROWS4(xq, d8, x16, bs, w, out, t * per, min(N, (t + 1) * per), f16)


def linear_q8k(x, w, fmt, threads=2):
    """x float32 [1, K] (one row) -> [1, N] with x rounded per 256."""
    out = np.empty(w.shape[0], np.float32)
    _run(numba_threads(threads), cpu_quant._CODE[fmt], w, np.ascontiguousarray(x[0], np.float32), out, _F16)
    return torch.from_numpy(out[None])


def down_inputs():
    """{layer: float32 [T, 4864]}: the float32 HF model's inputs to each layer's down projection on
    bench_cpu's prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedattn.bundled import bundled_model_path
    from scripts.bench_cpu import ONE_PROMPT, chat

    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got = {}
    for i, layer in enumerate(hf.model.layers):
        layer.mlp.down_proj.register_forward_pre_hook(lambda mod, a, i=i: got.__setitem__(i, a[0][0].clone()))
    with torch.no_grad():
        hf(torch.tensor([chat(tok, ONE_PROMPT)]))
    return got


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=40)
    a = p.parse_args()
    from bench_cpu_int8_kquant import down_matrices

    torch.set_num_threads(2)
    mats = down_matrices()
    # error, on the real inputs
    xs = down_inputs()
    errs = {"per 32 (the option)": [], "per 256 (Q8_K grid)": []}
    for layer, fmt, w in mats:
        x = xs[layer]
        ref = cpu_quant.linear(x, w, fmt).double()
        scale = ref.abs().max(1).values
        y32 = torch.cat([cpu_quant_int8.linear(x[t:t + 16], w, fmt) for t in range(0, x.shape[0], 16)])  # <= 16 rows:
        e32 = ((y32.double() - ref).abs().max(1).values / scale).max().item()                              # int8 x
        e256 = max(((linear_q8k(x[t:t + 1], w, fmt).double() - ref[t:t + 1]).abs().max() / scale[t]).item()
                   for t in range(x.shape[0]))
        errs["per 32 (the option)"].append(e32)
        errs["per 256 (Q8_K grid)"].append(e256)
    print(f"error against the float32-x product, max |dy| / max |y| over the prompt's {x.shape[0]} tokens, per layer:")
    for k, v in errs.items():
        print(f"  {k}: median {statistics.median(v):.2e}, worst {max(v):.2e} (layer {int(np.argmax(v))})")
    # speed
    x = torch.randn(1, 4864, generator=torch.Generator().manual_seed(0)) * 0.1
    ways = {"per 32 (this tree)": lambda w, fmt: cpu_quant_int8.linear(x, w, fmt, num_threads=2),
            "per 256": lambda w, fmt: linear_q8k(x.numpy(), w, fmt)}
    w = next(m for m in mats if m[1] == "Q6_K")[2]
    tasks = {"Q6_K in cache": [(w, "Q6_K")] * a.calls}
    times = {(t, k): [] for t in tasks for k in ways}
    for i in range(a.rounds + 1):
        for t, calls in tasks.items():
            for k, f in list(ways.items())[::1 if i % 2 else -1]:
                t0 = time.perf_counter()
                for w, fmt in calls:
                    f(w, fmt)
                times[t, k].append((time.perf_counter() - t0) / len(calls))
    print(f"\n1 row, 2 threads, {a.rounds} rounds, ms (min / median); load {os.getloadavg()[0]:.2f}")
    print("| | " + " | ".join(ways) + " |\n|---|" + "---|" * len(ways))
    for t in tasks:
        print(f"| {t} | " + " | ".join(f"{min(times[t, k][1:]) * 1e3:.3f} / {statistics.median(times[t, k][1:]) * 1e3:.3f}"
                                      for k in ways) + " |")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
