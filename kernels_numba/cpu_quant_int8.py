"""y = x W^T (+ b) with W in a GGUF block format and x rounded to int8: llama.cpp's method, on the CPU, by numba.

An option beside kernels_numba/cpu_quant.py (whose products are the dequantized float32 matrix's), not a
replacement: rounding x to 8 bits changes the function (outputs off by ~1e-3 of their scale; greedy tokens
may differ from the float32 model's). What it buys is arithmetic: a run's 32 products become two integer
instructions on AVX2 instead of an int -> float conversion and a float FMA per value.

Activations (`quantize_rows`), per input row, per block of 32 values, as ggml quantizes a row to Q8_0
on AVX2:

    amax = max |x[32r:32r+32]|,  xq = round-half-even(x * (127 / amax)) (int8, |xq| <= 127; 0 where amax = 0)
    dx = fp16(amax / 127) as float32,  xs = dx * sum(xq)   (xs: Q4_K's mins)
    xl[8r + k] = 32 * (xq[32r+4k] + ... + xq[32r+4k+3])   (int32: Q6_K's - 32, below)

One block size for every weight format: ggml pairs its K-quants with Q8_K activations (one float32
scale per 256 values); here the K-quants' runs of 32 (a Q4_K sub-block, two Q6_K sub-blocks of 16) take
the same 32-value blocks as Q8_0 / Q5_0, a finer grid and one quantized x for a fused layer whose parts
differ in format (q / k / v: Q5_0 and Q8_0).

The product, per weight row n, run r (the weight's integers q, as cpu_quant's dequantizer reads them):

    lane k of dot4(q, xq[32r:32r+32]) = the exact integer sum of products 4k..4k+3   (k = 0..7)
    acc += [lo, lo, lo, lo, hi, hi, hi, hi] * dx[r] * float(lanes)    (lo == hi but for Q6_K)
    out[m, n] = sum of acc's lanes - (Q4_K) sum over runs of mn[r] * xs[r] (+ bias)

Q8_0 and Q5_0 go a run at a time with the signed q of cpu_quant's `_run_values` (on AVX2 the sign moved
onto xq with vpsignb, as llama.cpp does, because the byte multiply-add takes one unsigned operand). The
K-quants go half a super-block (four runs, 128 values) at a time, unpacked as ggml does: the runs of a
half share their loads (Q6_K: one 32-byte load of qh gives the high bits of all four), and each run's
nibble and bit fields are constant shifts and masks. Their values are unsigned, Q4_K's q (0..15) and
Q6_K's q + 32 (0..63), so the byte products need no sign moved; for Q6_K

    lane k of dot4(q, xq) = lane k of dot4(q + 32, xq) - xl[8r + k]

(exact integers either way, so the lanes, and every float32 result after them, are the signed product's
bit for bit). The float work per run is unchanged (one conversion, dx's multiply, the FMA by the weight
scales): applying Q6_K's integer sub-block scales before the conversion would round differently, and
summing a super-block's runs in integers before one conversion, as ggml's Q8_K does, needs one
activation scale per 256 values. The Q6_K scales d * sc are formed 8 at a time in vectors in the loop,
Q4_K's lo / mn a super-block at a time from its 12 packed bytes (32-bit words, as ggml's kmasks); both
are reference/quant.py's float32 products. While a row's halves run, the row after next is asked for
two cache lines a half (from memory, the whole row's lines asked for at its start left the K-quant
products at ~0.6x their speed in cache).

The integer sums are written twice (kernels_numba/cpu_simd.py): with x86 AVX2's vpmaddubsw + vpmaddwd
where the CPU numba compiles for has AVX2 (`AVX2`), in target-independent LLVM IR otherwise (`linear`'s
avx2=False takes it anywhere); both give the same integers, so the same float32 results
(tests/test_cpu_quant_int8.py). reference/quant.py: quantize_rows_int8 / linear_int8 do the same in numpy.

At most cpu_quant.MAX_ROWS input rows; `linear_parts` hands larger calls (a prefill) to cpu_quant's
float32 tiles. Threads: the output features cut into one contiguous range per thread, as cpu_quant.
"""
import numpy as np
import torch
from numba import njit, prange

from kernels_numba import cpu_quant
from kernels_numba.cpu_quant import (_F16, _Q4_K, _Q5_0, _Q6_K, _Q8_0, PREFETCH_ROWS, _lo, _prefetch_row,
                                     _run_values, _store)
from kernels_numba.cpu_simd import (f32_bits, f32_from_bits, load_u16, load_u32, prefetch, target_has_avx2, vb_and,
                                    vb_dot4, vb_dot4_avx2, vb_load, vb_or, vb_shl, vb_shr, vb_udot4, vb_udot4_avx2,
                                    vb_udot4_minus, vb_udot4_minus_avx2, vf_bytes, vf_fma, vf_i8, vf_mul,
                                    vf_mul_rounded, vf_splat, vf_spread_pairs, vf_store, vf_sum, vf_zero)
from kernels_numba.cpu_linear import numba_threads, product_threads
from kernels_numba.errors import KernelLaunchError

# the integer products' spelling: AVX2's byte multiply-adds where the compile target has them
AVX2 = target_has_avx2()


@njit(inline="always")
def _round_to_f16(v):
    """The float32 v rounded to the nearest fp16 (ties to even), as float32: normal fp16 range by
    rounding the mantissa to 10 bits, subnormal fp16 (|v| < 2^-14) to a multiple of 2^-24; v >= 0."""
    if v < np.float32(6.103515625e-05):
        return np.float32(np.rint(v * np.float32(16777216.0))) * np.float32(5.9604644775390625e-08)
    u = f32_bits(v)
    u = (u + np.uint32(0xFFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return f32_from_bits(u)


@njit(cache=True, nogil=True, inline="always")
def _quantize_rows(x, xq, dx, xs, xl):
    """xq int8 [M, K], dx / xs float32 [M, K // 32], xl int32 [M, K // 4] from x float32 [M, K] (module
    docstring)."""
    M, K = x.shape
    for m in range(M):
        for r in range(K // 32):
            o = 32 * r
            amax = np.float32(0)
            for j in range(32):
                amax = max(amax, abs(x[m, o + j]))
            inv = np.float32(127) / amax if amax > 0 else np.float32(0)
            s = 0
            for j in range(32):
                q = np.int32(np.rint(x[m, o + j] * inv))
                xq[m, o + j] = q
                s += q
            dx[m, r] = _round_to_f16(amax / np.float32(127))
            xs[m, r] = dx[m, r] * np.float32(s)
            for k in range(8):
                j = o + 4 * k
                xl[m, 8 * r + k] = 32 * (np.int32(xq[m, j]) + np.int32(xq[m, j + 1]) + np.int32(xq[m, j + 2])
                                         + np.int32(xq[m, j + 3]))


def quantize_rows(x):
    """(xq int8 [M, K], dx float32 [M, K // 32], xs float32 [M, K // 32], xl int32 [M, K // 4]) of x float32
    [M, K], K a multiple of 32: x's blocks of 32 rounded to int8 with their fp16 scales, each block's
    dx * sum(xq), and 32 x each 4 values' sum of xq (Q6_K's - 32, moved onto x)."""
    xa = cpu_quant._check(x, "x", np.float32, 2)
    if xa.shape[1] % 32:
        raise KernelLaunchError(f"x: {xa.shape[1]} input features, not a multiple of 32")
    M, K = xa.shape
    xq, dx, xs = np.empty((M, K), np.int8), np.empty((M, K // 32), np.float32), np.empty((M, K // 32), np.float32)
    xl = np.empty((M, K // 4), np.int32)
    _quantize_rows(xa, xq, dx, xs, xl)
    return xq, dx, xs, xl


@njit(inline="always")
def _run_idot(fmt, avx2, q, xq, xl, o, ws, d, acc):
    """acc + ws * (d * dot4(q, xq[o:o + 32])): a run's integer sums times its activation scale d, then its
    weight scales ws ([lo x4, hi x4]: Q6_K's scale per 16 values; the other formats' lo == hi). Q6_K's q
    comes unsigned (q + 32, 0..63) and its lanes less 32 x their sums of xq (xl[o // 4:]): q's lanes."""
    b = vb_load(xq, o)
    if fmt == _Q6_K:
        s = vb_udot4_minus_avx2(q, b, xl, o >> 2) if avx2 else vb_udot4_minus(q, b, xl, o >> 2)
    elif fmt == _Q4_K:                                # q 0..15: no sign to move
        s = vb_udot4_avx2(q, b) if avx2 else vb_udot4(q, b)
    else:
        s = vb_dot4_avx2(q, b) if avx2 else vb_dot4(q, b)
    return vf_fma(ws, vf_mul(vf_splat(d), s), acc)


@njit(inline="always")
def _store4(fmt, a0, a1, a2, a3, m, n, mn, xs, bias, has_bias, out):
    """_store of input rows m..m+3's accumulators for output feature n."""
    _store(fmt, vf_sum(a0), m, n, mn, xs, bias, has_bias, out)
    _store(fmt, vf_sum(a1), m + 1, n, mn, xs, bias, has_bias, out)
    _store(fmt, vf_sum(a2), m + 2, n, mn, xs, bias, has_bias, out)
    _store(fmt, vf_sum(a3), m + 3, n, mn, xs, bias, has_bias, out)


def _rows_of(fmt, avx2):
    """The Q8_0 / Q5_0 rows for one format and one spelling of the integer sums (constants of the compiled
    copy, so their branches fold away); the body is the closure's own, as in cpu_quant._rows_of."""
    def rows(xq, dx, xs, xl, w, bias, out, n0, n1, col, f16):
        """out[:, col + n] = the int8 product of rows n0..n1-1 of w (uint8 [N, bytes_per_row]) with xq int8
        [M * K] (flat), dx / xs float32 [M, K // 32]; 4 input rows at a time, as cpu_quant's rows."""
        M, R = dx.shape
        K = 32 * R
        has_bias = bias.shape[0] > 0
        mn = np.zeros(0, np.float32)                     # no mins (_store reads them for Q4_K only)
        M4 = M - M % 4
        for n in range(n0, n1):
            row = w[n]
            if n + PREFETCH_ROWS < n1:                   # the row after next on its way from memory meanwhile
                _prefetch_row(w[n + PREFETCH_ROWS])
            for m in range(0, M4, 4):
                a0, a1, a2, a3 = vf_zero(), vf_zero(), vf_zero(), vf_zero()
                for r in range(R):
                    q = _run_values(fmt, row, r)
                    ws = vf_splat(_lo(fmt, row, r, mn, f16))     # the block's fp16 d (`lo` unread)
                    o = m * K + 32 * r
                    a0 = _run_idot(fmt, avx2, q, xq, xl, o, ws, dx[m, r], a0)
                    a1 = _run_idot(fmt, avx2, q, xq, xl, o + K, ws, dx[m + 1, r], a1)
                    a2 = _run_idot(fmt, avx2, q, xq, xl, o + 2 * K, ws, dx[m + 2, r], a2)
                    a3 = _run_idot(fmt, avx2, q, xq, xl, o + 3 * K, ws, dx[m + 3, r], a3)
                _store4(fmt, a0, a1, a2, a3, m, col + n, mn, xs, bias, has_bias, out)
            for m in range(M4, M):
                a0 = vf_zero()
                for r in range(R):
                    ws = vf_splat(_lo(fmt, row, r, mn, f16))
                    a0 = _run_idot(fmt, avx2, _run_values(fmt, row, r), xq, xl, m * K + 32 * r, ws, dx[m, r], a0)
                _store(fmt, vf_sum(a0), m, col + n, mn, xs, bias, has_bias, out)
    return njit(cache=True, nogil=True)(rows)


# ---- the K-quants: a half super-block (128 values, four runs) at a time ----------------------------------
# A super-block of 256 values is two halves of four runs; the runs of a half share their loads (Q6_K: 64
# bytes of ql and 32 of qh, Q4_K: 64 bytes of qs), and each run's place in the half is a constant, so its
# nibble and bit fields are fixed shifts and masks (as ggml unpacks them). Q6_K's values come unsigned.

@njit(inline="always")
def _kq_half(fmt, row, hb):
    """The four runs of half hb (super-block hb // 2, half hb % 2) of the row in byte lanes, unsigned:
    Q6_K q + 32 (0..63: four low bits from ql, two high bits from qh), Q4_K q (0..15)."""
    b, h = hb >> 1, hb & 1
    if fmt == _Q6_K:
        p = b * 210 + 64 * h
        ql0, ql1, qh = vb_load(row, p), vb_load(row, p + 32), vb_load(row, b * 210 + 128 + 32 * h)
        return (vb_or(vb_and(ql0, 15), vb_shl(vb_and(qh, 3), 4)),          # qh bits 0-1 -> bits 4-5
                vb_or(vb_and(ql1, 15), vb_shl(vb_and(qh, 12), 2)),         # bits 2-3
                vb_or(vb_shr(ql0, 4), vb_and(qh, 48)),                     # bits 4-5
                vb_or(vb_shr(ql1, 4), vb_shr(vb_and(qh, 192), 2)))         # bits 6-7
    p = b * 144 + 16 + 64 * h                                              # Q4_K: sub-blocks 2c, 2c + 1 the
    q0, q1 = vb_load(row, p), vb_load(row, p + 32)                         # low, high nibbles of 32 bytes
    return vb_and(q0, 15), vb_shr(q0, 4), vb_and(q1, 15), vb_shr(q1, 4)


@njit(inline="always")
def _kq_scales(fmt, row, hb, lo, f16):
    """The weight scales of half hb's four runs, as _run_idot takes them: Q6_K [d * sc[2i] x4, d * sc[2i + 1]
    x4] for run i (the float32 products reference/quant.py forms), Q4_K lo[run] in every lane."""
    if fmt == _Q6_K:                                  # the half's 8 scales at once, then two to a run
        b, h = hb >> 1, hb & 1
        d = vf_splat(f16[load_u16(row, b * 210 + 208)])
        return vf_spread_pairs(vf_mul_rounded(d, vf_i8(row, b * 210 + 192 + 8 * h)))
    r = 4 * hb
    return vf_splat(lo[r]), vf_splat(lo[r + 1]), vf_splat(lo[r + 2]), vf_splat(lo[r + 3])


@njit(inline="always")
def _q4_k_scales(row, lo, mn, f16):
    """lo / mn [K // 32] of a Q4_K row: d * sc and dmin * m (reference/quant.py's float32 products), the
    8 six-bit pairs of a super-block unpacked from its 12 bytes in 32-bit words (q4_k_scale_min's layout:
    sc[0..3] / m[0..3] the low 6 bits of bytes 0-3 / 4-7; sc[4..7] / m[4..7] the low / high nibbles of
    bytes 8-11 with the top 2 bits of bytes 0-3 / 4-7 above them), 8 lanes at a time."""
    low6, nib, top2, two, four, half = (np.uint64(0x3F3F3F3F), np.uint64(0x0F0F0F0F), np.uint64(0x30303030),
                                        np.uint64(2), np.uint64(4), np.uint64(32))      # (uint64: numba's int64
    for b in range(lo.shape[0] // 8):                                                   # mixed in is a float)
        p = b * 144
        w0, w1, w2 = load_u32(row, p + 4), load_u32(row, p + 8), load_u32(row, p + 12)
        sc = (w0 & low6) | (((w2 & nib) | ((w0 >> two) & top2)) << half)
        m = (w1 & low6) | ((((w2 >> four) & nib) | ((w1 >> two) & top2)) << half)
        vf_store(lo, 8 * b, vf_mul_rounded(vf_splat(f16[load_u16(row, p)]), vf_bytes(sc)))
        vf_store(mn, 8 * b, vf_mul_rounded(vf_splat(f16[load_u16(row, p + 2)]), vf_bytes(m)))


@njit(inline="always")
def _kq_half_dot(fmt, avx2, q, ws, xq, xl, o, dxm, r, acc):
    """acc after the four runs r..r+3 (one half: q, ws from _kq_half / _kq_scales) of one input row (xq from
    o, its scales dxm), in run order."""
    acc = _run_idot(fmt, avx2, q[0], xq, xl, o, ws[0], dxm[r], acc)
    acc = _run_idot(fmt, avx2, q[1], xq, xl, o + 32, ws[1], dxm[r + 1], acc)
    acc = _run_idot(fmt, avx2, q[2], xq, xl, o + 64, ws[2], dxm[r + 2], acc)
    return _run_idot(fmt, avx2, q[3], xq, xl, o + 96, ws[3], dxm[r + 3], acc)


@njit(inline="always")
def _prefetch_in_step(ahead, hb):
    """Cache lines 2 hb and 2 hb + 1 of the row `ahead` (a half super-block is at most 128 bytes: Q6_K 105,
    Q4_K 72), so the row after next comes from memory in step with this row's halves. (Asking for a whole
    row's lines at its start, as _rows_of does, left the K-quant products from memory ~1.7x their time
    from cache: measured in docs/cpu.md.)"""
    p = 128 * hb
    if p < ahead.shape[0]:
        prefetch(ahead, p)
        if p + 64 < ahead.shape[0]:
            prefetch(ahead, p + 64)


def _kq_rows_of(fmt, avx2):
    """The Q6_K / Q4_K rows: `rows` of _rows_of, the runs taken a half super-block at a time. Every input
    row's runs go in the same order with the same operations as one at a time, and Q6_K's unsigned
    products less 32 x sum(xq) are its signed ones: the same float32 results bit for bit."""
    def rows(xq, dx, xs, xl, w, bias, out, n0, n1, col, f16):
        M, R = dx.shape
        K = 32 * R
        has_bias = bias.shape[0] > 0
        lo, mn = np.empty(R, np.float32), np.zeros(R, np.float32)
        M4 = M - M % 4
        for n in range(n0, n1):
            row, ahead = w[n], w[min(n + PREFETCH_ROWS, n1 - 1)]
            if fmt == _Q4_K:
                _q4_k_scales(row, lo, mn, f16)
            for m in range(0, M4, 4):
                a0, a1, a2, a3 = vf_zero(), vf_zero(), vf_zero(), vf_zero()
                for hb in range(R // 4):
                    _prefetch_in_step(ahead, hb)
                    q, ws = _kq_half(fmt, row, hb), _kq_scales(fmt, row, hb, lo, f16)
                    o = m * K + 128 * hb
                    a0 = _kq_half_dot(fmt, avx2, q, ws, xq, xl, o, dx[m], 4 * hb, a0)
                    a1 = _kq_half_dot(fmt, avx2, q, ws, xq, xl, o + K, dx[m + 1], 4 * hb, a1)
                    a2 = _kq_half_dot(fmt, avx2, q, ws, xq, xl, o + 2 * K, dx[m + 2], 4 * hb, a2)
                    a3 = _kq_half_dot(fmt, avx2, q, ws, xq, xl, o + 3 * K, dx[m + 3], 4 * hb, a3)
                _store4(fmt, a0, a1, a2, a3, m, col + n, mn, xs, bias, has_bias, out)
            for m in range(M4, M):
                a0 = vf_zero()
                for hb in range(R // 4):
                    _prefetch_in_step(ahead, hb)
                    a0 = _kq_half_dot(fmt, avx2, _kq_half(fmt, row, hb), _kq_scales(fmt, row, hb, lo, f16), xq, xl,
                                      m * K + 128 * hb, dx[m], 4 * hb, a0)
                _store(fmt, vf_sum(a0), m, col + n, mn, xs, bias, has_bias, out)
    return njit(cache=True, nogil=True)(rows)


# (format code, avx2) -> that format's rows, compiled for one spelling of the integer sums
ROWS = {(f, avx2): (_kq_rows_of if f in (_Q6_K, _Q4_K) else _rows_of)(f, avx2)
        for f in (_Q8_0, _Q5_0, _Q6_K, _Q4_K) for avx2 in (False, True)}
_q8_0, _q5_0, _q6_k, _q4_k = (ROWS[f, False] for f in (_Q8_0, _Q5_0, _Q6_K, _Q4_K))
_q8_0_avx2, _q5_0_avx2, _q6_k_avx2, _q4_k_avx2 = (ROWS[f, True] for f in (_Q8_0, _Q5_0, _Q6_K, _Q4_K))


@njit(inline="always")
def _quantized(x):
    """quantize_rows inside a kernel: (xq flat int8 [M * K], dx, xs, xl flat int32 [M * K // 4])."""
    M, K = x.shape
    xq, dx, xs = np.empty(M * K, np.int8), np.empty((M, K // 32), np.float32), np.empty((M, K // 32), np.float32)
    xl = np.empty(M * K // 4, np.int32)
    _quantize_rows(x, xq.reshape(M, K), dx, xs, xl.reshape(M, K // 4))
    return xq, dx, xs, xl


# The threaded drivers over a fused layer's parts: x quantized once, then the parts' output features cut
# into one contiguous range per thread. Two copies, one per spelling of the integer sums (module-level
# functions, so numba's cache keeps them); _run_avx2 is compiled only when called, where AVX2 is there.
@njit(parallel=True, cache=True, nogil=True)
def _run_generic(num_threads, fmts, parts, offsets, x, bias, out, f16):
    xq, dx, xs, xl = _quantized(x)
    N = offsets[-1]
    per = -(-N // num_threads)
    for t in prange(num_threads):
        a, e = t * per, min(N, (t + 1) * per)
        for p in range(len(parts)):
            n0, n1 = max(a, offsets[p]), min(e, offsets[p + 1])
            if n0 < n1:
                args = (xq, dx, xs, xl, parts[p], bias, out, n0 - offsets[p], n1 - offsets[p], offsets[p], f16)
                if fmts[p] == _Q8_0:
                    _q8_0(*args)
                elif fmts[p] == _Q5_0:
                    _q5_0(*args)
                elif fmts[p] == _Q6_K:
                    _q6_k(*args)
                else:
                    _q4_k(*args)


@njit(parallel=True, cache=True, nogil=True)
def _run_avx2(num_threads, fmts, parts, offsets, x, bias, out, f16):
    xq, dx, xs, xl = _quantized(x)
    N = offsets[-1]
    per = -(-N // num_threads)
    for t in prange(num_threads):
        a, e = t * per, min(N, (t + 1) * per)
        for p in range(len(parts)):
            n0, n1 = max(a, offsets[p]), min(e, offsets[p + 1])
            if n0 < n1:
                args = (xq, dx, xs, xl, parts[p], bias, out, n0 - offsets[p], n1 - offsets[p], offsets[p], f16)
                if fmts[p] == _Q8_0:
                    _q8_0_avx2(*args)
                elif fmts[p] == _Q5_0:
                    _q5_0_avx2(*args)
                elif fmts[p] == _Q6_K:
                    _q6_k_avx2(*args)
                else:
                    _q4_k_avx2(*args)


def linear(x, blocks, fmt, bias=None, num_threads=None, avx2=None):
    """x [M, K] @ W[N, K]^T (+ bias) -> float32 torch tensor [M, N] with x rounded to int8 per block of 32;
    the arguments as cpu_quant.linear's. avx2: the integer sums' spelling (default AVX2; True raises
    KernelLaunchError where the target has no AVX2)."""
    return linear_parts(x, [(blocks, fmt)], bias, num_threads, avx2)


def linear_parts(x, parts, bias=None, num_threads=None, avx2=None, tile_dtype=torch.float32,
                 max_rows=cpu_quant.MAX_ROWS):
    """cpu_quant.linear_parts with int8 activations: x quantized once for every part (parts: a list or a
    cpu_quant.Parts). Above max_rows rows (a prefill): cpu_quant's tiles in tile_dtype (x not rounded to
    int8); max_rows None: the block kernel at any row count (a row's result is the same at every count)."""
    xa = cpu_quant._check(x, "x", np.float32, 2, contiguous=False)
    if max_rows is not None and xa.shape[0] > max_rows:
        return cpu_quant.linear_parts(xa, parts, bias, num_threads, tile_dtype)
    xa = np.ascontiguousarray(xa)
    avx2 = AVX2 if avx2 is None else avx2
    if avx2 and not target_has_avx2():
        raise KernelLaunchError("avx2: the CPU numba compiles for has no AVX2 (NUMBA_CPU_NAME / the host)")
    parts = parts if isinstance(parts, cpu_quant.Parts) else cpu_quant.Parts(parts)
    parts.check_input(xa)
    if xa.shape[1] % 32:
        raise KernelLaunchError(f"x: {xa.shape[1]} input features, not a multiple of 32")
    ba = cpu_quant._bias(bias, parts.N)
    out = torch.empty(xa.shape[0], parts.N, dtype=torch.float32)
    threads = num_threads or torch.get_num_threads()
    run = _run_avx2 if avx2 else _run_generic
    run(numba_threads(product_threads(threads, parts.N)), *parts.kernel_args, xa, ba,
        out.numpy(), _F16)
    return out
