"""The sampling rule's pieces both samplers share: its constants, its scalar functions, its argument checks.

The rule (reference/sampling.py writes it out in numpy; the CPU sampler, sampling_cpu.py, and the CUDA
kernels, sampling.py, give its tokens bit for bit):
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

Written once here, for both samplers (this module imports numba's CPU target and numpy, never
numba.cuda: the CPU sampler starts without it):
    the constants: PHILOX_*, the float32 constants of det_log / det_exp, G_MAX / G_MIN / G_TOP (bounds
        of the noise), MAX_VOCAB, ...
    make_math(jit, mul, add, div, bits, from_bits): the rule's scalar functions (philox, det_log,
        det_exp, gumbel, weight, scaled, inverse_temperature, key, clean) built for one target. CPU is
        their numba CPU build, also bound to module-level names (philox, det_log, ...) for @njit code;
        sampling_parts.GPU is their CUDA device build.
    check_args(logits, params, out_tokens, out_logprobs, check_tensor): what every sampler takes.
"""
import math
from types import SimpleNamespace

import numpy as np
from numba import njit

from kernels_numba.cpu_simd import f32_bits, f32_from_bits

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

U32_SIGN, U32_ONES = np.uint32(0x80000000), np.uint32(0xFFFFFFFF)
EXP_SHIFT, EXP_MASK, MANT_MASK, ONE_BITS = np.uint32(23), np.uint32(0xFF), np.uint32(0x007FFFFF), np.uint32(0x3F800000)
U_SHIFT = np.uint32(9)


# ----------------------------------------------------------------------------------------
# the scalar math, written once and compiled for CUDA, for the simulator and for the CPU


def make_math(jit, mul, add, div, bits, from_bits):
    """The rule's scalar functions built by `jit` (njit here, cuda.jit(device=True) in sampling_parts).
    mul/add/div: float32 operations rounded once each (never fused); bits/from_bits: float32 <-> uint32
    reinterpretation."""

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


CPU = make_math(njit, _mul, _add, _div, f32_bits, f32_from_bits)
# module-level names: numba resolves globals, not attributes of a namespace
philox, det_log, det_exp, gumbel, weight = CPU.philox, CPU.det_log, CPU.det_exp, CPU.gumbel, CPU.weight
scaled, inverse_temperature, key, clean = CPU.scaled, CPU.inverse_temperature, CPU.key, CPU.clean


# ----------------------------------------------------------------------------------------
# arguments

_PARAMS = (("temperature", "float32"), ("top_k", "int32"), ("top_p", "float32"), ("seed", "int64"),
           ("index", "int32"), ("position", "int32"))


def check_args(logits, params, out_tokens, out_logprobs, check_tensor):
    """KernelLaunchError naming the first argument a sampler cannot take. logits [N, V] float32/float16/
    bfloat16 with 1 <= V <= MAX_VOCAB; params (temperature, top_k, top_p, seed, index, position) and
    out_tokens, out_logprobs [N] of the dtypes in _PARAMS (int32, float32 for the outputs); all contiguous,
    on logits' device. check_tensor(name, t, dim, dtypes): the device's check of one tensor (bridge's for
    the kernels, sampling_cpu's for CPU tensors)."""
    import torch

    from kernels_numba.errors import KernelLaunchError

    def check(name, t, dim, dtypes):
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
