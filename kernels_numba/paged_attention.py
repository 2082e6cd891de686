"""Paged decode attention in numba.cuda: the journey, one version at a time.

One query token per sequence attends to that sequence's whole history, found block by block
through its block table in the shared pool (layout [num_blocks, num_kv_heads, block_size,
head_dim]). GQA: query head h reads KV head h // (num_heads // num_kv_heads). fp32
accumulation, scale 1/sqrt(head_dim), one launch for sequences of different lengths.

v1: naive. grid (num_seqs, num_heads), blockDim = head_dim. Pass 1: thread t scores tokens
    t, t + head_dim, ... straight from global memory into a materialised score buffer;
    every thread then scans all scores for max and sum; pass 2: thread t owns output dim t.
v2: adds shared-memory KV tiling: each physical block's K (then V) tile is loaded once,
    coalesced, by all threads into shared memory and reused by every thread; the softmax
    max/sum become a shared-memory tree reduction.
v3: the design's kernel: adds online softmax (one pass over K and V, running max m, sum l,
    accumulator), warp-level dot products reduced with shfl_down_sync, and fp16 *pair* math
    (q and k multiplied two halves per instruction with fma.rn.f16x2 / bf16x2, the pair
    summed in fp32), fp32 accumulation.
v4: what it takes on a memory-bound H200: one CTA of 4 warps per (sequence, KV head, split)
    computes all query heads of the GQA group (each KV byte is read once, not group times);
    128-bit loads (8 halves per lane, LDG.E.128) with K and V of 4 tokens in flight per lane;
    split-KV (flash-decoding): long contexts are cut into partitions processed by separate
    CTAs so small batches fill the 132 SMs, then a merge kernel combines the partial
    (max, sum, accumulator) triples; exp2 with log2(e) folded into q.
v5: v4's grid, loads and split-KV, with the arithmetic on tensor cores: per warp and 16-token
    step, S = Q K^T and O += P V are mma.sync.m16n8k16 (fp16/bf16 in, fp32 accumulate) with
    the group's query heads as the 16 rows (G <= 16; larger groups run v4). The softmax
    needs 2 shuffles per step instead of v4's ~25 per head, and v4's ~900 FFMA per token
    become 16 HMMA per 16 tokens: the kernel is left with loads and a few dozen
    instructions of bookkeeping, i.e. memory bound. P is rounded to fp16/bf16 for the
    second product, as in FlashAttention.
v6: v5 with two 16-token sub-chunks per warp step at d=64 (16 loads of 16 bytes in flight per
    lane instead of 8; 152 registers, 3 CTAs per SM) and a split-KV plan that sizes the grid
    to whole waves of resident CTAs (v4/v5 could launch 1.2-1.5 waves, the last one mostly
    idle) with partitions down to 128 tokens, so one short sequence still spreads over SMs.
v7: v5's step, software-pipelined: two register sets, the loads of the warp's next 16-token
    chunk are issued before the math of the current one (a load is always in flight), heads
    in one mma row block when G <= 8 (142 registers at d=64, 3 CTAs per SM); v6's wave plan
    with partitions a multiple of 4 warps x 16 tokens. d=128 runs v5's kernel with that plan
    (two register sets of d=128 K/V spill).
v8: v7's step fed through shared memory by cp.async: a ring of 3 stages per warp keeps two
    16-token chunks in flight without registers (127 registers, 48 KiB, 4 CTAs per SM). The
    copies are shaped for the memory system: each instruction copies 4 whole 128-byte rows
    (as few L2 requests as a dense kernel), and the lanes read their mma fragments back from
    XOR-swizzled rows after a syncwarp. Offsets are hoisted out of the loop and whole chunks
    run unmasked. d=64 (d=128 runs v7's launcher).
v9: v8's kernel, launched by occupancy: about 8 warps per SM stream the pool as fast as 16, and
    each split costs a merge kernel and shorter partitions, so a (sequence, KV head) gets one CTA
    of 2 to 8 warps over its whole context before any split (4-warp CTAs when more are needed).
    The warps of a CTA are merged in shared memory; the ring (12 KiB per warp) is dynamic
    shared memory, beyond the 48 KiB of a static array.

Every version computes the same function; tests/test_paged_attention_cuda.py checks each under
the CUDA simulator (tiny shapes) and on the GPU (real shapes) against reference/attention.py.

Entry points:
    paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, version=None,
                    out=None, validate=True, max_context_len=None)      torch tensors on CUDA
    launch(version, q, k_cache, v_cache, block_tables, context_lens, out, scale, ...)
                                    raw-bit numba device arrays, or numpy under the simulator
"""
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32

from kernels_numba.common import (
    FULL_MASK,
    cp_async16,
    cp_async_commit,
    cp_async_wait,
    f32_bits,
    f32_from_bits,
    SIMULATOR,
    bf16_to_f32,
    bf16x2_to_f32,
    f16_to_f32,
    f16x2_to_f32,
    f32_to_bf16,
    f32_to_f16,
    fma_bf16x2,
    fma_f16x2,
    f32x2_to_bf16x2,
    f32x2_to_f16x2,
    load_u32x4,
    mma_m16n8k16_bf16,
    mma_m16n8k16_f16,
    torch_stream,
)
from pagedattn.errors import KernelLaunchError

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
LOG2E = 1.4426950408889634
NEG_INF = float32(-math.inf)


def _converters(is_bf16):
    """(one 16-bit -> f32, pair -> (f32, f32), f32 -> 16 bits, pair fma) for the pool dtype."""
    if is_bf16:
        return bf16_to_f32, bf16x2_to_f32, f32_to_bf16, fma_bf16x2
    return f16_to_f32, f16x2_to_f32, f32_to_f16, fma_f16x2


# ----------------------------------------------------------------------------------------------
# v1: naive, materialised scores, no tiling


@lru_cache(maxsize=None)
def _make_v1(head_dim, block_size, is_bf16):
    D, BS = head_dim, block_size
    cvt, _, store, _ = _converters(is_bf16)

    @cuda.jit
    def paged_attention_v1(q, k_cache, v_cache, block_tables, context_lens, out, scores, scale):
        # q, out: [S, H, D] 16-bit; k_cache, v_cache: [NB, KVH, BS, D] 16-bit
        # scores: [S, H, max_context_len] float32 scratch
        s = cuda.blockIdx.x
        h = cuda.blockIdx.y
        t = cuda.threadIdx.x
        kvh = h // (q.shape[1] // k_cache.shape[1])
        ctx = context_lens[s]
        # pass 1: thread t scores tokens t, t + D, ... (a full 64/128-long dot product each)
        for j in range(t, ctx, D):
            block = block_tables[s, j // BS]
            off = j % BS
            acc = float32(0.0)
            for d in range(D):
                acc += cvt(q[s, h, d]) * cvt(k_cache[block, kvh, off, d])
            scores[s, h, j] = acc * scale
        cuda.syncthreads()  # scores of all threads visible to all threads of the block
        # every thread finds the max and the sum on its own
        m = NEG_INF
        for j in range(ctx):
            m = max(m, scores[s, h, j])
        denom = float32(0.0)
        for j in range(ctx):
            denom += math.exp(scores[s, h, j] - m)
        # pass 2: thread t owns output dim t
        acc = float32(0.0)
        for j in range(ctx):
            block = block_tables[s, j // BS]
            off = j % BS
            acc += math.exp(scores[s, h, j] - m) * cvt(v_cache[block, kvh, off, t])
        out[s, h, t] = store(acc / denom)

    return paged_attention_v1


def _launch_v1(a, stream):
    kernel = _make_v1(a.head_dim, a.block_size, a.is_bf16)
    scores = a.scratch((a.num_seqs, a.num_heads, a.max_context_len))
    kernel[(a.num_seqs, a.num_heads), a.head_dim, stream](
        a.q16, a.k16, a.v16, a.block_tables, a.context_lens, a.out16, scores, a.scale
    )


# ----------------------------------------------------------------------------------------------
# v2: + shared-memory KV tiling


@lru_cache(maxsize=None)
def _make_v2(head_dim, block_size, is_bf16):
    D, BS = head_dim, block_size
    cvt, _, store, _ = _converters(is_bf16)

    @cuda.jit
    def paged_attention_v2(q, k_cache, v_cache, block_tables, context_lens, out, scores, scale):
        # same arguments as v1
        s = cuda.blockIdx.x
        h = cuda.blockIdx.y
        t = cuda.threadIdx.x
        kvh = h // (q.shape[1] // k_cache.shape[1])
        ctx = context_lens[s]
        q_sh = cuda.shared.array(D, float32)
        tile = cuda.shared.array((BS, D), float32)  # one block of K, then of V
        p_sh = cuda.shared.array(BS, float32)
        red = cuda.shared.array(D, float32)  # tree reductions
        q_sh[t] = cvt(q[s, h, t])
        num_blocks = (ctx + BS - 1) // BS
        # pass 1: scores, one K tile at a time
        for b in range(num_blocks):
            block = block_tables[s, b]
            n = min(BS, ctx - b * BS)
            cuda.syncthreads()  # previous tile fully used (and q_sh written)
            for r in range(n):  # thread t loads column t: a warp reads 64 contiguous bytes
                tile[r, t] = cvt(k_cache[block, kvh, r, t])
            cuda.syncthreads()
            if t < n:
                acc = float32(0.0)
                for d in range(D):
                    acc += q_sh[d] * tile[t, d]
                scores[s, h, b * BS + t] = acc * scale
        cuda.syncthreads()
        # max, then sum: each thread reduces a strided slice, then a tree over D threads
        m = NEG_INF
        for j in range(t, ctx, D):
            m = max(m, scores[s, h, j])
        red[t] = m
        stride = D // 2
        while stride > 0:
            cuda.syncthreads()
            if t < stride:
                red[t] = max(red[t], red[t + stride])
            stride //= 2
        cuda.syncthreads()
        m = red[0]
        total = float32(0.0)
        for j in range(t, ctx, D):
            total += math.exp(scores[s, h, j] - m)
        cuda.syncthreads()
        red[t] = total
        stride = D // 2
        while stride > 0:
            cuda.syncthreads()
            if t < stride:
                red[t] += red[t + stride]
            stride //= 2
        cuda.syncthreads()
        denom = red[0]
        # pass 2: V tiles, thread t owns output dim t
        acc = float32(0.0)
        for b in range(num_blocks):
            block = block_tables[s, b]
            n = min(BS, ctx - b * BS)
            cuda.syncthreads()
            for r in range(n):
                tile[r, t] = cvt(v_cache[block, kvh, r, t])
            if t < n:
                p_sh[t] = math.exp(scores[s, h, b * BS + t] - m)
            cuda.syncthreads()
            for r in range(n):
                acc += p_sh[r] * tile[r, t]
        out[s, h, t] = store(acc / denom)

    return paged_attention_v2


def _launch_v2(a, stream):
    kernel = _make_v2(a.head_dim, a.block_size, a.is_bf16)
    scores = a.scratch((a.num_seqs, a.num_heads, a.max_context_len))
    kernel[(a.num_seqs, a.num_heads), a.head_dim, stream](
        a.q16, a.k16, a.v16, a.block_tables, a.context_lens, a.out16, scores, a.scale
    )


# ----------------------------------------------------------------------------------------------
# v3: + online softmax, warp reductions (shfl_down_sync), fp16 pair math


@lru_cache(maxsize=None)
def _make_v3(head_dim, block_size, is_bf16):
    D, BS = head_dim, block_size
    P = D // 2  # half pairs per row
    PPL = P // 32  # pairs per lane: 1 (d=64) or 2 (d=128)
    NW = D // 32  # warps per CTA
    _, cvt2, store, fma2 = _converters(is_bf16)

    @cuda.jit
    def paged_attention_v3(q, k_cache, v_cache, block_tables, context_lens, out, scale):
        # q: [S, H, D/2] pairs; k_cache, v_cache: [NB, KVH, BS, D/2] pairs; out: [S, H, D] 16-bit
        s = cuda.blockIdx.x
        h = cuda.blockIdx.y
        t = cuda.threadIdx.x
        warp = t // 32
        lane = t % 32
        kvh = h // (q.shape[1] // k_cache.shape[1])
        ctx = context_lens[s]
        k_sh = cuda.shared.array((BS, P), uint32)  # one block's K and V as raw pairs
        v_sh = cuda.shared.array((BS, P), uint32)
        s_sh = cuda.shared.array(BS, float32)  # the block's scores
        q0 = q[s, h, lane]  # this lane's q pairs stay in registers
        q1 = q[s, h, lane + 32] if PPL == 2 else q0
        m = NEG_INF  # running max, sum and this thread's output dim t: identical in all threads
        denom = float32(0.0)
        acc = float32(0.0)
        num_blocks = (ctx + BS - 1) // BS
        for b in range(num_blocks):
            block = block_tables[s, b]
            n = min(BS, ctx - b * BS)
            for i in range(t, n * P, D):  # cooperative, coalesced 4-byte loads
                r = i // P
                c = i % P
                k_sh[r, c] = k_cache[block, kvh, r, c]
                v_sh[r, c] = v_cache[block, kvh, r, c]
            cuda.syncthreads()
            # scores: warp w takes rows w, w + NW, ...; each lane multiplies its pair(s)
            for r in range(warp, BS, NW):
                lo, hi = cvt2(fma2(q0, k_sh[r, lane], 0))
                part = lo + hi
                if PPL == 2:
                    lo, hi = cvt2(fma2(q1, k_sh[r, lane + 32], 0))
                    part += lo + hi
                part += cuda.shfl_down_sync(FULL_MASK, part, 16)
                part += cuda.shfl_down_sync(FULL_MASK, part, 8)
                part += cuda.shfl_down_sync(FULL_MASK, part, 4)
                part += cuda.shfl_down_sync(FULL_MASK, part, 2)
                part += cuda.shfl_down_sync(FULL_MASK, part, 1)
                if lane == 0:
                    s_sh[r] = part * scale if r < n else NEG_INF
            cuda.syncthreads()
            # online softmax update (Milakov & Gimelshein): rescale what we have, add the block
            m_new = m
            for r in range(n):
                m_new = max(m_new, s_sh[r])
            alpha = math.exp(m - m_new)
            denom *= alpha
            acc *= alpha
            for r in range(n):
                p = math.exp(s_sh[r] - m_new)
                denom += p
                lo, hi = cvt2(v_sh[r, t // 2])
                acc += p * (hi if t % 2 == 1 else lo)
            m = m_new
            cuda.syncthreads()  # the tile is consumed before the next block overwrites it
        out[s, h, t] = store(acc / denom)

    return paged_attention_v3


def _launch_v3(a, stream):
    kernel = _make_v3(a.head_dim, a.block_size, a.is_bf16)
    kernel[(a.num_seqs, a.num_heads), a.head_dim, stream](
        a.q32, a.k32_4d, a.v32_4d, a.block_tables, a.context_lens, a.out16, a.scale
    )


# ----------------------------------------------------------------------------------------------
# v4 / v5: GQA-grouped CTA, 128-bit loads, split-KV + merge

NUM_WARPS = 4  # warps per CTA in v4/v5
MIN_PARTITION = 256  # tokens: below this a split costs more (merge, launch tail) than it gains
TARGET_CTAS = 4 * 132  # enough CTAs for a few waves on the H200's 132 SMs


def split_plan(num_seqs, num_kv_heads, max_context_len, chunk):
    """(num_splits, partition_size) for v4/v5: partitions are multiples of the chunk size."""
    base = max(1, num_seqs * num_kv_heads)
    splits = max(1, min(-(-TARGET_CTAS // base), -(-max_context_len // MIN_PARTITION)))
    part = -(-max_context_len // splits)
    part = -(-part // chunk) * chunk
    splits = -(-max_context_len // part)
    return splits, part


def _geometry(head_dim, block_size):
    LPT = head_dim // 8  # lanes per token row: each lane holds 8 halves = one 16-byte load
    TPW = 32 // LPT  # token rows per warp: 4 (d=64) or 2 (d=128)
    NT = 4  # token slots per lane per chunk (K and V of NT tokens in flight per lane)
    return LPT, TPW, NT, TPW * NT



@lru_cache(maxsize=None)
def _make_v4(head_dim, block_size, group, is_bf16):
    D, BS, G = head_dim, block_size, group
    LPT, TPW, NT, CH = _geometry(D, BS)
    NW = NUM_WARPS
    P = D // 2  # pairs per row
    cvt, cvt2, store, _ = _converters(is_bf16)
    QSCALE_LOG2E = float32(LOG2E)
    G8, NT4, NTG = G * 8, NT * 4, NT * G  # local array sizes must be plain constants

    @cuda.jit
    def paged_attention_v4(q, k_flat, v_flat, block_tables, context_lens, out, part_acc,
                           part_ml, scale, partition):
        # q, out: [S, H, D] 16-bit; k_flat, v_flat: the pool [NB, KVH, BS, D] as flat 32-bit
        # pairs; part_acc: [S, H, splits, D] f32, part_ml: [S, H, splits, 2] f32 (splits > 1)
        kvh = cuda.blockIdx.x
        s = cuda.blockIdx.y
        split = cuda.blockIdx.z
        num_splits = cuda.gridDim.z
        num_kv_heads = cuda.gridDim.x
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        row = lane // LPT  # token row of this lane inside a chunk
        dc = lane % LPT  # this lane owns dims dc*8 .. dc*8+7
        ctx = context_lens[s]
        start = split * partition
        if start >= ctx:
            return  # the whole CTA: this split lies past the sequence (the merge skips it)
        end = min(ctx, start + partition)
        h0 = kvh * G  # first query head of the group

        m_sh = cuda.shared.array((NW, G), float32)
        l_sh = cuda.shared.array((NW, G), float32)
        acc_sh = cuda.shared.array((NW, G, D), float32)

        # registers: q of every head of the group (this lane's 8 dims, pre-scaled for exp2),
        # running max m, sum l and accumulator per head
        qr = cuda.local.array(G8, float32)
        m = cuda.local.array(G, float32)
        lsum = cuda.local.array(G, float32)
        acc = cuda.local.array(G8, float32)
        for g in range(G):
            m[g] = NEG_INF
            lsum[g] = 0.0
            for e in range(8):
                qr[g * 8 + e] = cvt(q[s, h0 + g, dc * 8 + e]) * scale * QSCALE_LOG2E
                acc[g * 8 + e] = 0.0

        kw = cuda.local.array(NT4, uint32)  # the chunk's raw K / V words, NT token slots
        vw = cuda.local.array(NT4, uint32)
        sc = cuda.local.array(NTG, float32)  # scores, then probabilities
        kf = cuda.local.array(8, float32)
        words_per_block = num_kv_heads * BS * P
        num_chunks = (end - start + CH - 1) // CH
        for c in range(warp, num_chunks, NW):
            j0 = start + c * CH + row  # slot i of this lane is token j0 + i * TPW
            # issue all 2 * NT 16-byte loads of the chunk before using any of them
            for i in range(NT):
                j = j0 + i * TPW
                if j < end:
                    block = block_tables[s, j // BS]
                    base = block * words_per_block + (kvh * BS + j % BS) * P + dc * 4
                    kw[i * 4 + 0], kw[i * 4 + 1], kw[i * 4 + 2], kw[i * 4 + 3] = load_u32x4(k_flat, base)
                    vw[i * 4 + 0], vw[i * 4 + 1], vw[i * 4 + 2], vw[i * 4 + 3] = load_u32x4(v_flat, base)
                else:
                    for e in range(4):
                        kw[i * 4 + e] = 0
                        vw[i * 4 + e] = 0
            # q . k, every head: 8 products per lane, then a butterfly over the row's LPT lanes
            for i in range(NT):
                for e in range(4):
                    kf[2 * e], kf[2 * e + 1] = cvt2(kw[i * 4 + e])
                for g in range(G):
                    x = float32(0.0)
                    for e in range(8):
                        x += qr[g * 8 + e] * kf[e]
                    off = LPT // 2
                    while off > 0:
                        x += cuda.shfl_xor_sync(FULL_MASK, x, off)
                        off //= 2
                    sc[i * G + g] = x if j0 + i * TPW < end else NEG_INF
            # online softmax per head; the chunk max spans the warp's TPW token rows
            for g in range(G):
                cmax = sc[g]
                for i in range(1, NT):
                    cmax = max(cmax, sc[i * G + g])
                off = 16
                while off >= LPT:
                    cmax = max(cmax, cuda.shfl_xor_sync(FULL_MASK, cmax, off))
                    off //= 2
                m_new = max(m[g], cmax)  # finite: the chunk holds at least one token
                alpha = math.exp2(m[g] - m_new)
                m[g] = m_new
                psum = float32(0.0)
                for i in range(NT):
                    p = math.exp2(sc[i * G + g] - m_new)
                    sc[i * G + g] = p
                    psum += p
                lsum[g] = lsum[g] * alpha + psum
                for e in range(8):
                    acc[g * 8 + e] *= alpha
            # p . v: this lane's 8 dims of every head
            for i in range(NT):
                for e in range(4):
                    kf[2 * e], kf[2 * e + 1] = cvt2(vw[i * 4 + e])
                for g in range(G):
                    p = sc[i * G + g]
                    for e in range(8):
                        acc[g * 8 + e] += p * kf[e]

        # fold the warp's token rows together: lanes with the same dc, xor over the row bits
        for g in range(G):
            x = lsum[g]
            off = 16
            while off >= LPT:
                x += cuda.shfl_xor_sync(FULL_MASK, x, off)
                off //= 2
            lsum[g] = x
            for e in range(8):
                y = acc[g * 8 + e]
                off = 16
                while off >= LPT:
                    y += cuda.shfl_xor_sync(FULL_MASK, y, off)
                    off //= 2
                acc[g * 8 + e] = y
        if row == 0:
            for g in range(G):
                for e in range(8):
                    acc_sh[warp, g, dc * 8 + e] = acc[g * 8 + e]
                if dc == 0:
                    m_sh[warp, g] = m[g]
                    l_sh[warp, g] = lsum[g]
        cuda.syncthreads()
        # merge the warps (a warp that got no chunk has m = -inf, l = 0, acc = 0)
        for i in range(tid, G * D, NW * 32):
            g = i // D
            d = i % D
            mx = NEG_INF
            for w in range(NW):
                mx = max(mx, m_sh[w, g])
            num = float32(0.0)
            den = float32(0.0)
            for w in range(NW):
                f = math.exp2(m_sh[w, g] - mx)
                num += acc_sh[w, g, d] * f
                den += l_sh[w, g] * f
            if num_splits == 1:
                out[s, h0 + g, d] = store(num / den)
            else:
                part_acc[s, h0 + g, split, d] = num
                if d == 0:
                    part_ml[s, h0 + g, split, 0] = mx
                    part_ml[s, h0 + g, split, 1] = den

    return paged_attention_v4


@lru_cache(maxsize=None)
def _make_merge(head_dim, is_bf16):
    store = _converters(is_bf16)[2]

    @cuda.jit
    def merge_splits(part_acc, part_ml, context_lens, out, partition):
        # grid (S, H), blockDim = D: combine the partitions' (max, sum, acc) of one head
        s = cuda.blockIdx.x
        h = cuda.blockIdx.y
        d = cuda.threadIdx.x
        n = (context_lens[s] + partition - 1) // partition
        mx = NEG_INF
        for i in range(n):
            mx = max(mx, part_ml[s, h, i, 0])
        num = float32(0.0)
        den = float32(0.0)
        for i in range(n):
            f = math.exp2(part_ml[s, h, i, 0] - mx)
            num += part_acc[s, h, i, d] * f
            den += part_ml[s, h, i, 1] * f
        out[s, h, d] = store(num / den)

    return merge_splits


def _launch_split_kv(a, stream, kernel, q, splits, partition, sharedmem=0, warps=NUM_WARPS):
    """v4+'s launch: grid (KV heads, sequences, splits) of CTAs of `warps` warps (with `sharedmem`
    bytes of dynamic shared memory), then, when the context is split, the merge of the partitions'
    (max, sum, accumulator) into the output."""
    if splits == 1:
        part_acc = part_ml = a.scratch((1, 1, 1, 1))  # unused
    else:
        part_acc = a.scratch((a.num_seqs, a.num_heads, splits, a.head_dim))
        part_ml = a.scratch((a.num_seqs, a.num_heads, splits, 2))
    args = (q, a.k32, a.v32, a.block_tables, a.context_lens, a.out16, part_acc, part_ml, a.scale, partition)
    _allow_dynamic_smem(kernel, args, sharedmem)
    kernel[(a.num_kv_heads, a.num_seqs, splits), warps * 32, stream, sharedmem](*args)
    if splits > 1:
        merge = _make_merge(a.head_dim, a.is_bf16)
        merge[(a.num_seqs, a.num_heads), a.head_dim, stream](
            part_acc, part_ml, a.context_lens, a.out16, partition
        )


def _launch_v4(a, stream):
    kernel = _make_v4(a.head_dim, a.block_size, a.num_heads // a.num_kv_heads, a.is_bf16)
    chunk = _geometry(a.head_dim, a.block_size)[3]
    splits, partition = split_plan(a.num_seqs, a.num_kv_heads, a.max_context_len, chunk)
    _launch_split_kv(a, stream, kernel, a.q16, splits, partition)


# ----------------------------------------------------------------------------------------------
# v5: tensor cores (mma.sync m16n8k16) for q.k and p.v, heads of the group as the M dimension


@lru_cache(maxsize=None)
def _make_warp_merge(head_dim, group, rows, is_bf16, warps=NUM_WARPS):
    """v5/v7/v8's end of a CTA: each warp's (max, sum, accumulator) per head row goes to its
    region of `buf` (uint32 shared memory, `stride` words per warp: accumulator [h * D + d],
    max at G * D + h, sum at G * D + G + h, as f32 bits), then the CTA combines the 4 warps and
    writes the output (one split) or the partition's partials (several). Includes the barrier."""
    D, G, ROWS = head_dim, group, rows
    NW = warps
    DPC = D // 8
    NTILE = D // 8
    store = _converters(is_bf16)[2]

    @cuda.jit(device=True, inline="always")
    def merge_warps(buf, stride, warp, g, t, tid, lsum, m, acc, out, part_acc, part_ml, s, h0, split,
                    num_splits):
        # this warp's result: rows g, g+8; acc[jn*4 + 2r + e] is dim DPC*(2t+e) + jn
        base = warp * stride
        for r in range(ROWS):
            x = lsum[r]
            x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
            x += cuda.shfl_xor_sync(FULL_MASK, x, 2)
            h = g + 8 * r
            if h < G:
                for jn in range(NTILE):
                    buf[base + h * D + DPC * (2 * t) + jn] = f32_bits(acc[jn * 4 + 2 * r])
                    buf[base + h * D + DPC * (2 * t + 1) + jn] = f32_bits(acc[jn * 4 + 2 * r + 1])
                if t == 0:
                    buf[base + G * D + h] = f32_bits(m[r])
                    buf[base + G * D + G + h] = f32_bits(x)
        cuda.syncthreads()
        for i in range(tid, G * D, NW * 32):
            hh = i // D
            d = i % D
            mx = NEG_INF
            for w in range(NW):
                mx = max(mx, f32_from_bits(buf[w * stride + G * D + hh]))
            num = float32(0.0)
            den = float32(0.0)
            for w in range(NW):
                f = math.exp2(f32_from_bits(buf[w * stride + G * D + hh]) - mx)
                num += f32_from_bits(buf[w * stride + hh * D + d]) * f
                den += f32_from_bits(buf[w * stride + G * D + G + hh]) * f
            if num_splits == 1:
                out[s, h0 + hh, d] = store(num / den)
            else:
                part_acc[s, h0 + hh, split, d] = num
                if d == 0:
                    part_ml[s, h0 + hh, split, 0] = mx
                    part_ml[s, h0 + hh, split, 1] = den

    return merge_warps


@lru_cache(maxsize=None)
def _make_v5(head_dim, block_size, group, is_bf16, unroll=1, rows=2):
    D, BS, G = head_dim, block_size, group
    NW = NUM_WARPS
    CH = 16  # tokens per warp step: one mma k-slice for p.v, two n-tiles for q.k
    P = D // 2  # half pairs per row
    KS = D // 16  # q.k k-steps (mma k = 16 dims)
    QW = D // 8  # words of K one lane loads per token: dims tig*D/4 .. +D/4, i.e. D/8 pairs
    DPC = D // 8  # p.v: n-tile j, column g <-> dim DPC*g + j; a lane loads DPC dims per token
    NTILE = D // 8  # p.v n-tiles (8 dims each)
    VW = DPC // 2  # words of V per token per lane
    ACC = NTILE * 4
    U = unroll  # sub-chunks of 16 tokens whose loads are in flight together (v6: 2)
    ROWS = rows  # mma row blocks that hold heads: 2 (heads g and g+8), or 1 when G <= 8 (v7)
    PART_WORDS = G * D + 2 * G  # per warp, for merge_warps
    PART_BUF = NW * PART_WORDS
    merge_warps = _make_warp_merge(head_dim, group, ROWS, is_bf16)
    KS4, KWN, VWN = KS * 4, 2 * QW, 4 * VW  # local array sizes must be plain constants
    KWU, VWU = KWN * U, VWN * U
    mma = mma_m16n8k16_bf16 if is_bf16 else mma_m16n8k16_f16
    pack = f32x2_to_bf16x2 if is_bf16 else f32x2_to_f16x2
    QSCALE_LOG2E = float32(LOG2E)

    @cuda.jit
    def paged_attention_v5(q, k_flat, v_flat, block_tables, context_lens, out, part_acc,
                           part_ml, scale, partition):
        # q: [S, H, D/2] pairs; k_flat, v_flat: the pool as flat 32-bit pairs; out: [S, H, D]
        # 16-bit; part_acc / part_ml: split-KV partials as in v4
        kvh = cuda.blockIdx.x
        s = cuda.blockIdx.y
        split = cuda.blockIdx.z
        num_splits = cuda.gridDim.z
        num_kv_heads = cuda.gridDim.x
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4  # mma "group": head row g (and g + 8), token column g of a q.k n-tile
        t = lane % 4  # thread in group
        ctx = context_lens[s]
        start = split * partition
        if start >= ctx:
            return
        end = min(ctx, start + partition)
        h0 = kvh * G

        part_buf = cuda.shared.array(PART_BUF, uint32)  # the warps' results, for merge_warps

        # A fragments of q (rows: heads g, g+8 of the group; zero past G), per k-step:
        # k-slots (2t, 2t+1) <-> dims t*D/4 + 4*ks + (0, 1); (2t+8, 2t+9) <-> + (2, 3)
        qa = cuda.local.array(KS4, uint32)
        for ks in range(KS):
            for r in range(2):
                h = g + 8 * r
                w0 = uint32(0)
                w1 = uint32(0)
                if r < ROWS and h < G:
                    w0 = uint32(q[s, h0 + h, t * QW + 2 * ks])
                    w1 = uint32(q[s, h0 + h, t * QW + 2 * ks + 1])
                qa[ks * 4 + r] = w0  # a0 (r=0) / a1 (r=1)
                qa[ks * 4 + 2 + r] = w1  # a2 / a3
        m = cuda.local.array(2, float32)
        lsum = cuda.local.array(2, float32)
        acc = cuda.local.array(ACC, float32)
        for r in range(2):
            m[r] = NEG_INF
            lsum[r] = 0.0
        for i in range(ACC):
            acc[i] = 0.0

        kw = cuda.local.array(KWU, uint32)  # per sub-chunk: K of tokens g and 8+g, this lane's dims
        vw = cuda.local.array(VWU, uint32)  # per sub-chunk: V of tokens 2t, 2t+1, 8+2t, 9+2t, dims DPC*g..
        sc = cuda.local.array(8, float32)  # [row r][n-tile n][col c] -> r*4 + n*2 + c
        words_per_block = num_kv_heads * BS * P
        head_off = kvh * BS * P
        sl = scale * QSCALE_LOG2E
        num_steps = (end - start + CH * U - 1) // (CH * U)
        for c in range(warp, num_steps, NW):
            # a step is U sub-chunks of 16 tokens: all their loads are issued before any math
            for sub in range(U):
                c0 = start + (c * U + sub) * CH
                ko = sub * KWN
                vo = sub * VWN
                # loads first: 2 tokens of K (QW words each), 4 tokens of V (VW words each)
                for n in range(2):
                    j = c0 + 8 * n + g
                    if j < end:
                        base = block_tables[s, j // BS] * words_per_block + head_off + (j % BS) * P + t * QW
                        for i in range(QW // 4):
                            w = load_u32x4(k_flat, base + 4 * i)
                            kw[ko + n * QW + 4 * i + 0] = w[0]
                            kw[ko + n * QW + 4 * i + 1] = w[1]
                            kw[ko + n * QW + 4 * i + 2] = w[2]
                            kw[ko + n * QW + 4 * i + 3] = w[3]
                    else:
                        for i in range(QW):
                            kw[ko + n * QW + i] = 0
                for u in range(4):
                    j = c0 + 2 * t + (u % 2) + 8 * (u // 2)
                    if j < end:
                        base = block_tables[s, j // BS] * words_per_block + head_off + (j % BS) * P + g * VW
                        for i in range(VW // 4):
                            w = load_u32x4(v_flat, base + 4 * i)
                            vw[vo + u * VW + 4 * i + 0] = w[0]
                            vw[vo + u * VW + 4 * i + 1] = w[1]
                            vw[vo + u * VW + 4 * i + 2] = w[2]
                            vw[vo + u * VW + 4 * i + 3] = w[3]
                    else:
                        for i in range(VW):
                            vw[vo + u * VW + i] = 0
            for sub in range(U):
                c0 = start + (c * U + sub) * CH
                ko = sub * KWN
                vo = sub * VWN
                # S = Q K^T: two n-tiles of 8 tokens, KS k-steps each
                for n in range(2):
                    d0 = float32(0.0)
                    d1 = float32(0.0)
                    d2 = float32(0.0)
                    d3 = float32(0.0)
                    for ks in range(KS):
                        d0, d1, d2, d3 = mma(qa[ks * 4], qa[ks * 4 + 1], qa[ks * 4 + 2], qa[ks * 4 + 3],
                                             kw[ko + n * QW + 2 * ks], kw[ko + n * QW + 2 * ks + 1], d0, d1, d2, d3)
                    jt = c0 + 8 * n + 2 * t  # token of column 2t of this n-tile
                    sc[n * 2 + 0] = d0 * sl if jt < end else NEG_INF
                    sc[n * 2 + 1] = d1 * sl if jt + 1 < end else NEG_INF
                    sc[4 + n * 2 + 0] = d2 * sl if jt < end else NEG_INF
                    sc[4 + n * 2 + 1] = d3 * sl if jt + 1 < end else NEG_INF
                # online softmax per head row (the 4 lanes of a group hold the 16 tokens)
                pw = cuda.local.array(4, uint32)  # P as A fragments: a0..a3
                pw[1] = 0  # rows g+8 stay zero unless ROWS == 2
                pw[3] = 0
                for r in range(ROWS):
                    cmax = max(max(sc[r * 4], sc[r * 4 + 1]), max(sc[r * 4 + 2], sc[r * 4 + 3]))
                    cmax = max(cmax, cuda.shfl_xor_sync(FULL_MASK, cmax, 1))
                    cmax = max(cmax, cuda.shfl_xor_sync(FULL_MASK, cmax, 2))
                    m_new = max(m[r], cmax)
                    alpha = math.exp2(m[r] - m_new)
                    m[r] = m_new
                    p0 = math.exp2(sc[r * 4 + 0] - m_new)
                    p1 = math.exp2(sc[r * 4 + 1] - m_new)
                    p2 = math.exp2(sc[r * 4 + 2] - m_new)
                    p3 = math.exp2(sc[r * 4 + 3] - m_new)
                    lsum[r] = lsum[r] * alpha + (p0 + p1) + (p2 + p3)
                    pw[r] = pack(p0, p1)  # a0 / a1: tokens 2t, 2t+1
                    pw[2 + r] = pack(p2, p3)  # a2 / a3: tokens 8+2t, 9+2t
                    for jn in range(NTILE):
                        acc[jn * 4 + 2 * r] *= alpha
                        acc[jn * 4 + 2 * r + 1] *= alpha
                # O += P V: n-tile jn covers dims DPC*g + jn (column g); B needs token pairs of one
                # dim in a word, so interleave the halves of two tokens' words
                for i in range(VW):
                    for hi in range(2):
                        jn = 2 * i + hi
                        if hi == 0:
                            b0 = (vw[vo + i] & 0xFFFF) | (vw[vo + VW + i] << 16)
                            b1 = (vw[vo + 2 * VW + i] & 0xFFFF) | (vw[vo + 3 * VW + i] << 16)
                        else:
                            b0 = (vw[vo + i] >> 16) | (vw[vo + VW + i] & 0xFFFF0000)
                            b1 = (vw[vo + 2 * VW + i] >> 16) | (vw[vo + 3 * VW + i] & 0xFFFF0000)
                        c2 = acc[jn * 4 + 2] if ROWS == 2 else float32(0.0)
                        c3 = acc[jn * 4 + 3] if ROWS == 2 else float32(0.0)
                        a0, a1, a2, a3 = mma(pw[0], pw[1], pw[2], pw[3], b0, b1, acc[jn * 4], acc[jn * 4 + 1],
                                             c2, c3)
                        acc[jn * 4] = a0
                        acc[jn * 4 + 1] = a1
                        if ROWS == 2:
                            acc[jn * 4 + 2] = a2
                            acc[jn * 4 + 3] = a3

        merge_warps(part_buf, PART_WORDS, warp, g, t, tid, lsum, m, acc, out, part_acc, part_ml, s, h0, split,
                    num_splits)

    return paged_attention_v5


V5_MAX_GROUP = 16  # heads per KV head that fit the mma's 16 rows; larger groups run v4


def _launch_v5(a, stream):
    group = a.num_heads // a.num_kv_heads
    if group > V5_MAX_GROUP:
        return _launch_v4(a, stream)
    kernel = _make_v5(a.head_dim, a.block_size, group, a.is_bf16)
    splits, partition = split_plan(a.num_seqs, a.num_kv_heads, a.max_context_len, 16)
    _launch_split_kv(a, stream, kernel, a.q32, splits, partition)



# ----------------------------------------------------------------------------------------------
# v6: v5 with twice the bytes in flight per warp and a split plan that fills whole waves

V6_MIN_PARTITION = 128  # tokens: one 32-token step for each of the 4 warps


def _v6_unroll_and_occupancy(head_dim):
    """(16-token sub-chunks loaded together, resident CTAs per SM) from ptxas' register counts:
    d=64: 152 registers -> 3 CTAs of 128 threads; d=128 keeps v5's single sub-chunk (204 -> 2)."""
    return (2, 3) if head_dim == 64 else (1, 2)


def split_plan_waves(num_seqs, num_kv_heads, max_context_len, step, slots, min_partition=None):
    """(num_splits, partition_size) so that the CTAs fill whole waves of `slots` resident CTAs.

    Among 1 .. ceil(max_context_len / min_partition) splits, the smallest whose CTA count
    wastes at most 10% of its last wave; failing that (few, short sequences), the most splits.
    """
    min_partition = V6_MIN_PARTITION if min_partition is None else min_partition
    base = max(1, num_seqs * num_kv_heads)
    max_splits = max(1, -(-max_context_len // min_partition))
    splits = max_splits
    for n in range(1, max_splits + 1):
        ctas = base * n
        if ctas / (-(-ctas // slots) * slots) >= 0.9:
            splits = n
            break
    part = -(-max_context_len // splits)
    part = -(-part // step) * step
    return -(-max_context_len // part), part


def _launch_v6(a, stream):
    group = a.num_heads // a.num_kv_heads
    if group > V5_MAX_GROUP:
        return _launch_v4(a, stream)
    unroll, ctas_per_sm = _v6_unroll_and_occupancy(a.head_dim)
    kernel = _make_v5(a.head_dim, a.block_size, group, a.is_bf16, unroll)
    splits, partition = split_plan_waves(a.num_seqs, a.num_kv_heads, a.max_context_len, 16 * unroll,
                                         ctas_per_sm * a.num_sms)
    _launch_split_kv(a, stream, kernel, a.q32, splits, partition)

# ----------------------------------------------------------------------------------------------
# v7: v5's tensor-core step, software-pipelined: the next step's K/V loads are issued before
# the current step's math, so every warp always has a step of loads in flight


@lru_cache(maxsize=None)
def _make_mma_step(head_dim, group, is_bf16):
    """v7/v8's math on one warp's 16-token chunk in registers: S = Q K^T (2 n-tiles x D/16
    k-steps), online softmax per head row, O += P V (D/8 mmas); full: every token of the chunk
    is inside the context (no masking). kw: K of tokens g and 8+g (this
    lane's D/4 dims); vw: V of tokens 2t, 2t+1, 8+2t, 9+2t (D/8 dims from DPC*g); P goes to the
    second mma as fp16/bf16 pairs (pw), V is transposed in registers by interleaving halves."""
    G = group
    KS = head_dim // 16
    QW = head_dim // 8
    NTILE = head_dim // 8
    VW = head_dim // 16
    ROWS = 1 if G <= 8 else 2
    mma = mma_m16n8k16_bf16 if is_bf16 else mma_m16n8k16_f16
    pack = f32x2_to_bf16x2 if is_bf16 else f32x2_to_f16x2

    @cuda.jit(device=True, inline="always")
    def compute_chunk(kw, vw, qa, m, lsum, acc, sc, pw, c0, end, t, sl, full):
        for n in range(2):
            d0 = float32(0.0)
            d1 = float32(0.0)
            d2 = float32(0.0)
            d3 = float32(0.0)
            for ks in range(KS):
                d0, d1, d2, d3 = mma(qa[ks * 4], qa[ks * 4 + 1], qa[ks * 4 + 2], qa[ks * 4 + 3],
                                     kw[n * QW + 2 * ks], kw[n * QW + 2 * ks + 1], d0, d1, d2, d3)
            jt = c0 + 8 * n + 2 * t
            sc[n * 2 + 0] = d0 * sl if full or jt < end else NEG_INF
            sc[n * 2 + 1] = d1 * sl if full or jt + 1 < end else NEG_INF
            if ROWS == 2:
                sc[4 + n * 2 + 0] = d2 * sl if full or jt < end else NEG_INF
                sc[4 + n * 2 + 1] = d3 * sl if full or jt + 1 < end else NEG_INF
        pw[1] = 0
        pw[3] = 0
        for r in range(ROWS):
            cmax = max(max(sc[r * 4], sc[r * 4 + 1]), max(sc[r * 4 + 2], sc[r * 4 + 3]))
            cmax = max(cmax, cuda.shfl_xor_sync(FULL_MASK, cmax, 1))
            cmax = max(cmax, cuda.shfl_xor_sync(FULL_MASK, cmax, 2))
            m_new = max(m[r], cmax)
            alpha = math.exp2(m[r] - m_new)
            m[r] = m_new
            p0 = math.exp2(sc[r * 4 + 0] - m_new)
            p1 = math.exp2(sc[r * 4 + 1] - m_new)
            p2 = math.exp2(sc[r * 4 + 2] - m_new)
            p3 = math.exp2(sc[r * 4 + 3] - m_new)
            lsum[r] = lsum[r] * alpha + (p0 + p1) + (p2 + p3)
            pw[r] = pack(p0, p1)
            pw[2 + r] = pack(p2, p3)
            for jn in range(NTILE):
                acc[jn * 4 + 2 * r] *= alpha
                acc[jn * 4 + 2 * r + 1] *= alpha
        for i in range(VW):
            for hi in range(2):
                jn = 2 * i + hi
                if hi == 0:
                    b0 = (vw[i] & 0xFFFF) | (vw[VW + i] << 16)
                    b1 = (vw[2 * VW + i] & 0xFFFF) | (vw[3 * VW + i] << 16)
                else:
                    b0 = (vw[i] >> 16) | (vw[VW + i] & 0xFFFF0000)
                    b1 = (vw[2 * VW + i] >> 16) | (vw[3 * VW + i] & 0xFFFF0000)
                c2 = acc[jn * 4 + 2] if ROWS == 2 else float32(0.0)
                c3 = acc[jn * 4 + 3] if ROWS == 2 else float32(0.0)
                a0, a1, a2, a3 = mma(pw[0], pw[1], pw[2], pw[3], b0, b1, acc[jn * 4], acc[jn * 4 + 1], c2, c3)
                acc[jn * 4] = a0
                acc[jn * 4 + 1] = a1
                if ROWS == 2:
                    acc[jn * 4 + 2] = a2
                    acc[jn * 4 + 3] = a3

    return compute_chunk


@lru_cache(maxsize=None)
def _make_v7(head_dim, block_size, group, is_bf16):
    D, BS, G = head_dim, block_size, group
    NW = NUM_WARPS
    CH = 16
    P = D // 2
    KS = D // 16
    QW = D // 8
    DPC = D // 8
    NTILE = D // 8
    VW = DPC // 2
    ACC = NTILE * 4
    ROWS = 1 if G <= 8 else 2  # mma row blocks holding heads (g, and g+8 when G > 8)
    PART_WORDS = G * D + 2 * G  # per warp, for merge_warps
    PART_BUF = NW * PART_WORDS
    merge_warps = _make_warp_merge(head_dim, group, ROWS, is_bf16)
    KS4, KWN, VWN = KS * 4, 2 * QW, 4 * VW
    QSCALE_LOG2E = float32(LOG2E)

    @cuda.jit(device=True, inline="always")
    def load_chunk(kw, vw, k_flat, v_flat, block_tables, s, c0, end, g, t, words_per_block, head_off):
        # K of tokens c0+g, c0+8+g (this lane's D/4 dims); V of tokens c0+2t, +1, +8, +9 (DPC dims)
        for n in range(2):
            j = c0 + 8 * n + g
            if j < end:
                base = block_tables[s, j // BS] * words_per_block + head_off + (j % BS) * P + t * QW
                for i in range(QW // 4):
                    w = load_u32x4(k_flat, base + 4 * i)
                    kw[n * QW + 4 * i + 0] = w[0]
                    kw[n * QW + 4 * i + 1] = w[1]
                    kw[n * QW + 4 * i + 2] = w[2]
                    kw[n * QW + 4 * i + 3] = w[3]
            else:
                for i in range(QW):
                    kw[n * QW + i] = 0
        for u in range(4):
            j = c0 + 2 * t + (u % 2) + 8 * (u // 2)
            if j < end:
                base = block_tables[s, j // BS] * words_per_block + head_off + (j % BS) * P + g * VW
                for i in range(VW // 4):
                    w = load_u32x4(v_flat, base + 4 * i)
                    vw[u * VW + 4 * i + 0] = w[0]
                    vw[u * VW + 4 * i + 1] = w[1]
                    vw[u * VW + 4 * i + 2] = w[2]
                    vw[u * VW + 4 * i + 3] = w[3]
            else:
                for i in range(VW):
                    vw[u * VW + i] = 0

    compute_chunk = _make_mma_step(head_dim, group, is_bf16)

    @cuda.jit
    def paged_attention_v7(q, k_flat, v_flat, block_tables, context_lens, out, part_acc,
                           part_ml, scale, partition):
        # same arguments as v5
        kvh = cuda.blockIdx.x
        s = cuda.blockIdx.y
        split = cuda.blockIdx.z
        num_splits = cuda.gridDim.z
        num_kv_heads = cuda.gridDim.x
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        ctx = context_lens[s]
        start = split * partition
        if start >= ctx:
            return
        end = min(ctx, start + partition)
        h0 = kvh * G

        part_buf = cuda.shared.array(PART_BUF, uint32)  # the warps' results, for merge_warps

        qa = cuda.local.array(KS4, uint32)
        for ks in range(KS):
            for r in range(2):
                h = g + 8 * r
                w0 = uint32(0)
                w1 = uint32(0)
                if r < ROWS and h < G:
                    w0 = uint32(q[s, h0 + h, t * QW + 2 * ks])
                    w1 = uint32(q[s, h0 + h, t * QW + 2 * ks + 1])
                qa[ks * 4 + r] = w0
                qa[ks * 4 + 2 + r] = w1
        m = cuda.local.array(2, float32)
        lsum = cuda.local.array(2, float32)
        acc = cuda.local.array(ACC, float32)
        for r in range(2):
            m[r] = NEG_INF
            lsum[r] = 0.0
        for i in range(ACC):
            acc[i] = 0.0
        kw_a = cuda.local.array(KWN, uint32)  # two register sets: one in flight, one in use
        vw_a = cuda.local.array(VWN, uint32)
        kw_b = cuda.local.array(KWN, uint32)
        vw_b = cuda.local.array(VWN, uint32)
        sc = cuda.local.array(8, float32)
        pw = cuda.local.array(4, uint32)
        words_per_block = num_kv_heads * BS * P
        head_off = kvh * BS * P
        sl = scale * QSCALE_LOG2E
        num_chunks = (end - start + CH - 1) // CH
        c = warp
        if c < num_chunks:
            load_chunk(kw_a, vw_a, k_flat, v_flat, block_tables, s, start + c * CH, end, g, t,
                       words_per_block, head_off)
        while c < num_chunks:
            # set a holds chunk c: fetch chunk c + NW into set b, then do c's math
            if c + NW < num_chunks:
                load_chunk(kw_b, vw_b, k_flat, v_flat, block_tables, s, start + (c + NW) * CH, end, g, t,
                           words_per_block, head_off)
            compute_chunk(kw_a, vw_a, qa, m, lsum, acc, sc, pw, start + c * CH, end, t, sl, False)
            c += NW
            if c >= num_chunks:
                break
            if c + NW < num_chunks:
                load_chunk(kw_a, vw_a, k_flat, v_flat, block_tables, s, start + (c + NW) * CH, end, g, t,
                           words_per_block, head_off)
            compute_chunk(kw_b, vw_b, qa, m, lsum, acc, sc, pw, start + c * CH, end, t, sl, False)
            c += NW

        merge_warps(part_buf, PART_WORDS, warp, g, t, tid, lsum, m, acc, out, part_acc, part_ml, s, h0, split,
                    num_splits)

    return paged_attention_v7


V7_CTAS_PER_SM = {64: 3, 128: 2}  # ptxas: 142 registers at d=64 (v7), 204 at d=128 (v5 kernel)


def _launch_v7(a, stream):
    group = a.num_heads // a.num_kv_heads
    if group > V5_MAX_GROUP:
        return _launch_v4(a, stream)
    if a.head_dim == 64:
        kernel = _make_v7(a.head_dim, a.block_size, group, a.is_bf16)
    else:  # two register sets of d=128 K/V spill: d=128 keeps v5's kernel, with v7's plan
        kernel = _make_v5(a.head_dim, a.block_size, group, a.is_bf16)
    # partitions a multiple of 4 warps x 16 tokens, so the warps of a CTA get equal work
    splits, partition = split_plan_waves(a.num_seqs, a.num_kv_heads, a.max_context_len, 16 * NUM_WARPS,
                                         V7_CTAS_PER_SM[a.head_dim] * a.num_sms)
    _launch_split_kv(a, stream, kernel, a.q32, splits, partition)


# ----------------------------------------------------------------------------------------------
# v8: v7's tensor-core step fed by cp.async through a ring of shared-memory stages per warp, so
# that STAGES - 1 chunks of loads are in flight per warp without holding them in registers

V8_STAGES = 3  # 3 x 4 KiB per warp: 48 KiB of ring per CTA of 4 warps at d=64
V8_LAUNCH_BOUNDS = (NUM_WARPS * 32, 4)  # <= 128 registers, so 4 CTAs (the ring allows 4) per SM
V8_CTAS_PER_SM = V8_LAUNCH_BOUNDS[1]


@lru_cache(maxsize=None)
def _make_v8(head_dim, block_size, group, is_bf16, stages=V8_STAGES, ctas_per_sm=V8_CTAS_PER_SM, dynamic=False,
             warps=NUM_WARPS):
    """v8's kernel for CTAs of `warps` warps; dynamic: the ring is dynamic shared memory of
    ring_bytes(stages, warps) (v9), so that it may exceed the 48 KiB a static array can have."""
    D, BS, G, ST = head_dim, block_size, group, stages
    NW = warps
    CH = 16
    P = D // 2
    KS = D // 16
    QW = D // 8  # K words of one token a lane holds (its D/4 dims)
    VW = D // 16  # V words of one token a lane holds (D/8 dims)
    ACC = (D // 8) * 4  # accumulators: D/8 n-tiles of 4
    ROWS = 1 if G <= 8 else 2
    KS4, KWN, VWN = KS * 4, 2 * QW, 4 * VW
    KV4, VV4 = QW // 4, VW // 4  # 16-byte pieces of one token's K (V) a lane copies
    NV = 2 * KV4 + 4 * VV4  # 16-byte pieces a lane copies per chunk (8 at d=64)
    SLOT = NV * 128  # words of one warp's stage: piece p of lane L at p * 128 + 4 * L
    WARP_WORDS = ST * SLOT
    RING = NW * WARP_WORDS
    RING_DECL = 0 if dynamic else RING  # 0: dynamic shared memory, sized at launch
    HALF = 8 if BS == 8 else 0  # block size 8: tokens 8..15 of a chunk are in the next block
    assert D == 64, "v8's stage layout is for head_dim 64 (d=128 runs v7's launcher)"
    assert WARP_WORDS >= G * D + 2 * G, "the ring must hold a warp's partial results"
    compute_chunk = _make_mma_step(head_dim, group, is_bf16)
    merge_warps = _make_warp_merge(head_dim, group, ROWS, is_bf16, NW)
    wait_oldest = cp_async_wait(ST - 1)  # after step k commits chunk k + ST - 1: chunk k has landed
    wait_all = cp_async_wait(0)
    QSCALE_LOG2E = float32(LOG2E)
    jit_options = {} if SIMULATOR else {"launch_bounds": (NW * 32, ctas_per_sm)}

    @cuda.jit(device=True, inline="always")
    def issue_chunk(ring, slot, k_flat, v_flat, base_lo, base_hi, src_lane, kdst, vdst_even, vdst_odd, c0,
                    end, lrow, full):
        # the chunk's 16 K rows and 16 V rows (128 bytes each at d=64), 4 rows per instruction:
        # lane L copies 16-byte unit L % 8 of row 4 i + L // 8, so every copy instruction reads
        # 512 contiguous bytes (whole lines: as few L2 requests as a dense kernel makes).
        # base_lo/hi + r * P: the words of row r (rows 8.. use base_hi: block size 8).
        # Rows past the end are not copied.
        for i in range(4):
            if full or c0 + 4 * i + lrow < end:
                src = (base_lo if i < 2 else base_hi) + 4 * i * P + src_lane
                cp_async16(ring, slot + kdst + 4 * i * P, k_flat, src)
                cp_async16(ring, slot + (vdst_even if i % 2 == 0 else vdst_odd) + 4 * i * P, v_flat, src)

    @cuda.jit(device=True, inline="always")
    def read_chunk(kw, vw, ring, slot, krd0, krd1, vrd, c0, end, g, t, full):
        # this lane's mma fragments from the stage (see the layout in the kernel); tokens past the
        # end (never copied: stale words) read as zeros
        for n in range(2):
            ok = full or c0 + 8 * n + g < end
            for i in range(KV4):
                w = load_u32x4(ring, slot + (krd0 if i == 0 else krd1) + 8 * n * P)
                for e in range(4):
                    kw[4 * (n * KV4 + i) + e] = w[e] if ok else uint32(0)
        for u in range(4):
            ok = full or c0 + 2 * t + (u % 2) + 8 * (u // 2) < end
            w = load_u32x4(ring, slot + vrd + ((u % 2) + 8 * (u // 2)) * P)
            for e in range(4):
                vw[4 * u + e] = w[e] if ok else uint32(0)

    @cuda.jit(device=True, inline="always")
    def chunk_bases(block_tables, s, c0, end, words_per_block, head_off):
        # words of the chunk's row 0 in the pool; rows 8.. at base_hi + r * P (another block
        # when the block size is 8)
        blk = block_tables[s, c0 // BS]
        base_lo = blk * words_per_block + head_off + (c0 & (BS - 1)) * P
        base_hi = base_lo
        if HALF and c0 + 8 < end:
            base_hi = block_tables[s, c0 // BS + 1] * words_per_block + head_off - 8 * P
        return base_lo, base_hi

    @cuda.jit(**jit_options)
    def paged_attention_v8(q, k_flat, v_flat, block_tables, context_lens, out, part_acc,
                           part_ml, scale, partition):
        # same arguments as v5
        kvh = cuda.blockIdx.x
        s = cuda.blockIdx.y
        split = cuda.blockIdx.z
        num_splits = cuda.gridDim.z
        num_kv_heads = cuda.gridDim.x
        tid = cuda.threadIdx.x
        warp = tid >> 5  # (shifts and masks: no sign fix-ups of // and % on 64-bit ints)
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        ctx = context_lens[s]
        start = split * partition
        if start >= ctx:
            return
        end = min(ctx, start + partition)
        h0 = kvh * G

        ring = cuda.shared.array(RING_DECL, uint32)
        base = warp * WARP_WORDS

        qa = cuda.local.array(KS4, uint32)
        for ks in range(KS):
            for r in range(2):
                h = g + 8 * r
                w0 = uint32(0)
                w1 = uint32(0)
                if r < ROWS and h < G:  # lane word w <-> pair (w // 4) * 16 + 4 t + w % 4, as K
                    w0 = uint32(q[s, h0 + h, (ks // 2) * 16 + t * 4 + (2 * ks) % 4])
                    w1 = uint32(q[s, h0 + h, (ks // 2) * 16 + t * 4 + (2 * ks) % 4 + 1])
                qa[ks * 4 + r] = w0
                qa[ks * 4 + 2 + r] = w1
        m = cuda.local.array(2, float32)
        lsum = cuda.local.array(2, float32)
        acc = cuda.local.array(ACC, float32)
        for r in range(2):
            m[r] = NEG_INF
            lsum[r] = 0.0
        for i in range(ACC):
            acc[i] = 0.0
        kw = cuda.local.array(KWN, uint32)
        vw = cuda.local.array(VWN, uint32)
        sc = cuda.local.array(8, float32)
        pw = cuda.local.array(4, uint32)
        # A stage holds a chunk's K rows (words 0 .. 16 P) then its V rows, 128 bytes per row,
        # the eight 16-byte units of row r swizzled: K unit u at u ^ 4 (r & 1), V unit u at
        # u ^ 2 ((r >> 1) & 3), so that the copies (8 lanes: one row) and the fragment reads
        # (K: rows g, unit 4 i + t; V: rows 2t.., unit g) hit 8 different bank groups per phase.
        # this lane's word offsets in a stage (row 4 i + lrow, unit lane % 8 when copying; the
        # fragments' rows and units when reading), from the swizzles above with i, n, u folded out
        lrow = lane >> 3
        unit = lane & 7
        src_lane = lrow * P + 4 * unit
        kdst = lrow * P + 4 * (unit ^ ((lrow & 1) * 4))  # + 4 i P
        vdst_even = 16 * P + lrow * P + 4 * (unit ^ ((lrow >> 1) * 2))  # + 4 i P, i = 0, 2
        vdst_odd = 16 * P + lrow * P + 4 * (unit ^ ((2 + (lrow >> 1)) * 2))  # i = 1, 3
        krd0 = g * P + 16 * (g & 1) + 4 * t  # + 8 n P: K unit t of rows g, 8 + g
        krd1 = g * P + 16 * (1 - (g & 1)) + 4 * t  # unit 4 + t
        vrd = 16 * P + 2 * t * P + 4 * (g ^ (2 * t))  # + (u % 2 + 8 (u // 2)) P: V unit g
        words_per_block = num_kv_heads * BS * P
        head_off = kvh * BS * P
        sl = scale * QSCALE_LOG2E
        num_chunks = (end - start + CH - 1) // CH
        nk = (num_chunks - warp + NW - 1) // NW  # this warp's chunks: warp, warp + NW, ...
        step = NW * CH

        # prologue: chunks 0 .. ST-2 into stages 0 .. ST-2, one commit group each
        c0 = start + warp * CH
        for k in range(ST - 1):
            if k < nk:
                b_lo, b_hi = chunk_bases(block_tables, s, c0, end, words_per_block, head_off)
                issue_chunk(ring, base + k * SLOT, k_flat, v_flat, b_lo, b_hi, src_lane, kdst, vdst_even, vdst_odd, c0,
                            end, lrow, False)
            cp_async_commit()
            c0 += step
        # the pool offsets of the next chunk to issue are read a step ahead of their use
        nxt_lo = 0
        nxt_hi = 0
        if ST - 1 < nk:
            nxt_lo, nxt_hi = chunk_bases(block_tables, s, c0, end, words_per_block, head_off)
        c_issue = c0  # first token of chunk k + ST - 1
        c0 = start + warp * CH  # first token of chunk k
        slot_read = base
        slot_write = base + (ST - 1) * SLOT
        for k in range(nk):
            # refill the stage read at step k - 1 (its values are used) with chunk k + ST - 1
            if k + ST - 1 < nk:
                if c_issue + CH <= end:
                    issue_chunk(ring, slot_write, k_flat, v_flat, nxt_lo, nxt_hi, src_lane, kdst, vdst_even,
                                vdst_odd, c_issue, end, lrow, True)
                else:
                    issue_chunk(ring, slot_write, k_flat, v_flat, nxt_lo, nxt_hi, src_lane, kdst, vdst_even,
                                vdst_odd, c_issue, end, lrow, False)
                c_issue += step
                if k + ST < nk:
                    nxt_lo, nxt_hi = chunk_bases(block_tables, s, c_issue, end, words_per_block, head_off)
            cp_async_commit()
            slot_write = slot_read  # the stage read now is refilled at the next step
            wait_oldest()  # this lane's copies of chunk k have landed; k+1 .. k+ST-1 stay in flight
            cuda.syncwarp()  # ... and every lane's (a lane reads units other lanes copied)
            # (the stage refilled at the next step is free: its values fed this step's mma.sync,
            # which every lane of the warp must reach)
            if c0 + CH <= end:
                read_chunk(kw, vw, ring, slot_read, krd0, krd1, vrd, c0, end, g, t, True)
                compute_chunk(kw, vw, qa, m, lsum, acc, sc, pw, c0, end, t, sl, True)
            else:
                read_chunk(kw, vw, ring, slot_read, krd0, krd1, vrd, c0, end, g, t, False)
                compute_chunk(kw, vw, qa, m, lsum, acc, sc, pw, c0, end, t, sl, False)
            c0 += step
            slot_read += SLOT
            if slot_read == base + WARP_WORDS:
                slot_read = base

        # the ring, now idle, carries each warp's (max, sum, accumulator) to the CTA's combine
        wait_all()
        cuda.syncthreads()
        merge_warps(ring, WARP_WORDS, warp, g, t, tid, lsum, m, acc, out, part_acc, part_ml, s, h0, split,
                    num_splits)

    return paged_attention_v8


def _launch_v8(a, stream):
    group = a.num_heads // a.num_kv_heads
    if group > V5_MAX_GROUP or a.head_dim != 64:  # d=128: a stage would be 8 KiB per warp
        return _launch_v7(a, stream)
    kernel = _make_v8(a.head_dim, a.block_size, group, a.is_bf16)
    splits, partition = split_plan_waves(a.num_seqs, a.num_kv_heads, a.max_context_len, 16 * NUM_WARPS,
                                         V8_CTAS_PER_SM * a.num_sms)
    _launch_split_kv(a, stream, kernel, a.q32, splits, partition)


# ----------------------------------------------------------------------------------------------
# v9: v8's kernel, its launch shaped by occupancy. Measured (docs/kernels.md, scripts/tune_splits.py):
# about 8 warps per SM stream the pool as fast as 16, and every split costs (a merge kernel,
# short partitions), so each (sequence, KV head) gets its share of 8 warps per SM, as one CTA of
# 2 to 8 warps when that is enough and as partitions of 4-warp CTAs beyond. The CTA's warps are
# combined in shared memory; an 8-warp ring (96 KiB) is dynamic shared memory.

V9_WARPS_PER_SM = 8
SMEM_PER_CTA_MAX = 227 * 1024  # H100/H200: the most dynamic shared memory one CTA may have


def ring_bytes(head_dim, stages, warps=NUM_WARPS):
    """v8/v9's ring: warps x stages x one 16-token chunk of K and V."""
    return warps * stages * 2 * 16 * head_dim * 2


def v9_plan(num_seqs, num_kv_heads, max_context_len, num_sms):
    """(splits, partition, warps): warps per (sequence, KV head) = the power of two nearest below
    V9_WARPS_PER_SM * num_sms / pairs, at least 2; up to 8 of them form one CTA over the whole
    context, more are 4-warp CTAs over partitions of >= 2 chunks (128 tokens) per warp."""
    pairs = max(1, num_seqs * num_kv_heads)
    per_pair = max(2, 1 << max(0, (V9_WARPS_PER_SM * num_sms // pairs).bit_length() - 1))
    warps = per_pair if per_pair <= 8 else NUM_WARPS
    step = 16 * warps
    max_splits = max(1, max_context_len // (2 * step))
    part = -(-max_context_len // min(max_splits, per_pair // warps))
    part = -(-part // step) * step
    return -(-max_context_len // part), part, warps


def _make_v9(head_dim, block_size, group, is_bf16, warps=8, stages=V8_STAGES):
    """v8's kernel for CTAs of `warps` warps with a dynamic ring; launch bounds that allow 16
    warps per SM (<= 128 registers), as v8."""
    return _make_v8(head_dim, block_size, group, is_bf16, stages, max(1, 16 // warps), dynamic=True,
                    warps=warps)


_DYNAMIC_SMEM = set()  # (kernel, device, argument kinds) whose specialisation has opted in


def _allow_dynamic_smem(kernel, args, nbytes):
    """Beyond 48 KiB of dynamic shared memory a kernel must opt in (the driver's
    MAX_DYNAMIC_SHARED_SIZE_BYTES attribute) before its first launch: compile the
    specialisation for these arguments now and set the attribute on it. Each specialisation
    is configured for the most any launch may ask (SMEM_PER_CTA_MAX), once; the per-call check
    is a set lookup on what decides the specialisation (dtype and rank of each array)."""
    if SIMULATOR or nbytes <= 48 * 1024:
        return
    kinds = tuple((getattr(x, "dtype", None), getattr(x, "ndim", type(x))) for x in args)
    key = (id(kernel), cuda.get_current_device().id, kinds)
    if key in _DYNAMIC_SMEM:
        return
    from numba.cuda.cudadrv.driver import binding, driver

    argtypes = tuple(kernel.typeof_pyval(x) for x in args)
    cufunc = kernel.compile(argtypes)._codelibrary.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, SMEM_PER_CTA_MAX, cufunc.handle, cufunc.device.id)
    _DYNAMIC_SMEM.add(key)


def _launch_v9(a, stream, splits=None, warps=None, stages=V8_STAGES):
    """splits, warps, stages: override the plan (scripts/tune_splits.py measures the choices)."""
    group = a.num_heads // a.num_kv_heads
    if group > V5_MAX_GROUP or a.head_dim != 64:
        return _launch_v7(a, stream)
    plan_splits, partition, plan_warps = v9_plan(a.num_seqs, a.num_kv_heads, a.max_context_len, a.num_sms)
    warps = plan_warps if warps is None else warps
    if splits is not None or warps != plan_warps:
        n = plan_splits if splits is None else splits
        partition = -(-a.max_context_len // n)
        partition = -(-partition // (16 * warps)) * (16 * warps)
    splits = -(-a.max_context_len // partition)
    kernel = _make_v9(a.head_dim, a.block_size, group, a.is_bf16, warps, stages)
    _launch_split_kv(a, stream, kernel, a.q32, splits, partition, ring_bytes(a.head_dim, stages, warps), warps)


# ----------------------------------------------------------------------------------------------
# launchers

VERSIONS = {1: _launch_v1, 2: _launch_v2, 3: _launch_v3, 4: _launch_v4, 5: _launch_v5, 6: _launch_v6, 7: _launch_v7,
            8: _launch_v8, 9: _launch_v9}
BEST_VERSION = 9


def _launch_best(a, stream):
    """version=None: v9 (which runs v7's launcher for head_dim 128, and v4 for groups > 16);
    docs/kernels.md has the measurements behind the choice."""
    return _launch_v9(a, stream)


@dataclass
class _Args:
    """Everything a version's launcher needs: raw-bit views of the tensors plus geometry."""

    q16: object  # [S, H, D] 16-bit
    k16: object  # [NB, KVH, BS, D] 16-bit
    v16: object
    block_tables: object  # [S, M] int32
    context_lens: object  # [S] int32
    out16: object  # [S, H, D] 16-bit
    scale: float
    is_bf16: bool
    max_context_len: int
    scratch: object  # shape -> float32 array on the same device
    q32: object = None  # [S, H, D/2] pairs
    k32_4d: object = None  # [NB, KVH, BS, D/2] pairs
    v32_4d: object = None
    k32: object = None  # flat pairs
    v32: object = None
    num_sms: int = 132  # H200

    def __post_init__(self):
        self.num_seqs, self.num_heads, self.head_dim = self.q16.shape
        _, self.num_kv_heads, self.block_size, _ = self.k16.shape
        self.scale = float32(self.scale)
        if self.q32 is None:
            self.q32 = _pairs(self.q16)
        if self.k32_4d is None:
            self.k32_4d, self.v32_4d = _pairs(self.k16), _pairs(self.v16)
        if self.k32 is None:
            self.k32, self.v32 = self.k32_4d.reshape(-1), self.v32_4d.reshape(-1)


def _pairs(x16):
    """A 16-bit array viewed as pairs (last dim halved), numpy or numba device array."""
    return x16.view(np.uint32 if x16.dtype == np.uint16 else np.int32)


def check_supported(num_heads, num_kv_heads, head_dim, block_size):
    """Raise KernelLaunchError for a geometry no version supports."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise KernelLaunchError(f"head_dim={head_dim} is not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise KernelLaunchError(
            f"block_size={block_size} is not supported (supported: {SUPPORTED_BLOCK_SIZES})"
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise KernelLaunchError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")


def launch(version, q, k_cache, v_cache, block_tables, context_lens, out, scale=None,
           is_bf16=False, max_context_len=None, stream=0, scratch=None):
    """Low-level launcher: raw-bit arrays, no validation of values (version None: the best).

    q, out: [num_seqs, num_heads, head_dim] uint16/int16 holding fp16 or bf16 bits
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] uint16/int16 bits
    block_tables: [num_seqs, max_blocks] int32; context_lens: [num_seqs] int32 (>= 1)
    Arrays are numba device arrays (any stream) or, under the simulator, numpy arrays.
    is_bf16: the bits are bf16 (else fp16). max_context_len: >= every context length
    (default max_blocks * block_size); it sizes scratch buffers and v4's split plan.
    scratch: shape -> float32 array (default: numpy under the simulator, cuda.device_array).
    """
    if version is not None and version not in VERSIONS:
        raise KernelLaunchError(f"version={version!r} is not one of {sorted(VERSIONS)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    check_supported(num_heads, k_cache.shape[1], head_dim, k_cache.shape[2])
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * k_cache.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if scratch is None:
        if SIMULATOR:
            scratch = lambda shape: np.zeros(shape, dtype=np.float32)  # noqa: E731
        else:
            scratch = lambda shape: cuda.device_array(shape, dtype=np.float32, stream=stream)  # noqa: E731
    args = _Args(q, k_cache, v_cache, block_tables, context_lens, out, scale, is_bf16,
                 int(max_context_len), scratch)
    (_launch_best if version is None else VERSIONS[version])(args, stream)
    return out


_WRAPPED = {}  # (data_ptr, shape, dtype, view) -> (numba view, tensor): wrapped once, reused
_SCRATCH = {}  # (device, stream, shape) -> (numba view, tensor): split-KV partials
_MAX_CACHED = 256


def _wrap(t):
    return cuda.as_cuda_array(t, sync=False)  # torch orders the work: launch on its stream


def _cached_view(t, view):
    """numba view of torch tensor t reinterpreted as `view` ("int16", "int32", "int32_flat",
    "same"), cached by address, shape and dtype (the wrapper keeps t alive while cached).
    Wrapping costs tens of microseconds per tensor; the pool, block tables and the engine's
    static buffers are the same tensors call after call."""
    import torch

    key = (t.data_ptr(), tuple(t.shape), t.dtype, t.device.index, view)
    hit = _WRAPPED.get(key)
    if hit is None:
        if view == "int16":
            arr = _wrap(t.view(torch.int16))
        elif view == "int32":
            arr = _wrap(t.view(torch.int32))
        elif view == "int32_flat":
            arr = _wrap(t.view(torch.int32).view(-1))
        else:
            arr = _wrap(t)
        if len(_WRAPPED) >= _MAX_CACHED:
            _WRAPPED.pop(next(iter(_WRAPPED)))
        hit = _WRAPPED[key] = (arr, t)
    return hit[0]


_SMS = {}


def _num_sms(device):
    n = _SMS.get(device.index)
    if n is None:
        import torch

        n = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def clear_caches():
    """Drop the cached numba wrappers (they keep their tensors alive) and scratch buffers."""
    _WRAPPED.clear()
    _SCRATCH.clear()


def _validate(q, k_cache, v_cache, block_tables, context_lens, out, version):
    """Shapes, dtypes, devices (host only, no sync). Raises KernelLaunchError."""
    import torch

    if version is not None and version not in VERSIONS:
        raise KernelLaunchError(f"version={version!r} is not one of {sorted(VERSIONS)}")
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                 context_lens=context_lens)
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise KernelLaunchError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise KernelLaunchError(f"{name} must be contiguous")
    if q.dim() != 3:
        raise KernelLaunchError(f"q must be [num_seqs, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise KernelLaunchError(
            f"k_cache and v_cache must both be [num_blocks, num_kv_heads, block_size, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, kv_dim = k_cache.shape
    if kv_dim != head_dim:
        raise KernelLaunchError(f"q head_dim={head_dim} but the pool has head_dim={kv_dim}")
    check_supported(num_heads, num_kv_heads, head_dim, block_size)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise KernelLaunchError(f"q must be float16 or bfloat16, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise KernelLaunchError(f"k_cache/v_cache dtype ({k_cache.dtype}/{v_cache.dtype}) must equal q's ({q.dtype})")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise KernelLaunchError(
            f"block_tables must be int32 [num_seqs={num_seqs}, max_blocks], got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (num_seqs,):
        raise KernelLaunchError(
            f"context_lens must be int32 [num_seqs={num_seqs}], got {context_lens.dtype} {tuple(context_lens.shape)}"
        )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise KernelLaunchError(f"out must be {q.dtype} {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise KernelLaunchError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = q.device
    if device.type != "cuda" and not (SIMULATOR and device.type == "cpu"):
        raise KernelLaunchError(f"tensors must be on a CUDA device, got {device}")
    if num_seqs == 0 or block_tables.shape[1] == 0:
        raise KernelLaunchError("num_seqs and max_blocks must be >= 1")


def check_block_tables(block_tables, context_lens, num_blocks, block_size, max_context_len):
    """Value checks (one device->host sync): 1 <= context_len <= max_context_len, and every
    block-table entry a sequence will read lies in [0, num_blocks). Raises KernelLaunchError."""
    import torch

    lens = context_lens.long()
    max_blocks = block_tables.shape[1]
    used = torch.arange(max_blocks, device=lens.device)[None, :] < (lens[:, None] + block_size - 1) // block_size
    bad_entry = used & ((block_tables < 0) | (block_tables >= num_blocks))
    flags = torch.stack([(lens < 1).any(), (lens > max_context_len).any(), bad_entry.any()]).tolist()
    if flags[0]:
        raise KernelLaunchError("every context_len must be >= 1")
    if flags[1]:
        raise KernelLaunchError(
            f"a context_len exceeds {max_context_len} (max_context_len, or max_blocks * block_size)"
        )
    if flags[2]:
        s, b = [int(x) for x in bad_entry.nonzero()[0]]
        raise KernelLaunchError(
            f"block_tables[{s}, {b}] = {int(block_tables[s, b])} is outside the pool [0, {num_blocks})"
        )


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, version=None,
                    out=None, validate=True, max_context_len=None):
    """Decode attention over the paged KV pool, launched on torch's current CUDA stream.

    q: [num_seqs, num_heads, head_dim] float16/bfloat16, one query token per sequence
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim], q's dtype
    block_tables: [num_seqs, max_blocks] int32 physical block ids (entries past a sequence's
        last block are never read)
    context_lens: [num_seqs] int32, tokens each query attends to (>= 1, the new one included)
    scale: softmax scale, default 1/sqrt(head_dim). version: 1..9; None (default): BEST_VERSION.
    out: optional [num_seqs, num_heads, head_dim] in q's dtype, written in place.
    validate: also check context lengths and block-table entries against the pool (one
        device->host sync, ~0.1 ms; skipped automatically inside CUDA-graph capture).
    max_context_len: an upper bound on context_lens (default max_blocks * block_size); v4+
        choose their split-KV plan from it, so a tight bound helps short batches.
    Supported: head_dim 64/128, block_size 8/16/32, any num_heads % num_kv_heads == 0.
    Returns out: [num_seqs, num_heads, head_dim], q's dtype.
    """
    import torch

    _validate(q, k_cache, v_cache, block_tables, context_lens, out, version)
    num_blocks, _, block_size, head_dim = k_cache.shape
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if out is None:
        out = torch.empty_like(q)
    is_bf16 = q.dtype == torch.bfloat16
    if q.device.type == "cpu":  # only under the simulator: run on numpy copies
        if validate:
            check_block_tables(block_tables, context_lens, num_blocks, block_size, max_context_len)
        o16 = np.empty(tuple(q.shape), dtype=np.uint16)
        np16 = lambda t: t.contiguous().view(torch.int16).numpy().view(np.uint16)  # noqa: E731
        launch(version, np16(q), np16(k_cache), np16(v_cache), block_tables.numpy(),
               context_lens.numpy(), o16, scale, is_bf16, max_context_len)
        out.copy_(torch.from_numpy(o16.view(np.int16)).view(q.dtype))
        return out
    if validate and not torch.cuda.is_current_stream_capturing():
        check_block_tables(block_tables, context_lens, num_blocks, block_size, max_context_len)
    stream = torch_stream(q.device)
    handle = torch.cuda.current_stream(q.device).cuda_stream
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    device = q.device

    def scratch(shape):
        # one buffer per (device, stream, shape): calls on one stream run in order, so reuse is
        # safe, also inside a captured graph
        key = (device.index, handle, shape)
        hit = _SCRATCH.get(key)
        if hit is None:
            t = torch.empty(shape, dtype=torch.float32, device=device)
            hit = _SCRATCH[key] = (_wrap(t), t)
        return hit[0]

    args = _Args(_cached_view(q, "int16"), _cached_view(k_cache, "int16"), _cached_view(v_cache, "int16"),
                 _cached_view(block_tables, "same"), _cached_view(context_lens, "same"),
                 _cached_view(out, "int16"), scale, is_bf16, int(max_context_len), scratch,
                 q32=_cached_view(q, "int32"), k32_4d=_cached_view(k_cache, "int32"),
                 v32_4d=_cached_view(v_cache, "int32"), k32=_cached_view(k_cache, "int32_flat"),
                 v32=_cached_view(v_cache, "int32_flat"), num_sms=_num_sms(device))
    run = _launch_best if version is None else VERSIONS[version]
    if torch.cuda.current_device() != device.index:
        with torch.cuda.device(device):
            run(args, stream)
    else:
        run(args, stream)
    return out
