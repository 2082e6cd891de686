"""Paged prefill attention: a chunk of new queries per sequence attends causally to the
sequence's cached prefix and to itself, every K/V read through the block table.

Contract (docs/architecture.md): q [total_q, num_heads, head_dim] packs the chunks of
num_seqs sequences (cu_seqlens_q); their K/V are already in the pool; query i of a chunk of
q_len sits at position context_len - q_len + i and sees positions 0..that position.

The versions, side by side (times: H200, Qwen2-0.5B layer 14/2 heads, d=64, fp16, one
sequence of 2048 new tokens; torch SDPA on a dense cache takes 34.6 us; docs/prefill.md):

    v1  fp32 FMA on CUDA cores, register-blocked from shared-memory fp32 tiles   808 us
    v2  + tensor cores: mma.sync m16n8k16 (inline PTX), Q and P in registers     196 us
    v3  + block size as a compile-time constant, softmax on ex2.approx           129 us

Common to all: one CTA of 128 threads per (sequence, q tile, KV head), whose rows are
BQ queries x the G query heads of the KV head's GQA group (so each K/V tile is read from the
pool once per CTA for all G heads); online softmax (running max m, sum l) in fp32; the KV loop
stops at the causal boundary of the tile's last query, keys past a row's own position are
masked (-inf) and keys past context_len are never read (unused pool slots may hold NaN);
global loads of the pool are 128-bit (`common.load_u32x4`, 8 halves); the grid is 1-D over
tiles (an upper bound, sum ceil(q_len/BQ) <= total_q/BQ + num_seqs, so sizing it needs no host
sync) x KV heads, each CTA finds its (sequence, tile) by scanning cu_seqlens_q, and a
sequence's *last* tile (the longest causal range) is scheduled first.

v1 (BM = 64 rows at d=64, 32 at d=128; 32-key tiles)
    S = Q K^T [BM, 32] and O += P V [BM, D] on fp32 FMAs. Q, K/V (one buffer: K is dead once S
    is done) and P go through shared memory as fp32, rows padded by a word (no bank conflicts).
    Thread (tr, tc) = (tid // 8, tid % 8) owns rows tr + 16 i, keys tc + 8 j of S and dims
    tc + 8 j of O: every shared load feeds 2-3 FMAs. One thread per row runs the softmax.
v2 (BM = 64 = 4 warps x 16 rows; 64-key tiles)
    Warp w owns rows 16 w .. 16 w + 15. Its Q fragments stay in registers; S = Q K^T is
    (D/16) x 8 mma per tile with K read from shared memory as pairs; the softmax runs on the
    S fragments (a row lives in 4 lanes: max by two shfl_xor); P is packed to fp16/bf16 straight
    into A fragments (the C layout of two n-tiles is the A layout of one k-step) and
    O += P V reads V^T from shared memory, where the tile was stored transposed (pairs of keys).
    Shared arrays are flat and indexed (unsigned per-lane base + constant) so the unrolled
    fragment reads share one address register (with 2-D indexing: 255 registers and spills).
v3 = v2 with the block size compiled in (the per-tile block-table lookups' 64-bit // and % by a
    runtime value are long division sequences; a power-of-two constant is a shift and a mask)
    and exponentials as ex2.approx with log2(e) folded into the scale.

This file is the journey's first era: prefill_journey.py numbers these with v4-v9 (the engine's
kernel v7, paged_prefill_fa2.py, which imports nothing of this file, and the others,
prefill_journey_fa2.py) and runs any of them:
    paged_prefill(version, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None,
                  out=None, validate=False)          version 1-3 on torch tensors
    launch_paged_prefill(version, q, ...)            raw-bit numba device arrays

Supported: fp16 and bf16 q/K/V, head_dim 64 and 128, block_size 8/16/32, any GQA ratio
G <= BM (G = 1 is MHA). Under NUMBA_ENABLE_CUDASIM=1 every version runs in the simulator (v2/v3
with a numpy fallback of the warp's mma).
"""
import math

import numpy as np
import torch
from numba import cuda, float32

from kernels_numba import bridge, common
from kernels_numba.bridge import torch_stream
from kernels_numba.errors import KernelLaunchError
from kernels_numba.prefill_parts import BLOCK_SIZES, HEAD_DIMS, check_args, check_values, kind_of

THREADS = 128
V1_BN = 32  # v1: keys per KV tile
NEG_INF = np.float32(-np.inf)


@common.inline_device
def find_tile(t, cu_seqlens_q, num_seqs, bq):
    """CTA t of the 1-D grid -> (sequence, q tile): each sequence's ceil(q_len / bq) tiles in turn, its last
    (heaviest: the longest causal range) first; (-1, 0) past the last tile (the grid is an upper bound)."""
    for i in range(num_seqs):
        ntiles = (cu_seqlens_q[i + 1] - cu_seqlens_q[i] + bq - 1) // bq
        if t < ntiles:
            return i, ntiles - 1 - t
        t -= ntiles
    return -1, 0


def tile_rows(version, head_dim):
    """BM: query-head rows per CTA. v1: 64 at d=64, 32 at d=128 (48 KiB of static shared
    memory); v2, v3: 64 (4 warps x 16 rows of mma)."""
    if version == 1:
        return 64 if head_dim == 64 else 32
    return 64


def queries_per_tile(version, head_dim, group):
    """BQ: queries per CTA, all `group` heads of each."""
    return tile_rows(version, head_dim) // group


_KERNELS = {}


def _build_v1(head_dim, kind):
    """v1, compile-time specialised for one head_dim and storage type ("f16" / "bf16")."""
    D = head_dim
    BN = V1_BN
    BM = tile_rows(1, D)
    TM = BM // 16  # rows per thread
    TN = BN // 8  # keys per thread in S
    TD = D // 8  # dims per thread in O
    DP = D + 1  # padded row stride of the fp32 tiles in shared memory
    BNP = BN + 1
    W = D // 2  # uint32 words (pairs of halves) per head_dim row
    CH = D // 8  # 128-bit chunks per row
    to_f32 = common.f16x2_to_f32 if kind == "f16" else common.bf16x2_to_f32
    pack = common.f32x2_to_f16x2 if kind == "f16" else common.f32x2_to_bf16x2
    load4 = common.load_u32x4

    @common.inline_device
    def store8(dst, row, col, a, b, c, d):
        # 4 words = 8 halves -> dst[row, col : col + 8] as fp32
        x0, x1 = to_f32(a)
        x2, x3 = to_f32(b)
        x4, x5 = to_f32(c)
        x6, x7 = to_f32(d)
        dst[row, col] = x0
        dst[row, col + 1] = x1
        dst[row, col + 2] = x2
        dst[row, col + 3] = x3
        dst[row, col + 4] = x4
        dst[row, col + 5] = x5
        dst[row, col + 6] = x6
        dst[row, col + 7] = x7

    @common.inline_device
    def load_kv_tile(dst, cache, block_tables, s, g, n0, kv_end, num_kv_heads, block_size):
        # dst[n, :] = cache[block_tables[s, pos // bs], g, pos % bs, :] for pos = n0 + n < kv_end, else 0
        # cache: flat uint32 view of [num_blocks, num_kv_heads, block_size, D]
        for idx in range(cuda.threadIdx.x, BN * CH, THREADS):
            n = idx // CH
            c = idx % CH
            pos = n0 + n
            if pos < kv_end:
                block = block_tables[s, pos // block_size]
                base = ((block * num_kv_heads + g) * block_size + pos % block_size) * W + c * 4
                a, b, cc, d = load4(cache, base)
                store8(dst, n, c * 8, a, b, cc, d)
            else:
                for e in range(8):
                    dst[n, c * 8 + e] = float32(0.0)

    @cuda.jit
    def kernel(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
               num_heads, num_kv_heads, block_size, scale):
        # q, out: flat uint32 views of [total_q, num_heads, D]; k/v_cache: flat uint32 views of
        # [num_blocks, num_kv_heads, block_size, D]; block_tables [num_seqs, max_blocks] int32;
        # cu_seqlens_q [num_seqs + 1], context_lens [num_seqs] int32; scale float32.
        q_s = cuda.shared.array((BM, DP), float32)  # Q rows, later the output staging
        kv_s = cuda.shared.array((BN, DP), float32)  # K tile, then V tile
        p_s = cuda.shared.array((BM, BNP), float32)  # scores, then probabilities
        m_s = cuda.shared.array(BM, float32)  # running max per row
        l_s = cuda.shared.array(BM, float32)  # running sum per row
        alpha_s = cuda.shared.array(BM, float32)  # rescale of the accumulator this tile

        tid = cuda.threadIdx.x
        tr = tid // 8
        tc = tid % 8
        g = cuda.blockIdx.y  # KV head
        group = num_heads // num_kv_heads
        bq = BM // group  # queries per tile

        # ---- which (sequence, q tile) is this CTA: scan the chunk lengths
        s, tile = find_tile(cuda.blockIdx.x, cu_seqlens_q, context_lens.shape[0], bq)
        if s < 0:
            return  # past the last tile: the grid is an upper bound
        q_start = cu_seqlens_q[s]
        q_len = cu_seqlens_q[s + 1] - q_start
        ctx = context_lens[s]
        first_pos = ctx - q_len  # position of the chunk's query 0
        q0 = tile * bq  # first query of this tile within the chunk
        q_hi = min(q0 + bq, q_len)  # one past its last query
        kv_end = first_pos + q_hi  # causal boundary of the tile's last query

        # ---- Q tile: row r = (query q0 + r // group, head g * group + r % group)
        for idx in range(tid, BM * CH, THREADS):
            r = idx // CH
            c = idx % CH
            qi = q0 + r // group
            if r < bq * group and qi < q_len:
                base = ((q_start + qi) * num_heads + g * group + r % group) * W + c * 4
                a, b, cc, d = load4(q, base)
                store8(q_s, r, c * 8, a, b, cc, d)
            else:
                for e in range(8):
                    q_s[r, c * 8 + e] = float32(0.0)
        if tid < BM:
            m_s[tid] = NEG_INF
            l_s[tid] = float32(0.0)

        # causal limit of each of this thread's rows (unused rows see everything: scores 0)
        qpos = cuda.local.array(TM, np.int32)
        for i in range(TM):
            r = tr + 16 * i
            qi = q0 + r // group
            qpos[i] = first_pos + qi if (r < bq * group and qi < q_len) else ctx - 1
        acc = cuda.local.array((TM, TD), float32)  # O rows tr + 16 i, dims tc + 8 j
        sacc = cuda.local.array((TM, TN), float32)  # S rows tr + 16 i, keys tc + 8 j
        qv = cuda.local.array(TM, float32)  # operands of one rank-1 update
        kv = cuda.local.array(TN, float32)
        pv = cuda.local.array(TM, float32)
        vv = cuda.local.array(TD, float32)
        for i in range(TM):
            for j in range(TD):
                acc[i, j] = float32(0.0)

        for n0 in range(0, kv_end, BN):
            load_kv_tile(kv_s, k_cache, block_tables, s, g, n0, kv_end, num_kv_heads, block_size)
            cuda.syncthreads()

            # ---- S = Q K^T for rows tr + 16 i, keys tc + 8 j
            for i in range(TM):
                for j in range(TN):
                    sacc[i, j] = float32(0.0)
            for d in range(D):
                for i in range(TM):
                    qv[i] = q_s[tr + 16 * i, d]
                for j in range(TN):
                    kv[j] = kv_s[tc + 8 * j, d]
                for i in range(TM):
                    for j in range(TN):
                        sacc[i, j] += qv[i] * kv[j]
            for i in range(TM):
                for j in range(TN):
                    key = n0 + tc + 8 * j
                    p_s[tr + 16 * i, tc + 8 * j] = sacc[i, j] * scale if key <= qpos[i] else NEG_INF
            cuda.syncthreads()  # S complete; K is dead

            # ---- online softmax, one thread per row; meanwhile everyone loads V
            if tid < BM:
                m_old = m_s[tid]
                m_new = m_old
                for n in range(BN):
                    m_new = max(m_new, p_s[tid, n])
                alpha = math.exp(m_old - m_new)  # 0 on the first tile (m_old = -inf)
                total = float32(0.0)
                for n in range(BN):
                    p = math.exp(p_s[tid, n] - m_new)  # masked: exp(-inf) = 0
                    p_s[tid, n] = p
                    total += p
                m_s[tid] = m_new
                l_s[tid] = l_s[tid] * alpha + total
                alpha_s[tid] = alpha
            load_kv_tile(kv_s, v_cache, block_tables, s, g, n0, kv_end, num_kv_heads, block_size)
            cuda.syncthreads()

            # ---- O = alpha O + P V for rows tr + 16 i, dims tc + 8 j
            for i in range(TM):
                a = alpha_s[tr + 16 * i]
                for j in range(TD):
                    acc[i, j] *= a
            for n in range(BN):
                for i in range(TM):
                    pv[i] = p_s[tr + 16 * i, n]
                for j in range(TD):
                    vv[j] = kv_s[n, tc + 8 * j]
                for i in range(TM):
                    for j in range(TD):
                        acc[i, j] += pv[i] * vv[j]
            cuda.syncthreads()  # before the next tile overwrites kv_s and p_s

        # ---- normalise, stage in shared memory, write packed pairs
        for i in range(TM):
            r = tr + 16 * i
            inv = float32(1.0) / l_s[r]
            for j in range(TD):
                q_s[r, tc + 8 * j] = acc[i, j] * inv
        cuda.syncthreads()
        for idx in range(tid, BM * W, THREADS):
            r = idx // W
            w = idx % W
            qi = q0 + r // group
            if r < bq * group and qi < q_len:
                dst = ((q_start + qi) * num_heads + g * group + r % group) * W + w
                out[dst] = pack(q_s[r, 2 * w], q_s[r, 2 * w + 1])

    return kernel


# ----------------------------------------------------------------------------------------
# mma.sync m16n8k16 (fp16/bf16 in, fp32 accumulate) for v2
#
# Fragments of one warp (lane = 4 g + t), from the PTX ISA's m16n8k16 layouts:
#   A 16x16 (row major), 4 words of 2 halves: a0 = A[g, 2t:2t+2],   a1 = A[g+8, 2t:2t+2],
#                                              a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10]
#   B 16x8 (k x n), 2 words:                   b0 = B[2t:2t+2, g],   b1 = B[2t+8:2t+10, g]
#   C, D 16x8 fp32, 4 values:                  c0, c1 = C[g, 2t:2t+2], c2, c3 = C[g+8, 2t:2t+2]
# The C layout of two adjacent n-tiles is the A layout of one k-step: that is how the
# probabilities P go from the S = Q K^T mma into the O += P V mma without touching memory.
# (common.mma_m16n8k16_*: inline PTX on the GPU, a numpy product of the warp's pooled fragments
# in the simulator; common.ex2: ex2.approx.ftz.f32.)

mma_f16 = common.mma_m16n8k16_f16
mma_bf16 = common.mma_m16n8k16_bf16
ex2 = common.ex2


def _build_v2(head_dim, kind, fixed_block_size=0, fast_exp=False):
    """v2: tensor cores (mma.sync m16n8k16), compile-time specialised like v1.

    fixed_block_size > 0 and fast_exp are v3's additions (see _build_v3)."""
    D = head_dim
    BS = fixed_block_size  # 0: the block size is a runtime argument
    exp = ex2 if fast_exp else math.exp
    # scores are kept in the exponent's base: log2(e) folded into the scale for ex2
    SCALE_MUL = np.float32(1.4426950408889634 if fast_exp else 1.0)
    BM = tile_rows(2, D)  # 4 warps x 16 rows
    BN = 64  # keys per KV tile
    NT = BN // 8  # n-tiles of S per warp
    KS = D // 16  # k-steps of S = Q K^T
    DT = D // 8  # n-tiles of O
    PK = BN // 16  # k-steps of O += P V
    W = D // 2  # words (pairs of halves) per head_dim row
    CH = D // 8  # 128-bit chunks per row
    KP = W + 4  # padded strides (words): conflict-free fragment reads
    VP = BN // 2 + 4
    K_WORDS = BN * KP
    VT_WORDS = D * VP
    mma = mma_bf16 if kind == "bf16" else mma_f16
    pack = common.f32x2_to_f16x2 if kind == "f16" else common.f32x2_to_bf16x2
    load4 = common.load_u32x4
    FULL = 0xFFFFFFFF

    @cuda.jit
    def kernel(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
               num_heads, num_kv_heads, block_size, scale):
        # arguments as in v1 (block_size ignored when BS > 0)
        bs = BS if BS > 0 else block_size  # a constant folds // and % into shifts and masks
        qk_scale = scale * SCALE_MUL
        # flat, so that a fragment read is [per-lane base + compile-time offset]: one address
        # register per array instead of one per unrolled load (255 registers and spills otherwise)
        k_s = cuda.shared.array(K_WORDS, np.uint32)  # K tile as pairs: k_s[key * KP + pair of dims]
        vt_s = cuda.shared.array(VT_WORDS, np.uint32)  # V tile transposed: vt_s[dim * VP + pair of keys]

        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        fg = lane // 4  # fragment row group
        ft = lane % 4  # fragment column pair
        # this lane's B fragments: k_s (key fg, pair ft) and vt_s (dim fg, key pair ft); unsigned,
        # so numba adds no negative-index wraparound that would stop the offsets folding
        kbase = np.uint64(fg * KP + ft)
        vbase = np.uint64(fg * VP + ft)
        g = cuda.blockIdx.y  # KV head
        group = num_heads // num_kv_heads
        bq = BM // group

        s, tile = find_tile(cuda.blockIdx.x, cu_seqlens_q, context_lens.shape[0], bq)
        if s < 0:
            return
        q_start = cu_seqlens_q[s]
        q_len = cu_seqlens_q[s + 1] - q_start
        ctx = context_lens[s]
        first_pos = ctx - q_len
        q0 = tile * bq
        kv_end = first_pos + min(q0 + bq, q_len)

        # this lane's two rows: r0 = 16 warp + fg, r1 = r0 + 8 (row = query x head of the group)
        r0 = warp * 16 + fg
        r1 = r0 + 8
        qi0 = q0 + r0 // group
        qi1 = q0 + r1 // group
        ok0 = r0 < bq * group and qi0 < q_len
        ok1 = r1 < bq * group and qi1 < q_len
        qpos0 = first_pos + qi0 if ok0 else ctx - 1  # unused rows see everything, are never stored
        qpos1 = first_pos + qi1 if ok1 else ctx - 1
        base0 = ((q_start + qi0) * num_heads + g * group + r0 % group) * W
        base1 = ((q_start + qi1) * num_heads + g * group + r1 % group) * W

        # Q fragments, held in registers for the whole KV loop
        qa = cuda.local.array((KS, 4), np.uint32)
        for ks in range(KS):
            qa[ks, 0] = q[base0 + ks * 8 + ft] if ok0 else np.uint32(0)
            qa[ks, 1] = q[base1 + ks * 8 + ft] if ok1 else np.uint32(0)
            qa[ks, 2] = q[base0 + ks * 8 + 4 + ft] if ok0 else np.uint32(0)
            qa[ks, 3] = q[base1 + ks * 8 + 4 + ft] if ok1 else np.uint32(0)
        o = cuda.local.array((DT, 4), float32)
        for dt in range(DT):
            for e in range(4):
                o[dt, e] = float32(0.0)
        sc = cuda.local.array((NT, 4), float32)
        m0 = NEG_INF
        m1 = NEG_INF
        l0 = float32(0.0)  # this lane's share of the row sums (reduced over 4 lanes at the end)
        l1 = float32(0.0)

        for n0 in range(0, kv_end, BN):
            # ---- K tile as is, V tile transposed (pairs of keys per word); zeros past kv_end
            for idx in range(tid, BN * CH, THREADS):
                n = idx // CH
                c = idx % CH
                pos = n0 + n
                w0 = np.uint32(0)
                w1 = np.uint32(0)
                w2 = np.uint32(0)
                w3 = np.uint32(0)
                if pos < kv_end:
                    block = block_tables[s, pos // bs]
                    w0, w1, w2, w3 = load4(k_cache, ((block * num_kv_heads + g) * bs + pos % bs) * W + c * 4)
                k_s[n * KP + c * 4] = w0
                k_s[n * KP + c * 4 + 1] = w1
                k_s[n * KP + c * 4 + 2] = w2
                k_s[n * KP + c * 4 + 3] = w3
            for idx in range(tid, (BN // 2) * CH, THREADS):
                mp = idx // CH  # key pair
                c = idx % CH
                va = cuda.local.array(4, np.uint32)
                vb = cuda.local.array(4, np.uint32)
                for e in range(4):
                    va[e] = np.uint32(0)
                    vb[e] = np.uint32(0)
                pos = n0 + 2 * mp
                if pos < kv_end:
                    block = block_tables[s, pos // bs]
                    va[0], va[1], va[2], va[3] = load4(v_cache, ((block * num_kv_heads + g) * bs + pos % bs) * W + c * 4)
                if pos + 1 < kv_end:
                    block = block_tables[s, (pos + 1) // bs]
                    vb[0], vb[1], vb[2], vb[3] = load4(v_cache, ((block * num_kv_heads + g) * bs + (pos + 1) % bs) * W + c * 4)
                for e in range(4):  # word e holds dims c*8 + 2e (low half) and c*8 + 2e + 1 (high)
                    vt_s[(c * 8 + 2 * e) * VP + mp] = (va[e] & np.uint32(0xFFFF)) | (vb[e] << np.uint32(16))
                    vt_s[(c * 8 + 2 * e + 1) * VP + mp] = (va[e] >> np.uint32(16)) | (vb[e] & np.uint32(0xFFFF0000))
            cuda.syncthreads()

            # ---- S = Q K^T: 16 rows x BN keys per warp
            for nt in range(NT):
                d0 = float32(0.0)
                d1 = float32(0.0)
                d2 = float32(0.0)
                d3 = float32(0.0)
                for ks in range(KS):
                    b0 = k_s[kbase + np.uint64(nt * 8 * KP + ks * 8)]
                    b1 = k_s[kbase + np.uint64(nt * 8 * KP + ks * 8 + 4)]
                    d0, d1, d2, d3 = mma(qa[ks, 0], qa[ks, 1], qa[ks, 2], qa[ks, 3], b0, b1, d0, d1, d2, d3)
                sc[nt, 0] = d0
                sc[nt, 1] = d1
                sc[nt, 2] = d2
                sc[nt, 3] = d3

            # ---- causal mask, scale, online softmax (a row is spread over the 4 lanes of fg)
            mx0 = m0
            mx1 = m1
            for nt in range(NT):
                for e in range(2):
                    key = n0 + nt * 8 + 2 * ft + e
                    x0 = sc[nt, e] * qk_scale if key <= qpos0 else NEG_INF
                    x1 = sc[nt, 2 + e] * qk_scale if key <= qpos1 else NEG_INF
                    sc[nt, e] = x0
                    sc[nt, 2 + e] = x1
                    mx0 = max(mx0, x0)
                    mx1 = max(mx1, x1)
            mx0 = max(mx0, cuda.shfl_xor_sync(FULL, mx0, 1))
            mx0 = max(mx0, cuda.shfl_xor_sync(FULL, mx0, 2))
            mx1 = max(mx1, cuda.shfl_xor_sync(FULL, mx1, 1))
            mx1 = max(mx1, cuda.shfl_xor_sync(FULL, mx1, 2))
            alpha0 = exp(m0 - mx0)  # 0 on the first tile (m = -inf)
            alpha1 = exp(m1 - mx1)
            m0 = mx0
            m1 = mx1
            l0 *= alpha0
            l1 *= alpha1
            for dt in range(DT):
                o[dt, 0] *= alpha0
                o[dt, 1] *= alpha0
                o[dt, 2] *= alpha1
                o[dt, 3] *= alpha1
            for nt in range(NT):
                for e in range(2):
                    p0 = exp(sc[nt, e] - m0)
                    p1 = exp(sc[nt, 2 + e] - m1)
                    sc[nt, e] = p0
                    sc[nt, 2 + e] = p1
                    l0 += p0
                    l1 += p1

            # ---- O += P V: P from the S fragments (two n-tiles = one k-step), V^T from shared
            for kk in range(PK):
                pa0 = pack(sc[2 * kk, 0], sc[2 * kk, 1])
                pa1 = pack(sc[2 * kk, 2], sc[2 * kk, 3])
                pa2 = pack(sc[2 * kk + 1, 0], sc[2 * kk + 1, 1])
                pa3 = pack(sc[2 * kk + 1, 2], sc[2 * kk + 1, 3])
                for dt in range(DT):
                    b0 = vt_s[vbase + np.uint64(dt * 8 * VP + kk * 8)]
                    b1 = vt_s[vbase + np.uint64(dt * 8 * VP + kk * 8 + 4)]
                    o[dt, 0], o[dt, 1], o[dt, 2], o[dt, 3] = mma(
                        pa0, pa1, pa2, pa3, b0, b1, o[dt, 0], o[dt, 1], o[dt, 2], o[dt, 3])
            cuda.syncthreads()  # before the next tile overwrites k_s / vt_s

        # ---- full row sums, normalise, store pairs straight from the fragments
        l0 += cuda.shfl_xor_sync(FULL, l0, 1)
        l0 += cuda.shfl_xor_sync(FULL, l0, 2)
        l1 += cuda.shfl_xor_sync(FULL, l1, 1)
        l1 += cuda.shfl_xor_sync(FULL, l1, 2)
        inv0 = float32(1.0) / l0
        inv1 = float32(1.0) / l1
        for dt in range(DT):
            if ok0:
                out[base0 + dt * 4 + ft] = pack(o[dt, 0] * inv0, o[dt, 1] * inv0)
            if ok1:
                out[base1 + dt * 4 + ft] = pack(o[dt, 2] * inv1, o[dt, 3] * inv1)

    return kernel


def _build_v3(head_dim, kind, block_size):
    """v3: v2 + the block size as a compile-time constant (the block-table lookup's // and % of
    a runtime int64 are long integer-division sequences; a power-of-two constant makes them a
    shift and a mask) + softmax exponentials on the SFU (ex2.approx with log2(e) folded into the
    scale, instead of libdevice's exact expf)."""
    return _build_v2(head_dim, kind, fixed_block_size=block_size, fast_exp=True)


BUILDERS = {1: _build_v1, 2: _build_v2, 3: _build_v3}
SPECIALISED_ON_BLOCK_SIZE = (3,)


def get_kernel(version, head_dim, kind, block_size):
    """The kernel of `version` for (head_dim, "f16" | "bf16"[, block_size]), built once (compiled
    on first launch)."""
    if version in SPECIALISED_ON_BLOCK_SIZE:
        key = (version, head_dim, kind, block_size)
        build = lambda: BUILDERS[version](head_dim, kind, block_size)  # noqa: E731
    else:
        key = (version, head_dim, kind)
        build = lambda: BUILDERS[version](head_dim, kind)  # noqa: E731
    if key not in _KERNELS:
        _KERNELS[key] = bridge.enable_disk_cache(build(), ("kernels_numba.paged_prefill",) + key)
    return _KERNELS[key]


def num_tiles_bound(total_q, num_seqs, group, version, head_dim):
    """Grid x: an upper bound of sum_s ceil(q_len_s / BQ) that needs no host sync."""
    bq = queries_per_tile(version, head_dim, group)
    return (total_q + bq - 1) // bq + num_seqs


def launch_paged_prefill(version, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
                         num_heads, num_kv_heads, head_dim, block_size, scale, kind="f16", stream=0):
    """Launch version `version` (1-3) on raw arrays, no checks.

    q, out: 1-D uint32 views of [total_q, num_heads, head_dim] (pairs of halves), 16-byte aligned
    k_cache, v_cache: 1-D uint32 views of [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables: [num_seqs, max_blocks] int32; cu_seqlens_q: [num_seqs + 1] int32;
    context_lens: [num_seqs] int32; scale: float. numba device arrays (numpy in the simulator).
    """
    total_q = q.shape[0] // (num_heads * head_dim // 2)
    num_seqs = context_lens.shape[0]
    if total_q == 0 or num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    grid = (num_tiles_bound(total_q, num_seqs, group, version, head_dim), num_kv_heads)
    get_kernel(version, head_dim, kind, block_size)[grid, THREADS, stream](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        num_heads, num_kv_heads, block_size, np.float32(scale),
    )


# ----------------------------------------------------------------------------------------
# torch entry point


def _flat_words(name, t):
    """1-D uint32 view of a contiguous fp16/bf16 tensor, 16-byte aligned (for 128-bit loads)."""
    if t.data_ptr() % 16 != 0:
        raise KernelLaunchError(f"{name} must be 16-byte aligned for 128-bit loads")
    return bridge.as_array(t, "uint32", flat=True)


def paged_prefill(version, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                  validate=False):
    """Causal prefill attention over the paged pool (new K/V already written), version `version` (1-3).

    q: [total_q, num_heads, head_dim] float16/bfloat16, the chunks of num_seqs sequences packed
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim], q's dtype, contiguous
    block_tables: [num_seqs, max_blocks] int32 (entries past a sequence's end are never read)
    cu_seqlens_q: [num_seqs + 1] int32, sequence s owns q[cu[s]:cu[s+1]] (each >= 1 token)
    context_lens: [num_seqs] int32, tokens in the pool for s after the write (prefix + chunk)
    scale: softmax scale (default 1/sqrt(head_dim)); out: optional [total_q, num_heads, head_dim]
    validate: verify the metadata on the host (one sync): context_len >= q_len, block ids
        inside the pool, enough table columns. Off by default (the kernel is graph-capturable).
    Returns out [total_q, num_heads, head_dim] in q's dtype. Runs on torch's current stream.
    """
    out, group = check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, HEAD_DIMS, BLOCK_SIZES)
    total_q, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    if version not in BUILDERS:
        raise KernelLaunchError(f"version must be one of {sorted(BUILDERS)}, got {version!r}")
    if group > tile_rows(version, head_dim):
        raise KernelLaunchError(
            f"GQA group num_heads/num_kv_heads={group} must be <= {tile_rows(version, head_dim)} for v{version}")
    if validate:
        check_values(block_tables, cu_seqlens_q, context_lens, total_q, num_blocks, block_size)
    if total_q == 0 or num_seqs == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    q_c = q.contiguous()
    if q_c.data_ptr() % 16:
        q_c = q_c.clone()
    target = out if out.is_contiguous() and out.data_ptr() % 16 == 0 else torch.empty_like(q_c)
    stream = torch_stream()
    launch_paged_prefill(
        version, _flat_words("q", q_c), _flat_words("k_cache", k_cache), _flat_words("v_cache", v_cache),
        bridge.as_array(block_tables.contiguous()), bridge.as_array(cu_seqlens_q.contiguous()),
        bridge.as_array(context_lens.contiguous()), _flat_words("out", target),
        num_heads, num_kv_heads, head_dim, block_size, scale, kind_of(q.dtype), stream,
    )
    if target is not out:
        out.copy_(target)
    return out
