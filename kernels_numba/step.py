"""The whole Qwen2 decode step of 1-8 sequences as numba.cuda phases: the step family's v0.

A decode step is a chain of phases, each a device function of (cta, num_ctas, ...) that loops over its own
work items `cta, cta + num_ctas, ...` and never reads the grid itself:

    embed                      x[s] = embed[token[s]]                                 item: a sequence
    per layer:
      rms_norm                 h[s] = w * x[s] / sqrt(mean(x[s]^2) + eps)             item: a sequence
      linear (q, k, v)         qkv[s, n] = h[s] . Wqkv[n] + b[n]                      item: an output column
      rotary_kv                rotate q and k of (s, head) at s's position;           item: (sequence, head)
                               a K/V head's k and v written to its pool slot
      attention                a[s, head] = softmax(q k^T * scale) v over the pool    item: (sequence, head)
      linear (o, + residual)   x[s, n] += a[s] . Wo[n]                                item: an output column
      rms_norm                 h[s] = ...
      gate_up                  m[s, i] = silu(h[s] . Wg[i]) * (h[s] . Wu[i])          item: an intermediate column
      linear (down, + resid.)  x[s, n] += m[s] . Wd[n]                                item: an output column
    rms_norm, linear (LM head) logits[s, v] = h[s] . W_lm[v]                          item: a vocabulary column
    argmax                     ids[s] = the lowest v of the largest logit             item: a sequence

A CTA is WARPS warps; the column phases give each warp one output column at a time for every sequence of the
step at once (a lane reads K / 32 of the column's weights once and multiplies them into up to MAX_S rows:
the weights, which are most of a decode step's bytes, are read once per step whatever S is). The activations
and the residual stream are float32 (small: S x hidden); the weights and the KV pool are float16 or float32 (torch
hands numba no bfloat16 array; a later version reads bfloat16 as 16-bit words, as the decode family does),
widened on load.

v0 drives the phases with one launch each (`StepKernels.decode_step`): the baseline the later versions (v1:
the column phases reading 16 bytes a load and attention's keys over a CTA's warps, in 16-warp CTAs,
`make_column_phases`, `attention_v1`; v2: v1 with a warp taking 2 adjacent columns at a time (2 gate and 2 up
rows for gate/up) and the argmax split over every CTA, `argmax_parts` then `argmax_merge`; then one persistent
launch with a barrier between dependent phases, counters, prefetch: docs/kernels.md, "The step family") are
measured against, and the driver numba's CUDA simulator can run (it runs a grid's CTAs one after another, so
any wait between CTAs would hang it). Its ground truth is reference/step.py (float64).
"""
import math

import numpy as np
from numba import cuda, float32, int32

from kernels_numba import bridge
from kernels_numba.bridge import torch_stream
from kernels_numba.common import f16x2_to_f32, f32_from_bits, load_u32x4, warp_sum

WARPS = 4                   # warps per CTA
THREADS = 32 * WARPS
MAX_S = 8                   # sequences per step
MAX_D_PER_LANE = 4          # head_dim <= 128
SCRATCH = WARPS + 1         # block_sum's shared slots: one per warp, one for the total


@cuda.jit(device=True)
def block_sum(value, scratch):
    """Sum of `value` over the CTA's threads, returned to every thread. scratch: shared float32[SCRATCH]."""
    tid = cuda.threadIdx.x
    value = warp_sum(value)
    if tid % 32 == 0:
        scratch[tid // 32] = value
    cuda.syncthreads()
    if tid == 0:
        total = float32(0.0)
        for w in range(WARPS):
            total += scratch[w]
        scratch[WARPS] = total
    cuda.syncthreads()
    total = scratch[WARPS]
    cuda.syncthreads()                 # nobody writes scratch again before every thread has read it
    return total


@cuda.jit(device=True)
def embed_phase(cta, num_ctas, tokens, embed, x):
    for s in range(cta, x.shape[0], num_ctas):
        for e in range(cuda.threadIdx.x, x.shape[1], THREADS):
            x[s, e] = float32(embed[tokens[s], e])


@cuda.jit(device=True)
def rms_norm_phase(cta, num_ctas, x, weight, eps, h):
    scratch = cuda.shared.array(SCRATCH, float32)
    E = x.shape[1]
    for s in range(cta, x.shape[0], num_ctas):
        squares = float32(0.0)
        for e in range(cuda.threadIdx.x, E, THREADS):
            squares += x[s, e] * x[s, e]
        inv = float32(1.0) / math.sqrt(block_sum(squares, scratch) / float32(E) + eps)
        for e in range(cuda.threadIdx.x, E, THREADS):
            h[s, e] = float32(weight[e]) * (x[s, e] * inv)


@cuda.jit(device=True)
def linear_phase(cta, num_ctas, h, weight, bias, has_bias, accumulate, out):
    """out[s, n] (+)= h[s] . weight[n] (+ bias[n]) for every sequence s: one warp per column n at a time."""
    S, K = h.shape
    lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    acc = cuda.local.array(MAX_S, float32)
    for n in range(cta * WARPS + warp, weight.shape[0], num_ctas * WARPS):
        for s in range(MAX_S):
            acc[s] = float32(0.0)
        for k in range(lane, K, 32):
            w = float32(weight[n, k])
            for s in range(MAX_S):
                if s < S:
                    acc[s] += h[s, k] * w
        for s in range(MAX_S):
            if s < S:
                total = warp_sum(acc[s])
                if lane == 0:
                    if has_bias:
                        total += float32(bias[n])
                    if accumulate:
                        total += out[s, n]
                    out[s, n] = total


@cuda.jit(device=True)
def gate_up_phase(cta, num_ctas, h, w_gate, w_up, m):
    """m[s, i] = silu(h[s] . w_gate[i]) * (h[s] . w_up[i]): one warp per intermediate column i at a time."""
    S, K = h.shape
    lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    g = cuda.local.array(MAX_S, float32)
    u = cuda.local.array(MAX_S, float32)
    for i in range(cta * WARPS + warp, w_gate.shape[0], num_ctas * WARPS):
        for s in range(MAX_S):
            g[s] = float32(0.0)
            u[s] = float32(0.0)
        for k in range(lane, K, 32):
            wg, wu = float32(w_gate[i, k]), float32(w_up[i, k])
            for s in range(MAX_S):
                if s < S:
                    g[s] += h[s, k] * wg
                    u[s] += h[s, k] * wu
        for s in range(MAX_S):
            if s < S:
                gs, us = warp_sum(g[s]), warp_sum(u[s])
                if lane == 0:
                    m[s, i] = gs / (float32(1.0) + math.exp(-gs)) * us


@cuda.jit(device=True)
def rotary_kv_phase(cta, num_ctas, qkv, positions, cos, sin, num_heads, num_kv_heads, k_pool, v_pool, tables):
    """Rotate each (sequence, head)'s q or k in place (rotate-half by the tables cos, sin [position, D / 2]);
    a K/V head also writes its k and v to the sequence's slot in the pool [blocks, kv heads, block, D]."""
    S = qkv.shape[0]
    D, BS = k_pool.shape[3], k_pool.shape[2]
    half = D // 2
    lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    heads = num_heads + num_kv_heads
    for item in range(cta * WARPS + warp, S * heads, num_ctas * WARPS):
        s, head = item // heads, item % heads
        base = head * D                                       # q heads, then k heads
        pos = positions[s]
        kv = head - num_heads
        block, offset = tables[s, pos // BS], pos % BS
        for i in range(lane, half, 32):
            c, sn = cos[pos, i], sin[pos, i]
            x1, x2 = qkv[s, base + i], qkv[s, base + i + half]
            r1, r2 = x1 * c - x2 * sn, x2 * c + x1 * sn
            if head < num_heads:                              # q: rotated in place, for the attention phase
                qkv[s, base + i] = r1
                qkv[s, base + i + half] = r2
            else:                                             # k: straight from the registers to the pool
                k_pool[block, kv, offset, i] = r1
                k_pool[block, kv, offset, i + half] = r2
        if head >= num_heads:
            v_base = (num_heads + num_kv_heads + kv) * D      # v: copied as it is (no lane reads another's write)
            for d in range(lane, D, 32):
                v_pool[block, kv, offset, d] = qkv[s, v_base + d]


@cuda.jit(device=True, inline="always")
def attend_run(qkv, k_pool, v_pool, tables, s, head, kv, scale, t_lo, t_hi, lane, q, acc):
    """One warp's online softmax of query head `head` of sequence s over its keys t_lo .. t_hi - 1 (K/V head kv),
    in order, the lanes over head_dim: q gets the scaled query, acc the unnormalised output (this lane's dims
    lane, lane + 32, ...). Returns (running max, sum); (-inf, 0) for no key."""
    D, BS = k_pool.shape[3], k_pool.shape[2]
    for j in range(MAX_D_PER_LANE):
        d = lane + 32 * j
        q[j] = qkv[s, head * D + d] * scale if d < D else float32(0.0)
        acc[j] = float32(0.0)
    m, l = float32(-math.inf), float32(0.0)
    for t in range(t_lo, t_hi):
        block, offset = tables[s, t // BS], t % BS
        partial = float32(0.0)
        for j in range(MAX_D_PER_LANE):
            d = lane + 32 * j
            if d < D:
                partial += q[j] * float32(k_pool[block, kv, offset, d])
        score = warp_sum(partial)
        m_new = max(m, score)
        alpha, p = math.exp(m - m_new), math.exp(score - m_new)
        l = l * alpha + p
        for j in range(MAX_D_PER_LANE):
            d = lane + 32 * j
            if d < D:
                acc[j] = acc[j] * alpha + p * float32(v_pool[block, kv, offset, d])
        m = m_new
    return m, l


@cuda.jit(device=True)
def attention_phase(cta, num_ctas, qkv, k_pool, v_pool, tables, positions, num_heads, num_kv_heads, scale, out):
    """out[s, head] = softmax(q . k_t * scale) over t = 0 .. position[s], times v_t: one warp per (sequence,
    head), the lanes over head_dim, the keys in order with an online softmax (running max and sum)."""
    S = qkv.shape[0]
    D = k_pool.shape[3]
    group = num_heads // num_kv_heads
    lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    q = cuda.local.array(MAX_D_PER_LANE, float32)
    acc = cuda.local.array(MAX_D_PER_LANE, float32)
    for item in range(cta * WARPS + warp, S * num_heads, num_ctas * WARPS):
        s, head = item // num_heads, item % num_heads
        _, l = attend_run(qkv, k_pool, v_pool, tables, s, head, head // group, scale, 0, positions[s] + 1, lane,
                          q, acc)
        for j in range(MAX_D_PER_LANE):
            d = lane + 32 * j
            if d < D:
                out[s, head * D + d] = acc[j] / l


@cuda.jit(device=True)
def best_in(logits, s, lo, hi):
    """This thread's (largest logit of row s among lo + tid, lo + tid + THREADS, ... < hi, its index): the first
    of a tie (w < 0: none)."""
    b, w = float32(-math.inf), int32(-1)
    for v in range(lo + cuda.threadIdx.x, hi, THREADS):
        if logits[s, v] > b or w < 0:
            b, w = logits[s, v], v
    return b, w


@cuda.jit(device=True)
def best_of_cta(b, w, best, where):
    """The CTA's (largest value, its lowest index) of every thread's (b, w) (w < 0: none), by a tree in shared
    memory (best, where: THREADS slots), returned to thread 0."""
    tid = cuda.threadIdx.x
    best[tid] = b
    where[tid] = w
    cuda.syncthreads()
    stride = THREADS // 2
    while stride > 0:
        if tid < stride:
            ob, ow = best[tid + stride], where[tid + stride]
            if ow >= 0 and (where[tid] < 0 or ob > best[tid] or (ob == best[tid] and ow < where[tid])):
                best[tid] = ob
                where[tid] = ow
        cuda.syncthreads()
        stride //= 2
    b, w = best[0], where[0]
    cuda.syncthreads()                 # the slots are read before anyone writes them again
    return b, w


@cuda.jit(device=True)
def argmax_phase(cta, num_ctas, logits, ids):
    """ids[s] = the lowest index of row s's largest logit: each thread scans its columns, then a tree."""
    best = cuda.shared.array(THREADS, float32)
    where = cuda.shared.array(THREADS, int32)
    tid = cuda.threadIdx.x
    for s in range(cta, logits.shape[0], num_ctas):
        b, w = best_in(logits, s, 0, logits.shape[1])
        b, w = best_of_cta(b, w, best, where)
        if tid == 0:
            ids[s] = w


@cuda.jit
def argmax_parts(logits, part_best, part_where):
    """v2's argmax, first half: CTA c takes the c-th of gridDim.x slices of the vocabulary and writes each
    row's (largest logit, its lowest index) of that slice to part_best[s, c], part_where[s, c] (-1: an empty
    slice). Every CTA reads V / gridDim.x logits a row, where v0's one CTA reads all V."""
    best = cuda.shared.array(THREADS, float32)
    where = cuda.shared.array(THREADS, int32)
    V = logits.shape[1]
    per = (V + cuda.gridDim.x - 1) // cuda.gridDim.x
    lo = cuda.blockIdx.x * per
    hi = min(V, lo + per)
    for s in range(logits.shape[0]):
        b, w = best_in(logits, s, lo, hi)
        b, w = best_of_cta(b, w, best, where)
        if cuda.threadIdx.x == 0:
            part_best[s, cuda.blockIdx.x] = b
            part_where[s, cuda.blockIdx.x] = w


@cuda.jit
def argmax_merge(part_best, part_where, ids):
    """v2's argmax, second half: a CTA per row over its slices' (best, index): the lowest index of the largest."""
    best = cuda.shared.array(THREADS, float32)
    where = cuda.shared.array(THREADS, int32)
    for s in range(cuda.blockIdx.x, part_best.shape[0], cuda.gridDim.x):
        b, w = float32(-math.inf), int32(-1)
        for c in range(cuda.threadIdx.x, part_best.shape[1], THREADS):
            ow = part_where[s, c]
            if ow >= 0 and (w < 0 or part_best[s, c] > b):   # (slices in index order: a tie keeps the first)
                b, w = part_best[s, c], ow
        b, w = best_of_cta(b, w, best, where)
        if cuda.threadIdx.x == 0:
            ids[s] = w


# ----------------------------------------------------------------------------------------------
# v0's driver: one launch per phase


@cuda.jit
def _embed(tokens, embed, x):
    embed_phase(cuda.blockIdx.x, cuda.gridDim.x, tokens, embed, x)


@cuda.jit
def _rms_norm(x, weight, eps, h):
    rms_norm_phase(cuda.blockIdx.x, cuda.gridDim.x, x, weight, eps, h)


@cuda.jit
def _linear(h, weight, bias, has_bias, accumulate, out):
    linear_phase(cuda.blockIdx.x, cuda.gridDim.x, h, weight, bias, has_bias, accumulate, out)


@cuda.jit
def _gate_up(h, w_gate, w_up, m):
    gate_up_phase(cuda.blockIdx.x, cuda.gridDim.x, h, w_gate, w_up, m)


@cuda.jit
def _rotary_kv(qkv, positions, cos, sin, num_heads, num_kv_heads, k_pool, v_pool, tables):
    rotary_kv_phase(cuda.blockIdx.x, cuda.gridDim.x, qkv, positions, cos, sin, num_heads, num_kv_heads,
                    k_pool, v_pool, tables)


@cuda.jit
def _attention(qkv, k_pool, v_pool, tables, positions, num_heads, num_kv_heads, scale, out):
    attention_phase(cuda.blockIdx.x, cuda.gridDim.x, qkv, k_pool, v_pool, tables, positions, num_heads,
                    num_kv_heads, scale, out)


@cuda.jit
def _argmax(logits, ids):
    argmax_phase(cuda.blockIdx.x, cuda.gridDim.x, logits, ids)


# ----------------------------------------------------------------------------------------------
# v1: the column phases over 16-byte pieces of the weights, 16 warps a CTA


THREADS_V1 = 512            # v1's CTA for the column phases and attention: 16 warps


def make_column_phases(half, cols=1, gate_cols=1):
    """(linear, gate_up) kernels of v1 for 16-bit (half) or float32 weights, given as 1-D uint32 words of
    [rows, K] (two weights a word when half): v0's column phases with each lane reading 16 bytes of a row at a
    time (8 weights, or 4) instead of one weight, and CTAs of THREADS_V1 threads. Where v0 waits on each 2-byte
    load in turn (28 a column at K = 896, 152 at 4,864), a lane here has 4 (K / 8 / 32) or 19 in its loop,
    and 4x the warps are in flight. Each lane sums its pieces' products into per-sequence partials (a
    different order from v0's, the same float32 arithmetic).

    cols, gate_cols (v2): a warp takes that many adjacent columns at a time (linear; gate_up, whose column is a
    gate row and an up row): a lane issues the columns' 16-byte loads together and reads each activation once
    for all of them. A column's sums are v1's, in v1's order: the same bits."""
    PER = 8 if half else 4                  # weights in 16 bytes
    COLS, GCOLS = cols, gate_cols

    @cuda.jit(device=True, inline="always")
    def unpack(w0, w1, w2, w3, x, j):
        """x[j, :] = the PER weights of the 16 bytes w0 .. w3, as float32."""
        if PER == 8:
            x[j, 0], x[j, 1] = f16x2_to_f32(w0)
            x[j, 2], x[j, 3] = f16x2_to_f32(w1)
            x[j, 4], x[j, 5] = f16x2_to_f32(w2)
            x[j, 6], x[j, 7] = f16x2_to_f32(w3)
        else:
            x[j, 0], x[j, 1], x[j, 2], x[j, 3] = (f32_from_bits(w0), f32_from_bits(w1), f32_from_bits(w2),
                                                  f32_from_bits(w3))

    @cuda.jit(device=True, inline="always")
    def rows_dot(h, S, w, base, row_words, ncols, k_chunks, lane, acc, x):
        """acc[j, s] = this lane's part of h[s] . row j of the ncols (<= cols) rows whose first word is
        w[base + j row_words]: the rows' 16-byte pieces loaded first, then each activation read once for all."""
        for j in range(acc.shape[0]):
            for s in range(MAX_S):
                acc[j, s] = float32(0.0)
        for c in range(lane, k_chunks, 32):
            for j in range(acc.shape[0]):
                if j < ncols:
                    w0, w1, w2, w3 = load_u32x4(w, base + j * row_words + 4 * c)
                    unpack(w0, w1, w2, w3, x, j)
            k = c * PER
            for s in range(MAX_S):
                if s < S:
                    for e in range(PER):
                        hv = h[s, k + e]
                        for j in range(acc.shape[0]):
                            acc[j, s] += hv * x[j, e]

    @cuda.jit
    def linear(h, w, bias, has_bias, accumulate, out):
        """out[s, n] (+)= h[s] . W[n] (+ bias[n]): one warp per column n at a time (cols adjacent columns)."""
        S, K = h.shape
        nw = cuda.blockDim.x // 32
        lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        row_words = K // (PER // 4)           # 32-bit words of a row
        N = w.shape[0] // row_words
        acc = cuda.local.array((COLS, MAX_S), float32)
        x = cuda.local.array((COLS, PER), float32)
        for g in range(cuda.blockIdx.x * nw + warp, (N + COLS - 1) // COLS, cuda.gridDim.x * nw):
            n0 = g * COLS
            ncols = min(COLS, N - n0)
            rows_dot(h, S, w, n0 * row_words, row_words, ncols, K // PER, lane, acc, x)
            for j in range(COLS):
                for s in range(MAX_S):
                    if j < ncols and s < S:
                        total = warp_sum(acc[j, s])
                        if lane == 0:
                            n = n0 + j
                            if has_bias:
                                total += float32(bias[n])
                            if accumulate:
                                total += out[s, n]
                            out[s, n] = total

    @cuda.jit
    def gate_up(h, w_gate, w_up, m):
        """m[s, i] = silu(h[s] . Wg[i]) * (h[s] . Wu[i]): one warp per intermediate column i at a time
        (gate_cols adjacent columns)."""
        S, K = h.shape
        nw = cuda.blockDim.x // 32
        lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        row_words = K // (PER // 4)           # 32-bit words of a row
        N = w_gate.shape[0] // row_words
        g = cuda.local.array((GCOLS, MAX_S), float32)
        u = cuda.local.array((GCOLS, MAX_S), float32)
        x = cuda.local.array((GCOLS, PER), float32)
        for grp in range(cuda.blockIdx.x * nw + warp, (N + GCOLS - 1) // GCOLS, cuda.gridDim.x * nw):
            i0 = grp * GCOLS
            ncols = min(GCOLS, N - i0)
            rows_dot(h, S, w_gate, i0 * row_words, row_words, ncols, K // PER, lane, g, x)
            rows_dot(h, S, w_up, i0 * row_words, row_words, ncols, K // PER, lane, u, x)
            for j in range(GCOLS):
                for s in range(MAX_S):
                    if j < ncols and s < S:
                        gs, us = warp_sum(g[j, s]), warp_sum(u[j, s])
                        if lane == 0:
                            m[s, i0 + j] = gs / (float32(1.0) + math.exp(-gs)) * us

    return linear, gate_up


COLUMN_PHASES = {half: make_column_phases(half) for half in (True, False)}
V2_COLS, V2_GATE_COLS = 2, 2   # v2: columns a warp takes at a time (gate_up's are two rows each); 4 columns' fully
                               # unrolled sums (4 x 8 sequences x 8 weights) are past LLVM's unrolling: local memory
COLUMN_PHASES_V2 = {half: make_column_phases(half, V2_COLS, V2_GATE_COLS) for half in (True, False)}
MAX_WARPS = THREADS_V1 // 32
MAX_D = 32 * MAX_D_PER_LANE   # head_dim's bound: a run's output in shared memory


@cuda.jit
def attention_v1(qkv, k_pool, v_pool, tables, positions, num_heads, num_kv_heads, scale, out):
    """v1's attention: a CTA per (sequence, head) at a time, its warps over the keys. Warp w takes the w-th of
    nw equal runs of keys 0 .. position and runs v0's online softmax over them (lanes over head_dim); the runs'
    (max, sum, unnormalised output) then meet in shared memory, merged in warp order. Where v0 sums every key
    of a head on one warp, nw warps (16 in v1's CTA) each sum a run of them."""
    S = qkv.shape[0]
    D = k_pool.shape[3]
    group = num_heads // num_kv_heads
    nw = cuda.blockDim.x // 32
    lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    run_m = cuda.shared.array(MAX_WARPS, float32)
    run_l = cuda.shared.array(MAX_WARPS, float32)
    run_o = cuda.shared.array((MAX_WARPS, MAX_D), float32)
    q = cuda.local.array(MAX_D_PER_LANE, float32)
    acc = cuda.local.array(MAX_D_PER_LANE, float32)
    for item in range(cuda.blockIdx.x, S * num_heads, cuda.gridDim.x):
        s, head = item // num_heads, item % num_heads
        n = positions[s] + 1
        per = (n + nw - 1) // nw
        m, l = attend_run(qkv, k_pool, v_pool, tables, s, head, head // group, scale, warp * per,
                          min(n, (warp + 1) * per), lane, q, acc)
        if lane == 0:
            run_m[warp] = m
            run_l[warp] = l
        for j in range(MAX_D_PER_LANE):
            run_o[warp, lane + 32 * j] = acc[j]
        cuda.syncthreads()
        if warp == 0:
            top = float32(-math.inf)
            for w in range(nw):
                top = max(top, run_m[w])
            total = float32(0.0)
            for j in range(MAX_D_PER_LANE):
                acc[j] = float32(0.0)
            for w in range(nw):
                if run_l[w] > float32(0.0):         # (a run with no key: nothing to add)
                    f = math.exp(run_m[w] - top)
                    total += run_l[w] * f
                    for j in range(MAX_D_PER_LANE):
                        acc[j] += run_o[w, lane + 32 * j] * f
            for j in range(MAX_D_PER_LANE):
                d = lane + 32 * j
                if d < D:
                    out[s, head * D + d] = acc[j] / total
        cuda.syncthreads()                          # the shared runs are read before the next item's


def rotary_tables(num_positions, head_dim, theta):
    """(cos, sin) [num_positions, D / 2] float32 as HF's Qwen2 computes them: angle = position / theta^(2i / D),
    each factor float32 (reference/step.py's rotary). Tables, not cosf / sinf on the device: those keep a slow
    path for large angles with local memory and float64."""
    inv_freq = np.float32(1.0) / np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim))
    angles = np.arange(num_positions).astype(np.float32)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


class StepKernels:
    """A Qwen2 model's weights laid out for the step's phases, and v0's driver.

    weights: HF tensor names -> 2-D / 1-D arrays: numpy arrays for numba's CUDA simulator (on_gpu=False),
    torch CUDA tensors on a GPU; config: reference.step.load_config's dict. q, k and v are packed into one
    [(H + 2 Hkv) D, E] matrix (and bias) here, once; anything else is used as given.
    """

    def __init__(self, weights, config, num_ctas=132, on_gpu=False, max_positions=4096, version=0,
                 column_threads=THREADS_V1):
        if version not in (0, 1, 2):
            raise ValueError(f"version must be 0, 1 or 2, got {version!r}")
        if not (column_threads % 32 == 0 and 32 <= column_threads <= THREADS_V1):
            raise ValueError(f"column_threads must be a multiple of 32 up to {THREADS_V1}, got {column_threads}")
        self.config, self.num_ctas, self.version, self.column_threads = config, num_ctas, version, column_threads
        if on_gpu:
            import torch
            self.empty = lambda shape, dtype: torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
            concat, asarray = torch.cat, lambda a: torch.as_tensor(a, device="cuda")
            self.capturing = torch.cuda.is_current_stream_capturing
            if any(t.dtype == torch.bfloat16 for t in weights.values()):
                raise ValueError("v0 takes float16 or float32 weights and pools: torch hands numba no bfloat16 arrays")
        else:
            self.empty = lambda shape, dtype: np.empty(shape, dtype=dtype)
            concat, asarray = np.concatenate, np.asarray
            self.capturing = lambda: False
        H, Hkv, D = config["num_heads"], config["num_kv_heads"], config["head_dim"]
        if D > 32 * MAX_D_PER_LANE or H % Hkv:
            raise ValueError(f"head_dim {D} > {32 * MAX_D_PER_LANE} or heads {H} not a multiple of kv heads {Hkv}")
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = self.embed if config["tied"] else weights["lm_head.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.layers = []
        for i in range(config["num_layers"]):
            p = f"model.layers.{i}"
            qkv_w = concat([weights[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"])
            qkv_b = concat([weights[f"{p}.self_attn.{n}_proj.bias"] for n in "qkv"])
            self.layers.append(dict(
                ln1=weights[f"{p}.input_layernorm.weight"], qkv_w=qkv_w, qkv_b=qkv_b,
                o=weights[f"{p}.self_attn.o_proj.weight"], ln2=weights[f"{p}.post_attention_layernorm.weight"],
                gate=weights[f"{p}.mlp.gate_proj.weight"], up=weights[f"{p}.mlp.up_proj.weight"],
                down=weights[f"{p}.mlp.down_proj.weight"]))
        self.cos, self.sin = (asarray(t) for t in rotary_tables(max_positions, D, config["theta"]))
        if version >= 1:                    # v1's column phases read each weight matrix as 1-D uint32 words
            self.half = str(self.embed.dtype).endswith("float16")
            per = 8 if self.half else 4
            names = ("qkv_w", "o", "gate", "up", "down")
            matrices = [self.lm_head] + [layer[n] for layer in self.layers for n in names]
            if any(w.shape[1] % per for w in matrices):
                raise ValueError(f"v1 reads a row {per} weights at a time: every product's width a multiple of {per}")
            if on_gpu:
                self.words = {id(w): bridge.words(w) for w in matrices}                # (all contiguous)
            else:
                self.words = {id(w): np.ascontiguousarray(w).view(np.uint32).reshape(-1) for w in matrices}

    def decode_step(self, tokens, positions, k_pools, v_pools, tables):
        """One decode step: writes each sequence's new K/V into k_pools[i] / v_pools[i] (one [num_blocks,
        kv heads, block_size, D] array per layer) and returns (logits [S, vocab] float32, greedy ids [S]).
        Launched on torch's current stream (its temporaries are torch's, and so a CUDA graph captures it)."""
        c, empty, grid = self.config, self.empty, self.num_ctas
        cfg = (grid, THREADS, torch_stream())
        H, Hkv, D = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        S, E = len(tokens), self.embed.shape[1]
        if not 1 <= S <= MAX_S:
            raise ValueError(f"a step of {S} sequences: v0 takes 1 to {MAX_S}")
        if not self.capturing():           # (reading the positions back would break a graph's capture)
            last = int(positions.max())
            if last >= self.cos.shape[0]:
                raise ValueError(f"position {last} is past max_positions {self.cos.shape[0]}")
        x, h = empty((S, E), "float32"), empty((S, E), "float32")
        qkv, a = empty((S, (H + 2 * Hkv) * D), "float32"), empty((S, H * D), "float32")
        m = empty((S, self.layers[0]["gate"].shape[0]), "float32") if self.layers else None
        logits, ids = empty((S, self.lm_head.shape[0]), "float32"), empty(S, "int32")
        eps, scale = np.float32(c["eps"]), np.float32(1.0 / math.sqrt(D))
        none = qkv[0, :1]                      # a bias argument for the products without one

        linear, gate_up = self._column_phases(cfg)
        attention = _attention[cfg] if self.version == 0 else attention_v1[grid, self.column_threads, cfg[2]]
        if self.version == 2:
            part_best, part_where = empty((S, grid), "float32"), empty((S, grid), "int32")
        _embed[cfg](tokens, self.embed, x)
        for layer, k_pool, v_pool in zip(self.layers, k_pools, v_pools):
            _rms_norm[cfg](x, layer["ln1"], eps, h)
            linear(h, layer["qkv_w"], layer["qkv_b"], True, False, qkv)
            _rotary_kv[cfg](qkv, positions, self.cos, self.sin, H, Hkv, k_pool, v_pool, tables)
            attention(qkv, k_pool, v_pool, tables, positions, H, Hkv, scale, a)
            linear(a, layer["o"], none, False, True, x)
            _rms_norm[cfg](x, layer["ln2"], eps, h)
            gate_up(h, layer["gate"], layer["up"], m)
            linear(m, layer["down"], none, False, True, x)
        _rms_norm[cfg](x, self.final_norm, eps, h)
        linear(h, self.lm_head, none, False, False, logits)
        if self.version == 2:
            argmax_parts[cfg](logits, part_best, part_where)
            argmax_merge[S, THREADS, cfg[2]](part_best, part_where, ids)
        else:
            _argmax[cfg](logits, ids)
        return logits, ids

    def _column_phases(self, cfg):
        """(linear, gate_up) launchers of this version, each taking the weights as the layers hold them: v0's
        kernels on them; v1's (v2's: several columns a warp) on their words, in CTAs of column_threads threads."""
        if self.version == 0:
            return _linear[cfg], _gate_up[cfg]
        phases = COLUMN_PHASES_V2 if self.version == 2 else COLUMN_PHASES
        linear, gate_up = (kernel[cfg[0], self.column_threads, cfg[2]] for kernel in phases[self.half])
        words = self.words
        return (lambda h, w, *args: linear(h, words[id(w)], *args),                     # noqa: E731
                lambda h, w_gate, w_up, m: gate_up(h, words[id(w_gate)], words[id(w_up)], m))
