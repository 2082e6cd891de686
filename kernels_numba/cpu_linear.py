"""y = x W^T + b for a few rows of x on the CPU (a decode step's GEMMs), compiled by numba's CPU target.

At 4-16 rows torch's float32 GEMM is its slowest per row: below 4 rows it runs a matrix-vector product
that streams the weight once, from 4 rows on it switches to a blocked GEMM that packs the weight first,
and a decode step of 4-16 sequences then costs 1.5-3x a step of one (the whole-model GEMMs of one step at
8 rows: ~245 ms against ~95 ms at one row, on the 2-core Xeon of docs/cpu.md). The weight is read from
memory either way; the arithmetic on it is small. This kernel streams the weight once at any row count:

    for each group of 4 weight rows n..n+3 (one thread's share of the output features):
        for each group of 4 input rows m..m+3:
            acc[4 x 4] = sum over k of x[m+i, k] * W[n+j, k]      16 running sums, LLVM vectorises over k
        out[m.., n..] = acc (+ bias)

The 4 weight rows (4 x 3.5-19 KB for Qwen2-0.5B) stay in L1 while every group of input rows passes over
them, so each weight element is loaded from memory once and feeds 4-16 FMAs; each loaded x element feeds
4. The leftover rows (M % 4 inputs, N % 4 weight rows) take the same loop with fewer sums.

Threads: the output features are cut into one contiguous range per thread (multiples of 4 rows), run by
a numba parallel loop (a few microseconds to start; a Python thread pool's wake-up costs ~0.1 ms here,
and a decode step makes ~100 of these calls).

The CPU backend (pagedattn.layers.cpu) runs every GEMM of a step of at most MAX_ROWS rows
here, with torch on one thread meanwhile (its OpenMP threads would spin on the cores these threads
use); measured against torch on two threads (docs/cpu.md), the kernel is as fast at 1-3 rows and up to
2x faster at 4-16 (the LM head: 37 against 75 ms at 8 rows). Sums run in float32 in another order than
torch's: results differ from F.linear by float32 rounding (relative ~1e-6 of the row's magnitude).
"""
import numba
import numpy as np
import torch
from numba import njit, prange
from numba.extending import register_jitable

from kernels_numba.errors import KernelLaunchError

FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}   # as cpu_attention: NaN and inf propagate
MAX_ROWS = 16                # above: torch's blocked GEMM (prefill) does more arithmetic per byte than this
ROWS_PER_THREAD = 64         # a product's threads: at most one per this many output features


@register_jitable
def product_threads(num_threads, num_out):
    """Threads of a product with num_out output features on at most num_threads: the one split every CPU
    product uses (this file's, cpu_quant's, cpu_quant_int8's), called from Python and from compiled code
    alike (the fused layer's products must cut their rows as the unfused calls do)."""
    return max(1, min(num_threads, num_out // ROWS_PER_THREAD))


def numba_threads(num_threads):
    """Set numba's thread count for this thread's next parallel loop to num_threads (at most numba's pool
    size, at least 1); returns the count set."""
    n = max(1, min(num_threads, numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _rows(x, w, bias, out, n0, n1):
    """out[:, n0:n1] = x @ w[n0:n1].T (+ bias[n0:n1] when bias has any element)."""
    M, K = x.shape
    has_bias = bias.shape[0] > 0
    n = n0
    while n + 4 <= n1:
        tile4(x, w[n], w[n + 1], w[n + 2], w[n + 3], bias, has_bias, out, n)
        n += 4
    for n in range(n, n1):                           # leftover weight rows (N % 4): one dot product each
        for m in range(M):
            a0 = np.float32(0)
            for k in range(K):
                a0 += x[m, k] * w[n, k]
            out[m, n] = a0 + (bias[n] if has_bias else np.float32(0))


@njit(inline="always")
def tile4(x, w0, w1, w2, w3, bias, has_bias, out, n):
    """out[:, n:n + 4] = x @ [w0 w1 w2 w3] (+ bias[n:n + 4]): four weight rows (float32 [K] each) held
    while every input row passes over them, 4 rows at a time (16 sums in registers), then the leftovers."""
    M, K = x.shape
    M4 = M - M % 4
    for m in range(0, M4, 4):
        a0 = np.float32(0); a1 = np.float32(0); a2 = np.float32(0); a3 = np.float32(0)  # noqa: E702
        b0 = np.float32(0); b1 = np.float32(0); b2 = np.float32(0); b3 = np.float32(0)  # noqa: E702
        c0 = np.float32(0); c1 = np.float32(0); c2 = np.float32(0); c3 = np.float32(0)  # noqa: E702
        d0 = np.float32(0); d1 = np.float32(0); d2 = np.float32(0); d3 = np.float32(0)  # noqa: E702
        for k in range(K):
            v0, v1, v2, v3 = w0[k], w1[k], w2[k], w3[k]
            x0, x1, x2, x3 = x[m, k], x[m + 1, k], x[m + 2, k], x[m + 3, k]
            a0 += x0 * v0; a1 += x1 * v0; a2 += x2 * v0; a3 += x3 * v0  # noqa: E702
            b0 += x0 * v1; b1 += x1 * v1; b2 += x2 * v1; b3 += x3 * v1  # noqa: E702
            c0 += x0 * v2; c1 += x1 * v2; c2 += x2 * v2; c3 += x3 * v2  # noqa: E702
            d0 += x0 * v3; d1 += x1 * v3; d2 += x2 * v3; d3 += x3 * v3  # noqa: E702
        _store4(out, m, n, a0, a1, a2, a3, bias, has_bias)
        _store4(out, m, n + 1, b0, b1, b2, b3, bias, has_bias)
        _store4(out, m, n + 2, c0, c1, c2, c3, bias, has_bias)
        _store4(out, m, n + 3, d0, d1, d2, d3, bias, has_bias)
    for m in range(M4, M):                           # leftover input rows: one row x 4 weight rows
        a0 = np.float32(0); b0 = np.float32(0); c0 = np.float32(0); d0 = np.float32(0)  # noqa: E702
        for k in range(K):
            xk = x[m, k]
            a0 += xk * w0[k]; b0 += xk * w1[k]; c0 += xk * w2[k]; d0 += xk * w3[k]  # noqa: E702
        out[m, n] = a0 + (bias[n] if has_bias else np.float32(0))
        out[m, n + 1] = b0 + (bias[n + 1] if has_bias else np.float32(0))
        out[m, n + 2] = c0 + (bias[n + 2] if has_bias else np.float32(0))
        out[m, n + 3] = d0 + (bias[n + 3] if has_bias else np.float32(0))


@njit(inline="always")
def _store4(out, m, n, s0, s1, s2, s3, bias, has_bias):
    b = bias[n] if has_bias else np.float32(0)
    out[m, n] = s0 + b
    out[m + 1, n] = s1 + b
    out[m + 2, n] = s2 + b
    out[m + 3, n] = s3 + b


@njit(parallel=True, cache=True, nogil=True)
def _run(num_threads, x, w, bias, out):
    """One contiguous range of output features (multiples of 4) per thread of numba's pool."""
    N = w.shape[0]
    per = (N // num_threads) // 4 * 4
    for t in prange(num_threads):
        n0 = t * per
        n1 = N if t == num_threads - 1 else n0 + per
        _rows(x, w, bias, out, n0, n1)


_NO_BIAS = np.zeros(0, np.float32)


def use_kernel(x, weight):
    """Whether `linear` takes this call: CPU float32, 2-D, at most MAX_ROWS rows."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS)


def linear(x, weight, bias=None, num_threads=None, validate=True):
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N]: CPU float32 torch tensors (or numpy arrays).

    num_threads: default torch.get_num_threads(). validate: raise KernelLaunchError naming the argument whose
    device, dtype or shape does not fit; a caller whose tensors are known to fit (the engine's small step:
    contiguous float32 CPU tensors) passes False.
    """
    if validate:
        xa = _check(x, "x", 2)
        wa = _check(weight, "weight", 2)
        ba = _NO_BIAS if bias is None else _check(bias, "bias", 1)
        if wa.shape[1] != xa.shape[1]:
            raise KernelLaunchError(f"weight: shape {tuple(wa.shape)} does not take x's {xa.shape[1]} input features")
        if bias is not None and ba.shape[0] != wa.shape[0]:
            raise KernelLaunchError(f"bias: {ba.shape[0]} elements for {wa.shape[0]} output features")
    else:
        xa, wa, ba = x.numpy(), weight.detach().numpy(), _NO_BIAS if bias is None else bias.detach().numpy()
    out = torch.empty(xa.shape[0], wa.shape[0], dtype=torch.float32)
    threads = numba_threads(product_threads(num_threads or torch.get_num_threads(), wa.shape[0]))
    _run(threads, xa, wa, ba, out.numpy())
    return out


def _check(t, name, ndim):
    """C-contiguous float32 numpy view of a CPU tensor (no copy), or KernelLaunchError naming `name`."""
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            raise KernelLaunchError(f"{name}: on {t.device}, the CPU kernel needs a CPU tensor")
        t = t.detach().numpy() if t.dtype == torch.float32 else t
    if not isinstance(t, np.ndarray) or t.dtype != np.float32:
        raise KernelLaunchError(f"{name}: dtype {getattr(t, 'dtype', type(t).__name__)}, expected float32")
    if t.ndim != ndim:
        raise KernelLaunchError(f"{name}: {t.ndim} dimensions, expected {ndim}")
    return np.ascontiguousarray(t)
