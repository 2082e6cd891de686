"""Paged attention on the CPU, compiled by numba's CPU target: decode and prefill read K/V through
the block table in place (no gather into a dense tensor), plus the KV write.

Contract (the same as the CUDA kernels', docs/architecture.md):

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    decode:  q [S, H, D], sequence s attends to its context_lens[s] tokens
    prefill: q [total_q, H, D] packs the chunks of P sequences (cu_seqlens_q); their K/V are already
             in the pool; query i of a chunk of q_len sits at position context_len - q_len + i and
             sees positions 0..that position (a cached prefix, earlier chunks, itself)
    token j of sequence s lives at k_cache[block_tables[s, j // block_size], :, j % block_size]

One kernel does both (a decode is a prefill chunk of one query). Work item = (query tile, KV head):
the tile's BQ queries x the G query heads of the KV head's GQA group are the R = BQ * G rows that
share every K/V block read. Per KV block of the sequence, up to the causal end of the tile's last
query:

    S  = (Q * scale) K_block^T         [R, BS]   keys past a row's own position get -inf
    online softmax over the tile: m (running row max), l (running row sum), P = exp(S - m) in one pass
    over all R x BS scores, acc *= exp(m_old - m_new)
    acc += P V_block                   [R, D]

and out = acc / l at the end. Both products take two rows and four keys per pass over the head
dimension (each loaded q element feeds four FMAs, each K or V element two rows; one load and store
of acc per four V rows), which LLVM vectorises over D. A prefill tile (R >= 16 rows) with blocks of 16
keys computes S instead with the block's keys transposed into vector lanes (`_scores16`: per d, one
broadcast q element times two 8-lane K vectors, four rows per K load, no horizontal sums): the tile's
rows pay for the transpose, a decode's G rows would not. Measured beside the former (every tile through
`_scores`), alternating in one process on the 2-core AMD EPYC, 2 threads, 14/2 heads, d=64: a 1043-token
causal prefill 48.4 -> 42.9 ms, a 38-token chunk after 1005 cached tokens 3.67 -> 3.34 ms, decodes the same.
Measured on one core of the 2-core Xeon (AVX-512), before that change, at a 512-token causal prefill,
14/2 heads, d=64: 36-41 GFLOP/s, 0.77x torch's dense flash SDPA in the same run; the score and PV
products run at ~55-60 GFLOP/s each, near what 256-bit FMAs allow (LLVM's preferred vector width on this
CPU). The softmax was first done row by row (16-key loops): 20 GFLOP/s. Everything is float32;
exponentials use a polynomial that LLVM can vectorise (2^k built from the exponent bits, e^r by a degree-6
Taylor series on |r| <= ln2/2: relative error ~1e-7; numba has no vector exp without Intel's SVML, and a scalar libm call per score cost more
than the two matrix products it sits between).

Scheduling: work items are sorted by cost (rows x keys) and dealt round-robin to the threads, so a
long sequence and a causal tile near the end of a long prompt do not leave a thread idle while another
finishes them. The threads are Python threads (`Threads` below; calls below PARALLEL_MIN_WORK
run on the calling thread alone: a decode step of one short sequence costs less than waking a second
thread), or numba's thread pool with `numba_threads` (a parallel loop that starts in microseconds: the
CPU backend's choice inside a small step, pagedattn/layers/cpu.py).

Pools: float32 is read in place; bfloat16 and float16 pools (numba's CPU target has neither type) are
passed as 16-bit integer views, uint16 for bf16 and int16 for fp16, and each block tile is widened
into a float32 scratch tile before use. The KV write (`write_kv`) handles float32 pools; 16-bit
pools are written by torch (pagedattn.kv_cache.write_kv).

Compilation: every function is `cache=True`, so only the first process compiles (float32: ~10 s of
CPU time, each 16-bit pool dtype ~4 s more; stored in kernels_numba/__pycache__ or NUMBA_CACHE_DIR);
later processes load the machine code in about a second.

Safety: numba does not check bounds, so the kernels check every block id a call will read (and the
slots a write will touch) before any work and return an error code; the wrappers turn it into a
KernelLaunchError naming the field.
"""
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, prange
from numba.core import types
from numba.extending import overload

from kernels_numba.cpu_simd import vf_fma, vf_load, vf_splat, vf_store, vf_zero
from kernels_numba.cpu_linear import numba_threads as set_numba_threads
from kernels_numba.errors import KernelLaunchError

# Fast-math without 'nnan'/'ninf': poisoned pool slots are never read, but a NaN or inf that does
# arrive (e.g. an overflowing query) must propagate, not be assumed away.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}
QUERY_TILE = 8            # BQ: queries per prefill work item (R = 8 * G rows: 56 for Qwen2's G = 7)
PARALLEL_MIN_WORK = 1 << 14  # rows x keys below which one thread does it all (~0.2 ms: less than waking a pool)
LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)          # ln 2 = LN2_HI + LN2_LO, LN2_HI exact in 9 bits
LN2_LO = np.float32(-2.12194440e-4)
MIN_EXP_ARG = np.float32(-87.0)            # exp(-87) ~ 1.6e-38, still a normal float32; below it: 0

ERR_BLOCK, ERR_CONTEXT, ERR_SLOT = 1, 2, 3


# ----------------------------------------------------------------------------------------
# helpers (inlined by LLVM into the kernels)


def _tile(cache, block, head, scratch):
    """cache[block, head] as a float32 [block_size, head_dim] array (numba only, see the overload)."""
    raise NotImplementedError


@overload(_tile)
def _tile_impl(cache, block, head, scratch):
    # scratch: [block_size, head_dim] uint32 whose float32 view receives a widened 16-bit tile.
    if cache.dtype == types.float32:
        def read_in_place(cache, block, head, scratch):
            return cache[block, head]                                              # (BS, D) view
        return read_in_place
    if cache.dtype == types.uint16:  # bfloat16: the high half of a float32
        def widen_bf16(cache, block, head, scratch):
            src = cache[block, head]
            for j in range(src.shape[0]):
                for d in range(src.shape[1]):
                    scratch[j, d] = np.uint32(src[j, d]) << 16
            return scratch.view(np.float32)
        return widen_bf16
    if cache.dtype == types.int16:  # float16
        def widen_fp16(cache, block, head, scratch):
            src = cache[block, head]
            out = scratch.view(np.float32)
            for j in range(src.shape[0]):
                for d in range(src.shape[1]):
                    h = np.uint32(src[j, d]) & 0xFFFF
                    if (h & 0x7C00) == 0x7C00:                     # inf / NaN: exponent all ones
                        scratch[j, d] = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13)
                    else:
                        # Exponent and mantissa moved into float32 position (a half subnormal
                        # becomes a float32 subnormal), then rescaled by 2^(127 - 15).
                        scratch[j, d] = (h & 0x7FFF) << 13
                        out[j, d] = out[j, d] * np.float32(5.192296858534828e33)
                        if h & 0x8000:
                            out[j, d] = -out[j, d]
            return out
        return widen_fp16
    return None


# the exp's own flags: no "reassoc", which would fold (x - k LN2_HI) - k LN2_LO into x - k (LN2_HI + LN2_LO) and
# lose the split's precision (seen without FMA, under NUMBA_CPU_NAME=generic: ~8 ulp at |x| ~ 9)
EXP_FASTMATH = FASTMATH - {"reassoc"}


@njit(fastmath=EXP_FASTMATH, cache=True)
def _exp_inplace(x, n, bits):
    """x[:n] = exp(x[:n]) for x <= 0 (scores minus their running max; -inf gives 0), vectorisable.

    bits: [>= n] uint32 scratch. exp(x) = 2^k e^r with k = round(x log2 e) and r = x - k ln2, where
    k ln2 is subtracted in two parts (Cody-Waite: LN2_HI has few mantissa bits, so k * LN2_HI is exact
    and r keeps full precision even for x near -87). Below MIN_EXP_ARG the result is 0 (flush to zero). All
    float32 (math.floor would give an int64 k and float64 arithmetic, which AVX2 cannot convert in vectors)
    and no branch (selects only), so LLVM turns the loop into 8-lane vector code: ~1 ns a value, within
    ~4 ulp of exp.
    """
    scale = bits.view(np.float32)
    for j in range(n):
        under = x[j] < MIN_EXP_ARG
        xj = MIN_EXP_ARG if under else x[j]                                        # k stays >= -126
        k = np.floor(xj * LOG2E + np.float32(0.5))                                # float32 (math.floor: int64)
        r = (xj - k * LN2_HI) - k * LN2_LO                                         # |r| <~ ln2 / 2
        p = np.float32(1.0 / 720.0)
        p = p * r + np.float32(1.0 / 120.0)
        p = p * r + np.float32(1.0 / 24.0)
        p = p * r + np.float32(1.0 / 6.0)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        p = p * r + np.float32(1.0)
        bits[j] = np.uint32(np.int32(k) + 127) << 23                               # 2^k, k >= -126
        x[j] = np.float32(0.0) if under else p                                     # 0 * 2^k = 0
    for j in range(n):
        x[j] *= scale[j]


@njit(fastmath=FASTMATH, cache=True)
def _scores(qs, r, rows, kb, nr, s):
    """s[r + i, :nr] = qs[r + i] . kb[j] for i < rows (1 or 2), j < nr.

    Four keys per pass over the head dimension: each loaded q element feeds four FMAs and each loaded
    K element `rows` of them, and every reduction runs along contiguous memory (LLVM vectorises over d).
    """
    D = qs.shape[1]
    j = 0
    while j + 4 <= nr:
        if rows == 2:
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
            for d in range(D):
                q0, q1 = qs[r, d], qs[r + 1, d]
                k0, k1, k2, k3 = kb[j, d], kb[j + 1, d], kb[j + 2, d], kb[j + 3, d]
                a0 += q0 * k0
                a1 += q0 * k1
                a2 += q0 * k2
                a3 += q0 * k3
                b0 += q1 * k0
                b1 += q1 * k1
                b2 += q1 * k2
                b3 += q1 * k3
            s[r + 1, j], s[r + 1, j + 1], s[r + 1, j + 2], s[r + 1, j + 3] = b0, b1, b2, b3
        else:
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for d in range(D):
                q0 = qs[r, d]
                a0 += q0 * kb[j, d]
                a1 += q0 * kb[j + 1, d]
                a2 += q0 * kb[j + 2, d]
                a3 += q0 * kb[j + 3, d]
        s[r, j], s[r, j + 1], s[r, j + 2], s[r, j + 3] = a0, a1, a2, a3
        j += 4
    while j < nr:
        for i in range(rows):
            a0 = np.float32(0.0)
            for d in range(D):
                a0 += qs[r + i, d] * kb[j, d]
            s[r + i, j] = a0
        j += 1


@njit(fastmath=FASTMATH, cache=True)
def _transpose_keys(kb, n, kt):
    """kt[d * 16 + j] = kb[j, d] for the block's n keys, 0 for the other j < 16 (their scores are masked)."""
    D = kb.shape[1]
    for d in range(D):
        for j in range(16):
            kt[d * 16 + j] = kb[j, d] if j < n else np.float32(0.0)


@njit(inline="always")
def _store_row(flat, r, a0, a1):
    """Row r's 16 scores, two 8-lane vectors, into s flat [R * 16]."""
    vf_store(flat, 16 * r, a0)
    vf_store(flat, 16 * r + 8, a1)


@njit(cache=True)
def _scores16(qs, r, rows, kt, flat):
    """s[r + i, :16] = qs[r + i] . K[:16] for i < rows (1, 2 or 4), K given transposed (kt[d * 16 + j]) and s
    flat [R * 16]: the 16 keys are two 8-lane vectors, so each row's scores are 2 accumulators updated by a
    broadcast q element per d, with no horizontal sum; 2 or 4 rows per pass share each K load. Every lane
    sums its D products in order of d, whichever rows share the pass (a row's scores do not depend on its
    neighbours)."""
    D = qs.shape[1]
    a0, a1, b0, b1 = vf_zero(), vf_zero(), vf_zero(), vf_zero()
    c0, c1, e0, e1 = vf_zero(), vf_zero(), vf_zero(), vf_zero()
    for d in range(D):
        k0, k1 = vf_load(kt, 16 * d), vf_load(kt, 16 * d + 8)
        q = vf_splat(qs[r, d])
        a0, a1 = vf_fma(q, k0, a0), vf_fma(q, k1, a1)
        if rows >= 2:
            q = vf_splat(qs[r + 1, d])
            b0, b1 = vf_fma(q, k0, b0), vf_fma(q, k1, b1)
        if rows == 4:
            q = vf_splat(qs[r + 2, d])
            c0, c1 = vf_fma(q, k0, c0), vf_fma(q, k1, c1)
            q = vf_splat(qs[r + 3, d])
            e0, e1 = vf_fma(q, k0, e0), vf_fma(q, k1, e1)
    _store_row(flat, r, a0, a1)
    if rows >= 2:
        _store_row(flat, r + 1, b0, b1)
    if rows == 4:
        _store_row(flat, r + 2, c0, c1)
        _store_row(flat, r + 3, e0, e1)


@njit(fastmath=FASTMATH, cache=True)
def _accumulate(r, rows, nr, s, vb, acc):
    """acc[r + i] += s[r + i, :nr] @ vb[:nr] for i < rows (1 or 2): four V rows per pass, so each load and
    store of acc carries four FMAs and each loaded V element feeds `rows` rows."""
    D = acc.shape[1]
    j = 0
    while j + 4 <= nr:
        p0, p1, p2, p3 = s[r, j], s[r, j + 1], s[r, j + 2], s[r, j + 3]
        if rows == 2:
            t0, t1, t2, t3 = s[r + 1, j], s[r + 1, j + 1], s[r + 1, j + 2], s[r + 1, j + 3]
            for d in range(D):
                v0, v1, v2, v3 = vb[j, d], vb[j + 1, d], vb[j + 2, d], vb[j + 3, d]
                acc[r, d] += p0 * v0 + p1 * v1 + p2 * v2 + p3 * v3
                acc[r + 1, d] += t0 * v0 + t1 * v1 + t2 * v2 + t3 * v3
        else:
            for d in range(D):
                acc[r, d] += p0 * vb[j, d] + p1 * vb[j + 1, d] + p2 * vb[j + 2, d] + p3 * vb[j + 3, d]
        j += 4
    while j < nr:
        for i in range(rows):
            p0 = s[r + i, j]
            for d in range(D):
                acc[r + i, d] += p0 * vb[j, d]
        j += 1


@njit(fastmath=FASTMATH, cache=True)
def _attend_tile(q, q_row0, nq, pos0, g, k_cache, v_cache, table, scale, out,
                 qs, acc, m, l, alpha, s, kbuf, vbuf, bits, kt):
    """Queries q[q_row0 : q_row0 + nq] (positions pos0 .. pos0 + nq - 1), the G heads of KV head g.

    table: [>= blocks] the sequence's block table. Scratch (per thread): qs, acc [R, D], m, l, alpha [R],
    s [R, BS] float32 (C-contiguous), kbuf, vbuf [BS, D] uint32, bits [R * BS] uint32, kt [D * 16] float32
    (a block of 16 keys transposed), R >= nq * G.
    Row r = i * G + h is query i, head g * G + h.

    Per block every row takes the same steps over the block's n keys (rows two at a time); the keys
    past a row's own position get score -inf, so their probability is exactly 0. The softmax runs over
    the whole [R, BS] score tile at once (one exp pass), not row by row: per row the block is only
    BS = 16 keys, too short for loops to pay their set-up.
    """
    H, D = q.shape[1], q.shape[2]
    BS = k_cache.shape[2]
    G = H // k_cache.shape[1]
    R = nq * G
    for i in range(nq):
        for h in range(G):
            r = i * G + h
            for d in range(D):
                qs[r, d] = q[q_row0 + i, g * G + h, d] * scale
                acc[r, d] = 0.0
            m[r] = -np.inf
            l[r] = 0.0
    flat = s.reshape(-1)                                                            # (R * BS,)
    kv_end = pos0 + nq                           # keys 0 .. pos0 + nq - 1 (the last query's causal range)
    for b in range((kv_end + BS - 1) // BS):
        n = min(BS, kv_end - b * BS)             # keys of this block that some row sees (< context_len)
        kb = _tile(k_cache, table[b], g, kbuf)                                      # (BS, D)
        vb = _tile(v_cache, table[b], g, vbuf)                                      # (BS, D)
        r = 0
        if BS == 16 and R >= 16:                 # the default block, a prefill tile: keys in vector lanes
            # (a decode's G rows are too few to pay for the transpose: they take _scores)
            _transpose_keys(kb, n, kt)
            while r < R:
                rows = 4 if r + 3 < R else (2 if r + 1 < R else 1)
                _scores16(qs, r, rows, kt, flat)                                    # s[r:r+rows, :16]
                r += rows
        while r < R:
            rows = 2 if r + 1 < R else 1
            _scores(qs, r, rows, kb, n, s)                                          # s[r:r+rows, :n]
            r += rows
        for r in range(R):
            seen = min(n, pos0 + r // G - b * BS + 1)    # keys up to the row's own position
            for j in range(max(seen, 0), BS):
                s[r, j] = -np.inf
            m_new = m[r]
            for j in range(BS):
                m_new = max(m_new, s[r, j])
            alpha[r] = m[r] - m_new              # -inf on the first block: exp gives 0
            m[r] = m_new
            for j in range(BS):
                s[r, j] -= m_new
        _exp_inplace(flat, R * BS, bits)                                            # P = exp(S - m)
        _exp_inplace(alpha, R, bits)
        for r in range(R):
            row_sum = np.float32(0.0)
            for j in range(BS):
                row_sum += s[r, j]
            l[r] = l[r] * alpha[r] + row_sum
            if alpha[r] != 1.0:
                for d in range(D):
                    acc[r, d] *= alpha[r]
        r = 0
        while r < R:
            rows = 2 if r + 1 < R else 1
            _accumulate(r, rows, n, s, vb, acc)                                     # acc += P[:, :n] V
            r += rows
    for i in range(nq):
        for h in range(G):
            r = i * G + h
            inv = np.float32(1.0) / l[r]
            for d in range(D):
                out[q_row0 + i, g * G + h, d] = acc[r, d] * inv


@njit(cache=True)
def _check_tables(block_tables, context_lens, num_blocks, block_size):
    """0, or an error code when a sequence needs more table columns than there are, or a block id
    it will read is outside [0, num_blocks)."""
    for s in range(context_lens.shape[0]):
        ctx = context_lens[s]
        nb = (ctx + block_size - 1) // block_size
        if ctx < 1 or nb > block_tables.shape[1]:
            return ERR_CONTEXT
        for b in range(nb):
            if block_tables[s, b] < 0 or block_tables[s, b] >= num_blocks:
                return ERR_BLOCK
    return 0


# ----------------------------------------------------------------------------------------
# kernels


@njit(cache=True)
def _plan(block_tables, cu_seqlens_q, context_lens, num_blocks, block_size, num_kv_heads, query_tile):
    """Check the metadata and list the work items, most expensive first.

    block_tables: [S, max_blocks] int32; cu_seqlens_q: [S + 1] int32 (sequence s owns query rows
    cu_seqlens_q[s] : cu_seqlens_q[s + 1]); context_lens: [S] int32; query_tile: queries per item.
    Returns (error code or 0, tile_seq, tile_q0 [num_tiles] int64, order [num_tiles * Hkv] int64:
    item w = (tile order[w] // Hkv, KV head order[w] % Hkv), work: sum of rows x keys over the items).
    """
    S = context_lens.shape[0]
    empty = np.empty(0, np.int64)
    err = _check_tables(block_tables, context_lens, num_blocks, block_size)
    if err:
        return err, empty, empty, empty, 0
    num_tiles = 0
    for si in range(S):
        q_len = cu_seqlens_q[si + 1] - cu_seqlens_q[si]
        if q_len < 1 or q_len > context_lens[si]:
            return ERR_CONTEXT, empty, empty, empty, 0
        num_tiles += (q_len + query_tile - 1) // query_tile
    tile_seq = np.empty(num_tiles, np.int64)
    tile_q0 = np.empty(num_tiles, np.int64)
    cost = np.empty(num_tiles * num_kv_heads, np.int64)
    t, work = 0, 0
    for si in range(S):
        q_len = cu_seqlens_q[si + 1] - cu_seqlens_q[si]
        for q0 in range(0, q_len, query_tile):
            tile_seq[t] = si
            tile_q0[t] = q0
            keys = context_lens[si] - q_len + min(q0 + query_tile, q_len)     # the tile's causal range
            rows_x_keys = keys * min(query_tile, q_len - q0)
            work += rows_x_keys * num_kv_heads
            for g in range(num_kv_heads):
                cost[t * num_kv_heads + g] = -rows_x_keys
            t += 1
    return 0, tile_seq, tile_q0, np.argsort(cost), work


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _run(thread, num_threads, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, query_tile,
         tile_seq, tile_q0, order, out):
    """Work items thread, thread + num_threads, ... of `order` (round-robin over the sorted list keeps
    the threads' totals within one item of each other). Arguments as in `_plan` and `_attend_tile`.
    Releases the GIL, so several Python threads can run it at once on disjoint items."""
    D = q.shape[2]
    Hkv, BS = k_cache.shape[1], k_cache.shape[2]
    R = query_tile * (q.shape[1] // Hkv)
    qs = np.empty((R, D), np.float32)
    acc = np.empty((R, D), np.float32)
    m = np.empty(R, np.float32)
    l = np.empty(R, np.float32)
    alpha = np.empty(R, np.float32)
    s = np.empty((R, BS), np.float32)
    kbuf = np.empty((BS, D), np.uint32)
    vbuf = np.empty((BS, D), np.uint32)
    bits = np.empty(R * BS, np.uint32)
    kt = np.empty(D * 16, np.float32)
    for w in range(thread, order.shape[0], num_threads):
        tile, g = order[w] // Hkv, order[w] % Hkv
        si = tile_seq[tile]
        q_len = cu_seqlens_q[si + 1] - cu_seqlens_q[si]
        q0 = tile_q0[tile]
        _attend_tile(q, cu_seqlens_q[si] + q0, min(query_tile, q_len - q0), context_lens[si] - q_len + q0, g,
                     k_cache, v_cache, block_tables[si], scale, out, qs, acc, m, l, alpha, s, kbuf, vbuf, bits, kt)


@njit(parallel=True, cache=True, nogil=True)
def _run_parallel(num_threads, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, query_tile,
                  tile_seq, tile_q0, order, out):
    """`_run` for every thread index on numba's thread pool."""
    for t in prange(num_threads):
        _run(t, num_threads, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, query_tile,
             tile_seq, tile_q0, order, out)


class Threads:
    """A small pool of Python threads for the large calls (a prefill's). Python threads rather than numba's
    `prange` for calls made while torch's own threads are busy: they sleep on a lock between calls, where
    numba's OpenMP threads would spin for milliseconds on the cores torch's GEMMs need (numba links the
    system libgomp, torch ships its own). Waking one costs ~0.1 ms, so inside a small step, where torch runs
    on one thread, the CPU backend uses numba's parallel loop instead. The kernels release the GIL
    (`nogil=True`), so the threads run them at once on disjoint work. Rebuilt after a fork."""

    def __init__(self, prefix):
        self.prefix = prefix
        self.executor, self.size, self.pid = None, 0, None

    def run(self, fn, num_threads, args):
        """fn(t, num_threads, *args) for t in 0..num_threads-1; thread 0 in the calling thread."""
        if num_threads <= 1:
            return fn(0, 1, *args)
        if self.executor is None or self.size < num_threads - 1 or self.pid != os.getpid():
            self.executor = ThreadPoolExecutor(max_workers=num_threads - 1, thread_name_prefix=self.prefix)
            self.size, self.pid = num_threads - 1, os.getpid()
        futures = [self.executor.submit(fn, t, num_threads, *args) for t in range(1, num_threads)]
        fn(0, num_threads, *args)
        for f in futures:
            f.result()


_THREADS = Threads("cpu_attention")


@njit(cache=True)
def _write_kv(key, value, k_cache, v_cache, slot_mapping):
    """k_cache[slot // BS, :, slot % BS] = key[t] for every slot >= 0 (float32). Returns 0 or ERR_SLOT."""
    num_blocks, Hkv, BS, D = k_cache.shape
    for t in range(slot_mapping.shape[0]):
        if slot_mapping[t] >= num_blocks * BS:
            return ERR_SLOT
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        blk, off = slot // BS, slot % BS
        for h in range(Hkv):
            for d in range(D):
                k_cache[blk, h, off, d] = key[t, h, d]
                v_cache[blk, h, off, d] = value[t, h, d]
    return 0


# ----------------------------------------------------------------------------------------
# host side: a plan per step's metadata (shared by every layer), numpy views of torch tensors


@dataclass(frozen=True)
class Plan:
    """The checked metadata of one attention call and its work list; every layer of a step reuses it.

    block_tables [S, max_blocks], cu_seqlens_q [S + 1], context_lens [S]: int32 C arrays. tile_seq,
    tile_q0, order: the work items (see `_plan`); rows_x_keys: their total size; num_tokens: cu[-1];
    query_tile: queries per work item.
    """

    block_tables: np.ndarray
    cu_seqlens_q: np.ndarray
    context_lens: np.ndarray
    tile_seq: np.ndarray
    tile_q0: np.ndarray
    order: np.ndarray
    rows_x_keys: int
    num_tokens: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    query_tile: int = QUERY_TILE


_ERRORS = {
    ERR_BLOCK: "block_tables holds a block id outside [0, num_blocks) within a sequence's context",
    ERR_CONTEXT: "context_lens / cu_seqlens_q inconsistent: need 1 <= q_len <= context_len and "
                 "ceil(context_len / block_size) <= block_tables.shape[1]",
    ERR_SLOT: "slot_mapping holds a slot outside the pool",
}


def as_numpy(x, name="tensor"):
    """numpy view (no copy) of a CPU torch tensor or numpy array; bfloat16 as uint16 and float16 as
    int16 (numba's CPU target has neither float type; the kernels widen them)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise KernelLaunchError(f"{name} is on {x.device}: the CPU kernels need CPU tensors")
        x = x.detach()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(np.uint16)
        if x.dtype == torch.float16:
            return x.view(torch.int16).numpy()
        return x.numpy()
    return np.asarray(x)


def make_plan(block_tables, cu_seqlens_q, context_lens, num_blocks, num_kv_heads, block_size, query_tile=QUERY_TILE):
    """Check the metadata (every block id a call reads is in the pool, 1 <= q_len <= context_len) and
    order the work. block_tables: [S, max_blocks] int; cu_seqlens_q: [S + 1] int (sequence s owns query
    rows cu[s]:cu[s+1]; a decode owns one); context_lens: [S] int. query_tile: queries per work item;
    1 makes every query a tile of its own, so a prompt's query takes the arithmetic of a decode at its
    position, step for step (the batch-invariant mode's plan: docs/batch_invariance.md). Raises
    KernelLaunchError."""
    if isinstance(query_tile, bool) or not isinstance(query_tile, int) or query_tile < 1:
        raise KernelLaunchError(f"query_tile: {query_tile!r}, expected an int >= 1")
    tables = np.ascontiguousarray(as_numpy(block_tables, "block_tables"), dtype=np.int32)
    cu = np.ascontiguousarray(as_numpy(cu_seqlens_q, "cu_seqlens_q"), dtype=np.int32)
    ctx = np.ascontiguousarray(as_numpy(context_lens, "context_lens"), dtype=np.int32)
    if tables.ndim != 2 or tables.shape[0] != ctx.shape[0] or cu.shape != (ctx.shape[0] + 1,) or cu[0] != 0:
        raise KernelLaunchError(f"block_tables {tables.shape}, cu_seqlens_q {cu.shape} (from {cu[:1]}), "
                                f"context_lens {ctx.shape}: expected [S, max_blocks], [S + 1] from 0, [S]")
    err, tile_seq, tile_q0, order, work = _plan(tables, cu, ctx, num_blocks, block_size, num_kv_heads, query_tile)
    if err:
        raise KernelLaunchError(_ERRORS[err])
    return Plan(tables, cu, ctx, tile_seq, tile_q0, order, int(work), int(cu[-1]), num_blocks, num_kv_heads,
                block_size, query_tile)


def _pool(k_cache, v_cache):
    kc, vc = as_numpy(k_cache, "k_cache"), as_numpy(v_cache, "v_cache")
    if kc.ndim != 4 or kc.shape != vc.shape or kc.dtype != vc.dtype:
        raise KernelLaunchError(f"k_cache {kc.shape} {kc.dtype} and v_cache {vc.shape} {vc.dtype} must both be "
                                "[num_blocks, num_kv_heads, block_size, head_dim] of one dtype")
    if kc.dtype not in (np.float32, np.uint16, np.int16):
        raise KernelLaunchError(f"pool dtype {kc.dtype} is not float32 / bfloat16 / float16")
    if not (kc.flags.c_contiguous and vc.flags.c_contiguous):
        raise KernelLaunchError("k_cache and v_cache must be contiguous")
    return kc, vc


def attention(q, k_cache, v_cache, plan, scale=None, out=None, num_threads=1, numba_threads=False):
    """Paged attention of every query in `plan` (prefill chunks and decodes alike) over the pool.

    q: [plan.num_tokens, H, D] float32 (other float dtypes are converted); k_cache, v_cache: [num_blocks,
    Hkv, block_size, D] float32 / bfloat16 / float16 (torch or numpy); plan: make_plan(...) for this pool.
    scale: default 1/sqrt(D). out: optional [num_tokens, H, D] destination (torch or numpy, any float
    dtype). num_threads: threads to split the work over (below PARALLEL_MIN_WORK rows x keys: one).
    numba_threads: run them on numba's thread pool (a parallel loop: a few microseconds to start, its
    threads spin a while after) instead of Python threads (~0.1 ms to wake, asleep after): the CPU
    backend's choice inside a small step, where torch runs on one thread (pagedattn/layers/cpu_attention.py).
    Returns out, or a new float32 numpy array.
    """
    kc, vc = _pool(k_cache, v_cache)
    if (kc.shape[0], kc.shape[1], kc.shape[2]) != (plan.num_blocks, plan.num_kv_heads, plan.block_size):
        raise KernelLaunchError(f"pool {kc.shape} is not the one the plan was made for "
                                f"({plan.num_blocks} blocks, {plan.num_kv_heads} KV heads, block size {plan.block_size})")
    qa = np.ascontiguousarray(as_numpy(q, "q"), dtype=np.float32)
    if qa.ndim != 3 or qa.shape[0] != plan.num_tokens or qa.shape[2] != kc.shape[3] or qa.shape[1] % kc.shape[1]:
        raise KernelLaunchError(f"q has shape {qa.shape}: expected [{plan.num_tokens}, H, {kc.shape[3]}] with H a "
                                f"multiple of num_kv_heads={kc.shape[1]}")
    work = None
    if out is not None:
        if tuple(out.shape) != qa.shape:
            raise KernelLaunchError(f"out has shape {tuple(out.shape)}, q has {qa.shape}")
        oa = as_numpy(out, "out")
        if oa.dtype == np.float32 and oa.flags.c_contiguous:
            work = oa                             # written in place
    direct = work is not None
    if not direct:
        work = np.empty_like(qa)
    scale = np.float32(1.0 / math.sqrt(kc.shape[3]) if scale is None else scale)
    args = (qa, kc, vc, plan.block_tables, plan.cu_seqlens_q, plan.context_lens, scale, plan.query_tile,
            plan.tile_seq, plan.tile_q0, plan.order, work)
    threads = min(num_threads, len(plan.order))
    if threads > 1 and numba_threads:
        _run_parallel(set_numba_threads(threads), *args)
    elif threads > 1 and plan.rows_x_keys >= PARALLEL_MIN_WORK:
        _THREADS.run(_run, threads, args)
    else:
        _run(0, 1, *args)
    if out is None:
        return work
    if not direct:                                # a 16-bit or strided destination
        if isinstance(out, torch.Tensor):
            out.copy_(torch.from_numpy(work))
        else:
            out[...] = work
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                            num_threads=1):
    """Causal prefill over the paged pool (the chunks' new K/V already written).

    q: [total_q, H, D]; k_cache, v_cache: [num_blocks, Hkv, block_size, D]; block_tables: [P, max_blocks]
    int; cu_seqlens_q: [P + 1] int; context_lens: [P] int (tokens in the pool after the write: the
    chunk's q_len are the last of them). Other arguments and the result as in `attention`.
    """
    kc = as_numpy(k_cache, "k_cache")
    plan = make_plan(block_tables, cu_seqlens_q, context_lens, kc.shape[0], kc.shape[1], kc.shape[2])
    return attention(q, k_cache, v_cache, plan, scale, out, num_threads)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, out=None, num_threads=1):
    """One query per sequence over its paged K/V (the new token's K/V already written).

    q: [S, H, D]; block_tables: [S, max_blocks] int; context_lens: [S] int. The rest as in `attention`.
    """
    kc = as_numpy(k_cache, "k_cache")
    S = len(context_lens)
    plan = make_plan(block_tables, np.arange(S + 1, dtype=np.int32), context_lens, kc.shape[0], kc.shape[1],
                     kc.shape[2])
    return attention(q, k_cache, v_cache, plan, scale, out, num_threads)


def write_kv(key, value, k_cache, v_cache, slot_mapping):
    """Store the step's K/V rows at their slots (float32 pools; slot -1 = skip).

    key, value: [T, Hkv, D] (may be strided views); k_cache, v_cache: [num_blocks, Hkv, block_size, D]
    float32; slot_mapping: [T] int.
    """
    kc, vc = _pool(k_cache, v_cache)
    if kc.dtype != np.float32:
        raise KernelLaunchError("write_kv handles float32 pools; write 16-bit pools with pagedattn.kv_cache.write_kv")
    ka = np.ascontiguousarray(as_numpy(key, "key"), dtype=np.float32)
    va = np.ascontiguousarray(as_numpy(value, "value"), dtype=np.float32)
    slots = np.ascontiguousarray(as_numpy(slot_mapping, "slot_mapping"), dtype=np.int64)
    if ka.shape != va.shape or ka.shape[1:] != kc.shape[1:2] + kc.shape[3:] or ka.shape[0] != slots.shape[0]:
        raise KernelLaunchError(f"key {ka.shape} / value {va.shape} / slot_mapping {slots.shape} do not match a pool "
                                f"of {kc.shape}")
    if _write_kv(ka, va, kc, vc, slots):
        raise KernelLaunchError(_ERRORS[ERR_SLOT])
