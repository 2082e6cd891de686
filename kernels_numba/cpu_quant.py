"""y = x W^T (+ b) with W kept in a GGUF block format (Q8_0, Q5_0, Q6_K, Q4_K), on the CPU, by numba.

A decode step on a CPU is bound by the weight bytes it reads and by the arithmetic on them: float32
weights are 4 bytes a value, the GGUF blocks 1.06 (Q8_0), 0.69 (Q5_0), 0.82 (Q6_K) and 0.56 (Q4_K). The
product reads the blocks as stored, in one pass, 32 values (a "run": values sharing their scales) at a
time:

    for each weight row n (one thread's contiguous share of the output features):
        for each run r of the row (a Q8_0 / Q5_0 block, a Q4_K sub-block, two Q6_K sub-blocks of 16):
            q[0:32] = the run's integers, unpacked in 32 byte lanes          (nibbles, high bits, - 16 / - 32)
            q -> four 8-lane float32 vectors (exact: |q| <= 128)
            acc += lo * (q[0:16] . x[32r:32r+16]) + hi * (q[16:32] . x[32r+16:32r+32])   8 lanes of sums
        out[m, n] = sum of acc's 8 lanes - (Q4_K) sum over runs of mn[r] * sum(x of run r) (+ bias)

lo / hi / mn are the float32 scale products reference/quant.py forms (d, d * scales[s], d * sc,
dmin * m), so this is the product with the dequantized float32 matrix, with the scale applied to a run's
partial sum rather than to each value: the results differ from a float32 GEMM on the dequantized matrix
by float32 rounding only (tests/test_cpu_quant.py bounds it). Input rows go 4 at a time (each run
unpacked once for the 4), then one by one, with the same operations in the same order for every row, so
a row's result depends neither on the other rows nor on the thread count.

The unpacking is written in kernels_numba/cpu_simd.py's fixed-width vectors (numba intrinsics emitting
LLVM vector IR): numba types integer arithmetic on scalars at 64 bits, and a scalar loop over bytes
vectorises in 64-bit lanes or not at all. Each format has its own compiled copy (`_rows_of`), so the
format's branches fold away. A fused layer's parts (q / k / v in Q5_0 and Q8_0, gate / up) run in one
call, `linear_parts`, their outputs written into their columns of one result.

`dequantize` and `embedding` give the blocks' float32 values bit for bit: the same runs and scales, each
value lo / hi * q (Q4_K: sc * q - mn) rounded on its own (fp16 scales through a table of all 65536, so
subnormals, inf and NaN are kept). Above MAX_ROWS input rows (a prefill) `linear` dequantizes tiles of
TILE_VALUES weights (whole rows) at a time into one buffer and multiplies them with torch's GEMM.

Threads: the output features (of all parts) are cut into one contiguous range per thread of numba's
parallel loop, as in cpu_linear.
"""
import functools

import numpy as np
import torch
from numba import njit, prange

from kernels_numba.cpu_simd import (load_u16, load_u32, prefetch, vb_add, vb_and, vb_bits, vb_load, vb_nibbles, vb_or,
                                     vb_shl, vb_shr, vb_sub, vb_to_f32, vf_add, vf_fma, vf_load, vf_mul, vf_mul_rounded,
                                     vf_splat, vf_store, vf_sub_rounded, vf_sum, vf_zero)
from kernels_numba.cpu_linear import numba_threads, product_threads
from kernels_numba.errors import KernelLaunchError

MAX_ROWS = 16                # above: `linear` dequantizes tiles of W and runs torch's GEMM
TILE_VALUES = 1 << 20        # weights per dequantized tile above MAX_ROWS: 4 MB of float32, in cache while the
                             # GEMM reads it (1024 rows at K = 896, 128 at K = 4864; >= 1024 rows from 128 rows of x)

KERNEL_PARTS = 3             # parts of a fused layer (q / k / v) every kernel call is padded to

# format name -> (code used inside the kernels, values per block, bytes per block)
FORMATS = {"Q8_0": (0, 32, 34), "Q5_0": (1, 32, 22), "Q6_K": (2, 256, 210), "Q4_K": (3, 256, 144)}
_Q8_0, _Q5_0, _Q6_K, _Q4_K = 0, 1, 2, 3

# every fp16 bit pattern's float32 value (256 KB; a model's scales touch a few of its lines)
_F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


# ---- the product: one pass over the blocks, 32 values (one run) at a time ----------------------------
# A run is 32 consecutive values of a weight row that share their scales: a Q8_0 / Q5_0 block, a Q4_K
# sub-block, two Q6_K sub-blocks of 16 (scale `lo` for values 0-15, `hi` for 16-31). Its values are
# lo/hi * q - mn with q a small integer, so a run's share of a dot product with x is
#     lo * (q[0:16] . x[0:16]) + hi * (q[16:32] . x[16:32]) - mn * sum(x[0:32])
# q is unpacked in 32 byte lanes (cpu_simd), converted exactly to float32 and multiplied with x in 8-lane
# float32 vectors; sum(x) of every run is computed once per call (xsum), and only Q4_K has an mn.

@njit(inline="always")
def _run_values(fmt, row, r):
    """The 32 integers q of run r of the row (uint8 [bytes_per_row]) in byte lanes, read as signed."""
    if fmt == _Q8_0:                                 # int8 as stored
        return vb_load(row, r * 34 + 2)
    if fmt == _Q5_0:                                 # a nibble, a fifth bit from qh, minus 16
        p = r * 22                                   # (nibble | bit << 4) - 16 = nibble + (bit ? 0 : -16)
        return vb_add(vb_nibbles(row, p + 6), vb_bits(load_u32(row, p + 2), 0, 256 - 16))
    if fmt == _Q6_K:                                 # 4 low bits from ql, 2 high bits from qh, minus 32
        b, h, i = r >> 3, (r >> 2) & 1, r & 3        # super-block, its half, the run in the half
        ql = vb_load(row, b * 210 + 64 * h + 32 * (i & 1))
        ql = vb_and(vb_shr(ql, 4) if i >= 2 else ql, 15)
        qh = vb_and(vb_shr(vb_load(row, b * 210 + 128 + 32 * h), 2 * i), 3)
        return vb_sub(vb_or(ql, vb_shl(qh, 4)), 32)
    b, s = r >> 3, r & 7                             # Q4_K: sub-blocks 2c, 2c + 1 the low, high nibbles
    q = vb_load(row, b * 144 + 16 + 32 * (s >> 1))
    return vb_and(vb_shr(q, 4) if s & 1 else q, 15)


PREFETCH_ROWS = 2            # the product asks for row n + 2's cache lines while it computes row n


@njit(inline="always")
def _prefetch_row(row):
    for b in range(0, row.shape[0], 64):
        prefetch(row, b)


@njit(inline="always")
def _run_scales(fmt, row, lo, hi, mn, f16):
    """lo / hi / mn [K // 32] of every run of the row: the same float32 products reference/quant.py
    forms (d, d * scales[s], d * sc and dmin * m); f16 is the fp16 -> float32 table (_F16)."""
    R = lo.shape[0]
    if fmt == _Q8_0 or fmt == _Q5_0:
        step = 34 if fmt == _Q8_0 else 22
        for r in range(R):
            lo[r] = hi[r] = f16[load_u16(row, r * step)]
    elif fmt == _Q6_K:
        for b in range(R // 8):
            p = b * 210
            d = f16[load_u16(row, p + 208)]
            for t in range(8):                       # run t: sub-blocks 2t, 2t + 1
                lo[8 * b + t] = d * np.float32((np.int32(row[p + 192 + 2 * t]) ^ 128) - 128)
                hi[8 * b + t] = d * np.float32((np.int32(row[p + 193 + 2 * t]) ^ 128) - 128)
    else:
        for b in range(R // 8):
            p = b * 144
            d, dmin = f16[load_u16(row, p)], f16[load_u16(row, p + 2)]
            q = p + 4                                # the 12 packed scale bytes
            for s in range(8):
                if s < 4:
                    sc = np.int32(row[q + s]) & 63
                    m = np.int32(row[q + s + 4]) & 63
                else:
                    sc = (np.int32(row[q + s + 4]) & 15) | ((np.int32(row[q + s - 4]) >> 6) << 4)
                    m = (np.int32(row[q + s + 4]) >> 4) | ((np.int32(row[q + s]) >> 6) << 4)
                lo[8 * b + s] = hi[8 * b + s] = d * np.float32(sc)
                mn[8 * b + s] = dmin * np.float32(m)


@njit(inline="always")
def _row_scales(fmt, row, lo, hi, mn, f16):
    """_run_scales for the K-quants, whose scales take several steps to form; a Q8_0 / Q5_0 run's one
    fp16 scale is read inside the product's loop instead (_lo), so nothing is stored and loaded back
    (measured: 15-20% of a Q5_0 product's time; for Q6_K, forming d * scales[s] in the loop was slower)."""
    if fmt == _Q6_K or fmt == _Q4_K:
        _run_scales(fmt, row, lo, hi, mn, f16)


@njit(inline="always")
def _lo(fmt, row, r, lo, f16):
    """Run r's scale lo, the float32 _run_scales forms: Q8_0 / Q5_0 the block's fp16 d, read here;
    the K-quants _run_scales' lo[r]."""
    if fmt == _Q8_0:
        return f16[load_u16(row, r * 34)]
    if fmt == _Q5_0:
        return f16[load_u16(row, r * 22)]
    return lo[r]


@njit(inline="always")
def _run_dot(fmt, q0, q1, q2, q3, xm, o, lo, hi, acc):
    """acc + lo * (q[0:16] . x[o:o+16]) + hi * (q[16:32] . x[o+16:o+32]), in 8 lanes (Q6_K's two scales;
    the other formats' lo == hi: acc + lo * (q . x[o:o+32]))."""
    a = vf_fma(q1, vf_load(xm, o + 8), vf_mul(q0, vf_load(xm, o)))
    if fmt == _Q6_K:
        b = vf_fma(q3, vf_load(xm, o + 24), vf_mul(q2, vf_load(xm, o + 16)))
        return vf_fma(vf_splat(hi), b, vf_fma(vf_splat(lo), a, acc))
    a = vf_fma(q3, vf_load(xm, o + 24), vf_fma(q2, vf_load(xm, o + 16), a))
    return vf_fma(vf_splat(lo), a, acc)


def _rows_of(fmt):
    """The product's rows for one format: fmt is a constant of the compiled copy, so its branches fold away.
    The body is the closure's own rather than an inlined shared function: numba inlines by copying the
    callee's IR, and copying this loop nest took ~5 s of a format's ~8 s first compile."""
    def rows(x, xsum, w, bias, out, n0, n1, col, f16):
        """out[:, col + n] = x @ dequant(w[n]) (+ bias[col + n] when bias has any element), n in n0..n1-1.

        x float32 [M, K], xsum float32 [M, K // 32] (each run's sum of x), w uint8 [N, bytes_per_row].
        Input rows go 4 at a time (each run's q converted once for the 4), then one at a time; every row's
        sums are the same operations in the same order either way, so a row's result does not depend on
        the other rows of x."""
        M, K = x.shape
        R = K // 32
        has_bias = bias.shape[0] > 0
        lo, hi, mn = np.empty(R, np.float32), np.empty(R, np.float32), np.zeros(R, np.float32)
        xf = x.reshape(M * K)                            # row m at m * K (one view: no per-run array views)
        M4 = M - M % 4
        for n in range(n0, n1):
            row = w[n]
            if n + PREFETCH_ROWS < n1:                   # the row after next on its way from memory meanwhile
                _prefetch_row(w[n + PREFETCH_ROWS])
            _row_scales(fmt, row, lo, hi, mn, f16)
            for m in range(0, M4, 4):                    # 4 input rows: 4 x 8 partial sums in registers
                a0, a1, a2, a3 = vf_zero(), vf_zero(), vf_zero(), vf_zero()
                for r in range(R):
                    q0, q1, q2, q3 = vb_to_f32(_run_values(fmt, row, r))
                    o, d = m * K + 32 * r, _lo(fmt, row, r, lo, f16)
                    a0 = _run_dot(fmt, q0, q1, q2, q3, xf, o, d, hi[r], a0)
                    a1 = _run_dot(fmt, q0, q1, q2, q3, xf, o + K, d, hi[r], a1)
                    a2 = _run_dot(fmt, q0, q1, q2, q3, xf, o + 2 * K, d, hi[r], a2)
                    a3 = _run_dot(fmt, q0, q1, q2, q3, xf, o + 3 * K, d, hi[r], a3)
                _store(fmt, vf_sum(a0), m, col + n, mn, xsum, bias, has_bias, out)
                _store(fmt, vf_sum(a1), m + 1, col + n, mn, xsum, bias, has_bias, out)
                _store(fmt, vf_sum(a2), m + 2, col + n, mn, xsum, bias, has_bias, out)
                _store(fmt, vf_sum(a3), m + 3, col + n, mn, xsum, bias, has_bias, out)
            for m in range(M4, M):                       # the rest (a decode step of one sequence: M = 1)
                a0 = vf_zero()
                for r in range(R):
                    q0, q1, q2, q3 = vb_to_f32(_run_values(fmt, row, r))
                    a0 = _run_dot(fmt, q0, q1, q2, q3, xf, m * K + 32 * r, _lo(fmt, row, r, lo, f16), hi[r], a0)
                _store(fmt, vf_sum(a0), m, col + n, mn, xsum, bias, has_bias, out)
    return njit(cache=True, nogil=True)(rows)


@njit(inline="always")
def _store(fmt, s, m, c, mn, xsum, bias, has_bias, out):
    """out[m, c] = s (- Q4_K's mins: sum over runs of mn * sum(x of the run)) (+ bias[c])."""
    if fmt == _Q4_K:
        R = mn.shape[0]
        R8 = R - R % 8
        xs = xsum[m]
        t8 = vf_zero()
        for r in range(0, R8, 8):
            t8 = vf_fma(vf_load(mn, r), vf_load(xs, r), t8)
        t = vf_sum(t8)
        for r in range(R8, R):
            t += mn[r] * xs[r]
        s -= t
    out[m, c] = s + (bias[c] if has_bias else np.float32(0))


_rows_q8_0, _rows_q5_0, _rows_q6_k, _rows_q4_k = (_rows_of(f) for f in (_Q8_0, _Q5_0, _Q6_K, _Q4_K))


@njit(parallel=True, cache=True, nogil=True)
def _run(num_threads, fmts, parts, offsets, x, bias, out, f16):
    """out[:, offsets[p] + n] = x @ dequant(parts[p][n]) (+ bias): the parts' output features (a fused
    layer's, end to end) cut into one contiguous range per thread of numba's pool."""
    xsum = np.empty((x.shape[0], x.shape[1] // 32), np.float32)
    _run_sums(x, xsum)
    N = offsets[-1]
    per = -(-N // num_threads)
    for t in prange(num_threads):
        a, e = t * per, min(N, (t + 1) * per)
        for p in range(len(parts)):
            n0, n1 = max(a, offsets[p]), min(e, offsets[p + 1])
            if n0 >= n1:
                continue
            args = (x, xsum, parts[p], bias, out, n0 - offsets[p], n1 - offsets[p], offsets[p], f16)
            if fmts[p] == _Q8_0:
                _rows_q8_0(*args)
            elif fmts[p] == _Q5_0:
                _rows_q5_0(*args)
            elif fmts[p] == _Q6_K:
                _rows_q6_k(*args)
            else:
                _rows_q4_k(*args)


@njit(inline="always")
def _run_sums(x, xsum):
    """xsum[m, r] = sum(x[m, 32 r:32 r + 32]) in float32."""
    xf = x.reshape(x.size)
    for m in range(x.shape[0]):
        for r in range(xsum.shape[1]):
            o = m * x.shape[1] + 32 * r
            xsum[m, r] = vf_sum(vf_add(vf_add(vf_load(xf, o), vf_load(xf, o + 8)),
                                       vf_add(vf_load(xf, o + 16), vf_load(xf, o + 24))))


# ---- dequantization: the same runs, each value rounded as reference/quant.py rounds it -------------------
def _gather_of(fmt):
    """out[i] = dequant(w[ids[i]]) for i in i0..i1-1, compiled for one format: each row's float32 values
    lo / hi * q (Q4_K: sc * q - mn), each product and difference rounded on its own, so the bits are the
    reference's. (The body is the closure's own, as in _rows_of.)"""
    def gather(w, ids, out, i0, i1, f16):
        R = out.shape[1] // 32
        lo, hi, mn = np.empty(R, np.float32), np.empty(R, np.float32), np.zeros(R, np.float32)
        for i in range(i0, i1):
            row, dst = w[ids[i]], out[i]
            _run_scales(fmt, row, lo, hi, mn, f16)
            for r in range(R):
                q0, q1, q2, q3 = vb_to_f32(_run_values(fmt, row, r))
                a, b, o = vf_splat(lo[r]), vf_splat(hi[r]), 32 * r
                if fmt == _Q4_K:
                    m = vf_splat(mn[r])
                    vf_store(dst, o, vf_sub_rounded(vf_mul_rounded(a, q0), m))
                    vf_store(dst, o + 8, vf_sub_rounded(vf_mul_rounded(a, q1), m))
                    vf_store(dst, o + 16, vf_sub_rounded(vf_mul_rounded(a, q2), m))
                    vf_store(dst, o + 24, vf_sub_rounded(vf_mul_rounded(a, q3), m))
                else:
                    vf_store(dst, o, vf_mul_rounded(a, q0))
                    vf_store(dst, o + 8, vf_mul_rounded(a, q1))
                    vf_store(dst, o + 16, vf_mul_rounded(b, q2))
                    vf_store(dst, o + 24, vf_mul_rounded(b, q3))
    return njit(cache=True, nogil=True)(gather)


_gather_q8_0, _gather_q5_0, _gather_q6_k, _gather_q4_k = (_gather_of(f) for f in (_Q8_0, _Q5_0, _Q6_K, _Q4_K))


@njit(parallel=True, cache=True, nogil=True)
def _gather(num_threads, fmt, w, ids, out, f16):
    """out[i] = dequant(w[ids[i]]), the ids dealt to threads in contiguous ranges."""
    T = ids.shape[0]
    per = (T + num_threads - 1) // num_threads
    for t in prange(num_threads):
        i0, i1 = t * per, min(T, (t + 1) * per)
        if fmt == _Q8_0:
            _gather_q8_0(w, ids, out, i0, i1, f16)
        elif fmt == _Q5_0:
            _gather_q5_0(w, ids, out, i0, i1, f16)
        elif fmt == _Q6_K:
            _gather_q6_k(w, ids, out, i0, i1, f16)
        else:
            _gather_q4_k(w, ids, out, i0, i1, f16)


_NO_BIAS = np.zeros(0, np.float32)


def row_values(fmt, row_bytes):
    """Values (K) in a row of `row_bytes` bytes of format fmt; KernelLaunchError when it is not whole blocks."""
    if fmt not in FORMATS:
        raise KernelLaunchError(f"fmt: {fmt!r} is not one of {sorted(FORMATS)}")
    _, qk, nbytes = FORMATS[fmt]
    if row_bytes % nbytes:
        raise KernelLaunchError(f"blocks: a row of {row_bytes} bytes is not whole {fmt} blocks of {nbytes} bytes")
    return row_bytes // nbytes * qk


def linear(x, blocks, fmt, bias=None, num_threads=None):
    """x [M, K] @ W[N, K]^T (+ bias [N]) -> float32 torch tensor [M, N], W given as its GGUF blocks.

    x: float32 CPU torch tensor or numpy array [M, K]. blocks: uint8 numpy array (or CPU tensor)
    [N, K / QK * bytes_per_block], rows C-contiguous (a memory-mapped GGUF tensor is taken as it is).
    fmt: "Q8_0", "Q5_0", "Q6_K" or "Q4_K". bias: float32 [N] or None. num_threads: default
    torch.get_num_threads(). At most MAX_ROWS rows run the block kernel; more rows dequantize TILE_VALUES
    weight rows at a time (this kernel's threads) and multiply with torch's GEMM.
    Raises KernelLaunchError naming the argument whose device, dtype or shape does not fit.
    """
    return linear_parts(x, [(blocks, fmt)], bias, num_threads)


def linear_parts(x, parts, bias=None, num_threads=None, tile_dtype=torch.float32, max_rows=MAX_ROWS):
    """x [M, K] @ [W_0; W_1; ...]^T (+ bias) -> float32 torch tensor [M, N_0 + N_1 + ...] in one call: a
    fused layer whose parts are stored apart, each in its own format (q / k / v, gate / up).

    parts: [(blocks, fmt), ...] as `linear` takes them, every part K values a row, or a Parts of them
    (checked once: a layer called every step keeps one). bias: float32 [sum of N_p] or None.
    tile_dtype: the dtype of the GEMM above MAX_ROWS rows: torch.float32 (the dequantized matrix's product),
    or torch.bfloat16 (x and each dequantized tile rounded to bfloat16, the products rounded to bfloat16
    before they are written: relative error ~3e-3, a few times faster where the CPU multiplies bfloat16
    natively, see native_bf16; slower elsewhere). max_rows: the most rows the block kernel takes, MAX_ROWS
    by default; None: every call (the block kernel computes a row alike at any row count: the
    batch-invariant mode's products). The rest as `linear`."""
    # a prefill's x may be a strided view (SiLU-and-mul's output is the gate half of [T, 2 I]): torch's GEMM
    # takes its strides, the block kernel (few rows) a contiguous copy
    xa = _check(x, "x", np.float32, 2, contiguous=False)
    tiles = max_rows is not None and xa.shape[0] > max_rows
    if not tiles or xa.strides[1] != xa.itemsize or xa.strides[0] < 0:     # (torch: no negative strides)
        xa = np.ascontiguousarray(xa)
    parts = parts if isinstance(parts, Parts) else Parts(parts)
    parts.check_input(xa)
    M, N = xa.shape[0], parts.N
    ba = _bias(bias, N)
    threads = num_threads or torch.get_num_threads()
    out = torch.empty(M, N, dtype=torch.float32)
    if tiles:
        if tile_dtype not in (torch.float32, torch.bfloat16):
            raise KernelLaunchError(f"tile_dtype: {tile_dtype}, expected torch.float32 or torch.bfloat16")
        xt = torch.from_numpy(xa)
        # few input rows: a tile that stays in cache for the GEMM; many: the GEMM is compute-bound and
        # runs best on wide tiles (1024 rows or more), rewritten to memory or not
        # (a power of two: torch's GEMM ran 1170-row tiles 1.3x slower than 1024-row ones)
        rows = max(16 if M < 128 else 1024, 1 << (TILE_VALUES // xa.shape[1]).bit_length() - 1)
        tile = np.empty((min(rows, max(wa.shape[0] for wa in parts.blocks)), xa.shape[1]), np.float32)
        low = tile_dtype == torch.bfloat16
        if low:                         # x rounded once for every part; each tile rounded into one buffer
            xt, tile_low = xt.to(torch.bfloat16), torch.empty(tile.shape, dtype=torch.bfloat16)
        for wa, fmt, c in zip(parts.blocks, parts.fmts, parts.offsets):
            for n0 in range(0, wa.shape[0], rows):
                w = torch.from_numpy(_dequantize_into(wa[n0:n0 + rows], fmt, tile, threads))
                dst = out[:, c + n0:c + n0 + w.shape[0]]
                if low:
                    dst.copy_(torch.matmul(xt, tile_low[:w.shape[0]].copy_(w).T))
                else:
                    torch.matmul(xt, w.T, out=dst)
        if bias is not None:
            out += torch.from_numpy(ba)
        return out
    _run(numba_threads(product_threads(threads, N)), *parts.kernel_args, xa, ba,
         out.numpy(), _F16)
    return out


class Parts:
    """A fused layer's parts [(blocks, fmt), ...] checked once: `blocks` (read-only uint8 views, one array
    type for every part: a mapped file's is read-only), `fmts`, `codes` (int64, the kernels' format codes),
    `offsets` (int64 [parts + 1]: each part's first output feature, then N), K and N; `kernel_args`, the
    (codes, blocks, offsets) the kernels take (padded to KERNEL_PARTS parts). KernelLaunchError
    naming `blocks` for a part that is not whole blocks or whose K differs from the first part's."""

    def __init__(self, parts):
        blocks, fmts, offsets, K = [], [], [0], None
        for wb, fmt in parts:
            wa = _check(wb, "blocks", np.uint8, 2)
            k = row_values(fmt, wa.shape[1])
            if K is not None and k != K:
                raise KernelLaunchError(f"blocks: parts of {K} and {k} input features")
            K = k
            ro = wa.view()
            ro.flags.writeable = False
            blocks.append(ro)
            fmts.append(fmt)
            offsets.append(offsets[-1] + wa.shape[0])
        if not blocks:
            raise KernelLaunchError("blocks: no parts")
        self.blocks, self.fmts, self.K, self.N = tuple(blocks), fmts, K, offsets[-1]
        self.codes = np.array([_CODE[f] for f in fmts], np.int64)
        self.offsets = np.array(offsets, np.int64)
        # What the kernels take: the parts padded to KERNEL_PARTS with empty ranges (the first part again,
        # from N to N), so every layer's call is one specialisation of the threaded drivers: each tuple
        # length is another compile of them, and each is seconds.
        pad = max(0, KERNEL_PARTS - len(blocks))
        self.kernel_args = (np.concatenate([self.codes, np.full(pad, self.codes[0], np.int64)]),
                            self.blocks + (self.blocks[0],) * pad,
                            np.concatenate([self.offsets, np.full(pad, self.N, np.int64)]))

    def check_input(self, xa):
        if xa.shape[1] != self.K:
            raise KernelLaunchError(f"blocks: rows of {self.K} {self.fmts[0]} values do not take x's "
                                    f"{xa.shape[1]} input features")


def _bias(bias, N):
    """The bias as float32 numpy [N] (an empty array for None), or KernelLaunchError naming `bias`."""
    if bias is None:
        return _NO_BIAS
    ba = _check(bias, "bias", np.float32, 1)
    if ba.shape[0] != N:
        raise KernelLaunchError(f"bias: {ba.shape[0]} elements for {N} output features")
    return ba


def dequantize(blocks, fmt, num_threads=None):
    """float32 numpy [N, K] from the blocks uint8 [N, bytes_per_row] of format fmt (every row)."""
    wa = _check(blocks, "blocks", np.uint8, 2)
    K = row_values(fmt, wa.shape[1])
    return _dequantize_into(wa, fmt, np.empty((wa.shape[0], K), np.float32), num_threads or torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def native_bf16():
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16, as torch reports it): there
    torch's bfloat16 GEMM ran a prefill tile's product [2048, 896] x [896, 4864] at 420-730 GFLOP/s against
    float32's 146 (two cores of an AMD EPYC with AVX512-BF16, 265-310 with the roundings to and from
    bfloat16); elsewhere bfloat16 is emulated and slower than float32."""
    try:
        caps = torch.cpu.get_capabilities()
    except Exception:  # noqa: BLE001 (a torch without the query: take float32)
        return False
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def _dequantize_into(wa, fmt, buf, threads):
    """buf[:N] = the float32 values of the checked blocks wa [N, bytes_per_row]; returns that view."""
    out = buf[:wa.shape[0]]
    ids = np.arange(wa.shape[0], dtype=np.int64)
    _gather(numba_threads(min(threads, max(1, wa.shape[0] // 16))), _CODE[fmt], wa, ids, out, _F16)
    return out


def embedding(ids, blocks, fmt, num_threads=None):
    """float32 torch tensor [T, K]: rows ids (int [T], each in 0..N-1) of the table blocks uint8 [N, bytes_per_row].

    Raises KernelLaunchError for an id outside the table, before any row is read."""
    wa = _check(blocks, "blocks", np.uint8, 2)
    K = row_values(fmt, wa.shape[1])
    ia = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if ia.ndim != 1 or ia.dtype.kind not in "iu":
        raise KernelLaunchError(f"ids: {ia.ndim}-D {ia.dtype}, expected a 1-D integer array")
    ia = ia.astype(np.int64)
    if ia.size and (ia.min() < 0 or ia.max() >= wa.shape[0]):
        raise KernelLaunchError(f"ids: values {ia.min()}..{ia.max()} outside the table's {wa.shape[0]} rows")
    out = torch.empty(ia.shape[0], K, dtype=torch.float32)
    _gather(numba_threads(min(num_threads or torch.get_num_threads(), max(1, ia.shape[0] // 8))),
            _CODE[fmt], wa, ia, out.numpy(), _F16)
    return out


_CODE = {name: code for name, (code, _, _) in FORMATS.items()}


_TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.uint8): torch.uint8, np.dtype(np.int64): torch.int64}


@njit(cache=True, nogil=True)
def skip_strings(buf, pos, count):
    """The position after `count` GGUF strings (each a little-endian uint64 length, then its bytes) that
    start at `pos` in `buf` (uint8 [n]): a GGUF file's tokenizer holds ~300k of them (tokens, merges),
    which a Python loop walks past in about a second. Loading this compiled loop also loads numba's CPU
    target, which the layers' kernels need a moment later anyway. -1 when they run past the buffer's end."""
    for _ in range(count):
        if pos + 8 > buf.shape[0]:
            return -1
        n = np.uint64(0)
        for b in range(8):
            n |= np.uint64(buf[pos + b]) << np.uint64(8 * b)
        pos += 8 + np.int64(n)
    return pos if pos <= buf.shape[0] else -1


def _check(t, name, dtype, ndim, contiguous=True):
    """C-contiguous numpy view of a CPU tensor or array of `dtype` (no copy when it already is one), or
    KernelLaunchError naming `name`. contiguous=False: any strides (the caller copies what it must)."""
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            raise KernelLaunchError(f"{name}: on {t.device}, the CPU kernel needs a CPU tensor")
        t = t.detach().numpy() if t.dtype == _TORCH_DTYPES.get(np.dtype(dtype)) else t
    if not isinstance(t, np.ndarray) or t.dtype != dtype:
        raise KernelLaunchError(f"{name}: dtype {getattr(t, 'dtype', type(t).__name__)}, expected {np.dtype(dtype)}")
    if t.ndim != ndim:
        raise KernelLaunchError(f"{name}: {t.ndim} dimensions, expected {ndim}")
    return np.ascontiguousarray(t) if contiguous else t
