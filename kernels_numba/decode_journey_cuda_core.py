"""Paged decode attention on CUDA cores: the journey's first era (v1-v4), one version at a time.

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
v3: the textbook single-pass kernel: adds online softmax (one pass over K and V, running max m, sum l,
    accumulator), warp-level dot products reduced with shfl_down_sync, and fp16 *pair* math
    (q and k multiplied two halves per instruction with fma.rn.f16x2 / bf16x2, the pair
    summed in fp32), fp32 accumulation.
v4: what it takes on a memory-bound H200: one CTA of 4 warps per (sequence, KV head, split)
    computes all query heads of the GQA group (each KV byte is read once, not group times);
    128-bit loads (8 halves per lane, LDG.E.128) with K and V of 4 tokens in flight per lane;
    split-KV (flash-decoding): long contexts are cut into partitions processed by separate
    CTAs so small batches fill the 132 SMs, then a merge kernel combines the partial
    (max, sum, accumulator) triples; exp2 with log2(e) folded into q.

The tensor-core era (v5-v9) continues in decode_journey_tensor_core.py; the kernel the engine runs
is in paged_attention.py. Each version: make_vN(...) builds the kernel for one compile-time shape,
launch_vN(args, stream) launches it from attention_parts.LaunchArgs. Run one through
decode_journey.paged_attention(..., version=N) or decode_journey.launch(N, ...); every version is
tested (tests/test_paged_attention_cuda.py) and timed (scripts/bench_kernels.py). The host pieces
only the journey uses are here too: converters, v4's split-KV plan, its launch and merge kernel
(v5-v9 reuse them).
"""
import math
from functools import lru_cache

from numba import cuda, float32, uint32

from kernels_numba.attention_parts import LOG2E, NEG_INF
from kernels_numba.bridge import allow_dynamic_smem, disk_cached
from kernels_numba.common import (
    FULL_MASK,
    bf16_to_f32,
    bf16x2_to_f32,
    f16_to_f32,
    f16x2_to_f32,
    f32_to_bf16,
    f32_to_f16,
    fma_bf16x2,
    fma_f16x2,
    load_u32x4,
)

NUM_WARPS = 4  # warps per CTA of v4-v8
MIN_PARTITION = 256  # v4/v5: below this a split costs more (merge, launch tail) than it gains
TARGET_CTAS = 4 * 132  # v4/v5: enough CTAs for a few waves on the H200's 132 SMs


def converters(is_bf16):
    """(one 16-bit -> f32, pair -> (f32, f32), f32 -> 16 bits, pair fma) for the pool dtype."""
    if is_bf16:
        return bf16_to_f32, bf16x2_to_f32, f32_to_bf16, fma_bf16x2
    return f16_to_f32, f16x2_to_f32, f32_to_f16, fma_f16x2


# ----------------------------------------------------------------------------------------------
# v1: naive, materialised scores, no tiling


@disk_cached
@lru_cache(maxsize=None)
def make_v1(head_dim, block_size, is_bf16):
    D, BS = head_dim, block_size
    cvt, _, store, _ = converters(is_bf16)

    @cuda.jit
    def paged_attention_v1(q, k_cache, v_cache, block_tables, context_lens, out, scores, scale):
        # q, out: [S, H, D] 16-bit; k_cache, v_cache: [NB, KVH, BS, D] 16-bit
        # scores: [S, H, max_context_len] float32 scratch
        s, h, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x  # sequence, query head, dim
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


def launch_v1(a, stream, make=None):
    """v1 (and v2: make=make_v2): grid (S, H), blockDim = D, a score buffer [S, H, max_context_len]."""
    kernel = (make or make_v1)(a.head_dim, a.block_size, a.is_bf16)
    scores = a.scratch((a.num_seqs, a.num_heads, a.max_context_len))
    kernel[(a.num_seqs, a.num_heads), a.head_dim, stream](
        a.q16, a.k16, a.v16, a.block_tables, a.context_lens, a.out16, scores, a.scale
    )


# ----------------------------------------------------------------------------------------------
# v2: + shared-memory KV tiling


@disk_cached
@lru_cache(maxsize=None)
def make_v2(head_dim, block_size, is_bf16):
    D, BS = head_dim, block_size
    cvt, _, store, _ = converters(is_bf16)

    @cuda.jit
    def paged_attention_v2(q, k_cache, v_cache, block_tables, context_lens, out, scores, scale):
        # same arguments as v1
        s, h, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x  # sequence, query head, dim
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


def launch_v2(a, stream):
    launch_v1(a, stream, make_v2)


# ----------------------------------------------------------------------------------------------
# v3: + online softmax, warp reductions (shfl_down_sync), fp16 pair math


@disk_cached
@lru_cache(maxsize=None)
def make_v3(head_dim, block_size, is_bf16):
    D, BS = head_dim, block_size
    P = D // 2  # half pairs per row
    PPL = P // 32  # pairs per lane: 1 (d=64) or 2 (d=128)
    NW = D // 32  # warps per CTA
    _, cvt2, store, fma2 = converters(is_bf16)

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


def launch_v3(a, stream):
    kernel = make_v3(a.head_dim, a.block_size, a.is_bf16)
    kernel[(a.num_seqs, a.num_heads), a.head_dim, stream](
        a.q32, a.k32_4d, a.v32_4d, a.block_tables, a.context_lens, a.out16, a.scale
    )


# ----------------------------------------------------------------------------------------------
# split-KV on the host: v4/v5's plan, the launch, the merge kernel


def split_plan(num_seqs, num_kv_heads, max_context_len, chunk):
    """(num_splits, partition_size) for v4/v5: about TARGET_CTAS CTAs, partitions of at least
    MIN_PARTITION tokens, a multiple of the chunk size."""
    base = max(1, num_seqs * num_kv_heads)
    splits = max(1, min(-(-TARGET_CTAS // base), -(-max_context_len // MIN_PARTITION)))
    part = -(-max_context_len // splits)
    part = -(-part // chunk) * chunk
    splits = -(-max_context_len // part)
    return splits, part


@disk_cached
@lru_cache(maxsize=None)
def make_merge(head_dim, is_bf16):
    """v4-v9's merge kernel: grid (S, H), blockDim = D; part_acc [S, H, splits, D] and part_ml
    [S, H, splits, 2] (max, sum) of each partition -> out [S, H, D] 16-bit."""
    store = converters(is_bf16)[2]

    @cuda.jit
    def merge_splits(part_acc, part_ml, context_lens, out, partition):
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


def launch_split_kv(a, stream, kernel, q, splits, partition, sharedmem=0, warps=NUM_WARPS):
    """v4-v9's launch: grid (KV heads, sequences, splits) of CTAs of `warps` warps (with `sharedmem`
    bytes of dynamic shared memory), then, when the context is split, the merge of the partitions'
    (max, sum, accumulator) into the output."""
    if splits == 1:
        part_acc = part_ml = a.scratch((1, 1, 1, 1))  # unused
    else:
        part_acc = a.scratch((a.num_seqs, a.num_heads, splits, a.head_dim))
        part_ml = a.scratch((a.num_seqs, a.num_heads, splits, 2))
    args = (q, a.k32, a.v32, a.block_tables, a.context_lens, a.out16, part_acc, part_ml, a.scale, partition)
    allow_dynamic_smem(kernel, args, sharedmem)
    kernel[(a.num_kv_heads, a.num_seqs, splits), warps * 32, stream, sharedmem](*args)
    if splits > 1:
        merge = make_merge(a.head_dim, a.is_bf16)
        merge[(a.num_seqs, a.num_heads), a.head_dim, stream](part_acc, part_ml, a.context_lens, a.out16, partition)


# ----------------------------------------------------------------------------------------------
# v4: GQA-grouped CTA, 128-bit loads, split-KV + merge


def v4_geometry(head_dim, block_size):
    LPT = head_dim // 8  # lanes per token row: each lane holds 8 halves = one 16-byte load
    TPW = 32 // LPT  # token rows per warp: 4 (d=64) or 2 (d=128)
    NT = 4  # token slots per lane per chunk (K and V of NT tokens in flight per lane)
    return LPT, TPW, NT, TPW * NT


@disk_cached
@lru_cache(maxsize=None)
def make_v4(head_dim, block_size, group, is_bf16):
    D, BS, G = head_dim, block_size, group
    LPT, TPW, NT, CH = v4_geometry(D, BS)
    NW = NUM_WARPS
    P = D // 2  # pairs per row
    cvt, cvt2, store, _ = converters(is_bf16)
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


def launch_v4(a, stream):
    kernel = make_v4(a.head_dim, a.block_size, a.num_heads // a.num_kv_heads, a.is_bf16)
    chunk = v4_geometry(a.head_dim, a.block_size)[3]
    splits, partition = split_plan(a.num_seqs, a.num_kv_heads, a.max_context_len, chunk)
    launch_split_kv(a, stream, kernel, a.q16, splits, partition)


VERSIONS = {1: launch_v1, 2: launch_v2, 3: launch_v3, 4: launch_v4}
