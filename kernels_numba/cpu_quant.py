"""y = x W^T (+ b) with W kept in a GGUF block format (Q8_0, Q5_0, Q6_K, Q4_K), on the CPU, by numba.

A decode step on a CPU is bound by the weight bytes it reads: float32 weights are 4 bytes a value, the
GGUF blocks 1.06 (Q8_0), 0.69 (Q5_0), 0.82 (Q6_K) and 0.56 (Q4_K). This kernel reads the blocks as stored
and dequantizes them on the fly, in L1, into exactly the float32 values reference/quant.py gives:

    for each group of 4 weight rows n..n+3 (one thread's share of the output features):
        wbuf[4, K] = dequantize(blocks[n..n+3])              one pass over the 4 rows' blocks
        for each group of 4 input rows m..m+3:
            acc[4 x 4] = sum over k of x[m+i, k] * wbuf[j, k]  16 running sums, LLVM vectorises over k
        out[m.., n..] = acc (+ bias)

The second half is kernels_numba/cpu_linear.py's tile: the 4 dequantized rows (4 x 3.5-19 KB for
Qwen2-0.5B) stay in L1/L2 while every group of input rows passes over them, so each block is read from
memory once at any row count (1-16) and each dequantized value feeds 1-16 FMAs. The dequantization is a
loop over one block's 32 values (Q5_0's nibble and high-bit unpacking, Q6_K's 4+2 bits, Q4_K's nibbles)
that LLVM vectorises too; it is compiled without fast-math, so its products round exactly as the
reference's (no fused multiply-add), and the only difference from a float32 GEMM on the dequantized
matrix is the order of the float32 sums (results differ from F.linear by float32 rounding).

fp16 scales are decoded by integer arithmetic (`_half`): exact for normal and subnormal values, inf and
NaN kept.

Threads: the output features are cut into one contiguous range per thread (multiples of 4 rows), run by
a numba parallel loop, as in cpu_linear; every output is summed by the same code in the same order
whatever the thread count. `embedding` gathers rows of a Q5_0 (or any of the formats) table.
"""
import numpy as np
import torch
from numba import njit, prange

from kernels_numba.cpu_linear import tile4
from kernels_numba.cpu_threads import numba_threads
from kernels_numba.errors import KernelLaunchError

FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}   # as cpu_linear: NaN and inf propagate
MAX_ROWS = 16                # above: `linear` dequantizes tiles of W and runs torch's GEMM
TILE_ROWS = 1024             # weight rows per dequantized tile above MAX_ROWS (3.5 MB at K = 896)

# format name -> (code used inside the kernels, values per block, bytes per block)
FORMATS = {"Q8_0": (0, 32, 34), "Q5_0": (1, 32, 22), "Q6_K": (2, 256, 210), "Q4_K": (3, 256, 144)}
_Q8_0, _Q5_0, _Q6_K, _Q4_K = 0, 1, 2, 3

# 2^(e - 25) for the fp16 exponent field e: an fp16 normal is (1024 + mantissa) * 2^(e - 25)
LANES = 32                   # values per inner loop, an argument so LLVM vectorises rather than unrolls it
_POW2 = np.array([2.0 ** (e - 25) for e in range(32)], np.float32)


@njit(inline="always")
def _half(lo, hi):
    """The float32 value of the fp16 whose little-endian bytes are lo, hi (uint8)."""
    h = np.int32(lo) | (np.int32(hi) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:                                     # zero and subnormals: m * 2^-24
        v = np.float32(m) * _POW2[1]
    elif e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(m + 1024) * _POW2[e]
    return -v if h & 0x8000 else v


@njit(cache=True, nogil=True)
def _dequant_row(fmt, w, n, out, scale, minimum, qhbuf, lanes):
    """out[:K] = the float32 values of weight row n (w: uint8 [N, bytes_per_row]) in format fmt.

    Two passes: the row's block scales first (scalar, one per 16-32 values) into scale / minimum
    (float32 [>= K / 16]) and Q5_0's high bits into qhbuf (uint32 [>= K / 32]), then the values, an inner
    loop of `lanes` (= 32, passed at run time) or lanes // 2 values per block. Both halves matter for
    speed: LLVM fully unrolls a loop of a constant 32 trips into scalar code before its vectoriser sees
    it, and an fp16 decode (with its branches) inside the block loop keeps that loop from vectorising.
    No fast-math here: the products round as reference/quant.py's, bit for bit."""
    row = w[n]
    half = lanes // 2
    if fmt == _Q8_0:
        nb = row.shape[0] // 34
        for b in range(nb):
            scale[b] = _half(row[b * 34], row[b * 34 + 1])
        for b in range(nb):
            p, o, d = b * 34 + 2, b * 32, scale[b]
            for j in range(lanes):
                out[o + j] = d * np.float32((np.int32(row[p + j]) ^ 128) - 128)   # int8 from its byte
    elif fmt == _Q5_0:
        nb = row.shape[0] // 22
        for b in range(nb):
            p = b * 22
            scale[b] = _half(row[p], row[p + 1])
            qhbuf[b] = (np.uint32(row[p + 2]) | (np.uint32(row[p + 3]) << 8) | (np.uint32(row[p + 4]) << 16)
                        | (np.uint32(row[p + 5]) << 24))
        for b in range(nb):
            p, o, d, qh = b * 22 + 6, b * 32, scale[b], qhbuf[b]
            for j in range(16):
                q = np.int32(row[p + j])
                lo = (q & 15) | np.int32(((qh >> j) & 1) << 4)
                hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
                out[o + j] = d * np.float32(lo - 16)
                out[o + j + 16] = d * np.float32(hi - 16)
    elif fmt == _Q6_K:
        nb = row.shape[0] // 210
        for b in range(nb):                          # 16 sub-block scales d * scales[s]
            p = b * 210
            d = _half(row[p + 208], row[p + 209])
            for s in range(16):
                scale[16 * b + s] = d * np.float32((np.int32(row[p + 192 + s]) ^ 128) - 128)
        for b in range(nb):
            p, o = b * 210, b * 256
            for h in range(2):                       # halves of 128: ql[64], qh[32], scales[8] each
                ql, qh, oh = p + 64 * h, p + 128 + 32 * h, o + 128 * h
                for i in range(4):                   # runs of 32 values: sub-blocks s0 (l < 16), s0 + 1
                    s0 = 16 * b + 8 * h + 2 * i
                    src, shift, dst = ql + 32 * (i & 1), 4 * (i >> 1), oh + 32 * i
                    sa, sb = scale[s0], scale[s0 + 1]
                    for l in range(lanes):
                        low = (np.int32(row[src + l]) >> shift) & 15
                        high = ((np.int32(row[qh + l]) >> (2 * i)) & 3) << 4
                        out[dst + l] = (sa if l < 16 else sb) * np.float32((low | high) - 32)
    else:                                            # Q4_K
        nb = row.shape[0] // 144
        for b in range(nb):                          # 8 sub-blocks' d * sc and dmin * m
            p = b * 144
            d, dmin = _half(row[p], row[p + 1]), _half(row[p + 2], row[p + 3])
            q = p + 4                                # the 12 packed scale bytes
            for s in range(8):
                if s < 4:
                    sc = np.int32(row[q + s]) & 63
                    mn = np.int32(row[q + s + 4]) & 63
                else:
                    sc = (np.int32(row[q + s + 4]) & 15) | ((np.int32(row[q + s - 4]) >> 6) << 4)
                    mn = (np.int32(row[q + s + 4]) >> 4) | ((np.int32(row[q + s]) >> 6) << 4)
                scale[8 * b + s], minimum[8 * b + s] = d * np.float32(sc), dmin * np.float32(mn)
        for b in range(nb):
            p, o = b * 144, b * 256
            for s in range(8):
                src, shift, dst = p + 16 + 32 * (s >> 1), 4 * (s & 1), o + 32 * s
                sc, mn = scale[8 * b + s], minimum[8 * b + s]
                for l in range(lanes):
                    out[dst + l] = sc * np.float32((np.int32(row[src + l]) >> shift) & 15) - mn


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _rows(fmt, x, w, bias, out, n0, n1, lanes):
    """out[:, n0:n1] = x @ dequant(w[n0:n1]).T (+ bias[n0:n1] when bias has any element)."""
    M, K = x.shape
    has_bias = bias.shape[0] > 0
    wbuf = np.empty((4, K), np.float32)              # the 4 dequantized weight rows
    scale, minimum, qhbuf = _scratch(K)
    w0, w1, w2, w3 = wbuf[0], wbuf[1], wbuf[2], wbuf[3]
    n = n0
    while n + 4 <= n1:
        _dequant_row(fmt, w, n, w0, scale, minimum, qhbuf, lanes)
        _dequant_row(fmt, w, n + 1, w1, scale, minimum, qhbuf, lanes)
        _dequant_row(fmt, w, n + 2, w2, scale, minimum, qhbuf, lanes)
        _dequant_row(fmt, w, n + 3, w3, scale, minimum, qhbuf, lanes)
        tile4(x, w0, w1, w2, w3, bias, has_bias, out, n)
        n += 4
    for n in range(n, n1):                           # leftover weight rows (N % 4): one dot product each
        _dequant_row(fmt, w, n, w0, scale, minimum, qhbuf, lanes)
        for m in range(M):
            a0 = np.float32(0)
            for k in range(K):
                a0 += x[m, k] * w0[k]
            out[m, n] = a0 + (bias[n] if has_bias else np.float32(0))


@njit(inline="always")
def _scratch(K):
    """A row's block scales (float32, up to one per 16 values), Q4_K's mins, Q5_0's high bits."""
    return np.empty(K // 16 + 1, np.float32), np.empty(K // 32 + 1, np.float32), np.empty(K // 32 + 1, np.uint32)


@njit(parallel=True, cache=True, nogil=True)
def _run(num_threads, fmt, x, w, bias, out, lanes):
    """One contiguous range of output features (multiples of 4) per thread of numba's pool."""
    N, K = w.shape[0], x.shape[1]
    per = (N // num_threads) // 4 * 4
    for t in prange(num_threads):
        n0 = t * per
        n1 = N if t == num_threads - 1 else n0 + per
        _rows(fmt, x, w, bias, out, n0, n1, lanes)


@njit(parallel=True, cache=True, nogil=True)
def _gather(num_threads, fmt, w, ids, out, lanes):
    """out[i] = dequant(w[ids[i]]), the ids dealt to threads in contiguous ranges."""
    T = ids.shape[0]
    per = (T + num_threads - 1) // num_threads
    for t in prange(num_threads):
        scale, minimum, qhbuf = _scratch(out.shape[1])
        for i in range(t * per, min(T, (t + 1) * per)):
            _dequant_row(fmt, w, ids[i], out[i], scale, minimum, qhbuf, lanes)


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
    torch.get_num_threads(). At most MAX_ROWS rows run the block kernel; more rows dequantize TILE_ROWS
    weight rows at a time (this kernel's threads) and multiply with torch's GEMM.
    Raises KernelLaunchError naming the argument whose device, dtype or shape does not fit.
    """
    xa = _check(x, "x", np.float32, 2)
    wa = _check(blocks, "blocks", np.uint8, 2)
    K = row_values(fmt, wa.shape[1])
    ba = _NO_BIAS if bias is None else _check(bias, "bias", np.float32, 1)
    if K != xa.shape[1]:
        raise KernelLaunchError(f"blocks: rows of {K} {fmt} values do not take x's {xa.shape[1]} input features")
    if bias is not None and ba.shape[0] != wa.shape[0]:
        raise KernelLaunchError(f"bias: {ba.shape[0]} elements for {wa.shape[0]} output features")
    M, N = xa.shape[0], wa.shape[0]
    threads = num_threads or torch.get_num_threads()
    if M > MAX_ROWS:
        xt = torch.from_numpy(xa)
        out = torch.empty(M, N, dtype=torch.float32)
        for n0 in range(0, N, TILE_ROWS):
            w = dequantize(wa[n0:n0 + TILE_ROWS], fmt, threads)
            torch.matmul(xt, torch.from_numpy(w).T, out=out[:, n0:n0 + TILE_ROWS])
        if bias is not None:
            out += torch.from_numpy(ba)
        return out
    out = torch.empty(M, N, dtype=torch.float32)
    _run(numba_threads(min(threads, N // 64)), _CODE[fmt], xa, wa, ba, out.numpy(), LANES)
    return out


def dequantize(blocks, fmt, num_threads=None):
    """float32 numpy [N, K] from the blocks uint8 [N, bytes_per_row] of format fmt (every row)."""
    wa = _check(blocks, "blocks", np.uint8, 2)
    K = row_values(fmt, wa.shape[1])
    out = np.empty((wa.shape[0], K), np.float32)
    ids = np.arange(wa.shape[0], dtype=np.int64)
    _gather(numba_threads(min(num_threads or torch.get_num_threads(), max(1, wa.shape[0] // 16))),
            _CODE[fmt], wa, ids, out, LANES)
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
            _CODE[fmt], wa, ia, out.numpy(), LANES)
    return out


_CODE = {name: code for name, (code, _, _) in FORMATS.items()}


def _check(t, name, dtype, ndim):
    """C-contiguous numpy view of a CPU tensor or array of `dtype` (no copy when it already is one), or
    KernelLaunchError naming `name`."""
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            raise KernelLaunchError(f"{name}: on {t.device}, the CPU kernel needs a CPU tensor")
        t = t.detach().numpy() if t.dtype == torch.from_numpy(np.zeros(0, dtype)).dtype else t
    if not isinstance(t, np.ndarray) or t.dtype != dtype:
        raise KernelLaunchError(f"{name}: dtype {getattr(t, 'dtype', type(t).__name__)}, expected {np.dtype(dtype)}")
    if t.ndim != ndim:
        raise KernelLaunchError(f"{name}: {t.ndim} dimensions, expected {ndim}")
    return np.ascontiguousarray(t)
