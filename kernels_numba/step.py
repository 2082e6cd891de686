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

v0 drives the phases with one launch each (`StepKernels.decode_step`): the baseline the later versions are
measured against, and the driver numba's CUDA simulator can run (it runs a grid's CTAs one after another, so
any wait between CTAs would hang it). v1: the column phases reading 16 bytes a load and attention's keys over a
CTA's warps, in 16-warp CTAs (`make_column_phases`, `attention_v1`); v2: a warp taking 2 adjacent columns at a
time and the argmax split over every CTA (`argmax_parts`, then `argmax_merge`); v3: a lane's loads of a round
issued before its products, the RMSNorm inside the product that reads it, rotary and the K/V write inside
attention, whose warps hold several keys at once, the argmax's parts kept by the LM head: 5 launches a layer
(`make_column_v3`, `make_attention_v3`); v4: v3's phases in one cooperative launch with a grid barrier between
dependent phases (`make_step_v4`); v5: v4 asking the L2 for each phase's weights a phase ahead. docs/kernels.md, "The step family", has each version's prediction and
measurement. Its ground truth is reference/step.py (float64).
"""
import math
import types
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32

from kernels_numba import bridge
from kernels_numba.bridge import torch_stream
from kernels_numba.common import (f16_to_f32, f16x2_to_f32, f32_bits, f32_from_bits, f32_to_f16, f32x2_to_f16x2,
                                   load_u32x4, prefetch_l2, warp_sum)

WARPS = 4                   # warps per CTA
THREADS = 32 * WARPS
MAX_S = 8                   # sequences per step
MAX_D_PER_LANE = 4          # head_dim <= 128
MAX_WARPS = 16              # the most warps a CTA has (v1's and later versions' CTAs: 16)
SCRATCH = MAX_WARPS + 1     # block_sum's shared slots: one per warp, one for the total


@cuda.jit(device=True)
def block_sum(value, scratch):
    """Sum of `value` over the CTA's threads (its warps' sums added in warp order), returned to every thread.
    scratch: shared float32[SCRATCH]."""
    tid = cuda.threadIdx.x
    value = warp_sum(value)
    if tid % 32 == 0:
        scratch[tid // 32] = value
    cuda.syncthreads()
    if tid == 0:
        total = float32(0.0)
        for w in range(cuda.blockDim.x // 32):
            total += scratch[w]
        scratch[MAX_WARPS] = total
    cuda.syncthreads()
    total = scratch[MAX_WARPS]
    cuda.syncthreads()                 # nobody writes scratch again before every thread has read it
    return total


@cuda.jit(device=True)
def embed_phase(cta, num_ctas, tokens, embed, x):
    for s in range(cta, x.shape[0], num_ctas):
        for e in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
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


@cuda.jit(device=True, inline="always")
def better(b, w, ob, ow):
    """Whether (ob, ow) beats (b, w): a larger value, or the same at a lower index (w < 0: none)."""
    return ow >= 0 and (w < 0 or ob > b or (ob == b and ow < w))


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
            if better(best[tid], where[tid], ob, ow):
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
MAX_D = 32 * MAX_D_PER_LANE   # head_dim's bound: a run's output in shared memory


@cuda.jit(device=True, inline="always")
def store_merged_runs(run_m, run_l, run_o, nw, lane, D, acc, out, s, head):
    """One warp's end of a CTA's attention over runs of keys: the nw warps' runs (running max, sum and
    unnormalised output in shared memory) merged in warp order, out[s, head D + d] = output / sum, the lanes
    over d (acc: the lane's MAX_D_PER_LANE sums)."""
    top = float32(-math.inf)
    for w in range(nw):
        top = max(top, run_m[w])
    total = float32(0.0)
    for j in range(MAX_D_PER_LANE):
        acc[j] = float32(0.0)
    for w in range(nw):
        if run_l[w] > float32(0.0):             # (a run with no key: nothing to add)
            f = math.exp(run_m[w] - top)
            total += run_l[w] * f
            for j in range(MAX_D_PER_LANE):
                if lane + 32 * j < D:           # (past D a run holds nothing it wrote)
                    acc[j] += run_o[w, lane + 32 * j] * f
    for j in range(MAX_D_PER_LANE):
        d = lane + 32 * j
        if d < D:
            out[s, head * D + d] = acc[j] / total


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
            store_merged_runs(run_m, run_l, run_o, nw, lane, D, acc, out, s, head)
        cuda.syncthreads()                          # the shared runs are read before the next item's


# ----------------------------------------------------------------------------------------------
# v3: a lane's loads issued together; the norm in the product that reads it; rotary and the K/V write in
# attention, whose warps take several keys at a time; the argmax's parts in the LM head


V3_JIT = {} if bridge.SIMULATOR else {"launch_bounds": (THREADS_V1, 1)}   # <= 128 registers: 16 warps fit


def v3_round(S, k_chunks, rows=1):
    """16-byte pieces of a row a lane loads at once in v3's column phases, for S sequences, rows of k_chunks
    pieces and `rows` rows at a time (gate/up, and the column pairs of norm_linear: 2). A lane holds
    ceil(k_chunks / 32) pieces of a row; it loads them in as few rounds as a cap allows, the rounds equal. The
    cap: 12 pieces (48 registers of weights), and fewer as S grows, so that a round's products (pieces x rows x
    8 weights x S) stay within what the compiler unrolls into registers (at 240 products the codegen test's
    probe found local memory; 16 // (S rows) pieces keep them at <= 128)."""
    per_lane = -(-k_chunks // 32)
    cap = max(1, min(12, 16 // (S * rows)))
    rounds = -(-per_lane // cap)
    return max(1, -(-per_lane // rounds))


def make_column_v3(half, S, R, R2):
    """v3's column phases for 16-bit (half) or float32 weights as 1-D uint32 words, for exactly S sequences,
    a lane loading R 16-byte pieces of a row at once (R2 of each of two rows: gate/up's gate and up row,
    norm_linear's two adjacent columns). v1/v2 load a piece, then use it, then load the next: a
    lane waits for DRAM once per piece (19 times a column at K = 4,864: v2's down projection spent ~20 µs a
    layer where reading its 8.7 MB takes ~2). Here a round issues R pieces' loads (gate/up: R of the gate row
    and R of the up row) before any product, so a column costs ceil(pieces / 32 / R) round trips. A CTA takes a
    contiguous slice of the columns (its warps one column, or two, at a time), so the LM head's argmax parts are
    slices in index order, as argmax_merge expects.

    Returns the kernels linear, norm_linear and norm_gate_up, and the phases (device functions of (cta,
    num_ctas, ...), the weights from a word offset) they launch, for v4's one launch. The norm_ phases read the residual stream x and apply the
    RMSNorm as they read it (each CTA sums its rows' squares first): the separate norm phase and its launch
    are gone."""
    PER = 8 if half else 4                  # weights in 16 bytes

    @cuda.jit(device=True, inline="always")
    def row_norms(x, eps, inv, scratch):
        """inv[s] = 1 / sqrt(mean(x[s]^2) + eps) for every sequence, in this CTA's shared memory."""
        E = x.shape[1]
        for s in range(S):
            squares = float32(0.0)
            for e in range(cuda.threadIdx.x, E, cuda.blockDim.x):
                squares += x[s, e] * x[s, e]
            total = block_sum(squares, scratch)
            if cuda.threadIdx.x == 0:
                inv[s] = float32(1.0) / math.sqrt(total / float32(E) + eps)
        cuda.syncthreads()

    def make_dot(NORM, TWO, R):
        @cuda.jit(device=True, inline="always")
        def dot(h, norm_w, inv, wa, wb, base, base_b, k_chunks, lane, acc, wr):
            """acc[j, s] = this lane's part of a[s] . row j (j = 0: wa's row at word base; j = 1, when TWO:
            wb's at word base_b), where a = h, or with NORM the RMSNorm of h (weight norm_w, row factors inv).
            The lane's pieces are c = lane, lane + 32, ... < k_chunks, R of them a round: loads first, then
            products."""
            for j in range(2):
                for s in range(S):
                    acc[j, s] = float32(0.0)
            for c0 in range(0, k_chunks, 32 * R):
                for u in range(R):
                    c = c0 + lane + 32 * u
                    if c < k_chunks:
                        wr[0, u, 0], wr[0, u, 1], wr[0, u, 2], wr[0, u, 3] = load_u32x4(wa, base + 4 * c)
                        if TWO:
                            wr[1, u, 0], wr[1, u, 1], wr[1, u, 2], wr[1, u, 3] = load_u32x4(wb, base_b + 4 * c)
                for u in range(R):
                    c = c0 + lane + 32 * u
                    if c < k_chunks:
                        for q in range(4):
                            k = c * PER + q * (PER // 4)
                            for j in range(2 if TWO else 1):
                                if PER == 8:
                                    w0, w1 = f16x2_to_f32(wr[j, u, q])
                                else:
                                    w0 = f32_from_bits(wr[j, u, q])
                                for s in range(S):
                                    if NORM:
                                        acc[j, s] += float32(norm_w[k]) * (h[s, k] * inv[s]) * w0
                                    else:
                                        acc[j, s] += h[s, k] * w0
                                    if PER == 8:
                                        if NORM:
                                            acc[j, s] += float32(norm_w[k + 1]) * (h[s, k + 1] * inv[s]) * w1
                                        else:
                                            acc[j, s] += h[s, k + 1] * w1
        return dot

    dot_plain, dot_norm_two = make_dot(False, False, R), make_dot(True, True, R2)

    @cuda.jit(device=True, inline="always")
    def column_slice(cta, num_ctas, N):
        """(lo, hi): CTA cta's contiguous slice of N columns."""
        per = (N + num_ctas - 1) // num_ctas
        lo = cta * per
        return lo, min(N, lo + per)

    @cuda.jit(device=True, inline="always")
    def linear_phase(cta, num_ctas, h, w, wbase, bias, has_bias, accumulate, out):
        """out[s, n] (+)= h[s] . W[n] (+ bias[n]), W's words from w[wbase]."""
        K = h.shape[1]
        nw, lane, warp = cuda.blockDim.x // 32, cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        row_words = K // (PER // 4)
        acc = cuda.local.array((2, S), float32)
        wr = cuda.local.array((2, R, 4), np.uint32)
        lo, hi = column_slice(cta, num_ctas, out.shape[1])
        for n in range(lo + warp, hi, nw):
            dot_plain(h, h, h, w, w, wbase + n * row_words, 0, K // PER, lane, acc, wr)
            for s in range(S):
                total = warp_sum(acc[0, s])
                if lane == 0:
                    if has_bias:
                        total += float32(bias[n])
                    if accumulate:
                        total += out[s, n]
                    out[s, n] = total

    @cuda.jit(device=True, inline="always")
    def norm_linear_phase(cta, num_ctas, x, norm_w, eps, w, wbase, bias, has_bias, out, argmax, part_best,
                          part_where):
        """out[s, n] = rms_norm(x[s]) . W[n] (+ bias[n]), a warp taking two adjacent columns at a time (the LM
        head's 151,936 columns are ~72 a warp: 36 round trips, not 72); with argmax (the LM head) also each row's
        largest out[s, n] of this CTA's slice and its lowest index into part_best[s, cta], part_where[s, cta]."""
        K = x.shape[1]
        nw, lane, warp = cuda.blockDim.x // 32, cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        scratch = cuda.shared.array(SCRATCH, float32)
        inv_s = cuda.shared.array(MAX_S, float32)
        best = cuda.shared.array((MAX_WARPS, MAX_S), float32)
        where = cuda.shared.array((MAX_WARPS, MAX_S), int32)
        row_norms(x, eps, inv_s, scratch)
        inv = cuda.local.array(S, float32)
        b = cuda.local.array(S, float32)
        bw = cuda.local.array(S, int32)
        for s in range(S):
            inv[s], b[s], bw[s] = inv_s[s], float32(-math.inf), int32(-1)
        row_words = K // (PER // 4)
        acc = cuda.local.array((2, S), float32)
        wr = cuda.local.array((2, R2, 4), np.uint32)
        lo, hi = column_slice(cta, num_ctas, out.shape[1])
        for n0 in range(lo + 2 * warp, hi, 2 * nw):    # two adjacent columns at a time
            pair = n0 + 1 < hi
            dot_norm_two(x, norm_w, inv, w, w, wbase + n0 * row_words, wbase + (n0 + 1 if pair else n0) * row_words,
                         K // PER, lane, acc, wr)
            for j in range(2):
                if j == 0 or pair:
                    n = n0 + j
                    for s in range(S):
                        total = warp_sum(acc[j, s])
                        if has_bias:
                            total += float32(bias[n])
                        if lane == 0:
                            out[s, n] = total
                        if total > b[s] or bw[s] < 0:  # a warp's columns rise: a tie keeps the first
                            b[s], bw[s] = total, n
        if argmax:                                     # the warps' bests, merged in shared memory
            if lane == 0:
                for s in range(S):
                    best[warp, s], where[warp, s] = b[s], bw[s]
            cuda.syncthreads()
            if cuda.threadIdx.x < S:
                s = cuda.threadIdx.x
                vb, vw = float32(-math.inf), int32(-1)
                for w_ in range(nw):
                    if better(vb, vw, best[w_, s], where[w_, s]):
                        vb, vw = best[w_, s], where[w_, s]
                part_best[s, cta], part_where[s, cta] = vb, vw
            cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def norm_gate_up_phase(cta, num_ctas, x, norm_w, eps, w_gate, w_up, wbase, m):
        """m[s, i] = silu(a[s] . Wg[i]) * (a[s] . Wu[i]), a = rms_norm(x): a lane's gate and up pieces loaded
        together."""
        K = x.shape[1]
        nw, lane, warp = cuda.blockDim.x // 32, cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        scratch = cuda.shared.array(SCRATCH, float32)
        inv_s = cuda.shared.array(MAX_S, float32)
        row_norms(x, eps, inv_s, scratch)
        inv = cuda.local.array(S, float32)
        for s in range(S):
            inv[s] = inv_s[s]
        row_words = K // (PER // 4)
        acc = cuda.local.array((2, S), float32)
        wr = cuda.local.array((2, R2, 4), np.uint32)
        lo, hi = column_slice(cta, num_ctas, m.shape[1])
        for i in range(lo + warp, hi, nw):
            dot_norm_two(x, norm_w, inv, w_gate, w_up, wbase + i * row_words, wbase + i * row_words, K // PER, lane,
                         acc, wr)
            for s in range(S):
                gs, us = warp_sum(acc[0, s]), warp_sum(acc[1, s])
                if lane == 0:
                    m[s, i] = gs / (float32(1.0) + math.exp(-gs)) * us

    @cuda.jit(**V3_JIT)
    def linear(h, w, bias, has_bias, accumulate, out):
        linear_phase(cuda.blockIdx.x, cuda.gridDim.x, h, w, 0, bias, has_bias, accumulate, out)

    @cuda.jit(**V3_JIT)
    def norm_linear(x, norm_w, eps, w, bias, has_bias, out, argmax, part_best, part_where):
        norm_linear_phase(cuda.blockIdx.x, cuda.gridDim.x, x, norm_w, eps, w, 0, bias, has_bias, out, argmax,
                          part_best, part_where)

    @cuda.jit(**V3_JIT)
    def norm_gate_up(x, norm_w, eps, w_gate, w_up, m):
        norm_gate_up_phase(cuda.blockIdx.x, cuda.gridDim.x, x, norm_w, eps, w_gate, w_up, 0, m)

    return types.SimpleNamespace(linear=linear, norm_linear=norm_linear, norm_gate_up=norm_gate_up,
                                 linear_phase=linear_phase, norm_linear_phase=norm_linear_phase,
                                 norm_gate_up_phase=norm_gate_up_phase)


def make_attention_v3(half):
    """v3's attention for 16-bit (half) or float32 pools given as 1-D uint32 words of [blocks, kv heads, block,
    D]. A CTA per (sequence, q head) at a time, as v1, but:

    * rotary and the K/V write are here: warp 0 rotates the head's q and its K/V head's k from the unrotated
      q/k/v, rounds k and v to the pool's type, and the CTA of the group's first q head writes them to the
      sequence's slot; every CTA takes the newest key from its own shared memory (no CTA reads a slot another
      writes in the same launch). The rotary phase and its launch are gone.
    * a key is D / P lanes' work (P = 8 float16 or 4 float32 elements: 16 bytes a lane), so a warp holds
      32 P / D keys at once, two rounds of them a step of its loop: each lane's K and V loads of both rounds
      are issued before the scores' shuffles (v1's warp took one key at a time, 2-byte loads, a 5-shuffle sum
      each). A lane group keeps its own online softmax; the groups merge by xor shuffles (the same bits on
      every lane: each merge is commutative), then the warps in shared memory in warp order, as v1."""
    P = 8 if half else 4

    @cuda.jit(device=True, inline="always")
    def to_pool(v):
        """v rounded to the pool's type (as it will be read back), as float32."""
        if half:
            return f16_to_f32(f32_to_f16(v))
        return v

    @cuda.jit(device=True, inline="always")
    def widen(w, r, x):
        """x[r, :P] = the P pool elements of the 16 bytes w[r, 0..3]."""
        for q in range(4):
            if half:
                x[r, 2 * q], x[r, 2 * q + 1] = f16x2_to_f32(w[r, q])
            else:
                x[r, q] = f32_from_bits(w[r, q])

    @cuda.jit(device=True, inline="always")
    def merge(m, l, acc, mo, lo_, acco):
        """(m, l, acc) and another run's (mo, lo_, acco) as one run (a run with no key: m = -inf)."""
        top = max(m, mo)
        if top == -math.inf:
            return m, l
        f, fo = math.exp(m - top), math.exp(mo - top)
        for e in range(P):
            acc[e] = acc[e] * f + acco[e] * fo
        return top, l * f + lo_ * fo

    @cuda.jit(device=True, inline="always")
    def attention_phase(cta, num_ctas, qkv, k_words, v_words, pbase, kv_heads, block_size, head_dim, tables,
                        positions, cos, sin, num_heads, scale, out):
        """The pools' words from k_words[pbase], v_words[pbase]."""
        S = qkv.shape[0]
        D, BS = head_dim, block_size
        half_d = D // 2
        group = num_heads // kv_heads
        lanes = D // P                                     # lanes a key
        keys = 32 // lanes                                 # keys a warp holds at once
        row_words = D * (2 if half else 4) // 4
        nw, tid = cuda.blockDim.x // 32, cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, sub = lane // lanes, lane % lanes
        qs = cuda.shared.array(MAX_D, float32)
        ks = cuda.shared.array(MAX_D, float32)
        vs = cuda.shared.array(MAX_D, float32)
        run_m = cuda.shared.array(MAX_WARPS, float32)
        run_l = cuda.shared.array(MAX_WARPS, float32)
        run_o = cuda.shared.array((MAX_WARPS, MAX_D), float32)
        q = cuda.local.array(P, float32)
        acc = cuda.local.array(P, float32)
        other = cuda.local.array(P, float32)
        wk = cuda.local.array((2, 4), np.uint32)
        wv = cuda.local.array((2, 4), np.uint32)
        kf = cuda.local.array((2, P), float32)
        vf = cuda.local.array((2, P), float32)
        fin = cuda.local.array(MAX_D_PER_LANE, float32)
        score = cuda.local.array(2, float32)
        for item in range(cta, S * num_heads, num_ctas):
            s, head = item // num_heads, item % num_heads
            kv = head // group
            pos = positions[s]
            if warp == 0:                                  # rotary of q (scaled) and k; v as it is
                qb, kb, vb = head * D, (num_heads + kv) * D, (num_heads + kv_heads + kv) * D
                for i in range(lane, half_d, 32):
                    c, sn = cos[pos, i], sin[pos, i]
                    x1, x2 = qkv[s, qb + i], qkv[s, qb + i + half_d]
                    qs[i], qs[i + half_d] = (x1 * c - x2 * sn) * scale, (x2 * c + x1 * sn) * scale
                    x1, x2 = qkv[s, kb + i], qkv[s, kb + i + half_d]
                    ks[i], ks[i + half_d] = to_pool(x1 * c - x2 * sn), to_pool(x2 * c + x1 * sn)
                for d in range(lane, D, 32):
                    vs[d] = to_pool(qkv[s, vb + d])
            cuda.syncthreads()
            slot = pbase + ((tables[s, pos // BS] * kv_heads + kv) * BS + pos % BS) * row_words
            if head % group == 0:                          # the group's first head writes the new K/V
                for wi in range(tid, row_words, cuda.blockDim.x):
                    if half:
                        k_words[slot + wi] = f32x2_to_f16x2(ks[2 * wi], ks[2 * wi + 1])
                        v_words[slot + wi] = f32x2_to_f16x2(vs[2 * wi], vs[2 * wi + 1])
                    else:
                        k_words[slot + wi] = f32_bits(ks[wi])
                        v_words[slot + wi] = f32_bits(vs[wi])
            for e in range(P):
                q[e] = qs[sub * P + e]
                acc[e] = float32(0.0)
            m, l = float32(-math.inf), float32(0.0)
            n = pos + 1
            step = nw * 2 * keys
            for t0 in range(warp * 2 * keys, n + (step - n % step) % step, step):   # the same trips for every warp
                for r in range(2):                         # both rounds' loads first
                    t = t0 + r * keys + g
                    if t < pos:
                        base = pbase + ((tables[s, t // BS] * kv_heads + kv) * BS + t % BS) * row_words + sub * 4
                        wk[r, 0], wk[r, 1], wk[r, 2], wk[r, 3] = load_u32x4(k_words, base)
                        wv[r, 0], wv[r, 1], wv[r, 2], wv[r, 3] = load_u32x4(v_words, base)
                for r in range(2):
                    t = t0 + r * keys + g
                    if t < pos:
                        widen(wk, r, kf)
                        widen(wv, r, vf)
                    elif t == pos:                         # the newest key: from shared memory
                        for e in range(P):
                            kf[r, e], vf[r, e] = ks[sub * P + e], vs[sub * P + e]
                    else:                                  # no key: weight 0 on zeros (not on stale registers,
                        for e in range(P):                 # which may hold an inf or a NaN: 0 x inf is NaN)
                            kf[r, e], vf[r, e] = float32(0.0), float32(0.0)
                    partial = float32(0.0)
                    for e in range(P):
                        partial += q[e] * kf[r, e]
                    off = lanes // 2
                    while off > 0:
                        partial += cuda.shfl_xor_sync(0xFFFFFFFF, partial, off)
                        off //= 2
                    score[r] = partial if t <= pos else float32(-math.inf)
                top = max(m, max(score[0], score[1]))
                if top > -math.inf:
                    alpha, p0, p1 = math.exp(m - top), math.exp(score[0] - top), math.exp(score[1] - top)
                    for e in range(P):
                        acc[e] = acc[e] * alpha + p0 * vf[0, e] + p1 * vf[1, e]
                    l = l * alpha + p0 + p1
                    m = top
            off = lanes                                    # the warp's groups, merged
            while off < 32:
                mo, lo_ = cuda.shfl_xor_sync(0xFFFFFFFF, m, off), cuda.shfl_xor_sync(0xFFFFFFFF, l, off)
                for e in range(P):
                    other[e] = cuda.shfl_xor_sync(0xFFFFFFFF, acc[e], off)
                m, l = merge(m, l, acc, mo, lo_, other)
                off *= 2
            if lane == 0:
                run_m[warp], run_l[warp] = m, l
            if g == 0:
                for e in range(P):
                    run_o[warp, sub * P + e] = acc[e]
            cuda.syncthreads()
            if warp == 0:                                  # the warps' runs, merged in warp order (v1's)
                store_merged_runs(run_m, run_l, run_o, nw, lane, D, fin, out, s, head)
            cuda.syncthreads()                             # shared memory read before the next item's

    @cuda.jit(**V3_JIT)
    def attention(qkv, k_words, v_words, kv_heads, block_size, head_dim, tables, positions, cos, sin, num_heads,
                  scale, out):
        attention_phase(cuda.blockIdx.x, cuda.gridDim.x, qkv, k_words, v_words, 0, kv_heads, block_size, head_dim,
                        tables, positions, cos, sin, num_heads, scale, out)

    return attention, attention_phase


_V3 = {}


def v3_kernels(half, S, k_chunks):
    """v3's column kernels and phases (make_column_v3) for S sequences and rows of k_chunks 16-byte pieces (made once
    a shape: each is compiled for its S and round)."""
    key = (half, S, v3_round(S, k_chunks), v3_round(S, k_chunks, rows=2))
    if key not in _V3:
        _V3[key] = make_column_v3(*key)
    return _V3[key]


ATTENTION_V3 = {half: make_attention_v3(half) for half in (True, False)}


# ----------------------------------------------------------------------------------------------
# v4: v3's phases in one persistent launch, a grid barrier between dependent phases


@cuda.jit(device=True, inline="always")
def merge_parts_phase(cta, num_ctas, part_best, part_where, ids):
    """argmax_merge as a phase of 32 lanes: ids[s] = the lowest index of the largest of row s's parts."""
    lane = cuda.threadIdx.x % 32
    if cuda.threadIdx.x < 32:
        for s in range(cta, part_best.shape[0], num_ctas):
            b, w = float32(-math.inf), int32(-1)
            for c in range(lane, part_best.shape[1], 32):
                if better(b, w, part_best[s, c], part_where[s, c]):
                    b, w = part_best[s, c], part_where[s, c]
            off = 16
            while off > 0:
                ob, ow = cuda.shfl_xor_sync(0xFFFFFFFF, b, off), cuda.shfl_xor_sync(0xFFFFFFFF, w, off)
                if better(b, w, ob, ow):
                    b, w = ob, ow
                off //= 2
            if lane == 0:
                ids[s] = w


PREFETCH_BYTES = 16384      # v5: the L2 prefetch's piece (one instruction of one warp's first lane)


@cuda.jit(device=True, inline="always")
def prefetch_phase(cta, num_ctas, words, start, nwords):
    """Ask the L2 for words[start : start + nwords] (start a multiple of 4), PREFETCH_BYTES a piece, the pieces
    over every CTA's warps (~1 a warp for a layer's gate/up at 0.5B), and go on without waiting."""
    nw, warp = cuda.blockDim.x // 32, cuda.threadIdx.x // 32
    if cuda.threadIdx.x % 32 == 0:
        per = PREFETCH_BYTES // 4
        for p in range(cta * nw + warp, (nwords + per - 1) // per, num_ctas * nw):
            prefetch_l2(words, start + p * per, min(per, nwords - p * per) * 4)


@bridge.disk_cached
@lru_cache(maxsize=None)
def make_step_v4(half, S, k_chunks, i_chunks, prefetch=False):
    """v4: the whole step as one cooperative launch of v3's phases (hidden-width rows of k_chunks 16-byte pieces,
    the down projection's of i_chunks), `cuda.cg.this_grid().sync()` between dependent phases: 5 barriers a
    layer where v3 has 5 launches, each ~1.5 µs on the H200 (scripts/probe_grid_sync.py) against a launch's
    fill and drain. Every layer's weights come from one stacked array of each kind (a word offset a layer),
    the pools from one allocation of all layers'.

    prefetch (v5): each phase first asks the L2 for the weights of a phase to come, so that DRAM streams them
    while the grid computes and waits at barriers, and the phase that reads them finds them in the L2 (a round
    trip of ~0.5 µs, not ~0.8, and the L2's bandwidth): at q/k/v the layer's o, at attention (light on DRAM:
    ~5 µs) its gate and up (17.4 MB at 0.5B), at o its down, at gate/up the next layer's q/k/v. A layer's
    weights (~30 MB at 0.5B) fit the H200's 50 MB L2; the LM head (272 MB) does not and is not prefetched."""
    hidden, inner = v3_kernels(half, S, k_chunks), v3_kernels(half, S, i_chunks)
    norm_linear_phase, linear_phase = hidden.norm_linear_phase, hidden.linear_phase      # (names numba can type)
    norm_gate_up_phase, down_phase = hidden.norm_gate_up_phase, inner.linear_phase
    attention_phase = ATTENTION_V3[half][1]
    W = 2 if half else 1                    # weights a 32-bit word
    PREFETCH = prefetch

    @cuda.jit(**V3_JIT)
    def step(tokens, positions, tables, embed, x, qkv, a, m, logits, part_best, part_where, ids, ln1, qkv_w, qkv_b,
             o_w, ln2, gate_w, up_w, down_w, final_norm, lm_w, k_words, v_words, pool_words, kv_heads, block_size,
             head_dim, cos, sin, num_heads, eps, scale):
        grid = cuda.cg.this_grid()
        cta, n = cuda.blockIdx.x, cuda.gridDim.x
        E, Q, A, I, L = x.shape[1], qkv.shape[1], a.shape[1], m.shape[1], ln1.shape[0]
        qkv_words, o_words, mlp_words = Q * (E // W), E * (A // W), I * (E // W)       # a layer's, of each kind
        if PREFETCH and L > 0:
            prefetch_phase(cta, n, qkv_w, 0, qkv_words)
        embed_phase(cta, n, tokens, embed, x)
        grid.sync()
        for layer in range(L):
            if PREFETCH:
                prefetch_phase(cta, n, o_w, layer * o_words, o_words)
            norm_linear_phase(cta, n, x, ln1[layer], eps, qkv_w, layer * qkv_words, qkv_b[layer], True, qkv, False,
                              part_best, part_where)
            grid.sync()
            if PREFETCH:                    # (a layer's gate and up: one [2 I, E] matrix)
                prefetch_phase(cta, n, gate_w, 2 * layer * mlp_words, 2 * mlp_words)
            attention_phase(cta, n, qkv, k_words, v_words, layer * pool_words, kv_heads, block_size, head_dim, tables,
                            positions, cos, sin, num_heads, scale, a)
            grid.sync()
            if PREFETCH:
                prefetch_phase(cta, n, down_w, layer * mlp_words, mlp_words)
            linear_phase(cta, n, a, o_w, layer * o_words, qkv_b[layer], False, True, x)
            grid.sync()
            if PREFETCH and layer + 1 < L:
                prefetch_phase(cta, n, qkv_w, (layer + 1) * qkv_words, qkv_words)
            norm_gate_up_phase(cta, n, x, ln2[layer], eps, gate_w, up_w, 2 * layer * mlp_words, m)
            grid.sync()
            down_phase(cta, n, m, down_w, layer * mlp_words, qkv_b[layer], False, True, x)
            grid.sync()
        norm_linear_phase(cta, n, x, final_norm, eps, lm_w, 0, final_norm, False, logits, True, part_best,
                          part_where)
        grid.sync()
        merge_parts_phase(cta, n, part_best, part_where, ids)

    return step


def v4_kernel(half, S, k_chunks, i_chunks, prefetch=False):
    """v4's step kernel (v5's with prefetch), made once a shape (and kept in numba's disk cache)."""
    return make_step_v4(half, S, k_chunks, i_chunks, prefetch=prefetch)


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
        if version not in (0, 1, 2, 3, 4, 5):
            raise ValueError(f"version must be 0 to 5, got {version!r}")
        if not (column_threads % 32 == 0 and 32 <= column_threads <= THREADS_V1):
            raise ValueError(f"column_threads must be a multiple of 32 up to {THREADS_V1}, got {column_threads}")
        self.config, self.num_ctas, self.version, self.column_threads = config, num_ctas, version, column_threads
        self.check_positions, self.on_gpu = True, on_gpu
        if on_gpu:
            import torch
            self.empty = lambda shape, dtype: torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
            concat, stack, asarray = torch.cat, torch.stack, lambda a: torch.as_tensor(a, device="cuda")
            self.capturing = torch.cuda.is_current_stream_capturing
            if any(t.dtype == torch.bfloat16 for t in weights.values()):
                raise ValueError("v0 takes float16 or float32 weights and pools: torch hands numba no bfloat16 arrays")
        else:
            self.empty = lambda shape, dtype: np.empty(shape, dtype=dtype)
            concat, stack, asarray = np.concatenate, np.stack, np.asarray
            self.capturing = lambda: False
        for name, w in weights.items():     # (the kernels read words of 2 or 4 bytes: a float64 would be garbage)
            if str(w.dtype).replace("torch.", "") not in ("float16", "float32"):
                raise ValueError(f"weight {name!r} is {w.dtype}: the step kernels take float16 or float32")
        H, Hkv, D = config["num_heads"], config["num_kv_heads"], config["head_dim"]
        if D > 32 * MAX_D_PER_LANE or H % Hkv:
            raise ValueError(f"head_dim {D} > {32 * MAX_D_PER_LANE} or heads {H} not a multiple of kv heads {Hkv}")
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = self.embed if config["tied"] else weights["lm_head.weight"]
        self.final_norm = weights["model.norm.weight"]
        layers = []
        for i in range(config["num_layers"]):
            p = f"model.layers.{i}"
            qkv_w = concat([weights[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"])
            qkv_b = concat([weights[f"{p}.self_attn.{n}_proj.bias"] for n in "qkv"])
            gate_up = concat([weights[f"{p}.mlp.{n}_proj.weight"] for n in ("gate", "up")])
            layers.append(dict(
                ln1=weights[f"{p}.input_layernorm.weight"], qkv_w=qkv_w, qkv_b=qkv_b,
                o=weights[f"{p}.self_attn.o_proj.weight"], ln2=weights[f"{p}.post_attention_layernorm.weight"],
                gate_up=gate_up, down=weights[f"{p}.mlp.down_proj.weight"]))
        # each kind of weight stacked over the layers (v4 reads a layer's at an offset); a layer's are views, its
        # gate and up the halves of its [2 I, E] gate_up (the layout of an engine's merged gate/up product)
        self.stacked = {n: stack([layer[n] for layer in layers]) for n in layers[0]} if layers else {}
        self.layers = [{n: s[i] for n, s in self.stacked.items()} for i in range(len(layers))]
        for layer in self.layers:
            I = layer["gate_up"].shape[0] // 2
            layer["gate"], layer["up"] = layer["gate_up"][:I], layer["gate_up"][I:]
        self.cos, self.sin = (asarray(t) for t in rotary_tables(max_positions, D, config["theta"]))
        if version >= 1:                    # v1's column phases read each weight matrix as 1-D uint32 words
            self.half = str(self.embed.dtype).endswith("float16")
            per = 8 if self.half else 4
            names = ("qkv_w", "o", "gate", "up", "down")
            matrices = [self.lm_head] + [layer[n] for layer in self.layers for n in names]
            if any(w.shape[1] % per for w in matrices):
                raise ValueError(f"v1 reads a row {per} weights at a time: every product's width a multiple of {per}")
            words = bridge.words if on_gpu else lambda w: np.ascontiguousarray(w).view(np.uint32).reshape(-1)
            self.words = {id(w): words(w) for w in matrices}                          # (all contiguous)
            self.stacked_words = {n: words(self.stacked[n]) for n in ("qkv_w", "o", "gate_up", "down")
                                  if n in self.stacked}

    def decode_step(self, tokens, positions, k_pools, v_pools, tables):
        """One decode step: writes each sequence's new K/V into k_pools[i] / v_pools[i] (one [num_blocks,
        kv heads, block_size, D] array per layer) and returns (logits [S, vocab] float32, greedy ids [S]).
        Launched on torch's current stream (its temporaries are torch's, and so a CUDA graph captures it). In the
        simulator the tokens, positions and tables may be CPU tensors (read through numpy views), and a version
        >= 1's pools too (the engine's, in tests)."""
        if not self.on_gpu:
            tokens, positions, tables = np.asarray(tokens), np.asarray(positions), np.asarray(tables)
        if self.version >= 3:
            return self._decode_step_v3(tokens, positions, k_pools, v_pools, tables)
        c, empty, grid = self.config, self.empty, self.num_ctas
        cfg = (grid, THREADS, torch_stream())
        H, Hkv, D = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        S, E = len(tokens), self.embed.shape[1]
        self._check_step(S, positions)
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

    def _check_step(self, S, positions):
        if not 1 <= S <= MAX_S:
            raise ValueError(f"a step of {S} sequences: the step kernels take 1 to {MAX_S}")
        # (reading the positions back would break a graph's capture, and costs an eager step a sync: a caller
        # that bounds its positions itself, the engine, sets check_positions False)
        if self.check_positions and not self.capturing():
            last = int(positions.max())
            if last >= self.cos.shape[0]:
                raise ValueError(f"position {last} is past max_positions {self.cos.shape[0]}")

    def _decode_step_v3(self, tokens, positions, k_pools, v_pools, tables):
        """v3's step: 5 launches a layer (norm + q/k/v, attention with rotary and the K/V write, o, norm +
        gate/up, down), then norm + the LM head with the argmax's parts, and their merge; v4's: the same phases
        in one launch; v5's: v4's with the L2 prefetch."""
        c, empty, grid, threads = self.config, self.empty, self.num_ctas, self.column_threads
        H, Hkv, D = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        S, E = len(tokens), self.embed.shape[1]
        self._check_step(S, positions)
        stream = torch_stream()
        per = 8 if self.half else 4
        I = self.layers[0]["gate"].shape[0] if self.layers else per
        x, qkv, a = empty((S, E), "float32"), empty((S, (H + 2 * Hkv) * D), "float32"), empty((S, H * D), "float32")
        m = empty((S, I), "float32")
        logits, ids = empty((S, self.lm_head.shape[0]), "float32"), empty(S, "int32")
        part_best, part_where = empty((S, grid), "float32"), empty((S, grid), "int32")
        eps, scale = np.float32(c["eps"]), np.float32(1.0 / math.sqrt(D))
        none, w = qkv[0, :1], self.words
        if self.version >= 4:
            (k_words, pool_words), (v_words, _) = self._stacked_pool_words(k_pools), self._stacked_pool_words(v_pools)
            st, sw, block_size = self.stacked, self.stacked_words, k_pools[0].shape[2]
            step = v4_kernel(self.half, S, E // per, I // per, prefetch=self.version == 5)[grid, threads, stream]
            up = sw["gate_up"][I * E // (2 if self.half else 1):] if self.layers else sw["gate_up"]   # layer 0's up
            step(tokens, positions, tables, self.embed, x, qkv, a, m, logits, part_best, part_where, ids, st["ln1"],
                 sw["qkv_w"], st["qkv_b"], sw["o"], st["ln2"], sw["gate_up"], up, sw["down"], self.final_norm,
                 w[id(self.lm_head)], k_words, v_words, pool_words, Hkv, block_size, D, self.cos, self.sin, H, eps,
                 scale)
            return logits, ids
        hidden = v3_kernels(self.half, S, E // per)
        linear, norm_linear, norm_gate_up = (k[grid, threads, stream] for k in (hidden.linear, hidden.norm_linear,
                                                                                hidden.norm_gate_up))
        down = v3_kernels(self.half, S, I // per).linear[grid, threads, stream]
        attention = ATTENTION_V3[self.half][0][grid, threads, stream]
        _embed[grid, THREADS, stream](tokens, self.embed, x)
        for layer, k_pool, v_pool in zip(self.layers, k_pools, v_pools):
            norm_linear(x, layer["ln1"], eps, w[id(layer["qkv_w"])], layer["qkv_b"], True, qkv, False, part_best,
                        part_where)
            attention(qkv, self._pool_words(k_pool), self._pool_words(v_pool), Hkv, k_pool.shape[2], D, tables,
                      positions, self.cos, self.sin, H, scale, a)
            linear(a, w[id(layer["o"])], none, False, True, x)
            norm_gate_up(x, layer["ln2"], eps, w[id(layer["gate"])], w[id(layer["up"])], m)
            down(m, w[id(layer["down"])], none, False, True, x)
        norm_linear(x, self.final_norm, eps, w[id(self.lm_head)], none, False, logits, True, part_best, part_where)
        argmax_merge[S, THREADS, stream](part_best, part_where, ids)
        return logits, ids

    def _stacked_pool_words(self, pools):
        """(1-D uint32 words of every layer's pool from the first's, words a layer's pool) for pools that lie in
        one allocation at equal spacing (list(stacked) of a [layers, ...] array or tensor): v4 reads layer l's
        at offset l x (words a pool)."""
        numpy = isinstance(pools[0], np.ndarray)
        nbytes = pools[0].size * pools[0].itemsize if numpy else pools[0].numel() * pools[0].element_size()
        ptr = (lambda p: p.__array_interface__["data"][0]) if numpy else (lambda p: p.data_ptr())   # noqa: E731
        contiguous = all(p.flags.c_contiguous if numpy else p.is_contiguous() for p in pools)
        if not contiguous or any(ptr(p) != ptr(pools[0]) + i * nbytes for i, p in enumerate(pools)):
            raise ValueError("v4 reads every layer's pool from one allocation: pass list(pools) of one "
                             "[layers, blocks, kv heads, block, D] array")
        if numpy:
            flat = np.lib.stride_tricks.as_strided(pools[0].reshape(-1), (len(pools) * pools[0].size,),
                                                   (pools[0].itemsize,), writeable=True)
            return flat.view(np.uint32), nbytes // 4
        import torch

        return bridge.words(torch.as_strided(pools[0], (len(pools) * pools[0].numel(),), (1,))), nbytes // 4

    def _pool_words(self, pool):
        """A pool as 1-D uint32 words (a view: writes land in the pool)."""
        if isinstance(pool, np.ndarray):
            return pool.reshape(-1).view(np.uint32)
        return bridge.words(pool)

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
