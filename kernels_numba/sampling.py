"""Sampling on the logits' device: CUDA kernels (and their CPU twin) from logits to tokens.

The rule (reference/sampling.py writes it out in numpy; the three implementations agree bit for bit):
    greedy rows (temperature <= 0): argmax of the logits, ties -> lowest index (NaN counts as -inf).
    sampled rows: x_i = min(l_i * inv_t, FLT_MAX) + 0; S = the top_k tokens ranked by (x desc, index
    asc), cut to the top_p nucleus (a token stays while the mass ranked before it is < top_p of the
    top-k mass; the top token always stays); token = argmax over S of x_i + gumbel_i, ties -> lowest
    index. The masses are int64 weights floor(exp(x_i - max x) * 2**40): integer sums are the same in
    any order, so a parallel reduction and a loop agree exactly.
    Noise: gumbel_i = -log(-log(u_i)), u_i = ((r >> 9) + 0.5) 2**-23 (23 bits: + 0.5 stays exact in
    float32) from word r = i % 4 of Philox4x32-10 with counter (position, completion index, i // 4, 0)
    and key (seed low 32 bits, seed high 32 bits). exp and log are written out (det_exp, det_log) with
    float32 multiplies and adds that are never fused (libdevice fmul_rn / fadd_rn on the GPU), so every
    device rounds them the same way.
    Also returned: the raw log-probability log_softmax(l)[token] (vLLM's "raw logprobs").

CUDA: no sort, no global atomics; the row is read in groups of 4 tokens (one 16-byte load of float32
or one 8-byte load of fp16/bf16 when V % 4 == 0, and one Philox call for all 4). The versions
(sampling_journey.py holds {version: entry} and runs any one; this file ships v2):
    v1: one CTA per row: the hot kernel (passes 1-3) and the fallback kernel.
    v2: adds rows split over several CTAs: the split path below (the engine's), whose last kernel is
        v1's fallback kernel run on the merged partials.
split path (v2): each pass is a kernel over split_chunks(N, V) CTAs per row (64 at
    N = 1, 1 from N = 264 on), the next kernel merging the row's partials; pass 2 draws noise only
    for tokens that could beat the raw argmax's score, and top_k with top_p bounds Z_k from below
    before it falls back to a selection (make_split_kernels says how and why both are exact); the
    last kernel decides every row and runs the one-CTA fallback below for the rows left undecided.
one-CTA path (v1): one CTA per row, the passes below in one hot kernel.
hot kernel (two CTAs of 448 threads per SM, 72 registers):
    pass 1  raw max, logsumexp (online) and argmax.                       greedy rows end here.
    pass 2  m = max x; the Gumbel argmax j over all tokens and Z = sum of weights. A token whose
            x + 17 (above the largest noise) is below m - 3 (below the smallest noise of the top
            token) cannot win: no noise is drawn for it.                  rows without top_k/top_p end.
    pass 3  count and mass of the tokens ranked before j. j is in S when count < top_k and mass <
            top_p * Z (S is a prefix of the ranking); then j, which beat a superset, is S's argmax.
            That happens with probability 1 - (mass outside S): ~95% of top_p = 0.95 rows end here.
fallback kernel (launched after it; returns at once for the rows that ended):
    top_k with top_p needs Z_k, the mass of the top k: a selection by count first, then pass 3's test.
    Else S's boundary by radix selection over the order-preserving uint32 keys of x: 2048 bins of
    (count, mass) in shared memory per level, the first level spanning only the keys that can matter
    (those ranked before j), a tie group at the boundary cut by index the same way; then one pass for
    the argmax over S with the same noise, regenerated from Philox.

Entry points:
    sample_cuda(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs)
        v2 on torch CUDA tensors (CPU tensors under the simulator); launches on torch's current stream
        with no host sync and no allocation (after a first call per batch size), so it can be captured
        in a CUDA graph. The engine's entry (pagedattn/layers/sampler.py).
    sample_cpu(...)     the same arguments as CPU tensors: numba @njit, one row after the other.
    launch_split(words, ...), launch(words, ...)   v2 and v1 on numba device arrays (numpy under the
        simulator), no checks; torch_launch_args and run_on_stream build their arguments from torch.
    philox, det_log, det_exp, gumbel, weight, ...: the rule's scalar functions compiled for the CPU
    (GPU holds the device versions).
"""
import math
from functools import lru_cache
from types import SimpleNamespace

import numpy as np
from numba import cuda, njit

from kernels_numba.bridge import as_array, cached_view, disk_cached, enable_disk_cache, scratch
from kernels_numba.cpu_attention import _exp_inplace
from kernels_numba.common import (SIMULATOR, bf16_to_f32, check_tensor, cpu_f32_bits, cpu_f32_from_bits, f16_to_f32,
                                  f32_bits, f32_from_bits, load_u32x4, torch_stream)
from kernels_numba.launcher import launch as launch_kernel

# ----------------------------------------------------------------------------------------
# constants (tests/test_sampler.py checks that they equal reference/sampling.py's)

PHILOX_M0, PHILOX_M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
PHILOX_W0, PHILOX_W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
MASK32 = np.uint64(0xFFFFFFFF)
SHIFT32 = np.uint64(32)

F32 = np.float32
ZERO, HALF, ONE, MINUS_ONE = F32(0.0), F32(0.5), F32(1.0), F32(-1.0)
NEG_INF = F32(-np.inf)
FLT_MAX = F32(np.finfo(np.float32).max)
INV_T_MIN = F32(2.0**-126)
TWO_M23 = F32(2.0**-23)
WEIGHT_ONE = F32(2.0**40)
WEIGHT_CUT = F32(-28.0)
MAX_VOCAB = 1 << 21
SQRT2 = F32(1.4142135)
LOG_C11, LOG_C9, LOG_C7, LOG_C5, LOG_C3 = (F32(1.0 / k) for k in (11, 9, 7, 5, 3))
LN2_HI, LN2_LO = F32(0.693145751953125), F32(1.428606765330187e-06)
NEG_LN2_HI, NEG_LN2_LO = -LN2_HI, -LN2_LO
LOG2E = F32(1.4426950408889634)
EXP_C7, EXP_C6, EXP_C5, EXP_C4, EXP_C3, EXP_C2 = (F32(1.0 / f) for f in (5040, 720, 120, 24, 6, 2))
G_MAX, G_MIN = F32(17.0), F32(-3.0)
G_TOP = F32(16.635532)   # the largest noise: gumbel of u = 1 - 2**-24 (the split kernels' skip bound)
LADDER = (F32(2.0), F32(4.0), F32(8.0), F32(16.0))   # top-k selection starts at the first m - d holding k

U32_SIGN, U32_ONES = np.uint32(0x80000000), np.uint32(0xFFFFFFFF)
EXP_SHIFT, EXP_MASK, MANT_MASK, ONE_BITS = np.uint32(23), np.uint32(0xFF), np.uint32(0x007FFFFF), np.uint32(0x3F800000)
U_SHIFT = np.uint32(9)

THREADS = 448           # per CTA of the hot kernel, one CTA per row: two CTAs per SM at <= 72 registers
TARGET_CTAS = 264       # the split aims at two CTAs per SM of an H200 (132 SMs) ...
MAX_CHUNKS = 64         # ... with at most this many CTAs per row
FALLBACK_THREADS = 384  # per CTA of the fallback kernel (at 512 its 128 registers spill)
NBINS_LOG2 = 11        # 2048 radix bins: 24 KiB of shared memory


# ----------------------------------------------------------------------------------------
# the scalar math, written once and compiled for CUDA, for the simulator and for the CPU


def _make_math(jit, mul, add, div, bits, from_bits):
    """Device functions of the rule. mul/add/div: float32 operations rounded once each (never fused);
    bits/from_bits: float32 <-> uint32 reinterpretation."""

    @jit
    def philox(c0, c1, c2, c3, k0, k1):
        """Philox4x32-10: counter (c0..c3), key (k0, k1), all uint32 -> 4 uint32 words."""
        c0, c1, c2, c3 = np.uint32(c0), np.uint32(c1), np.uint32(c2), np.uint32(c3)
        k0, k1 = np.uint32(k0), np.uint32(k1)
        for _ in range(10):
            p0 = np.uint64(c0) * PHILOX_M0                       # mulhilo: the full 64-bit product
            p1 = np.uint64(c2) * PHILOX_M1
            c0, c1, c2, c3 = (np.uint32((p1 >> SHIFT32) ^ c1 ^ k0), np.uint32(p1 & MASK32),
                              np.uint32((p0 >> SHIFT32) ^ c3 ^ k1), np.uint32(p0 & MASK32))
            k0 = np.uint32((np.uint64(k0) + PHILOX_W0) & MASK32)
            k1 = np.uint32((np.uint64(k1) + PHILOX_W1) & MASK32)
        return c0, c1, c2, c3

    @jit
    def det_log(x):
        """log(x) for a positive normal float32, from its exponent and an atanh series."""
        b = bits(x)
        e = np.int32((b >> EXP_SHIFT) & EXP_MASK) - np.int32(127)
        f = from_bits((b & MANT_MASK) | ONE_BITS)               # mantissa in [1, 2)
        if f > SQRT2:
            f = mul(f, HALF)
            e += 1
        s = div(add(f, MINUS_ONE), add(f, ONE))                  # |s| <= 0.172
        z = mul(s, s)
        p = add(mul(LOG_C11, z), LOG_C9)
        p = add(mul(p, z), LOG_C7)
        p = add(mul(p, z), LOG_C5)
        p = add(mul(p, z), LOG_C3)
        p = mul(p, z)
        s2 = add(s, s)
        ef = np.float32(e)
        return add(mul(ef, LN2_HI), add(add(s2, mul(s2, p)), mul(ef, LN2_LO)))

    @jit
    def det_exp(d):
        """exp(d) for float32 d in [-28, 0]: 2**k * Taylor(r), r = d - k ln 2."""
        k = np.int32(math.floor(add(mul(d, LOG2E), HALF)))
        kf = np.float32(k)
        r = add(d, mul(kf, NEG_LN2_HI))
        r = add(r, mul(kf, NEG_LN2_LO))
        p = add(mul(EXP_C7, r), EXP_C6)
        p = add(mul(p, r), EXP_C5)
        p = add(mul(p, r), EXP_C4)
        p = add(mul(p, r), EXP_C3)
        p = add(mul(p, r), EXP_C2)
        p = add(mul(p, r), ONE)
        p = add(mul(p, r), ONE)
        return mul(p, from_bits(np.uint32((k + 127) << 23)))

    @jit
    def gumbel(r):
        """Gumbel noise of one Philox word: u = ((r >> 9) + 0.5) 2**-23, -log(-log(u))."""
        u = mul(add(np.float32(np.uint32(r) >> U_SHIFT), HALF), TWO_M23)
        return -det_log(-det_log(u))

    @jit
    def weight(x, m):
        """int64 weight floor(exp(x - m) 2**40), 0 below x - m = -28."""
        d = add(x, -m)
        if d >= WEIGHT_CUT:
            return np.int64(mul(det_exp(d), WEIGHT_ONE))
        return np.int64(0)

    @jit
    def scaled(l, inv_t):
        """x = min(l * inv_t, FLT_MAX) + 0: the +0 turns -0 into +0 (equal values, equal keys)."""
        return add(min(mul(l, inv_t), FLT_MAX), ZERO)

    @jit
    def inverse_temperature(t):
        return min(max(div(ONE, np.float32(t)), INV_T_MIN), FLT_MAX)

    @jit
    def key(x):
        """Order-preserving uint32 key of a float32 (no NaN): x < y <=> key(x) < key(y)."""
        b = bits(x)
        if b >= U32_SIGN:
            return np.uint32(b ^ U32_ONES)
        return np.uint32(b | U32_SIGN)

    @jit
    def clean(v):
        """A logit as float32, NaN -> -inf."""
        v = np.float32(v)
        if v != v:
            return NEG_INF
        return v

    return SimpleNamespace(philox=philox, det_log=det_log, det_exp=det_exp, gumbel=gumbel, weight=weight,
                           scaled=scaled, inverse_temperature=inverse_temperature, key=key, clean=clean,
                           add=add)


# CPU: plain float32 operators (LLVM does not contract them on the CPU without fast-math)
@njit(inline="always")
def _mul(a, b):
    return a * b


@njit(inline="always")
def _add(a, b):
    return a + b


@njit(inline="always")
def _div(a, b):
    return a / b


CPU = _make_math(njit, _mul, _add, _div, cpu_f32_bits, cpu_f32_from_bits)
# module-level names: numba resolves globals, not attributes of a namespace
philox, det_log, det_exp, gumbel, weight = CPU.philox, CPU.det_log, CPU.det_exp, CPU.gumbel, CPU.weight
scaled, inverse_temperature, key, clean = CPU.scaled, CPU.inverse_temperature, CPU.key, CPU.clean
_add_cpu = CPU.add

if SIMULATOR:
    def _sim_mul(a, b):
        return np.float32(a) * np.float32(b)

    def _sim_add(a, b):
        return np.float32(a) + np.float32(b)

    def _sim_div(a, b):
        return np.float32(a) / np.float32(b)

    GPU = _make_math(cuda.jit(device=True), _sim_mul, _sim_add, _sim_div, f32_bits, f32_from_bits)
else:
    from numba.cuda import libdevice

    # fmul_rn / fadd_rn / fdiv_rn: PTX mul.rn / add.rn / div.rn, which ptxas never fuses into an FMA
    GPU = _make_math(cuda.jit(device=True), libdevice.fmul_rn, libdevice.fadd_rn, libdevice.fdiv_rn,
                     f32_bits, f32_from_bits)


# ----------------------------------------------------------------------------------------
# CPU implementation: the same rule, the same passes, a sort of the few candidates for the fallback


LSE_CHUNK = 2048


@njit(cache=True)
def _exp_total(l, top):
    """sum_i exp(clean(l[i]) - top) for the row's max `top` (finite): each term by cpu_attention's
    vectorised float32 exp (within ~4 ulp), the terms added in float64 in four interleaved sums (a fixed
    order, so the same bits every call). The raw logprob's error stays ~1e-7, far inside what its float32
    output holds; a scalar float64 exp per token cost ~1 ms of a CPU decode step at V = 152k."""
    vocab = l.shape[0]
    x, bits = np.empty(LSE_CHUNK, np.float32), np.empty(LSE_CHUNK, np.uint32)
    s0 = s1 = s2 = s3 = 0.0
    for c in range(0, vocab, LSE_CHUNK):
        n = min(LSE_CHUNK, vocab - c)
        for j in range(n):
            x[j] = clean(l[c + j]) - top                       # NaN counts as -inf: exp gives 0
        _exp_inplace(x, n, bits)
        n4 = n - n % 4
        for j in range(0, n4, 4):
            s0 += np.float64(x[j])
            s1 += np.float64(x[j + 1])
            s2 += np.float64(x[j + 2])
            s3 += np.float64(x[j + 3])
        for j in range(n4, n):
            s0 += np.float64(x[j])
    return (s0 + s1) + (s2 + s3)


@njit(cache=True)
def _row_cpu(l, temperature, top_k, top_p, seed, comp_index, position):
    """One row: l [V] float32. Returns (token, raw logprob)."""
    vocab = l.shape[0]
    top, arg = NEG_INF, 0
    for i in range(vocab):
        v = clean(l[i])
        if v > top:
            top, arg = v, i
    total = _exp_total(l, top) if top > NEG_INF else 0.0
    logprob = np.float64(clean(l[arg])) - (np.float64(top) + math.log(total)) if top > NEG_INF else np.nan
    if not (temperature > 0) or top == NEG_INF:
        return arg, logprob

    inv_t = inverse_temperature(temperature)
    x = np.empty(vocab, dtype=np.float32)
    for i in range(vocab):
        x[i] = scaled(clean(l[i]), inv_t)
    m = scaled(top, inv_t)
    lb = _add_cpu(m, G_MIN)
    k0, k1 = np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)
    kk = top_k if 0 < top_k < vocab else vocab
    use_p = top_p < 1

    # the Gumbel argmax over every token (tokens that cannot win draw no noise)
    best, j = NEG_INF, 0
    for g in range((vocab + 3) // 4):
        r = (np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0))
        drawn = False
        for e in range(4):
            i = 4 * g + e
            if i < vocab and _add_cpu(x[i], G_MAX) >= lb:
                if not drawn:
                    r = philox(position, comp_index, g, 0, k0, k1)
                    drawn = True
                s = _add_cpu(x[i], gumbel(r[e]))
                if s > best:
                    best, j = s, i
    if kk == vocab and not use_p:
        return j, np.float64(clean(l[j])) - (np.float64(top) + math.log(total))

    w = np.empty(vocab, dtype=np.int64)
    for i in range(vocab):
        w[i] = weight(x[i], m)
    xj = x[j]
    count_before, mass_before = 0, np.int64(0)
    for i in range(vocab):
        if x[i] > xj or (x[i] == xj and i < j):
            count_before += 1
            mass_before += w[i]
    thr = np.inf
    if use_p:
        if kk < vocab:                                   # Z_k: the k-th largest x and its ties' share
            tau = np.sort(x)[vocab - kk]                  # (np.partition compiles for 13 s)
            above, mass_k = 0, np.int64(0)
            for i in range(vocab):
                if x[i] > tau:
                    above += 1
                    mass_k += w[i]
            mass_k += (kk - above) * weight(tau, m)
        else:
            mass_k = w.sum()
        thr = np.float64(np.float32(top_p)) * np.float64(mass_k)
    if count_before < kk and np.float64(mass_before) < thr:
        token = j
    else:                                                # S lies in the tokens ranked before j
        cand = np.empty(count_before, dtype=np.uint64)
        n = 0
        for i in range(vocab):
            if x[i] > xj or (x[i] == xj and i < j):
                cand[n] = (np.uint64(key(x[i])) << SHIFT32) | np.uint64(0xFFFFFFFF - i)
                n += 1
        cand = np.sort(cand)[::-1]                       # rank order: key desc, index asc
        size = min(kk, count_before)
        if use_p:
            cum, size = np.int64(0), 0
            while size < min(kk, count_before) and np.float64(cum) < thr:
                cum += w[0xFFFFFFFF - np.int64(cand[size] & MASK32)]
                size += 1
        best, token = NEG_INF, -1
        for r_ in range(size):
            i = 0xFFFFFFFF - np.int64(cand[r_] & MASK32)
            s = _add_cpu(x[i], gumbel(philox(position, comp_index, i // 4, 0, k0, k1)[i % 4]))
            if s > best or (s == best and i < token):
                best, token = s, i
    return token, np.float64(clean(l[token])) - (np.float64(top) + math.log(total))


@njit(cache=True)
def _rows_cpu(logits, temperature, top_k, top_p, seed, comp_index, position, out_tokens, out_logprobs):
    for r in range(logits.shape[0]):
        token, logprob = _row_cpu(logits[r], temperature[r], top_k[r], top_p[r], seed[r], comp_index[r],
                                  position[r])
        out_tokens[r] = token
        out_logprobs[r] = logprob


# ----------------------------------------------------------------------------------------
# CUDA kernels
#
# The hot kernel (passes 1-3; 72 registers: two CTAs of THREADS per SM) finishes every row it
# can and leaves, for the others, its results in a state record. The fallback kernel (the radix
# selections; ~160 registers at FALLBACK_THREADS, 24 KiB of shared memory), launched right after on
# the same stream with the same grid, returns at once for the rows that are done. (One kernel with
# both needs 128 registers: one CTA of 512 threads per SM for every row.)

STATE_I64 = ("j", "count", "mass", "total", "ladder0", "ladder1", "ladder2", "ladder3", "pending")
STATE_F32 = ("rmax", "lse")


def _make_loaders(kind, vec):
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


def _make_block_ops(threads):
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


@disk_cached
@lru_cache(maxsize=None)
def make_hot_kernel(kind, vec, threads=THREADS):
    """Passes 1-3 for logits of `kind` read as in _make_loaders, one CTA of `threads` per row."""
    load4, load1 = _make_loaders(kind, vec)
    ops = _make_block_ops(threads)
    block_sum, block_argmax, block_lse = ops.sum, ops.argmax, ops.lse
    philox, gumbel, weight, scaled, add = GPU.philox, GPU.gumbel, GPU.weight, GPU.scaled, GPU.add
    inverse_temperature = GPU.inverse_temperature
    NW = threads // 32

    @cuda.jit(device=True)
    def hot_row(words, row, vocab, temperature, top_k, top_p, seed, comp_index, position, state_f, shf, shg, shi):
        """Returns (token or -1 when the row is left to the fallback kernel, the state). Writes
        (rmax, lse) to state_f[row] at once: fewer live registers in passes 2 and 3."""
        tid = cuda.threadIdx.x
        groups = (vocab + 3) // 4
        zero = np.int64(0)

        # pass 1: raw max, sum of exp(l - max) (online), argmax
        rmax, rsum, ridx = NEG_INF, np.float32(0), np.int64(vocab)
        for g in range(tid, groups, threads):
            ls = load4(words, row, g, vocab)
            for e in range(4):
                v = ls[e]
                if v > rmax:
                    rsum = rsum * math.exp(rmax - v) + np.float32(1)
                    rmax, ridx = v, np.int64(4 * g + e)
                elif v > NEG_INF:
                    rsum += math.exp(v - rmax)
        rmax, rsum, ridx = block_lse(rmax, rsum, ridx, shf, shg, shi)
        if tid == 0:
            state_f[row, 0] = rmax
            state_f[row, 1] = rmax + math.log(rsum) if rsum > 0 else NEG_INF
        if ridx >= vocab:                                # a row of -inf: token 0
            ridx = zero
        if not (temperature > 0) or rmax == NEG_INF:
            return ridx, (zero, zero, zero, zero, zero, zero, zero, zero)

        # pass 2: the Gumbel argmax j over all tokens; the total weight Z
        inv_t = inverse_temperature(temperature)
        m = scaled(rmax, inv_t)                          # = max x (x is monotone in l)
        lb = add(m, G_MIN)                               # the top token scores at least this
        k0, k1 = np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)
        kk = np.int64(top_k) if 0 < top_k < vocab else np.int64(vocab)
        use_p = top_p < 1
        filtered = kk < vocab or use_p
        best, j, total = NEG_INF, np.int32(vocab), zero     # j: int32 (V < 2**21), one register
        for g in range(tid, groups, threads):
            ls = load4(words, row, g, vocab)
            # x is monotone in l: the group's largest x decides whether any of the 4 can win
            if add(scaled(max(max(ls[0], ls[1]), max(ls[2], ls[3])), inv_t), G_MAX) >= lb:
                r = philox(position, comp_index, g, 0, k0, k1)
                for e in range(4):
                    x = scaled(ls[e], inv_t)
                    if add(x, G_MAX) >= lb and x + fast_gumbel(r[e]) + FAST_MARGIN >= best:
                        s = add(x, gumbel(r[e]))
                        if s > best:
                            best, j = s, np.int32(4 * g + e)
            if filtered:
                for e in range(4):
                    total += weight(scaled(ls[e], inv_t), m)
        best, j = block_argmax(best, np.int64(j), shf, shi)
        if not filtered:
            return j, (zero, zero, zero, zero, zero, zero, zero, zero)
        total = block_sum(total, shi)

        # pass 3: count and mass ranked before j; for top_k with top_p, the counts above m - LADDER[q]
        xj = scaled(load1(words, row, j, vocab), inv_t)
        ladder = kk < vocab and use_p
        taus = (add(m, -LADDER[0]), add(m, -LADDER[1]), add(m, -LADDER[2]), add(m, -LADDER[3]))
        cnt, mass = np.int32(0), zero                    # counts < 2**21 fit int32 (fewer registers)
        c0, c1, c2, c3 = np.int32(0), np.int32(0), np.int32(0), np.int32(0)
        for g in range(tid, groups, threads):
            ls = load4(words, row, g, vocab)
            for e in range(4):
                i = 4 * g + e
                x = scaled(ls[e], inv_t)
                if x > xj or (x == xj and i < j):
                    cnt += np.int32(1)
                    mass += weight(x, m)
                if ladder:
                    c0 += np.int32(x >= taus[0])
                    c1 += np.int32(x >= taus[1])
                    c2 += np.int32(x >= taus[2])
                    c3 += np.int32(x >= taus[3])
        cnt = block_sum(np.int64(cnt), shi)
        mass = block_sum(mass, shi)
        c0, c1, c2, c3 = np.int64(c0), np.int64(c1), np.int64(c2), np.int64(c3)
        if ladder:
            c0, c1, c2, c3 = block_sum(c0, shi), block_sum(c1, shi), block_sum(c2, shi), block_sum(c3, shi)
            token = np.int64(-1)                         # needs Z_k: the fallback kernel decides
        elif use_p:
            token = j if np.float64(mass) < np.float64(top_p) * np.float64(total) else np.int64(-1)
        else:
            token = j if cnt < kk else np.int64(-1)
        return token, (j, cnt, mass, total, c0, c1, c2, c3)

    def hot(words, vocab, temperature, top_k, top_p, seed, comp_index, position, out_tokens, out_logprobs,
            state_i, state_f):
        row = cuda.blockIdx.x
        shf = cuda.shared.array(NW, np.float32)
        shg = cuda.shared.array(NW, np.float32)
        shi = cuda.shared.array(NW, np.int64)
        token, st = hot_row(words, row, np.int64(vocab), temperature[row], top_k[row], top_p[row], seed[row],
                            comp_index[row], position[row], state_f, shf, shg, shi)
        if cuda.threadIdx.x == 0:
            for k in range(8):
                state_i[row, k] = st[k]
            state_i[row, 8] = token < 0
            if token >= 0:
                out_tokens[row] = token
                out_logprobs[row] = load1(words, row, token, np.int64(vocab)) - state_f[row, 1]

    # two CTAs per SM (72 registers at 448 threads; at 512, 64 registers spill); the element-wise loads
    # of the unaligned path need more
    return cuda.jit(hot) if SIMULATOR else cuda.jit(launch_bounds=(threads, 2 if vec else 1))(hot)


# ----------------------------------------------------------------------------------------
# The split path: each row over `chunks` CTAs, one kernel per pass
#
# CTA b works on row b // chunks, chunk c = b % chunks: the groups [c * gpc, (c + 1) * gpc) with
# gpc = ceil(groups / chunks), so chunk boundaries fall on groups of 4 tokens (one Philox call). Each
# kernel reduces its chunk to a partial record (part_f / part_i[b]); the next kernel starts by merging
# the row's partials (ops.parts_*: every CTA of the row gets bit-identical values) and the first CTA of
# the row stores what later kernels need in the row's state. Kernel boundaries order the writes and the
# reads: no global atomics, no fences, no counters to reset, so graph replays need nothing extra.
#
#   split pass 1   raw max / sum of exp / argmax of the chunk
#   split pass 2   merge pass 1 -> state (rmax, lse; greedy token); greedy rows stop. The Gumbel argmax
#                  of the chunk with the skip bound below, and the chunk's total weight (top_k/top_p)
#   split pass 3   merge pass 2 -> state (j, Z); rows without top_k/top_p stop. Count and mass ranked
#                  before j; for top_k with top_p also the count and mass at or above m - LADDER[q]
#   split fallback merge pass 3, decide (below), write the token; rows left undecided continue with the
#                  single-CTA fallback (fallback_row), as in the one-CTA path
#
# The skip bound (pass 2). Let a be the raw argmax (x_a = m) and s_a = fl(x_a + g_a) its score; the
# winner's score S (the largest score) is >= s_a, and >= every score a thread has seen (its `best`),
# so B = max(s_a, best) <= S. Every noise g_i <= G_TOP (the noise of the largest uniform; the noise is
# monotone in u, tests/test_sampler.py checks both on every uniform), and float rounding is monotone,
# so s_i = fl(x_i + g_i) <= fl(x_i + G_TOP). A token with fl(x_i + G_TOP) < B therefore has s_i < S:
# it can neither win nor tie the winner (a tie would need s_i == S), so it needs no noise. The test is
# applied to a group's largest x first (x is monotone in l), so a group of 4 below it draws no Philox
# at all. A token at the bound (fl(x_i + G_TOP) == B) is drawn.
#
# Z_k without a selection (split fallback, top_k with top_p): j is in S iff count < K' and
# float64(mass) < float64(top_p) * float64(Z_k). Lower bounds of Z_k: the mass of the first count + 1
# ranks (those before j, and j), and the mass M_q of the tokens with x >= m - LADDER[q] when there are
# at most K' of them (they are a prefix of the ranking). Both roundings are monotone, so mass <
# top_p * (lower bound) proves j in S; otherwise the fallback computes Z_k exactly, as before.


def split_chunks(n, vocab, threads=THREADS):
    """CTAs per row for n rows of vocab logits: enough for TARGET_CTAS in all, at most MAX_CHUNKS, and
    at least one group of 4 per thread. A fixed function of (n, vocab): a captured graph stays valid."""
    groups = (vocab + 3) // 4
    return max(1, min(MAX_CHUNKS, -(-TARGET_CTAS // n), groups // threads))


PART_I64 = ("ridx", "j", "total", "count", "mass", "count0", "count1", "count2", "count3", "mass0", "mass1",
            "mass2", "mass3")
PART_F32 = ("rmax", "rsum", "best")


def make_split_kernels(kind, vec, threads=THREADS):
    """(pass 1, pass 2, pass 3) kernels of the split path (_make_split_kernels), each kept in the disk cache."""
    kernels = _make_split_kernels(kind, vec, threads)
    for i, k in enumerate(kernels):
        enable_disk_cache(k, (__name__, "make_split_kernels", kind, vec, threads, i),
                          recipe=(__name__, "make_split_kernels", (kind, vec, threads), (), i))
    return kernels


@lru_cache(maxsize=None)
def _make_split_kernels(kind, vec, threads=THREADS):
    """(pass 1, pass 2, pass 3) kernels of the split path for logits of `kind` read as in _make_loaders.
    Grid: rows * chunks CTAs of `threads`. All take the arguments of launch_split's kernels."""
    load4, load1 = _make_loaders(kind, vec)
    ops = _make_block_ops(threads)
    block_sum, block_argmax, block_lse = ops.sum, ops.argmax, ops.lse
    parts_lse, parts_argmax, parts_sum = ops.parts_lse, ops.parts_argmax, ops.parts_sum
    philox, gumbel, weight, scaled, add = GPU.philox, GPU.gumbel, GPU.weight, GPU.scaled, GPU.add
    inverse_temperature = GPU.inverse_temperature
    NW = threads // 32

    @cuda.jit(device=True)
    def chunk_range(vocab, chunks, c):
        """The groups [g0, g1) of chunk c."""
        groups = (vocab + 3) // 4
        gpc = (groups + chunks - 1) // chunks
        g0 = c * gpc
        return g0, min(groups, g0 + gpc)

    def pass1(words, vocab, chunks, temperature, top_k, top_p, seed, comp_index, position, out_tokens,
              out_logprobs, state_i, state_f, part_i, part_f):
        b = cuda.blockIdx.x
        row = b // chunks
        tid = cuda.threadIdx.x
        shf = cuda.shared.array(NW, np.float32)
        shg = cuda.shared.array(NW, np.float32)
        shi = cuda.shared.array(NW, np.int64)
        g0, g1 = chunk_range(vocab, chunks, b - row * chunks)
        rmax, rsum, ridx = NEG_INF, np.float32(0), np.int64(vocab)
        for g in range(g0 + tid, g1, threads):
            ls = load4(words, row, g, vocab)
            for e in range(4):
                v = ls[e]
                if v > rmax:
                    rsum = rsum * math.exp(rmax - v) + np.float32(1)
                    rmax, ridx = v, np.int64(4 * g + e)
                elif v > NEG_INF:
                    rsum += math.exp(v - rmax)
        rmax, rsum, ridx = block_lse(rmax, rsum, ridx, shf, shg, shi)
        if tid == 0:
            part_f[b, 0] = rmax
            part_f[b, 1] = rsum
            part_i[b, 0] = ridx

    def pass2(words, vocab, chunks, temperature, top_k, top_p, seed, comp_index, position, out_tokens,
              out_logprobs, state_i, state_f, part_i, part_f):
        b = cuda.blockIdx.x
        row = b // chunks
        c = b - row * chunks
        tid = cuda.threadIdx.x
        shf = cuda.shared.array(NW, np.float32)
        shi = cuda.shared.array(NW, np.int64)
        rmax, rsum, ridx = parts_lse(part_f, part_i, row * chunks, chunks, np.int64(vocab))
        if ridx >= vocab:                                # a row of -inf: token 0
            ridx = np.int64(0)
        if c == 0 and tid == 0:
            state_f[row, 0] = rmax
            state_f[row, 1] = rmax + math.log(rsum) if rsum > 0 else NEG_INF
            state_i[row, 0] = ridx                       # the greedy token (pass 3 puts j here)
        t = temperature[row]
        if not (t > 0) or rmax == NEG_INF:
            return
        inv_t = inverse_temperature(t)
        m = scaled(rmax, inv_t)                          # = max x = x_a
        k0, k1 = np.uint32(seed[row] & 0xFFFFFFFF), np.uint32((seed[row] >> 32) & 0xFFFFFFFF)
        pos, ci = position[row], comp_index[row]
        filtered = (0 < top_k[row] < vocab) or top_p[row] < 1
        ra = philox(pos, ci, ridx >> 2, 0, k0, k1)       # the raw argmax's noise: s_a bounds the winner
        wa, ea = ra[0], ridx & 3
        if ea == 1:
            wa = ra[1]
        elif ea == 2:
            wa = ra[2]
        elif ea == 3:
            wa = ra[3]
        s_a = add(m, gumbel(wa))
        g0, g1 = chunk_range(vocab, chunks, c)
        best, j, total = NEG_INF, np.int32(vocab), np.int64(0)
        for g in range(g0 + tid, g1, threads):
            ls = load4(words, row, g, vocab)
            bound = max(s_a, best)
            if add(scaled(max(max(ls[0], ls[1]), max(ls[2], ls[3])), inv_t), G_TOP) >= bound:
                r = philox(pos, ci, g, 0, k0, k1)
                for e in range(4):
                    x = scaled(ls[e], inv_t)
                    if add(x, G_TOP) >= max(s_a, best) and x + fast_gumbel(r[e]) + FAST_MARGIN >= best:
                        s = add(x, gumbel(r[e]))
                        if s > best:
                            best, j = s, np.int32(4 * g + e)
            if filtered:
                for e in range(4):
                    total += weight(scaled(ls[e], inv_t), m)
        best, jj = block_argmax(best, np.int64(j), shf, shi)
        if filtered:
            total = block_sum(total, shi)
        if tid == 0:
            part_f[b, 2] = best
            part_i[b, 1] = jj
            part_i[b, 2] = total

    def pass3(words, vocab, chunks, temperature, top_k, top_p, seed, comp_index, position, out_tokens,
              out_logprobs, state_i, state_f, part_i, part_f):
        b = cuda.blockIdx.x
        row = b // chunks
        c = b - row * chunks
        tid = cuda.threadIdx.x
        shi = cuda.shared.array(NW, np.int64)
        t = temperature[row]
        rmax = state_f[row, 0]
        if not (t > 0) or rmax == NEG_INF:
            return
        _, j = parts_argmax(part_f, part_i, row * chunks, chunks, np.int64(vocab))
        kk = np.int64(top_k[row]) if 0 < top_k[row] < vocab else np.int64(vocab)
        use_p = top_p[row] < 1
        if c == 0 and tid == 0:
            state_i[row, 0] = j
        if not (kk < vocab or use_p):
            return
        total = parts_sum(part_i, row * chunks, chunks, 2)   # every thread: shuffles need whole warps
        if c == 0 and tid == 0:
            state_i[row, 3] = total
        inv_t = inverse_temperature(t)
        m = scaled(rmax, inv_t)
        xj = scaled(load1(words, row, j, vocab), inv_t)
        ladder = kk < vocab and use_p
        taus = (add(m, -LADDER[0]), add(m, -LADDER[1]), add(m, -LADDER[2]), add(m, -LADDER[3]))
        cnt, mass = np.int32(0), np.int64(0)             # counts < 2**21 fit int32
        c0, c1, c2, c3 = np.int32(0), np.int32(0), np.int32(0), np.int32(0)
        w0, w1, w2, w3 = np.int64(0), np.int64(0), np.int64(0), np.int64(0)
        g0, g1 = chunk_range(vocab, chunks, c)
        for g in range(g0 + tid, g1, threads):
            ls = load4(words, row, g, vocab)
            for e in range(4):
                i = 4 * g + e
                x = scaled(ls[e], inv_t)
                before = x > xj or (x == xj and i < j)
                if before or (ladder and x >= taus[3]):
                    w = weight(x, m)
                    if before:
                        cnt += np.int32(1)
                        mass += w
                    if ladder:
                        if x >= taus[0]:
                            c0 += np.int32(1)
                            w0 += w
                        if x >= taus[1]:
                            c1 += np.int32(1)
                            w1 += w
                        if x >= taus[2]:
                            c2 += np.int32(1)
                            w2 += w
                        c3 += np.int32(1)
                        w3 += w
        cnt64 = block_sum(np.int64(cnt), shi)
        mass = block_sum(mass, shi)
        if tid == 0:
            part_i[b, 3] = cnt64
            part_i[b, 4] = mass
        if ladder:
            c0, c1 = block_sum(np.int64(c0), shi), block_sum(np.int64(c1), shi)
            c2, c3 = block_sum(np.int64(c2), shi), block_sum(np.int64(c3), shi)
            w0, w1, w2, w3 = block_sum(w0, shi), block_sum(w1, shi), block_sum(w2, shi), block_sum(w3, shi)
            if tid == 0:
                part_i[b, 5], part_i[b, 6], part_i[b, 7], part_i[b, 8] = c0, c1, c2, c3
                part_i[b, 9], part_i[b, 10], part_i[b, 11], part_i[b, 12] = w0, w1, w2, w3

    if SIMULATOR:
        return cuda.jit(pass1), cuda.jit(pass2), cuda.jit(pass3)
    jit = cuda.jit(launch_bounds=(threads, 2 if vec else 1))
    return jit(pass1), jit(pass2), jit(pass3)


@disk_cached
@lru_cache(maxsize=None)
def make_fallback_kernel(kind, vec, threads=FALLBACK_THREADS, nbins_log2=NBINS_LOG2, split=False):
    """The exact fallback for the rows the hot kernel left pending; `threads` per CTA (a multiple of
    32), 2**nbins_log2 radix bins. split: the split path's last kernel, which first merges pass 3's
    partials, decides every row and writes its token, and continues only with the undecided rows."""
    assert threads % 32 == 0
    load4, load1 = _make_loaders(kind, vec)
    ops = _make_block_ops(threads)
    block_max, block_argmax, block_exclusive_scan = ops.max, ops.argmax, ops.exclusive_scan
    parts_sum = ops.parts_sum
    philox, gumbel, weight, scaled, key, add = GPU.philox, GPU.gumbel, GPU.weight, GPU.scaled, GPU.key, GPU.add
    inverse_temperature = GPU.inverse_temperature
    NB, NW = 1 << nbins_log2, threads // 32
    BPT = -(-NB // threads)                              # bins per thread (the last threads may own fewer)

    @cuda.jit(device=True)
    def select(words, row, vocab, inv_t, m, lo, hi, by_index, kb, target, want_mass, by_mass, thr,
               hist_c, hist_w, sh1, sh2):
        """Walk the ranking from the top to the group of equal values that holds the boundary.

        Values: key(x_i) for every token (by_index false), or vocab - 1 - i for the tokens whose key is
        kb (by_index: ranks ties by index); only values in [lo, hi] take part, and nothing above hi
        exists. The boundary is the `target`-th value from the top (by count), or (by_mass) the last
        one whose mass ranked before it, as float64, is < thr. Each level bins [lo, hi] into NB bins of
        (count, mass), finds the last bin the boundary touches and narrows [lo, hi] to it.
        Returns (value, count above its group, mass above, group size, group mass)."""
        tid = cuda.threadIdx.x
        above_c, above_w = np.int64(0), np.int64(0)
        while True:
            shift = 0
            while ((hi - lo) >> shift) >= NB:
                shift += 1
            for b in range(tid, NB, threads):
                hist_c[b] = 0
                hist_w[b] = 0
            cuda.syncthreads()
            for g in range(tid, (vocab + 3) // 4, threads):
                ls = load4(words, row, g, vocab)
                for e in range(4):
                    i = 4 * g + e
                    if i < vocab:
                        x = scaled(ls[e], inv_t)
                        v = np.int64(key(x))
                        if by_index:
                            v = vocab - 1 - i if v == kb else np.int64(-1)
                        if v >= lo and v <= hi:
                            b = (v - lo) >> shift
                            cuda.atomic.add(hist_c, b, 1)
                            if want_mass:
                                w = weight(x, m)
                                if w != 0:
                                    cuda.atomic.add(hist_w, b, w)
            cuda.syncthreads()
            # thread tid owns the bins at walk positions q = tid * BPT + s (top first): bin NB - 1 - q
            tc, tw = np.int64(0), np.int64(0)
            for s in range(BPT):
                b = NB - 1 - (tid * BPT + s)
                if b >= 0:
                    tc += hist_c[b]
                    tw += hist_w[b]
            ac, aw = block_exclusive_scan(tc, tw, sh1, sh2)   # count and mass of the bins before ours
            last = np.int64(-1)
            at_c, at_w, at_n, at_g = np.int64(0), np.int64(0), np.int64(0), np.int64(0)
            for s in range(BPT):
                q = tid * BPT + s
                b = NB - 1 - q
                c, wsum = (np.int64(hist_c[b]), hist_w[b]) if b >= 0 else (np.int64(0), np.int64(0))
                if c > 0:
                    if by_mass:
                        touched = np.float64(above_w + aw) < thr
                    else:
                        touched = above_c + ac < target
                    if touched:
                        last, at_c, at_w, at_n, at_g = q, ac, aw, c, wsum
                ac += c
                aw += wsum
            q_star = block_max(last, sh1)
            if last == q_star and last >= 0:                  # the owner of the boundary bin publishes it
                sh2[0], sh2[1], sh2[2], sh2[3] = at_c, at_w, at_n, at_g
            cuda.syncthreads()
            above_c += sh2[0]
            above_w += sh2[1]
            n, gw = sh2[2], sh2[3]
            cuda.syncthreads()
            lo = lo + ((NB - 1 - q_star) << shift)
            hi = min(hi, lo + (np.int64(1) << shift) - 1)
            if shift == 0 or q_star < 0:
                return lo, above_c, above_w, n, gw

    @cuda.jit(device=True)
    def tie_share(above_w, n, gw, thr):
        """How many of a group of n equal weights (sum gw), the first with mass above_w ranked before
        it, stay in the nucleus: the number of s in [0, n) with float64(above_w + s w) < thr."""
        w = gw // n if n > 0 else np.int64(0)
        lo, hi = np.int64(1), n                          # s = 0 stays: the group was touched
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if np.float64(above_w + (mid - 1) * w) < thr:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @cuda.jit(device=True)
    def fallback_row(words, row, vocab, temperature, top_k, top_p, seed, comp_index, position, rmax, st,
                     hist_c, hist_w, shf, sh1, sh2):
        tid = cuda.threadIdx.x
        j, cnt, mass, total = st[0], st[1], st[2], st[3]
        inv_t = inverse_temperature(temperature)
        m = scaled(rmax, inv_t)
        lb = add(m, G_MIN)
        k0, k1 = np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)
        kk = np.int64(top_k) if 0 < top_k < vocab else np.int64(vocab)
        use_p = top_p < 1
        xj = scaled(load1(words, row, j, vocab), inv_t)
        key_m, key_j = np.int64(key(m)), np.int64(key(xj))
        thr = np.float64(np.inf)
        if use_p:
            if kk < vocab:                                    # Z_k by a selection of the top k
                if cnt >= kk:
                    lo = key_j                                # the top k all rank before j
                elif st[4] >= kk:
                    lo = np.int64(key(add(m, -LADDER[0])))
                elif st[5] >= kk:
                    lo = np.int64(key(add(m, -LADDER[1])))
                elif st[6] >= kk:
                    lo = np.int64(key(add(m, -LADDER[2])))
                elif st[7] >= kk:
                    lo = np.int64(key(add(m, -LADDER[3])))
                else:
                    lo = np.int64(0)
                _, ab_c, ab_w, n, gw = select(words, row, vocab, inv_t, m, lo, key_m, False, 0, kk, True, False,
                                              0.0, hist_c, hist_w, sh1, sh2)
                w = gw // n if n > 0 else np.int64(0)          # the k-th token's group shares one weight
                thr = np.float64(np.float32(top_p)) * np.float64(ab_w + (kk - ab_c) * w)
            else:
                thr = np.float64(np.float32(top_p)) * np.float64(total)
        if cnt < kk and np.float64(mass) < thr:
            return j

        # S is a prefix of the ranking inside the tokens ranked before j: find its last element. With
        # top_p the nucleus ends at or before rank k (the mass before rank k is Z_k > thr).
        if use_p:
            vb, ab_c, ab_w, n, gw = select(words, row, vocab, inv_t, m, key_j, key_m, False, 0, 0, True, True, thr,
                                           hist_c, hist_w, sh1, sh2)
            t = tie_share(ab_w, n, gw, thr)
        else:
            vb, ab_c, ab_w, n, gw = select(words, row, vocab, inv_t, m, key_j, key_m, False, 0, kk, False, False,
                                           0.0, hist_c, hist_w, sh1, sh2)
            t = kk - ab_c
        last = np.int64(vocab - 1)                            # tokens with key vb and index <= last are in S
        if t < n:
            v, _, _, _, _ = select(words, row, vocab, inv_t, m, np.int64(0), np.int64(vocab - 1), True, vb, t,
                                   False, False, 0.0, hist_c, hist_w, sh1, sh2)
            last = vocab - 1 - v

        # the argmax over S with the same noise
        best, tok = NEG_INF, np.int64(vocab)
        for g in range(tid, (vocab + 3) // 4, threads):
            ls = load4(words, row, g, vocab)
            drawn = False
            r = (np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0))
            for e in range(4):
                i = 4 * g + e
                x = scaled(ls[e], inv_t)
                kx = np.int64(key(x))
                if i < vocab and (kx > vb or (kx == vb and i <= last)) and add(x, G_MAX) >= lb:
                    if not drawn:
                        r = philox(position, comp_index, g, 0, k0, k1)
                        drawn = True
                    if x + fast_gumbel(r[e]) + FAST_MARGIN >= best:
                        s = add(x, gumbel(r[e]))
                        if s > best:
                            best, tok = s, np.int64(i)
        best, tok = block_argmax(best, tok, shf, sh1)
        return tok

    def fallback(words, vocab, temperature, top_k, top_p, seed, comp_index, position, out_tokens, out_logprobs,
                 state_i, state_f):
        row = cuda.blockIdx.x
        if state_i[row, 8] == 0:                              # the hot kernel finished this row
            return
        hist_c = cuda.shared.array(NB, np.int32)
        hist_w = cuda.shared.array(NB, np.int64)
        shf = cuda.shared.array(NW, np.float32)
        sh1 = cuda.shared.array(NW if NW > 4 else 4, np.int64)
        sh2 = cuda.shared.array(NW if NW > 4 else 4, np.int64)
        st = (state_i[row, 0], state_i[row, 1], state_i[row, 2], state_i[row, 3], state_i[row, 4],
              state_i[row, 5], state_i[row, 6], state_i[row, 7])
        token = fallback_row(words, row, np.int64(vocab), temperature[row], top_k[row], top_p[row], seed[row],
                             comp_index[row], position[row], state_f[row, 0], st, hist_c, hist_w, shf, sh1, sh2)
        if cuda.threadIdx.x == 0:
            out_tokens[row] = token
            out_logprobs[row] = load1(words, row, token, np.int64(vocab)) - state_f[row, 1]

    def split_fallback(words, vocab, chunks, temperature, top_k, top_p, seed, comp_index, position, out_tokens,
                       out_logprobs, state_i, state_f, part_i, part_f):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        hist_c = cuda.shared.array(NB, np.int32)
        hist_w = cuda.shared.array(NB, np.int64)
        shf = cuda.shared.array(NW, np.float32)
        sh1 = cuda.shared.array(NW if NW > 4 else 4, np.int64)
        sh2 = cuda.shared.array(NW if NW > 4 else 4, np.int64)
        vocab = np.int64(vocab)
        t, tk, tp = temperature[row], top_k[row], top_p[row]
        rmax = state_f[row, 0]
        token = state_i[row, 0]                               # greedy: the argmax; sampled: j
        kk = np.int64(tk) if 0 < tk < vocab else vocab
        use_p = tp < 1
        base = row * chunks
        total = state_i[row, 3]
        cnt, mass = np.int64(0), np.int64(0)
        c0, c1, c2, c3 = np.int64(0), np.int64(0), np.int64(0), np.int64(0)
        # every thread merges (the conditions are the row's, so whole warps shuffle); exact sums: all agree
        if t > 0 and rmax > NEG_INF and (kk < vocab or use_p):
            cnt, mass = parts_sum(part_i, base, chunks, 3), parts_sum(part_i, base, chunks, 4)
            if kk < vocab and use_p:                          # Z_k from below: see the split path's notes
                c0, c1 = parts_sum(part_i, base, chunks, 5), parts_sum(part_i, base, chunks, 6)
                c2, c3 = parts_sum(part_i, base, chunks, 7), parts_sum(part_i, base, chunks, 8)
                if cnt < kk:
                    inv_t = inverse_temperature(t)
                    m = scaled(rmax, inv_t)
                    zlo = mass + weight(scaled(load1(words, row, token, vocab), inv_t), m)
                    if c0 <= kk:                              # M_q: a prefix of at most K' ranks
                        zlo = max(zlo, parts_sum(part_i, base, chunks, 9))
                    if c1 <= kk:
                        zlo = max(zlo, parts_sum(part_i, base, chunks, 10))
                    if c2 <= kk:
                        zlo = max(zlo, parts_sum(part_i, base, chunks, 11))
                    if c3 <= kk:
                        zlo = max(zlo, parts_sum(part_i, base, chunks, 12))
                    if not np.float64(mass) < np.float64(np.float32(tp)) * np.float64(zlo):
                        token = np.int64(-1)
                else:
                    token = np.int64(-1)
            elif use_p:
                if not np.float64(mass) < np.float64(tp) * np.float64(total):
                    token = np.int64(-1)
            elif cnt >= kk:
                token = np.int64(-1)
        if token < 0:
            st = (state_i[row, 0], cnt, mass, total, c0, c1, c2, c3)
            token = fallback_row(words, row, vocab, t, tk, tp, seed[row], comp_index[row], position[row], rmax, st,
                                 hist_c, hist_w, shf, sh1, sh2)
        if tid == 0:
            out_tokens[row] = token
            out_logprobs[row] = load1(words, row, token, vocab) - state_f[row, 1]

    kernel = split_fallback if split else fallback
    return cuda.jit(kernel) if SIMULATOR else cuda.jit(launch_bounds=(threads, 1))(kernel)


# ----------------------------------------------------------------------------------------
# launchers


def launch(words, vocab, kind, vec, temperature, top_k, top_p, seed, comp_index, position, out_tokens,
           out_logprobs, state_i, state_f, stream=0, threads=THREADS, fallback_threads=FALLBACK_THREADS,
           nbins_log2=NBINS_LOG2):
    """Launch the hot kernel, then the fallback kernel, one CTA per row each, no checks.

    words: the [N, V] logits as one flat array of words (see _make_loaders): f32 -> int32/uint32 bits;
        fp16/bf16 -> int64 (vec) or int16/uint16 (not vec). kind: "f32", "f16" or "bf16"; vec needs
        V % 4 == 0 and a base aligned to the load (16 bytes f32, 8 bytes fp16/bf16).
    temperature [N] float32; top_k [N] int32; top_p [N] float32; seed [N] int64; comp_index,
    position [N] int32; out_tokens [N] int32; out_logprobs [N] float32; state_i [N, 9] int64 and
    state_f [N, 2] float32: scratch passed from the first kernel to the second. numba device arrays
    (numpy under the simulator). stream: a numba stream.
    """
    n = out_tokens.shape[0]
    if n == 0:
        return
    args = (words, vocab, temperature, top_k, top_p, seed, comp_index, position, out_tokens, out_logprobs,
            state_i, state_f)
    launch_kernel(make_hot_kernel(kind, bool(vec), threads), n, threads, args, stream)
    launch_kernel(make_fallback_kernel(kind, bool(vec), fallback_threads, nbins_log2), n, fallback_threads, args,
                  stream)


def launch_split(words, vocab, kind, vec, chunks, temperature, top_k, top_p, seed, comp_index, position,
                 out_tokens, out_logprobs, state_i, state_f, part_i, part_f, stream=0, threads=THREADS,
                 fallback_threads=FALLBACK_THREADS, nbins_log2=NBINS_LOG2):
    """Launch the split path, no checks: passes 1-3 on rows * chunks CTAs, then the split fallback on
    one CTA per row. Arguments as in launch, plus chunks (CTAs per row, >= 1), part_i
    [rows * chunks, len(PART_I64)] int64 and part_f [rows * chunks, len(PART_F32)] float32 (scratch)."""
    n = out_tokens.shape[0]
    if n == 0:
        return
    args = (words, vocab, chunks, temperature, top_k, top_p, seed, comp_index, position, out_tokens, out_logprobs,
            state_i, state_f, part_i, part_f)
    for kernel in make_split_kernels(kind, bool(vec), threads):
        launch_kernel(kernel, n * chunks, threads, args, stream)
    launch_kernel(make_fallback_kernel(kind, bool(vec), fallback_threads, nbins_log2, True), n, fallback_threads,
                  args, stream)


_KINDS = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16"}
def _state(device, n, chunks=0):
    """The scratch one kernel leaves to the next, one per (device, stream, rows, chunks): (state_i, state_f)
    and, for the split path (chunks >= 1), the partials (part_i, part_f); bridge.scratch's buffers, so each
    engine's share goes when it closes (bridge.release). Calls on one stream run in order, so reusing it is
    safe, also inside a captured graph. Zeroed once: the split fallback sums partials a row does not use
    (never their values), which then stay finite."""
    shapes = [((n, len(STATE_I64)), np.int64), ((n, len(STATE_F32)), np.float32)]
    if chunks:
        shapes += [((n * chunks, len(PART_I64)), np.int64), ((n * chunks, len(PART_F32)), np.float32)]
    return tuple(scratch(device, shape, dtype, zero=True, tag="sampling") for shape, dtype in shapes)


def clear_caches():
    """Nothing of its own: the scratch is bridge's (bridge.clear_caches drops it with the views)."""


_PARAMS = (("temperature", "float32"), ("top_k", "int32"), ("top_p", "float32"), ("seed", "int64"),
           ("index", "int32"), ("position", "int32"))


def check_args(logits, params, out_tokens, out_logprobs, on_cpu):
    import torch

    from kernels_numba.errors import KernelLaunchError

    def check(name, t, dim, dtypes):
        if on_cpu:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                raise KernelLaunchError(f"{name} must be a CPU torch.Tensor")
            if t.dim() != dim or t.dtype not in dtypes:
                raise KernelLaunchError(f"{name} must be {dim}-D {[str(d) for d in dtypes]}, got "
                                        f"{tuple(t.shape)} {t.dtype}")
        else:
            check_tensor(name, t, dim, dtypes)
        if not t.is_contiguous():
            raise KernelLaunchError(f"{name} must be contiguous")

    check("logits", logits, 2, (torch.float32, torch.float16, torch.bfloat16))
    n, vocab = logits.shape
    if not 1 <= vocab <= MAX_VOCAB:
        raise KernelLaunchError(f"vocab size {vocab} must be in [1, {MAX_VOCAB}]")
    named = dict(zip((p for p, _ in _PARAMS), params))
    named["out_tokens"], named["out_logprobs"] = out_tokens, out_logprobs
    dtypes = dict(_PARAMS, out_tokens="int32", out_logprobs="float32")
    for name, t in named.items():
        check(name, t, 1, (getattr(torch, dtypes[name]),))
        if t.shape[0] != n:
            raise KernelLaunchError(f"{name} must have {n} rows (one per logits row), got {t.shape[0]}")
        if t.device != logits.device:
            raise KernelLaunchError(f"{name} is on {t.device}, logits on {logits.device}")


def torch_launch_args(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs, chunks):
    """The launchers' arguments for torch tensors (checked by the caller): (words, vocab, kind, vec, args),
    args = the parameters' and outputs' views and the scratch of `chunks` CTAs per row (0: the one-CTA
    path's). Shared by sample_cuda and the journey's v1 (sampling_journey.py)."""
    import torch

    n, vocab = logits.shape
    kind = _KINDS[str(logits.dtype)]
    align = 16 if kind == "f32" else 8
    vec = vocab % 4 == 0 and logits.data_ptr() % align == 0
    words = as_array(logits.view(torch.int32 if kind == "f32" else (torch.int64 if vec else torch.int16)), flat=True)
    # the engine passes the same small static buffers step after step: their views are cached
    params = (temperature, top_k, top_p, seed, index, position)
    args = [cached_view(t) for t in params] + [cached_view(out_tokens), cached_view(out_logprobs)]
    args += list(_state(logits.device, n, chunks))
    return words, vocab, kind, vec, args


def run_on_stream(device, go):
    """go() under the simulator, else go(stream=) on torch's current stream of `device` (made current)."""
    import torch

    if SIMULATOR:
        go()
    elif torch.cuda.current_device() != device.index:
        with torch.cuda.device(device):
            go(stream=torch_stream(device))
    else:
        go(stream=torch_stream(device))


def sample_cuda(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs,
                threads=THREADS, fallback_threads=FALLBACK_THREADS, nbins_log2=NBINS_LOG2, chunks=None):
    """Sample one token per row on the GPU (v2, the split path), on torch's current stream: no host sync,
    no allocation, launch configuration fixed by (N, V, dtype), so a CUDA graph can capture it.

    chunks: CTAs per row (>= 1; tests and benches force it); None: split_chunks(N, V, threads).

    logits [N, V] float32/float16/bfloat16; temperature [N] float32 (<= 0: greedy); top_k [N] int32
    (<= 0 or >= V: off); top_p [N] float32 (>= 1: off); seed [N] int64 (the 64-bit key); index [N]
    int32 (completion index); position [N] int32 (tokens this completion generated before);
    out_tokens [N] int32, out_logprobs [N] float32 (written). All contiguous, on one CUDA device
    (CPU under the simulator). Returns (out_tokens, out_logprobs).
    """
    params = (temperature, top_k, top_p, seed, index, position)
    check_args(logits, params, out_tokens, out_logprobs, on_cpu=False)
    n, vocab = logits.shape
    if n == 0:
        return out_tokens, out_logprobs
    if chunks is None:
        chunks = split_chunks(n, vocab, threads)
    if chunks < 1:
        from kernels_numba.errors import KernelLaunchError

        raise KernelLaunchError(f"chunks={chunks}: the split path runs >= 1 CTA per row "
                                "(the one-CTA path is the journey's v1, sampling_journey.py)")
    words, vocab, kind, vec, args = torch_launch_args(logits, *params, out_tokens, out_logprobs, chunks)
    config = dict(threads=threads, fallback_threads=fallback_threads, nbins_log2=nbins_log2)
    run_on_stream(logits.device, lambda **kw: launch_split(words, vocab, kind, vec, chunks, *args, **kw, **config))
    return out_tokens, out_logprobs


def sample_cpu(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs):
    """The same as sample_cuda for CPU tensors (compiled by numba @njit, cached on disk; one row at a
    time). Returns (out_tokens, out_logprobs)."""
    params = tuple(t.contiguous() for t in (temperature, top_k, top_p, seed, index, position))
    check_args(logits.contiguous(), params, out_tokens, out_logprobs, on_cpu=True)
    if logits.shape[0] == 0:
        return out_tokens, out_logprobs
    x = logits.detach().float().contiguous().numpy()     # fp16/bf16 widen exactly
    tokens = np.empty(logits.shape[0], dtype=np.int64)
    logprobs = np.empty(logits.shape[0], dtype=np.float64)
    _rows_cpu(x, *(t.numpy() for t in params), tokens, logprobs)
    out_tokens.numpy()[:] = tokens
    out_logprobs.numpy()[:] = logprobs
    return out_tokens, out_logprobs
