"""The sampling kernels' device pieces, written once: v1's hot kernel (sampling_journey.py) and the
engine's kernels (sampling.py: v2's split passes, and the fallback kernel both versions run) are built
from them. They build on sampling_rule.py (the rule's constants and make_math) and common.py (intrinsics).

    GPU                        the rule's scalar functions (sampling_rule.make_math) as device functions:
                               float32 multiplies, adds and divides that are never fused (libdevice
                               fmul_rn / fadd_rn / fdiv_rn, PTX mul.rn / add.rn / div.rn), so the device
                               rounds as the CPU does; numpy's float32 operators under the simulator
    make_loaders(kind, vec)    (load4, load1): 4 logits of a row (one 16-byte float32 load or one 8-byte
                               fp16/bf16 load when V % 4 == 0) or one, as float32, NaN -> -inf
    fast_gumbel(r)             the Gumbel noise from the hardware log2 (within 1e-6): a pre-filter that
                               spares the exact noise for tokens FAST_MARGIN below the thread's best
    make_block_ops(threads)    CTA-wide reductions (sum, max, argmax, logsumexp, exclusive scan) and the
                               warp merges of one row's per-CTA partials (parts_lse, parts_argmax, parts_sum)
"""
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda

from kernels_numba.common import SIMULATOR, bf16_to_f32, f16_to_f32, f32_bits, f32_from_bits, load_u32x4
from kernels_numba.sampling_rule import F32, HALF, NEG_INF, ONE, TWO_M23, U_SHIFT, make_math

# ----------------------------------------------------------------------------------------
# the rule's scalar math as device functions

if SIMULATOR:
    def _sim_mul(a, b):
        return np.float32(a) * np.float32(b)

    def _sim_add(a, b):
        return np.float32(a) + np.float32(b)

    def _sim_div(a, b):
        return np.float32(a) / np.float32(b)

    GPU = make_math(cuda.jit(device=True), _sim_mul, _sim_add, _sim_div, f32_bits, f32_from_bits)
else:
    from numba.cuda import libdevice

    # fmul_rn / fadd_rn / fdiv_rn: PTX mul.rn / add.rn / div.rn, which ptxas never fuses into an FMA
    GPU = make_math(cuda.jit(device=True), libdevice.fmul_rn, libdevice.fadd_rn, libdevice.fdiv_rn,
                    f32_bits, f32_from_bits)


def make_loaders(kind, vec):
    """(load4, load1) for logits of `kind` ("f32", "f16", "bf16") seen as a flat array of words:
    vec: f32 as uint32 read 4 at a time (16 bytes), fp16/bf16 as int64 (4 halves, 8 bytes), which
    needs V % 4 == 0 and an aligned base; else one element per load (int32 / int16 words).
    load4(words, row, g, V) -> the 4 float32 logits of tokens 4g .. 4g+3 (-inf past V), NaN -> -inf.
    load1(words, row, i, V) -> logit i."""
    clean = GPU.clean
    cvt = f16_to_f32 if kind == "f16" else bf16_to_f32
    if kind == "f32":
        def one(words, row, i, vocab):
            return clean(f32_from_bits(words[row * vocab + i]))
    elif vec:
        def one(words, row, i, vocab):
            w = words[(row * vocab + i) >> 2]
            return clean(cvt((w >> (16 * (i & 3))) & 0xFFFF))
    else:
        def one(words, row, i, vocab):
            return clean(cvt(words[row * vocab + i]))
    load1 = cuda.jit(device=True)(one)

    if vec and kind == "f32":
        @cuda.jit(device=True)
        def load4(words, row, g, vocab):
            a, b, c, d = load_u32x4(words, row * vocab + 4 * g)
            return (clean(f32_from_bits(a)), clean(f32_from_bits(b)), clean(f32_from_bits(c)),
                    clean(f32_from_bits(d)))
    elif vec:
        @cuda.jit(device=True)
        def load4(words, row, g, vocab):
            w = words[row * (vocab >> 2) + g]
            return (clean(cvt(w & 0xFFFF)), clean(cvt((w >> 16) & 0xFFFF)), clean(cvt((w >> 32) & 0xFFFF)),
                    clean(cvt((w >> 48) & 0xFFFF)))
    else:
        @cuda.jit(device=True)
        def load4(words, row, g, vocab):
            i = 4 * g
            return (load1(words, row, i, vocab) if i < vocab else NEG_INF,
                    load1(words, row, i + 1, vocab) if i + 1 < vocab else NEG_INF,
                    load1(words, row, i + 2, vocab) if i + 2 < vocab else NEG_INF,
                    load1(words, row, i + 3, vocab) if i + 3 < vocab else NEG_INF)
    return load4, load1


# A pre-filter for the noise: the exact Gumbel noise costs two written-out logs per token; the hardware
# log2 (MUFU, lg2.approx) gives it within ~1e-6 (checked for every u, on the GPU too), so a token whose
# fast score is FAST_MARGIN below the thread's best so far cannot win, and only the others pay for the
# exact noise. On flat rows that is ~log(tokens per thread) exact draws per thread instead of all.
FAST_MARGIN = F32(1e-3)
LN2 = F32(0.6931471805599453)
# -log(1 - v) = v (1 + v/2 + ... + v^7/8)
LOG1M_C8, LOG1M_C7, LOG1M_C6, LOG1M_C5, LOG1M_C4, LOG1M_C3, LOG1M_C2 = (F32(1.0 / k) for k in range(8, 1, -1))

if SIMULATOR:
    def _fast_log2(x):
        return np.float32(np.log2(np.float32(x)))
else:
    from numba.cuda.libdevice import fast_log2f as _fast_log2   # PTX lg2.approx.f32


@cuda.jit(device=True)
def fast_gumbel(r):
    """-log(-log(u)) from the hardware log2, u as in gumbel(r); below u = 0.75 -log(u) = -ln2 log2(u)
    (|log2 u| > 0.4: the approximation's absolute error is small beside it), above it a series in
    v = 1 - u (exact), whose terms past v^8 / 8 are < 1e-6 of the sum."""
    u = (np.float32(np.uint32(r) >> U_SHIFT) + HALF) * TWO_M23
    if u <= F32(0.75):
        e = -LN2 * _fast_log2(u)
    else:
        v = ONE - u
        p = ((((((LOG1M_C8 * v + LOG1M_C7) * v + LOG1M_C6) * v + LOG1M_C5) * v + LOG1M_C4) * v + LOG1M_C3) * v
             + LOG1M_C2)
        e = v * (p * v + ONE)
    return -LN2 * _fast_log2(e)


def make_block_ops(threads):
    """CTA-wide reductions: a butterfly in each warp, then every thread combines the warps' results
    from shared memory (the scratch arrays hold one entry per warp). Every thread gets the result."""
    NW = threads // 32
    FULL = np.uint32(0xFFFFFFFF)

    @cuda.jit(device=True)
    def block_sum(v, sh):
        """Sum of int64 v (sh: int64[NW])."""
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(FULL, v, off)
        if cuda.threadIdx.x % 32 == 0:
            sh[cuda.threadIdx.x // 32] = v
        cuda.syncthreads()
        total = np.int64(0)
        for w in range(NW):
            total += sh[w]
        cuda.syncthreads()
        return total

    @cuda.jit(device=True)
    def block_max(v, sh):
        """Max of int64 v (sh: int64[NW])."""
        for off in (16, 8, 4, 2, 1):
            v = max(v, cuda.shfl_xor_sync(FULL, v, off))
        if cuda.threadIdx.x % 32 == 0:
            sh[cuda.threadIdx.x // 32] = v
        cuda.syncthreads()
        out = sh[0]
        for w in range(1, NW):
            out = max(out, sh[w])
        cuda.syncthreads()
        return out

    @cuda.jit(device=True)
    def block_argmax(s, i, shf, shi):
        """(max of float32 s, lowest int64 i among the maxima)."""
        for off in (16, 8, 4, 2, 1):
            s2 = cuda.shfl_xor_sync(FULL, s, off)
            i2 = cuda.shfl_xor_sync(FULL, i, off)
            if s2 > s or (s2 == s and i2 < i):
                s, i = s2, i2
        if cuda.threadIdx.x % 32 == 0:
            shf[cuda.threadIdx.x // 32] = s
            shi[cuda.threadIdx.x // 32] = i
        cuda.syncthreads()
        s, i = shf[0], shi[0]
        for w in range(1, NW):
            if shf[w] > s or (shf[w] == s and shi[w] < i):
                s, i = shf[w], shi[w]
        cuda.syncthreads()
        return s, i

    @cuda.jit(device=True)
    def merge_lse(m1, s1, i1, m2, s2, i2):
        """Merge two (max, sum of exp(l - max), argmax) partials."""
        if m2 > m1 or (m2 == m1 and i2 < i1):
            m1, s1, i1, m2, s2, i2 = m2, s2, i2, m1, s1, i1
        if s2 > 0:
            s1 += s2 * math.exp(m2 - m1)
        return m1, s1, i1

    @cuda.jit(device=True)
    def block_lse(m, s, i, shf, shs, shi):
        """merge_lse over the CTA (shf, shs: float32[NW]; shi: int64[NW])."""
        for off in (16, 8, 4, 2, 1):
            m2 = cuda.shfl_xor_sync(FULL, m, off)
            s2 = cuda.shfl_xor_sync(FULL, s, off)
            i2 = cuda.shfl_xor_sync(FULL, i, off)
            m, s, i = merge_lse(m, s, i, m2, s2, i2)
        if cuda.threadIdx.x % 32 == 0:
            shf[cuda.threadIdx.x // 32] = m
            shs[cuda.threadIdx.x // 32] = s
            shi[cuda.threadIdx.x // 32] = i
        cuda.syncthreads()
        m, s, i = shf[0], shs[0], shi[0]
        for w in range(1, NW):
            m, s, i = merge_lse(m, s, i, shf[w], shs[w], shi[w])
        cuda.syncthreads()
        return m, s, i

    @cuda.jit(device=True)
    def block_exclusive_scan(c, w, shc, shw):
        """Exclusive prefix sums over the threads, in thread order, of int64 c and w."""
        lane = cuda.threadIdx.x % 32
        ic, iw = c, w
        for off in (1, 2, 4, 8, 16):
            c2 = cuda.shfl_up_sync(FULL, ic, off)
            w2 = cuda.shfl_up_sync(FULL, iw, off)
            if lane >= off:
                ic += c2
                iw += w2
        if lane == 31:
            shc[cuda.threadIdx.x // 32] = ic
            shw[cuda.threadIdx.x // 32] = iw
        cuda.syncthreads()
        for k in range(cuda.threadIdx.x // 32):
            ic += shc[k]
            iw += shw[k]
        cuda.syncthreads()
        return ic - c, iw - w

    # Merges of the per-CTA partials of one row (part_*[base .. base + chunks - 1]) by each warp on its
    # own: lane l takes the partials l, l + 32, ..., then a butterfly. Every merge below is commutative
    # (the argmax keeps the lowest index among equal maxima, merge_lse orders its two inputs first), so
    # at each butterfly step lanes l and l ^ off combine the same two values into the same result: every
    # lane of every warp ends with bit-identical values, and no shared memory or barrier is needed.

    @cuda.jit(device=True)
    def parts_lse(part_f, part_i, base, chunks, vocab):
        """(raw max, sum of exp(l - max), lowest argmax) of pass 1's partials."""
        m, s, i = NEG_INF, np.float32(0), vocab
        for p in range(cuda.threadIdx.x % 32, chunks, 32):
            m, s, i = merge_lse(m, s, i, part_f[base + p, 0], part_f[base + p, 1], part_i[base + p, 0])
        for off in (16, 8, 4, 2, 1):
            m2 = cuda.shfl_xor_sync(FULL, m, off)
            s2 = cuda.shfl_xor_sync(FULL, s, off)
            i2 = cuda.shfl_xor_sync(FULL, i, off)
            m, s, i = merge_lse(m, s, i, m2, s2, i2)
        return m, s, i

    @cuda.jit(device=True)
    def parts_argmax(part_f, part_i, base, chunks, vocab):
        """(best score, lowest index among the best) of pass 2's partials."""
        s, i = NEG_INF, vocab
        for p in range(cuda.threadIdx.x % 32, chunks, 32):
            s2, i2 = part_f[base + p, 2], part_i[base + p, 1]
            if s2 > s or (s2 == s and i2 < i):
                s, i = s2, i2
        for off in (16, 8, 4, 2, 1):
            s2 = cuda.shfl_xor_sync(FULL, s, off)
            i2 = cuda.shfl_xor_sync(FULL, i, off)
            if s2 > s or (s2 == s and i2 < i):
                s, i = s2, i2
        return s, i

    @cuda.jit(device=True)
    def parts_sum(part_i, base, chunks, field):
        """Sum of the int64 field `field` of the partials (exact in any order)."""
        v = np.int64(0)
        for p in range(cuda.threadIdx.x % 32, chunks, 32):
            v += part_i[base + p, field]
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(FULL, v, off)
        return v

    return SimpleNamespace(sum=block_sum, max=block_max, argmax=block_argmax, lse=block_lse,
                           exclusive_scan=block_exclusive_scan, parts_lse=parts_lse, parts_argmax=parts_argmax,
                           parts_sum=parts_sum)
