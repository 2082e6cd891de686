"""The sampling rule, written the slow and obvious way in numpy: the ground truth for the kernels.

Everything the token depends on is computed with IEEE float32 operations that round the same way on
every machine (add, multiply, divide; no library exp/log, no fused multiply-add), or with integers,
so kernels_numba's samplers (sampling_cpu.py on the CPU, sampling.py on CUDA) must return exactly the tokens
this module returns.

Per row (logits l [V] float32; NaN counts as -inf):
    temperature T <= 0 (or a row of -inf): token = argmax l, ties -> lowest index.
    else:
      x_i   = min(l_i * inv_t, FLT_MAX) + 0,  inv_t = clamp(1 / T, 2**-126, FLT_MAX)
              (+0 turns -0 into +0, so equal floats are equal bits)
      rank  = order by (x desc, index asc)
      w_i   = floor(exp(x_i - max x) * 2**40), an int64 weight (0 once x_i - max x < -28), exp = det_exp
      S     = the first L ranks: K' = top_k if 0 < top_k < V else V; Z_k = sum of the first K' weights;
              with top_p < 1, rank r stays while float64(C_r) < float64(top_p) * float64(Z_k), where C_r is
              the sum of the weights ranked before r (the top token always stays); L = K' otherwise
      token = argmax over S of (x_i + gumbel_i) in float32, ties -> lowest index
    gumbel_i = -det_log(-det_log(u_i)), u_i = ((r >> 9) + 0.5) * 2**-23 with r = word i % 4 of
      philox4x32_10(counter=(position, completion index, i // 4, 0), key=(seed low 32 bits, seed high 32 bits))
    logprob = log_softmax(l)[token] in float64 (vLLM's raw logprobs).

The weights are integers so that the nucleus sums do not depend on the order of the additions (a GPU
adds in a different order than a loop); 2**40 keeps every weight exact to ~1e-12 of the top one.
"""
import numpy as np

# Philox4x32 (Random123): round multipliers and the Weyl key increments
PHILOX_M0, PHILOX_M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
PHILOX_W0, PHILOX_W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)

F32 = np.float32
ZERO, HALF, ONE = F32(0.0), F32(0.5), F32(1.0)
FLT_MAX = F32(np.finfo(np.float32).max)
INV_T_MIN = F32(2.0**-126)
TWO_M23 = F32(2.0**-23)
WEIGHT_BITS = 40
WEIGHT_ONE = F32(2.0**WEIGHT_BITS)
WEIGHT_CUT = F32(-28.0)            # exp(-28) * 2**40 < 0.7: weights below are 0
MAX_VOCAB = 1 << 21                # V * 2**40 * (1 + 1e-7) < 2**62: the int64 sums cannot overflow
# det_log: log(f) = 2s (1 + s^2/3 + s^4/5 + ...), s = (f - 1) / (f + 1), f in [sqrt(1/2), sqrt(2))
SQRT2 = F32(1.4142135)
LOG_C = tuple(F32(1.0 / k) for k in (11, 9, 7, 5, 3))
LN2_HI, LN2_LO = F32(0.693145751953125), F32(1.428606765330187e-06)   # LN2_HI * e is exact for |e| < 256
# det_exp on [-28, 0]: 2**k * exp(r), |r| <= ln(2)/2, Taylor to r^7 (relative error < 2e-8)
LOG2E = F32(1.4426950408889634)
EXP_C = tuple(F32(1.0 / f) for f in (5040, 720, 120, 24, 6, 2, 1, 1))
# the Gumbel noise of a 23-bit uniform lies in [-2.82, 16.64]; the kernels skip tokens with
# x + G_MAX below (max x) + G_MIN, which can never win
G_MAX, G_MIN = F32(17.0), F32(-3.0)
# the largest noise, that of u = 1 - 2**-24 (word 0xFFFFFFFF): no token scores more than x_i + G_TOP, so
# the split kernels skip the tokens with fl(x_i + G_TOP) below a score already reached
G_TOP = F32(16.635532)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32 with 10 rounds, vectorised: counters c0..c3 and keys k0, k1 are uint32 arrays (or
    scalars) that broadcast together. Returns 4 uint32 arrays, the output words 0..3."""
    c0, c1, c2, c3, k0, k1 = np.broadcast_arrays(*(np.asarray(a, dtype=np.uint32) for a in (c0, c1, c2, c3, k0, k1)))
    for _ in range(10):
        p0 = c0.astype(np.uint64) * PHILOX_M0                                    # 64-bit products
        p1 = c2.astype(np.uint64) * PHILOX_M1
        c0, c1, c2, c3 = (
            (p1 >> np.uint64(32)).astype(np.uint32) ^ c1 ^ k0,
            (p1 & _MASK32).astype(np.uint32),
            (p0 >> np.uint64(32)).astype(np.uint32) ^ c3 ^ k1,
            (p0 & _MASK32).astype(np.uint32),
        )
        k0 = ((k0.astype(np.uint64) + PHILOX_W0) & _MASK32).astype(np.uint32)
        k1 = ((k1.astype(np.uint64) + PHILOX_W1) & _MASK32).astype(np.uint32)
    return c0, c1, c2, c3


def uniform(r):
    """uint32 words -> float32 in (0, 1): 23 bits, ((r >> 9) + 0.5) * 2**-23 (exact in float32)."""
    return ((np.asarray(r, dtype=np.uint32) >> np.uint32(9)).astype(np.float32) + HALF) * TWO_M23


def det_log(x):
    """Natural log of positive normal float32 values with rounded float32 operations only."""
    x = np.asarray(x, dtype=np.float32)
    b = x.view(np.uint32)
    e = ((b >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32) - 127
    f = ((b & np.uint32(0x007FFFFF)) | np.uint32(0x3F800000)).view(np.float32)   # mantissa in [1, 2)
    big = f > SQRT2
    f = np.where(big, f * HALF, f)                                                 # now in [0.707, 1.414]
    e = e + big.astype(np.int32)
    s = (f - ONE) / (f + ONE)
    z = s * s
    p = LOG_C[0]
    for c in LOG_C[1:]:
        p = p * z + c
    p = p * z
    s2 = s + s
    ef = e.astype(np.float32)
    return ef * LN2_HI + (s2 + s2 * p + ef * LN2_LO)


def det_exp(d):
    """exp(d) for float32 d in [-28, 0] with rounded float32 operations only."""
    d = np.asarray(d, dtype=np.float32)
    k = np.floor(d * LOG2E + HALF)                                                 # float32, integral
    r = d + k * (-LN2_HI)
    r = r + k * (-LN2_LO)
    p = EXP_C[0]
    for c in EXP_C[1:]:
        p = p * r + c
    scale = ((k.astype(np.int32) + 127).astype(np.uint32) << np.uint32(23)).view(np.float32)   # 2**k
    return p * scale


def gumbel(r):
    """Gumbel(0, 1) noise of uint32 words: -log(-log(u)), float32."""
    return -det_log(-det_log(uniform(r)))


def scaled_logits(l, inv_t):
    """x = min(l * inv_t, FLT_MAX) + 0 (float32; -0 becomes +0)."""
    return np.minimum(np.asarray(l, dtype=np.float32) * inv_t, FLT_MAX) + ZERO


def inverse_temperature(t):
    """clamp(1 / t, 2**-126, FLT_MAX) in float32 (t > 0)."""
    return min(max(ONE / F32(t), INV_T_MIN), FLT_MAX)


def weights(x, m):
    """int64 weights floor(det_exp(x - m) * 2**40); 0 where x - m < -28."""
    d = np.asarray(x, dtype=np.float32) - m
    keep = d >= WEIGHT_CUT
    e = det_exp(np.where(keep, d, ZERO))
    return np.where(keep, (e * WEIGHT_ONE).astype(np.int64), 0)


def noise_words(seed, index, position, tokens):
    """The Philox word of each token id in `tokens` for one row's key and counter."""
    tokens = np.asarray(tokens, dtype=np.int64)
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    words = philox4x32_10(position, index, tokens // 4, 0, seed & 0xFFFFFFFF, seed >> 32)
    return np.choose(tokens % 4, words)


def allowed_set(x, top_k, top_p):
    """Token ids of S in rank order, for scaled logits x [V] float32."""
    vocab = x.shape[0]
    order = np.lexsort((np.arange(vocab), -x))                                     # x desc, index asc
    kk = top_k if 0 < top_k < vocab else vocab
    if not top_p < 1:
        return order[:kk]
    w = weights(x[order], x.max())                                                 # (V,) int64, rank order
    before = np.cumsum(w) - w                                                      # C_r, exact
    thr = np.float64(np.float32(top_p)) * np.float64(w[:kk].sum())
    keep = before[:kk].astype(np.float64) < thr                                    # a prefix of the ranks
    return order[: int(keep.sum())]


def sample_row(logits, temperature, top_k, top_p, seed, index, position):
    """One row: logits [V] (any float dtype; compared as float32). Returns (token, logprob float64)."""
    l = np.asarray(logits, dtype=np.float32)
    l = np.where(np.isnan(l), np.float32(-np.inf), l)
    l64 = l.astype(np.float64)
    top = l64.max()
    with np.errstate(invalid="ignore", divide="ignore"):
        lse = top + np.log(np.exp(l64 - top).sum())
    if not np.float32(temperature) > 0 or top == -np.inf:
        token = int(np.argmax(l))
    else:
        x = scaled_logits(l, inverse_temperature(temperature))
        allowed = allowed_set(x, int(top_k), np.float32(top_p))
        score = x[allowed] + gumbel(noise_words(seed, index, position, allowed))     # float32
        token = int(allowed[score == score.max()].min())
    with np.errstate(invalid="ignore"):
        return token, float(l64[token] - lse)


def sample(logits, temperature, top_k, top_p, seed, index, position):
    """Reference sampler over rows.

    logits: [N, V] float array (float16/bfloat16 values widen exactly to float32).
    temperature [N] float32 (<= 0: greedy); top_k [N] int (<= 0 or >= V: off); top_p [N] float32
    (>= 1: off); seed [N] int (64-bit keys; int64 two's complement accepted); index, position [N] int.
    Returns (tokens [N] int64, logprobs [N] float64).
    """
    logits = np.asarray(logits)
    n = logits.shape[0]
    out = [sample_row(logits[i], temperature[i], top_k[i], top_p[i], seed[i], index[i], position[i]) for i in range(n)]
    return np.array([t for t, _ in out], dtype=np.int64), np.array([lp for _, lp in out], dtype=np.float64)


def exact_distribution(logits, temperature, top_k, top_p):
    """The distribution the rule samples from, in float64 (for statistical tests): softmax(x) over S
    (S from the rule above, so the ranks and the nucleus cut are the rule's own). logits: [V].
    Returns probs [V] float64."""
    l = np.asarray(logits, dtype=np.float32)
    x = scaled_logits(l, inverse_temperature(temperature))
    allowed = allowed_set(x, int(top_k), np.float32(top_p))
    p = np.zeros(l.shape[0])
    xs = x[allowed].astype(np.float64)
    p[allowed] = np.exp(xs - xs.max())
    return p / p.sum()
