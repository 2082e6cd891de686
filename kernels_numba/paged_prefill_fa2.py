"""Paged prefill v4+: the FlashAttention-2 structure in numba.

Same contract as the journey's first era, kernels_numba/paged_prefill.py (v1-v3): q [total_q, H, D] packs the chunks
of num_seqs sequences (cu_seqlens_q); their K/V are already in the pool; query i of a chunk of
q_len sits at position context_len - q_len + i and sees positions 0..that position (the cached
prefix and its own chunk). Unused pool slots may hold anything (NaN in the tests): no position
at or past context_len is ever read.

The versions (predicted times: H200, Qwen2-0.5B layer 14/2 heads, d=64, fp16, one sequence of
2048 new tokens; v3 takes 129 us, torch SDPA (flash) on a dense cache 34.9 us; docs/prefill.md):

    v4  one CTA of 4 warps per (sequence, 64 rows, KV head); K/V tiles of 64 keys staged by
        cp.async through a 2-stage shared-memory ring (swizzled: no bank conflicts), fragments
        by ldmatrix (.trans for V), S = Q K^T and O += P V on mma.sync m16n8k16, exp2 online
        softmax, only diagonal tiles masked; Q fragments held in registers    predicted ~50 us
    v5  + 128 rows per CTA at d=64 (each warp two m-tiles of 16 rows): every K/V fragment read
        from shared memory feeds two mma instead of one; Q stays in shared memory and is
        re-read by ldmatrix at every tile (its 32 registers would not fit)    predicted ~40 us
    v6  + split-KV when the grid is short (fewer CTAs than SMs, e.g. a short chunk behind a
        long prefix): the KV range of each tile is cut into parts, each part's CTA writes a
        normalised fp32 partial and its log2-sum-exp, a small kernel merges them
                                           1x2048: as v5; 1x(4096 cached + 256 new): ~15 us
    v7  + a work list: a one-CTA plan kernel writes every CTA's (sequence, q tile) in v6's order,
        so a CTA reads two words instead of searching cu_seqlens_q (find_tile walks every
        sequence ~log(tiles) + 3 times with 64-bit divisions, per CTA: at 64 x 128 tokens that
        search, not attention, is most of the time); 128 rows per CTA at d=128 too (KV tiles of
        32 keys keep S at 32 registers beside O's 128); O held in two halves so the compiler
        unrolls every loop over it; int32 row positions; Q's rows stepped, not divided (d=64)
                             64 x 128 new: ~30 us (v6 ~296); 4 x 1024 at 28/4, d=128: ~160 us (v6 ~230)
    v8  + each tile's block ids loaded one tile ahead, all of a thread's passes at once (v7's copies
        waited on four dependent block-table loads a tile, right after the barrier: the SASS shows
        LDG -> LDGSTS four times in a row), and a lazy rescale: the running max moves only when some
        row of the warp would see p > 2^8 (warp-uniform by shuffles), so O's MT * D / 2 multiplies a
        tile (as many as the tile's HMMAs at d=128) are skipped on most tiles
                             1 x 8192 new: ~440 us (v7 494); 2 x 4096 at 28/4, d=128: ~850 us (v7 1028)
    v9  v7's kernel in a persistent loop: one wave of CTAs (2 per SM), each running work items in a snake
        over the work list (round r: the r-th of every CTA's items, backward every other round); at the
        start of an item's last tile the next item's Q (into a second Q buffer) and first KV tile (into the
        ring's free stage) are issued, landing during the last tile's math and the epilogue (O staged in
        this item's Q buffer; prefetch="epilogue": issued after the math), its place in the work list
        loaded at the item's start. v7 pays a CTA's launch, its chain of dependent loads and its first
        tile's latency per item (~9 us a CTA, from v7's measured short-prompt times); no split (short_plan
        picks v9 only for grids past one wave, at d=64)
                             64 x 128 new: ~32 us (v7 54); 16 x 256: ~22 us (v7 33)

Why (written before any GPU run). 1x2048 is 7.5 GFLOP of causal attention (4 * 14 * 64 *
2048 * 2049 / 2). v3 loads each tile synchronously (global -> registers -> shared, two barriers
per tile), reads fragments with 32-bit shared loads (128 LDS per warp and tile) and transposes V
with scalar stores. v4 has one barrier per tile with the next tile's copies in flight during the
current one's math, 36 ldmatrix.x4 per warp and tile and masks on diagonal tiles only. Per CTA
and tile it moves 74 KB through ldmatrix plus 16 KB of copies, ~700 clk of the SM's 128 B/clk
shared-memory port, against ~400 clk of mma (64 m16n8k16 per warp at ~6 clk): bound by shared
memory; ~7300 CTA-tiles over 132 SMs at ~60% of that bound is ~50 us. v5's 128-row CTA feeds each
K/V fragment to two m-tiles: per 64 rows ~400 clk of shared traffic for ~400 clk of mma, ~40 us
(its longest CTA, the 32 tiles of the last queries, keeps it above ~25 us). 1x(4096+256) has
only 16 q tiles x 2 KV heads: 32 CTAs of 68 tiles each on 132 SMs; v6 cuts each into 8 parts
(256 CTAs, one wave at 2 per SM) plus a merge of 8 x 0.9 MB of fp32 partials.

Occupancy: 2 CTAs of 128 threads per SM (launch bounds: <= 255 registers; v4 uses ~212, v5
255, no spills), 32 KB (v4) or 48 KB (v5: + the Q tile) of dynamic shared memory per CTA at d=64.
v7 at d=128: 255 registers and ~40 bytes of spills (ptxas), 64 KB of shared memory (2 stages of
32-key K and V tiles, 32 KB of Q). v8 keeps the next tile's block ids live: 4 bytes of spills at d=64,
56 at d=128. v9: a second Q tile (64 KB at d=64, 96 KB at d=128); ~150 bytes of spills at d=64, ~2.5 KB of
reloads at d=128 (prefetch="epilogue": 56 bytes at d=64, none inside the KV loop).

Design (every version)
----------------------
Rows. A CTA owns BM rows = (query, head-in-group) pairs of one sequence and KV head g: row r
is query q0 + r // G of head g * G + r % G (G = num_heads / num_kv_heads), so a K/V tile is
read from the pool once for all G heads (G = 7: 9 queries x 7 heads = 63 of 64 rows). Warp w
owns rows 16 (w * MT + mt) .. + 15 for its m-tiles mt < MT. Rows past the chunk are computed
(as the chunk's last position: finite) and never stored.

Grid. (tiles x num_kv_heads, 1, splits): tiles is an upper bound of sum_s ceil(q_len_s / BQ),
BQ = BM // G (no host sync to size it); z = 1 except in v6's plan. CTA x takes KV head
x % num_kv_heads and the (x // num_kv_heads)-th (sequence, q tile) in rank-major order: first
every sequence's last tile (its last queries see the most keys), then every sequence's tile
before it, and so on (find_tile: a binary search over ranks, O(num_seqs log tiles)). Blocks are
dispatched in x order, so the heaviest CTAs start first and the light ones fill the SMs at the
end (longest-processing-time-first), across heads and sequences; v3 orders within a sequence.
v7 computes the same order once per launch (build_plan, one CTA; within a rank the sequences
with more tiles first) into a work list of (sequence, q tile) per x // num_kv_heads.

Pipeline per CTA (ST = 2 stages of [K tile | V tile], 64 keys each, dynamic shared memory):
    Q tile -> stage ST-1 (v4) by cp.async (zeros for rows past the chunk), commit
    tiles 0 .. ST-2 -> stages 0 .. ST-2, one commit group each
    v4: wait for Q, barrier, Q fragments -> registers by ldmatrix.x4 (held for the whole loop);
        v5, v6: Q goes to its own region past the ring and its fragments are re-read per tile
    for each KV tile j: wait for tile j (cp.async.wait_group ST-2), barrier (every thread's
        copies of j have landed and every warp is done with tile j - 1), issue tile j + ST - 1
        into the stage tile j - 1 used, then S = Q K^T, mask (diagonal tiles only), online
        softmax, O += P V on stage j
    O / l -> shared (packed) -> 16-byte coalesced stores (v6 split: fp32 partials + lse)
A tile's rows at or past the CTA's last visible position are zero-filled by ordinary shared
stores, never copied: the pool's unused slots are not read and stale shared memory (which the
simulator poisons with NaN) never reaches P V (0 * NaN would be NaN).

Shared layout. A tile row (one key's D halves: 128 B at d=64, 256 B at d=128) is stored as
16-byte chunks, chunk c of row r at position c ^ (r & 7) (an XOR swizzle). ldmatrix reads 8
rows of one logical chunk per 8x8 matrix: the 8 physical chunks are distinct mod 8, so the
128 bytes hit 32 distinct banks; the cp.async writes (CPR threads per row, consecutive chunks)
are likewise conflict-free. Without the swizzle every row starts on bank 0 (8-way conflicts).

Fragments (PTX ISA 9.7.14.5.8, "Matrix Fragments for mma.m16n8k16 with floating point type";
lane = 4 g + t; a word = 2 halves, the lower-indexed element in the low 16 bits):
    A 16x16 row major: a0 = A[g, 2t:2t+2]   a1 = A[g+8, 2t:2t+2]
                       a2 = A[g, 2t+8:2t+10] a3 = A[g+8, 2t+8:2t+10]
    B 16x8 (k x n):    b0 = B[2t:2t+2, g]    b1 = B[2t+8:2t+10, g]
    C/D 16x8 fp32:     c0, c1 = C[g, 2t:2t+2]  c2, c3 = C[g+8, 2t:2t+2]
ldmatrix (PTX ISA 9.7.14.5.15): lanes 8i .. 8i+7 give the addresses of the 8 rows of matrix i
(16 bytes each); lane 4 g + t receives of matrix i the word (row g, halves 2t, 2t+1), or with
.trans the halves (row 2t, col g) and (row 2t+1, col g). Hence, with 16-byte chunks of rows:
    Q (A of S = Q K^T), k-step ks: matrices (rows 0-7, chunk 2ks), (rows 8-15, chunk 2ks),
        (rows 0-7, chunk 2ks+1), (rows 8-15, chunk 2ks+1) -> a0, a1, a2, a3
    K (B of S, "col": B[k, n] = K[key n, dim k]), n-tile of keys 8nt..8nt+7: matrices (those
        keys, chunks 4p, 4p+1, 4p+2, 4p+3) -> b0, b1 of k-step 2p and b0, b1 of k-step 2p+1
    V (B of O += P V: B[k, n] = V[key k, dim n]), k-step kk of keys 16kk..16kk+15, .trans:
        matrices (keys +0-7, chunk 2dp), (keys +8-15, chunk 2dp), (keys +0-7, chunk 2dp+1),
        (keys +8-15, chunk 2dp+1) -> b0, b1 of d-tile 2dp and b0, b1 of d-tile 2dp+1
    P (A of O += P V): the C fragments of S's n-tiles 2kk and 2kk+1 are the A fragment of
        k-step kk (packed to fp16/bf16 in registers, never through memory).

Softmax. Scores stay in fp32 in the S fragments; the running max m (raw score units) and this
lane's share of the row sum l are per row; p = 2^(s * scale * log2(e) - m * scale * log2(e))
(one FFMA + one MUFU.EX2); a row's max over its 4 lanes takes two shfl_xor. A row whose part of
the KV range is fully masked (possible only in a split) keeps m = -inf and contributes nothing.

Supported: fp16 and bf16, head_dim 64 and 128, block_size 8/16/32, any GQA group G <= BM
(MHA included). Under NUMBA_ENABLE_CUDASIM=1 the kernels run in the simulator: cp.async
copies at issue, and ldmatrix, mma and the shuffles go through warp-collective fallbacks that
follow the fragment layouts above element by element.

Entry points (this file stands alone: the journey's versions are in prefill_journey.py):
    paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                  validate=False, max_context_len=None, splits=None, stages=None, plans=None,
                  short_prompts=None)
                                    VERSION (7) on torch tensors: the engine's kernel; plans: a step's
                                    dict of work lists (built by its first layer, reused by the others);
                                    short_prompts: v9 where short_plan says so (SHORT_PROMPTS, off)
    launch_torch(version, q, ...)   a kernel of KERNEL_VERSIONS on torch tensors (the journey's others)
    launch(version, q, ...)         raw-bit numba device arrays, or numpy under the simulator

Intrinsics: ldmatrix_x4, ldmatrix_x4_trans and store_u32x4 come from common.py; the simulator mma
vectorised over the warp (30x faster than common's fallback there) is defined here.
"""
import math

import numpy as np
import torch
from numba import cuda, float32, uint32

from kernels_numba import bridge, common
from kernels_numba.common import (cp_async16, cp_async_commit, cp_async_wait, ex2, inline_device, ldmatrix_x4,
                                  ldmatrix_x4_trans, load_u32x4, store_u32x4)
from kernels_numba.errors import KernelLaunchError
from kernels_numba.launcher import launch as launch_kernel
from kernels_numba.prefill_parts import BLOCK_SIZES, DTYPES, HEAD_DIMS, check_args, check_values

SIMULATOR = bridge.SIMULATOR
THREADS = 128  # 4 warps
LAUNCH_BOUNDS = (THREADS, 2)  # (threads, CTAs per SM the registers must allow)
BN = 64  # keys per KV tile
NEG_INF = float32(-np.inf)
LOG2E = 1.4426950408889634
RESCALE_LOG2 = 8.0  # v8: the running max moves once a p would exceed 2^8 (fp16 holds 65504, bf16 more)
NAN_WORD = 0x7FC07FC0  # two halves that are NaN as fp16 and as bf16 (the simulator's poison)
SMEM_ALIGN = None if SIMULATOR else 16  # cp.async and ldmatrix move 16-byte units (the simulator has no alignment)

# ----------------------------------------------------------------------------------------
# The mma step: common's, and under the simulator one vectorised over the warp

if SIMULATOR:
    from kernels_numba import simulator as _sim

    # mma.sync m16n8k16 for the simulator, vectorised over the warp (common's fallback unpacks
    # every lane's fragments in Python for every lane: 30x slower). Where each lane's words sit
    # in A (16x16) and B (16x8), from the layouts in the header: word w, half e of lane 4 g + t.
    _g = (np.arange(32) >> 2)[:, None, None]
    _t = (np.arange(32) & 3)[:, None, None]
    _e = np.arange(2)[None, None, :]
    _w4 = np.arange(4)[None, :, None]
    _w2 = np.arange(2)[None, :, None]
    _A_ROW = np.broadcast_to(_g + 8 * (_w4 & 1), (32, 4, 2))
    _A_COL = np.broadcast_to(2 * _t + 8 * (_w4 >> 1) + _e, (32, 4, 2))
    _B_ROW = np.broadcast_to(2 * _t + 8 * _w2 + _e, (32, 2, 2))
    _B_COL = np.broadcast_to(_g, (32, 2, 2))

    def _make_mma(bf16):
        def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            """D = A B + C for the warp: exact products summed in float64, one rounding to fp32."""
            words = np.array(_sim.warp_all((a0, a1, a2, a3, b0, b1)), dtype=np.uint32)  # (lane, word)
            h = words.view(np.uint16).reshape(32, 6, 2)  # little endian: the low half first
            x = (h.astype(np.uint32) << 16).view(np.float32) if bf16 else h.view(np.float16)
            x = x.astype(np.float64)
            a = np.empty((16, 16))
            b = np.empty((16, 8))
            a[_A_ROW, _A_COL] = x[:, :4]
            b[_B_ROW, _B_COL] = x[:, 4:]
            lane = _sim.lane_id()
            g, t = lane >> 2, lane & 3
            d = a[[g, g + 8]] @ b[:, 2 * t : 2 * t + 2]  # this lane's C/D elements
            return (np.float32(d[0, 0] + c0), np.float32(d[0, 1] + c1),
                    np.float32(d[1, 0] + c2), np.float32(d[1, 1] + c3))

        return mma

    mma_f16 = _make_mma(False)
    mma_bf16 = _make_mma(True)

else:
    mma_f16 = common.mma_m16n8k16_f16
    mma_bf16 = common.mma_m16n8k16_bf16


# ----------------------------------------------------------------------------------------
# The kernels


class Config:
    """Compile-time shape of one version's kernel: MT m-tiles of 16 rows per warp, ST stages,
    Q's fragments held in registers or read from shared memory at every KV tile, bn keys per KV
    tile, and where a CTA finds its (sequence, q tile): find_tile's search (v4-v6) or the work
    list a plan kernel wrote before it (v7)."""

    def __init__(self, m_tiles, stages=2, q_in_smem=False, bn=BN, planned=False, ahead=False, persistent=False,
                 prefetch=None):
        self.m_tiles = m_tiles
        self.stages = stages
        self.q_in_smem = q_in_smem
        self.bn = bn
        self.planned = planned
        self.ahead = ahead  # v8: block ids one tile ahead, and the running max moved only when it grows
        # v9: a CTA loops over work items, the next item's Q and first KV tile copied during this one's last
        # tile ("tile": issued at its start, after its barrier) or its epilogue ("epilogue": after its math)
        self.persistent = persistent
        self.prefetch = prefetch

    def key(self):
        return (self.m_tiles, self.stages, self.q_in_smem, self.bn, self.planned, self.ahead, self.persistent,
                self.prefetch)


BN_D128_V7 = 32  # v7 at d=128: 128 rows x 32 keys keeps S in 32 registers beside O's 128


PREFETCH = ("tile", "epilogue")  # v9: where the next item's copies are issued (the first is the default)


def version_config(version, head_dim, stages=None, prefetch=None):
    """v4: 64 rows per CTA; v5, v6: 128 at d=64, 64 at d=128 (two m-tiles of 64-key tiles need
    more than 255 registers there: O alone is 128, S 64); v7: 128 rows at both, d=128 with tiles
    of 32 keys, and the work list; v8: v7's shape with the block ids loaded a tile ahead and the
    lazy rescale; v9: v7's shape in a persistent loop over the work list (two Q buffers, 2 stages only).
    stages: override the ring's 2 stages (bench sweeps); prefetch: v9's PREFETCH placement (default the first)."""
    stages = 2 if stages is None else stages
    if version == 9:
        if stages != 2:
            raise KernelLaunchError(f"v9 runs a ring of 2 stages (its prefetch across items), got stages={stages}")
        prefetch = PREFETCH[0] if prefetch is None else prefetch
        if prefetch not in PREFETCH:
            raise KernelLaunchError(f"prefetch must be one of {PREFETCH}, got {prefetch!r}")
        return Config(m_tiles=2, stages=2, q_in_smem=True, bn=BN_D128_V7 if head_dim == 128 else BN, planned=True,
                      persistent=True, prefetch=prefetch)
    if prefetch is not None:
        raise KernelLaunchError(f"prefetch={prefetch!r}: only v9 prefetches across work items")
    if version >= 7:
        return Config(m_tiles=2, stages=stages, q_in_smem=True, bn=BN_D128_V7 if head_dim == 128 else BN,
                      planned=True, ahead=version == 8)
    if version == 4 or head_dim == 128:
        return Config(m_tiles=1, stages=stages)
    return Config(m_tiles=2, stages=stages, q_in_smem=True)


def tile_rows(version, head_dim):
    """BM: (query, head) rows per CTA."""
    return 4 * 16 * version_config(version, head_dim).m_tiles


def smem_bytes(version, head_dim, stages=None):
    """Dynamic shared memory of one CTA: ST stages of a K and a V tile (+ the Q tile when its
    fragments are re-read at every KV tile; v9: two Q tiles, this item's and the next one's)."""
    cfg = version_config(version, head_dim, stages)
    q_tile = tile_rows(version, head_dim) * head_dim * 2 if cfg.q_in_smem else 0
    return cfg.stages * 2 * cfg.bn * head_dim * 2 + q_tile * (2 if cfg.persistent else 1)


_KERNELS = {}


@inline_device
def find_tile(t, cu_seqlens_q, num_seqs, bq):
    """(sequence, q tile) of the t-th CTA in rank-major order, or (-1, 0) past the last tile.

    Rank r is every sequence's tile ntiles - 1 - r (rank 0: its last bq queries, which see the
    most keys), so CTAs start heaviest first across sequences (longest-processing-time-first:
    the short tiles fill the SMs at the end). C(r) = sum_s min(ntiles_s, r) tiles come before
    rank r; a binary search finds t's rank, then the (t - C(r))-th sequence that has one.
    cu_seqlens_q: [num_seqs + 1] int32; bq: queries per tile.
    """
    hi = 0
    for i in range(num_seqs):
        hi = max(hi, (cu_seqlens_q[i + 1] - cu_seqlens_q[i] + bq - 1) // bq)
    lo = 0  # C(lo) <= t < C(hi) once t is in range
    before = 0  # C(lo)
    total = 0
    for i in range(num_seqs):
        total += (cu_seqlens_q[i + 1] - cu_seqlens_q[i] + bq - 1) // bq
    if t >= total:
        return -1, 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = 0
        for i in range(num_seqs):
            c += min((cu_seqlens_q[i + 1] - cu_seqlens_q[i] + bq - 1) // bq, mid)
        if c <= t:
            lo = mid
            before = c
        else:
            hi = mid
    k = t - before
    for i in range(num_seqs):
        ntiles = (cu_seqlens_q[i + 1] - cu_seqlens_q[i] + bq - 1) // bq
        if ntiles > lo:
            if k == 0:
                return i, ntiles - 1 - lo
            k -= 1
    return -1, 0


def _build(head_dim, kind, block_size, m_tiles, stages, q_in_smem, bn, planned, ahead, persistent, prefetch):
    """The kernel for one (head_dim, "f16" | "bf16", block_size) and Config."""
    D, BS, MT, ST, Q_SMEM, BN, PLANNED, AHEAD = head_dim, block_size, m_tiles, stages, q_in_smem, bn, planned, ahead
    PERSISTENT = persistent
    AT_TILE = prefetch == "tile"  # v9: the next item's copies at the last tile's start, else after its math
    # v9's prefetch of the next item: its Q into the other Q buffer, its first tile into the stage the last
    # tile's predecessor used (2 stages: the ring's only free one); the work list says what comes next
    assert not PERSISTENT or (ST == 2 and Q_SMEM and PLANNED and not AHEAD)
    BM = 64 * MT  # rows per CTA
    W = D // 2  # words (pairs of halves) per row
    CPR = D // 8  # 16-byte chunks per row
    RPP = THREADS // CPR  # rows a copy pass covers (one chunk per thread)
    PASSES = BN // RPP  # copy passes per K (and V) tile
    Q_PASSES = BM // RPP
    NT = BN // 8  # n-tiles of S per m-tile
    KS = D // 16  # k-steps of S = Q K^T
    KP = KS // 2  # ldmatrix.x4 of K per n-tile (two k-steps each)
    KK = BN // 16  # k-steps of O += P V
    DT = D // 8  # n-tiles (8 dims) of O
    DH = DT // 2  # ... in each half of O
    POS_TYPE = np.int32 if PLANNED else np.int64  # a row's position
    # v7 at d=64: Q's rows by steps, not divisions (at d=128 ptxas then spills more: 68 B, not 40)
    STEP_ROWS = PLANNED and D == 64
    DP = DT // 2  # ldmatrix.x4.trans of V per k-step (two d-tiles each)
    TILE = BN * W  # words of a K (or V) tile
    STAGE = 2 * TILE
    RING = ST * STAGE
    QW = BM * W  # words of a Q tile (and of a CTA's O tile)
    SMEM_WORDS = RING + (QW * (2 if PERSISTENT else 1) if Q_SMEM else 0)
    # Q (v4) goes to the ring's last stage; O is staged at the start of shared memory
    assert BM * W <= (SMEM_WORDS if Q_SMEM else STAGE), "the Q and O tiles fit"
    assert PASSES >= 1 and BN % 16 == 0
    BS_SHIFT = BS.bit_length() - 1  # block_tables index: pos >> BS_SHIFT, offset: pos & (BS - 1)
    assert BS == 1 << BS_SHIFT
    mma = mma_bf16 if kind == "bf16" else mma_f16
    pack = common.f32x2_to_bf16x2 if kind == "bf16" else common.f32x2_to_f16x2
    wait_q = cp_async_wait(ST - 1)  # Q's group done, the prologue's ST-1 tile groups may pend
    wait_tile = cp_async_wait(ST - 2)  # tile j done, tiles j+1 .. j+ST-2 may pend
    POISON = SIMULATOR  # fill the ring with NaN first, so a read of an unwritten word shows
    # 2 CTAs (8 warps) per SM, as FA2 at d=64: up to 255 registers (v4 needs ~210, v5 255)
    jit_options = {} if SIMULATOR else {"launch_bounds": LAUNCH_BOUNDS}

    @inline_device
    def issue_q(ring, qs, q, q_start, q_len, q0, head, num_heads, group, rows_used, row0, chunk):
        # the Q tile of queries q0 .. q0 + bq - 1 of the chunk at q_start (q_len queries) into the region
        # at word qs (rows past the chunk: zeros): this thread copies chunk `chunk` of rows row0 + RPP i.
        # Row r = row0 + RPP i is query r // group of head-in-group r % group: v7 at d=64 steps both from
        # row0's by RPP's (two divisions per thread instead of two per pass; the epilogue divides: keeping
        # the steps live through the KV loop costs registers there)
        rq = row0 // group
        rh = row0 - rq * group
        step_q = RPP // group
        step_h = RPP - step_q * group
        for i in range(Q_PASSES):
            r = row0 + RPP * i
            if STEP_ROWS:
                qi = q0 + rq
                hr = rh
                rq += step_q
                rh += step_h
                if rh >= group:
                    rh -= group
                    rq += 1
            else:
                qi = q0 + r // group
                hr = r % group
            dst = qs + r * W + ((chunk ^ (r & 7)) << 2)
            if r < rows_used and qi < q_len:
                src = ((q_start + qi) * num_heads + head * group + hr) * W + chunk * 4
                cp_async16(ring, dst, q, src)
            else:
                store_u32x4(ring, dst, 0, 0, 0, 0)

    @inline_device
    def item_index(rnd, first, per_round):
        # v9: the work-list item of a CTA's round rnd (first: its item in round 0; per_round: CTAs per
        # KV head). Rounds run the list in a snake, forward then backward, so a CTA given one of a round's
        # heaviest items gets one of the next round's lightest (the list falls in weight)
        return rnd * per_round + (first if rnd % 2 == 0 else per_round - 1 - first)

    @inline_device
    def issue_tile(ring, dst0, k_cache, v_cache, block_tables, s, block_words, n0, kv_stop, row0, tdst, tsrc):
        # K and V rows n0 .. n0+63 into the stage at word dst0: this thread copies one 16-byte
        # chunk of rows row0 + RPP i (row0 < RPP); rows at or past kv_stop become zeros.
        # tdst: the chunk's swizzled offset in row row0 (row & 7 is the same for every pass);
        # tsrc: its offset in the pool block (KV head, row0's slot, chunk). As n0 is a multiple
        # of BN and RPP, BS are powers of two, pass i's block is (n0 + RPP i) / BS + row0 / BS
        # and its slot (RPP i) % BS + row0 % BS: compile-time offsets from per-tile values.
        rem = kv_stop - n0 - row0  # pass i copies while RPP i < rem
        b0 = (n0 >> BS_SHIFT) + (row0 >> BS_SHIFT)
        for i in range(PASSES):
            dst = dst0 + tdst + RPP * i * W
            if RPP * i < rem:
                block = block_tables[s, b0 + ((RPP * i) >> BS_SHIFT)]
                src = block * block_words + tsrc + ((RPP * i) & (BS - 1)) * W
                cp_async16(ring, dst, k_cache, src)
                cp_async16(ring, dst + TILE, v_cache, src)
            else:
                store_u32x4(ring, dst, 0, 0, 0, 0)
                store_u32x4(ring, dst + TILE, 0, 0, 0, 0)

    @inline_device
    def tile_blocks(nb, block_tables, s, n0, kv_stop, row0):
        # v8: the pool block of each of this thread's copy passes of the tile at n0 (issue_tile's
        # block, 0 where the pass copies nothing), all loaded at once and a tile before issue_blocks
        # needs them: the loads' latency hides behind a tile of math instead of stalling the copies
        rem = kv_stop - n0 - row0
        b0 = (n0 >> BS_SHIFT) + (row0 >> BS_SHIFT)
        for i in range(PASSES):
            nb[i] = block_tables[s, b0 + ((RPP * i) >> BS_SHIFT)] if RPP * i < rem else 0

    @inline_device
    def issue_blocks(ring, dst0, k_cache, v_cache, nb, block_words, n0, kv_stop, row0, tdst, tsrc):
        # issue_tile with the blocks tile_blocks loaded before
        rem = kv_stop - n0 - row0
        for i in range(PASSES):
            dst = dst0 + tdst + RPP * i * W
            if RPP * i < rem:
                src = nb[i] * block_words + tsrc + ((RPP * i) & (BS - 1)) * W
                cp_async16(ring, dst, k_cache, src)
                cp_async16(ring, dst + TILE, v_cache, src)
            else:
                store_u32x4(ring, dst, 0, 0, 0, 0)
                store_u32x4(ring, dst + TILE, 0, 0, 0, 0)

    @inline_device
    def issue_next(ring, dst0, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, s, q0, qs, head,
                   num_heads, group, bq, rows_used, block_words, row0, chunk, tdst, tsrc):
        # v9: work item (sequence s, queries q0 ..)'s Q tile into the Q buffer at qs and its first KV tile
        # into the stage at dst0
        q_start = cu_seqlens_q[s]
        q_len = cu_seqlens_q[s + 1] - q_start
        kv_end = context_lens[s] - q_len + min(q0 + bq, q_len)  # the item's (v9 does not split)
        issue_q(ring, qs, q, q_start, q_len, q0, head, num_heads, group, rows_used, row0, chunk)
        issue_tile(ring, dst0, k_cache, v_cache, block_tables, s, block_words, 0, kv_end, row0, tdst, tsrc)

    @cuda.jit(**jit_options)
    def kernel(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, part_o, part_lse, work,
               num_heads, num_kv_heads, scale):
        # q, out: flat uint32 views of [total_q, num_heads, D]; k_cache, v_cache: flat uint32
        # views of [num_blocks, num_kv_heads, BS, D]; block_tables [num_seqs, max_blocks],
        # cu_seqlens_q [num_seqs + 1], context_lens [num_seqs] int32; part_o float32
        # [splits, total_q * num_heads, D] and part_lse float32 [splits, total_q * num_heads]
        # (used when gridDim.z > 1); work int32 [3 * gridDim.x / num_kv_heads], the plan's work
        # list (v7; any 1-element array before); scale float32.
        # ST stages of [K tile | V tile] (+ the Q tile in v5, v6); Q (v4) and O are staged in it
        ring = cuda.shared.array(0, uint32, alignment=SMEM_ALIGN)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        fg = lane >> 2  # fragment row group
        ft = lane & 3  # fragment column pair
        split = cuda.blockIdx.z
        num_splits = cuda.gridDim.z
        group = num_heads // num_kv_heads
        bq = BM // group  # queries per tile
        rows_used = bq * group

        # ---- which (sequence, q tile, KV head): heaviest first (see find_tile), heads interleaved
        head = cuda.blockIdx.x % num_kv_heads
        item = cuda.blockIdx.x // num_kv_heads
        bound = work.shape[0] // 3  # v7+: items in the work list (v7, v8: the grid's x // num_kv_heads)
        if PLANNED:  # two loads from the plan's work list (build_plan)
            s = work[item]
            tile = work[bound + item]
        else:
            s, tile = find_tile(item, cu_seqlens_q, context_lens.shape[0], bq)
        if s < 0:
            return  # past the last tile: the grid is an upper bound
        total_rows = q.shape[0] // W  # total_q * num_heads
        chunk = tid % CPR
        row0 = tid // CPR
        tdst = row0 * W + ((chunk ^ (row0 & 7)) << 2)
        tsrc = (head * BS + (row0 & (BS - 1))) * W + chunk * 4
        block_words = num_kv_heads * BS * W
        nb = cuda.local.array(PASSES, np.int32)  # v8: the blocks of the next tile to issue
        pos = cuda.local.array((MT, 2), POS_TYPE)  # v7: int32, four registers fewer
        qa = cuda.local.array((MT, KS, 4), uint32)  # Q fragments (when held in registers)
        sc = cuda.local.array((MT, NT, 4), float32)  # S, then P, of this tile
        # O's d-tiles in two halves (dims 0 .. D/2 - 1, D/2 .. D - 1): each loop over O below runs
        # over one half, short enough that the compiler unrolls it fully at MT = 2, d = 128 (one loop
        # over all 128 accumulators stays a loop, and O moves to local memory)
        oa = cuda.local.array((MT, DH, 4), float32)
        ob = cuda.local.array((MT, DH, 4), float32)
        m = cuda.local.array((MT, 2), float32)  # running max per row (raw score units)
        lsum = cuda.local.array((MT, 2), float32)  # this lane's part of the row sums
        tmax = cuda.local.array((MT, 2), float32)  # v8: this tile's row maxima
        lrow = (lane & 7) + ((lane >> 3) & 1) * 8  # ldmatrix row of Q and V this lane addresses
        lhi = lane >> 4  # ... and its chunk offset (0 or 1)
        sl = scale * float32(LOG2E)
        krow = (lane & 7) * W  # K: this lane addresses key 8 nt + lane % 8 of chunk 4 kp + lane // 8
        vrow = lrow * W  # V: key 16 kk + lrow of chunk 2 dp + lhi

        read = 0  # word offset of tile j's stage
        write = (ST - 1) * STAGE  # ... and of the stage tile j + ST - 1 goes to
        rnd = 0  # v9: this CTA's round (its item is item_index(rnd, ...)); Q buffer rnd % 2
        while True:  # v9: one work item per pass, until the list ends; v4-v8: one pass
            q_start = cu_seqlens_q[s]
            q_len = cu_seqlens_q[s + 1] - q_start
            first_pos = context_lens[s] - q_len  # position of the chunk's query 0
            q0 = tile * bq
            kv_end = first_pos + min(q0 + bq, q_len)  # one past the tile's last visible position
            unmasked_end = first_pos + q0 + 1  # keys below it are visible to every row of the tile

            # ---- this split's KV tiles [t_lo, t_hi) (all of them without a split)
            n_tiles = (kv_end + BN - 1) // BN
            per_split = (n_tiles + num_splits - 1) // num_splits
            t_lo = split * per_split
            t_hi = min(n_tiles, t_lo + per_split)
            if t_lo >= t_hi:  # an empty part of a split tile: nothing to add to the merge
                for r in range(tid, rows_used, THREADS):
                    qi = q0 + r // group
                    if qi < q_len:
                        part_lse[split * total_rows + (q_start + qi) * num_heads + head * group + r % group] = NEG_INF
                return
            kv_stop = min(kv_end, t_hi * BN)
            # Q tile (v5+: past the ring; v9: buffer rnd % 2 there; v4: the last stage, its fragments go to
            # registers)
            qs = RING + (rnd % 2) * QW if PERSISTENT else (RING if Q_SMEM else (ST - 1) * STAGE)

            if rnd == 0:  # v9: later items' Q and first tile were copied during the item before
                if POISON:
                    for i in range(tid, SMEM_WORDS, THREADS):
                        ring[i] = uint32(NAN_WORD)
                    cuda.syncthreads()
                # ---- Q tile (rows past the chunk: zeros), then tiles t_lo .. t_lo + ST - 2
                issue_q(ring, qs, q, q_start, q_len, q0, head, num_heads, group, rows_used, row0, chunk)
                cp_async_commit()
                for k in range(ST - 1):
                    if t_lo + k < t_hi:
                        if AHEAD:
                            tile_blocks(nb, block_tables, s, (t_lo + k) * BN, kv_stop, row0)
                            issue_blocks(ring, k * STAGE, k_cache, v_cache, nb, block_words, (t_lo + k) * BN, kv_stop,
                                         row0, tdst, tsrc)
                        else:
                            issue_tile(ring, k * STAGE, k_cache, v_cache, block_tables, s, block_words, (t_lo + k) * BN,
                                       kv_stop, row0, tdst, tsrc)
                    cp_async_commit()
                if AHEAD and t_lo + ST - 1 < t_hi:
                    tile_blocks(nb, block_tables, s, (t_lo + ST - 1) * BN, kv_stop, row0)

            # ---- per lane: rows (warp MT + mt) 16 + fg + 8 h, their positions, Q fragments (v4)
            for mt in range(MT):
                for h in range(2):
                    r = (warp * MT + mt) * 16 + fg + 8 * h
                    qi = q0 + r // group
                    pos[mt, h] = first_pos + qi if (r < rows_used and qi < q_len) else kv_end - 1
            qrow = qs + (warp * MT * 16 + lrow) * W  # + 16 W mt: this lane's ldmatrix row of Q
            if not Q_SMEM:
                wait_q()
                cuda.syncthreads()
                for mt in range(MT):
                    for ks in range(KS):
                        a0, a1, a2, a3 = ldmatrix_x4(ring, qrow + mt * 16 * W + (((2 * ks + lhi) ^ (lane & 7)) << 2))
                        qa[mt, ks, 0] = a0
                        qa[mt, ks, 1] = a1
                        qa[mt, ks, 2] = a2
                        qa[mt, ks, 3] = a3

            for mt in range(MT):
                for h in range(2):
                    m[mt, h] = NEG_INF
                    lsum[mt, h] = float32(0.0)
                for dt in range(DH):
                    for e in range(4):
                        oa[mt, dt, e] = float32(0.0)
                for dt in range(DH):
                    for e in range(4):
                        ob[mt, dt, e] = float32(0.0)
            s_n = -1
            tile_n = 0
            if PERSISTENT:  # v9: the next item's place in the work list, loaded now, used after the last tile
                nxt = item_index(rnd + 1, item, cuda.gridDim.x // num_kv_heads)
                if nxt < bound:
                    s_n = work[nxt]
                    tile_n = work[bound + nxt]
            for j in range(t_lo, t_hi):
                wait_tile()
                cuda.syncthreads()
                if j + ST - 1 < t_hi:
                    if AHEAD:
                        issue_blocks(ring, write, k_cache, v_cache, nb, block_words, (j + ST - 1) * BN, kv_stop, row0,
                                     tdst, tsrc)
                    else:
                        issue_tile(ring, write, k_cache, v_cache, block_tables, s, block_words, (j + ST - 1) * BN,
                                   kv_stop, row0, tdst, tsrc)
                elif PERSISTENT and AT_TILE and s_n >= 0:
                    # v9, the item's last tile: the next item's Q into the other Q buffer and its first KV tile
                    # into the free stage, in flight during this tile's math and the epilogue
                    issue_next(ring, write, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, s_n,
                               tile_n * bq, RING + ((rnd + 1) % 2) * QW, head, num_heads, group, bq, rows_used,
                               block_words, row0, chunk, tdst, tsrc)
                cp_async_commit()
                if AHEAD and j + ST < t_hi:  # the blocks of the tile the next iteration issues
                    tile_blocks(nb, block_tables, s, (j + ST) * BN, kv_stop, row0)
                n0 = j * BN

                # ---- S = Q K^T: per n-tile, KP ldmatrix.x4 of K, each feeding 2 MT mma
                for mt in range(MT):
                    for nt in range(NT):
                        for e in range(4):
                            sc[mt, nt, e] = float32(0.0)
                for kp in range(KP):
                    if Q_SMEM:  # this k-step pair's Q fragments, re-read (the tile stays in shared memory)
                        for mt in range(MT):
                            for ks in range(2 * kp, 2 * kp + 2):
                                a0, a1, a2, a3 = ldmatrix_x4(ring, qrow + mt * 16 * W + (((2 * ks + lhi) ^ (lane & 7)) << 2))
                                qa[mt, ks, 0] = a0
                                qa[mt, ks, 1] = a1
                                qa[mt, ks, 2] = a2
                                qa[mt, ks, 3] = a3
                    kaddr = read + krow + (((4 * kp + (lane >> 3)) ^ (lane & 7)) << 2)
                    for nt in range(NT):
                        b0, b1, b2, b3 = ldmatrix_x4(ring, kaddr + nt * 8 * W)
                        for mt in range(MT):
                            c0, c1, c2, c3 = mma(qa[mt, 2 * kp, 0], qa[mt, 2 * kp, 1], qa[mt, 2 * kp, 2],
                                                 qa[mt, 2 * kp, 3], b0, b1,
                                                 sc[mt, nt, 0], sc[mt, nt, 1], sc[mt, nt, 2], sc[mt, nt, 3])
                            c0, c1, c2, c3 = mma(qa[mt, 2 * kp + 1, 0], qa[mt, 2 * kp + 1, 1], qa[mt, 2 * kp + 1, 2],
                                                 qa[mt, 2 * kp + 1, 3], b2, b3, c0, c1, c2, c3)
                            sc[mt, nt, 0] = c0
                            sc[mt, nt, 1] = c1
                            sc[mt, nt, 2] = c2
                            sc[mt, nt, 3] = c3

                # ---- causal mask, only where some key of the tile is past some row's position
                if n0 + BN > unmasked_end:
                    for mt in range(MT):
                        for nt in range(NT):
                            for e in range(4):
                                if n0 + nt * 8 + 2 * ft + (e & 1) > pos[mt, e >> 1]:
                                    sc[mt, nt, e] = NEG_INF

                # ---- online softmax in base 2 (a row lives in the 4 lanes of its fg)
                if AHEAD:
                    # v8: the running max m moves only when some row of the warp would see a p above
                    # 2^RESCALE_LOG2 (or sees its first key); otherwise p = 2^((s - m) sl) <= 2^RESCALE_LOG2
                    # with the old m and O, l need no rescale: O / l is the same for any m (fp16/bf16 P and
                    # fp32 sums hold 2^8 without loss). Warp-uniform (rows' flags OR-ed by shuffles), so
                    # the branch costs 3 shuffles a tile and skips MT * D / 2 multiplies most tiles
                    grow = float32(0.0)  # a float flag: 32-bit shuffles (numba widens integer flags to 64 bits)
                    for mt in range(MT):
                        for h in range(2):
                            tx = NEG_INF
                            for nt in range(NT):
                                tx = max(tx, max(sc[mt, nt, 2 * h], sc[mt, nt, 2 * h + 1]))
                            tx = max(tx, cuda.shfl_xor_sync(0xFFFFFFFF, tx, 1))
                            tx = max(tx, cuda.shfl_xor_sync(0xFFFFFFFF, tx, 2))
                            tmax[mt, h] = tx
                            # m = -inf, tx finite: inf, grows; both -inf (a split's empty rows): NaN, does not
                            if (tx - m[mt, h]) * sl > float32(RESCALE_LOG2):
                                grow = float32(1.0)
                    grow = max(grow, cuda.shfl_xor_sync(0xFFFFFFFF, grow, 4))
                    grow = max(grow, cuda.shfl_xor_sync(0xFFFFFFFF, grow, 8))
                    grow = max(grow, cuda.shfl_xor_sync(0xFFFFFFFF, grow, 16))
                    if grow != float32(0.0):
                        for mt in range(MT):
                            for h in range(2):
                                mx = max(m[mt, h], tmax[mt, h])
                                ms = mx * sl if mx != NEG_INF else float32(0.0)
                                alpha = ex2(m[mt, h] * sl - ms)  # 0 while the row has seen nothing
                                m[mt, h] = mx
                                lsum[mt, h] *= alpha
                                for dt in range(DH):
                                    oa[mt, dt, 2 * h] *= alpha
                                    oa[mt, dt, 2 * h + 1] *= alpha
                                for dt in range(DH):
                                    ob[mt, dt, 2 * h] *= alpha
                                    ob[mt, dt, 2 * h + 1] *= alpha
                    for mt in range(MT):
                        for h in range(2):
                            ms = m[mt, h] * sl if m[mt, h] != NEG_INF else float32(0.0)  # nothing seen: p = 0
                            total = float32(0.0)
                            for nt in range(NT):
                                p0 = ex2(sc[mt, nt, 2 * h] * sl - ms)
                                p1 = ex2(sc[mt, nt, 2 * h + 1] * sl - ms)
                                sc[mt, nt, 2 * h] = p0
                                sc[mt, nt, 2 * h + 1] = p1
                                total += p0 + p1
                            lsum[mt, h] += total
                else:  # v4-v7: the max moves with every tile
                    for mt in range(MT):
                        for h in range(2):
                            mx = m[mt, h]
                            for nt in range(NT):
                                mx = max(mx, max(sc[mt, nt, 2 * h], sc[mt, nt, 2 * h + 1]))
                            mx = max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 1))
                            mx = max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 2))
                            ms = mx * sl if mx != NEG_INF else float32(0.0)  # a fully masked row: p = 0
                            alpha = ex2(m[mt, h] * sl - ms)  # 0 while the row has seen nothing
                            m[mt, h] = mx
                            total = float32(0.0)
                            for nt in range(NT):
                                p0 = ex2(sc[mt, nt, 2 * h] * sl - ms)
                                p1 = ex2(sc[mt, nt, 2 * h + 1] * sl - ms)
                                sc[mt, nt, 2 * h] = p0
                                sc[mt, nt, 2 * h + 1] = p1
                                total += p0 + p1
                            lsum[mt, h] = lsum[mt, h] * alpha + total
                            for dt in range(DH):
                                oa[mt, dt, 2 * h] *= alpha
                                oa[mt, dt, 2 * h + 1] *= alpha
                            for dt in range(DH):
                                ob[mt, dt, 2 * h] *= alpha
                                ob[mt, dt, 2 * h + 1] *= alpha

                # ---- O += P V: P from the S fragments, V by ldmatrix.trans
                for kk in range(KK):
                    vaddr = read + TILE + kk * 16 * W + vrow
                    pa = cuda.local.array((MT, 4), uint32)
                    for mt in range(MT):
                        pa[mt, 0] = pack(sc[mt, 2 * kk, 0], sc[mt, 2 * kk, 1])
                        pa[mt, 1] = pack(sc[mt, 2 * kk, 2], sc[mt, 2 * kk, 3])
                        pa[mt, 2] = pack(sc[mt, 2 * kk + 1, 0], sc[mt, 2 * kk + 1, 1])
                        pa[mt, 3] = pack(sc[mt, 2 * kk + 1, 2], sc[mt, 2 * kk + 1, 3])
                    for dp in range(DP // 2):  # d-tiles 2 dp, 2 dp + 1 of the first half
                        b0, b1, b2, b3 = ldmatrix_x4_trans(ring, vaddr + (((2 * dp + lhi) ^ (lane & 7)) << 2))
                        for mt in range(MT):
                            oa[mt, 2 * dp, 0], oa[mt, 2 * dp, 1], oa[mt, 2 * dp, 2], oa[mt, 2 * dp, 3] = mma(
                                pa[mt, 0], pa[mt, 1], pa[mt, 2], pa[mt, 3], b0, b1,
                                oa[mt, 2 * dp, 0], oa[mt, 2 * dp, 1], oa[mt, 2 * dp, 2], oa[mt, 2 * dp, 3])
                            oa[mt, 2 * dp + 1, 0], oa[mt, 2 * dp + 1, 1], oa[mt, 2 * dp + 1, 2], oa[mt, 2 * dp + 1, 3] = mma(
                                pa[mt, 0], pa[mt, 1], pa[mt, 2], pa[mt, 3], b2, b3,
                                oa[mt, 2 * dp + 1, 0], oa[mt, 2 * dp + 1, 1], oa[mt, 2 * dp + 1, 2], oa[mt, 2 * dp + 1, 3])
                    for dp in range(DP // 2):  # ... and of the second half
                        b0, b1, b2, b3 = ldmatrix_x4_trans(ring, vaddr + (((2 * (dp + DP // 2) + lhi) ^ (lane & 7)) << 2))
                        for mt in range(MT):
                            ob[mt, 2 * dp, 0], ob[mt, 2 * dp, 1], ob[mt, 2 * dp, 2], ob[mt, 2 * dp, 3] = mma(
                                pa[mt, 0], pa[mt, 1], pa[mt, 2], pa[mt, 3], b0, b1,
                                ob[mt, 2 * dp, 0], ob[mt, 2 * dp, 1], ob[mt, 2 * dp, 2], ob[mt, 2 * dp, 3])
                            ob[mt, 2 * dp + 1, 0], ob[mt, 2 * dp + 1, 1], ob[mt, 2 * dp + 1, 2], ob[mt, 2 * dp + 1, 3] = mma(
                                pa[mt, 0], pa[mt, 1], pa[mt, 2], pa[mt, 3], b2, b3,
                                ob[mt, 2 * dp + 1, 0], ob[mt, 2 * dp + 1, 1], ob[mt, 2 * dp + 1, 2], ob[mt, 2 * dp + 1, 3])

                write = read
                read += STAGE
                if read == RING:
                    read = 0

            if PERSISTENT and not AT_TILE:
                if s_n >= 0:
                    # v9 (prefetch="epilogue"): the same copies after the last tile's math, into the stage
                    # tile t_hi - 2 used (`read` now; free since the last tile's barrier): fewer values live
                    # through the KV loop, less of the next item's latency hidden
                    issue_next(ring, read, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, s_n,
                               tile_n * bq, RING + ((rnd + 1) % 2) * QW, head, num_heads, group, bq, rows_used,
                               block_words, row0, chunk, tdst, tsrc)
                cp_async_commit()

            # ---- full row sums; write O / l
            for mt in range(MT):
                for h in range(2):
                    x = lsum[mt, h]
                    x += cuda.shfl_xor_sync(0xFFFFFFFF, x, 1)
                    x += cuda.shfl_xor_sync(0xFFFFFFFF, x, 2)
                    lsum[mt, h] = x
            if num_splits == 1:
                # packed rows into shared memory (swizzled as the tiles), then 16-byte stores; v9 stages them in
                # this item's Q tile (the next item's tile is in flight into the ring)
                obase = qs if PERSISTENT else 0
                cuda.syncthreads()  # every warp is done reading the ring (v9: this item's Q tile, where O goes)
                for mt in range(MT):
                    for h in range(2):
                        r = (warp * MT + mt) * 16 + fg + 8 * h  # r & 7 == fg
                        inv = float32(1.0) / lsum[mt, h]
                        for dt in range(DH):
                            ring[obase + r * W + ((dt ^ fg) << 2) + ft] = pack(oa[mt, dt, 2 * h] * inv, oa[mt, dt, 2 * h + 1] * inv)
                        for dt in range(DH):
                            ring[obase + r * W + (((dt + DH) ^ fg) << 2) + ft] = pack(ob[mt, dt, 2 * h] * inv,
                                                                              ob[mt, dt, 2 * h + 1] * inv)
                cuda.syncthreads()
                for i in range(Q_PASSES):
                    r = row0 + RPP * i
                    qi = q0 + r // group
                    hr = r % group
                    if r < rows_used and qi < q_len:
                        w0, w1, w2, w3 = load_u32x4(ring, obase + r * W + ((chunk ^ (r & 7)) << 2))
                        dst = ((q_start + qi) * num_heads + head * group + hr) * W + chunk * 4
                        store_u32x4(out, dst, w0, w1, w2, w3)
            else:
                # this part's normalised O (fp32) and log2-sum-exp per row; merged by _build_merge
                for mt in range(MT):
                    for h in range(2):
                        r = (warp * MT + mt) * 16 + fg + 8 * h
                        qi = q0 + r // group
                        if r < rows_used and qi < q_len:
                            row = split * total_rows + (q_start + qi) * num_heads + head * group + r % group
                            x = lsum[mt, h]
                            inv = float32(1.0) / x if x > float32(0.0) else float32(0.0)
                            for dt in range(DH):
                                part_o[row * D + dt * 8 + 2 * ft] = oa[mt, dt, 2 * h] * inv
                                part_o[row * D + dt * 8 + 2 * ft + 1] = oa[mt, dt, 2 * h + 1] * inv
                            for dt in range(DH):
                                part_o[row * D + (dt + DH) * 8 + 2 * ft] = ob[mt, dt, 2 * h] * inv
                                part_o[row * D + (dt + DH) * 8 + 2 * ft + 1] = ob[mt, dt, 2 * h + 1] * inv
                            if ft == 0:
                                part_lse[row] = m[mt, h] * sl + math.log2(x) if x > float32(0.0) else NEG_INF

            # ---- v9: the next item (its Q and first tile are in flight), or the end of the work list
            if not PERSISTENT:
                break
            if s_n < 0:
                break
            rnd += 1
            s = s_n
            tile = tile_n

    return kernel


MERGE_THREADS = 128


def _build_merge(kind):
    """O[row] = sum_p 2^(lse_p - lse) O_p over the parts p of a split row (lse = log2 sum 2^lse_p)."""
    pack = common.f32x2_to_bf16x2 if kind == "bf16" else common.f32x2_to_f16x2

    @cuda.jit
    def merge(part_o, part_lse, out, head_dim, num_splits):
        # part_o float32 [splits, rows, head_dim], part_lse float32 [splits, rows] (-inf: empty
        # part); out: flat uint32 view of [rows, head_dim]; one thread per pair of dims of a row
        w_per_row = head_dim // 2
        rows = part_lse.shape[0] // num_splits
        idx = cuda.blockIdx.x * MERGE_THREADS + cuda.threadIdx.x
        row = idx // w_per_row
        w = idx % w_per_row
        if row >= rows:
            return
        mx = NEG_INF
        for p in range(num_splits):
            mx = max(mx, part_lse[p * rows + row])
        total = float32(0.0)
        a0 = float32(0.0)
        a1 = float32(0.0)
        for p in range(num_splits):
            lse = part_lse[p * rows + row]
            if lse != NEG_INF:  # an empty part's O was never written
                wgt = ex2(lse - mx)
                total += wgt
                a0 += wgt * part_o[(p * rows + row) * head_dim + 2 * w]
                a1 += wgt * part_o[(p * rows + row) * head_dim + 2 * w + 1]
        out[row * w_per_row + w] = pack(a0 / total, a1 / total)

    return merge


def get_kernel(version, head_dim, kind, block_size, stages=None, prefetch=None):
    """The attention kernel of `version` for (head_dim, "f16" | "bf16", block_size), built once."""
    cfg = version_config(version, head_dim, stages, prefetch)
    key = (head_dim, kind, block_size) + cfg.key()
    if key not in _KERNELS:
        _KERNELS[key] = bridge.enable_disk_cache(_build(head_dim, kind, block_size, *cfg.key()),
                                                 ("kernels_numba.paged_prefill_fa2",) + key,
                                                 recipe=(__name__, "get_kernel", (version, head_dim, kind, block_size),
                                                         (("stages", stages), ("prefetch", prefetch)), None))
    return _KERNELS[key]


def get_merge(kind):
    key = ("merge", kind)
    if key not in _KERNELS:
        _KERNELS[key] = bridge.enable_disk_cache(_build_merge(kind), ("kernels_numba.paged_prefill_fa2",) + key,
                                                 recipe=(__name__, "get_merge", (kind,), (), None))
    return _KERNELS[key]


PLAN_THREADS = 256
PLAN_SEQS = 4096  # sequences whose tile counts the plan keeps in shared memory (more: recomputed)


def _build_plan():
    """v7's work list: item i of the attention grid (x // num_kv_heads) -> (sequence, q tile), in
    find_tile's rank-major order with each rank's sequences by falling tile count, written once
    per launch by one CTA so that no attention CTA searches.

    Item (s, rank k) (s's tile n_s - 1 - k) sits at C(k) + p(s): C(k) = sum_s min(n_s, k) items
    come before rank k, and p(s), s's place among the sequences sorted by falling n_s (ties by
    index), is its place among the n_s > k sequences of rank k (they come first in that order)."""

    @cuda.jit
    def plan(cu_seqlens_q, bq, work):
        # cu_seqlens_q [num_seqs + 1] int32; bq: queries per tile; work int32 [3 * bound]:
        # [0, bound) the items' sequences (-1 past the last item), [bound, 2 bound) their q tiles,
        # [2 bound, 3 bound) scratch for C(k)
        bound = work.shape[0] // 3
        num_seqs = cu_seqlens_q.shape[0] - 1
        tid = cuda.threadIdx.x
        most = cuda.shared.array(1, np.int32)  # the largest n_s
        ntiles = cuda.shared.array(PLAN_SEQS, np.int32)  # n_s of the first PLAN_SEQS sequences
        if tid == 0:
            most[0] = 0
        cuda.syncthreads()
        mx = 0
        for s in range(tid, num_seqs, PLAN_THREADS):
            n = (cu_seqlens_q[s + 1] - cu_seqlens_q[s] + bq - 1) // bq
            if s < PLAN_SEQS:
                ntiles[s] = n
            mx = max(mx, n)
        cuda.atomic.max(most, 0, mx)
        cuda.syncthreads()
        n_max = most[0]
        for k in range(tid, n_max + 1, PLAN_THREADS):  # C(k); C(n_max) is the item count
            c = 0
            for s in range(num_seqs):
                n = ntiles[s] if s < PLAN_SEQS else (cu_seqlens_q[s + 1] - cu_seqlens_q[s] + bq - 1) // bq
                c += min(n, k)
            work[2 * bound + k] = c
        cuda.syncthreads()  # C is in global memory: visible to the whole CTA after the barrier
        for s in range(tid, num_seqs, PLAN_THREADS):
            n = (cu_seqlens_q[s + 1] - cu_seqlens_q[s] + bq - 1) // bq
            place = 0
            for s2 in range(num_seqs):
                n2 = ntiles[s2] if s2 < PLAN_SEQS else (cu_seqlens_q[s2 + 1] - cu_seqlens_q[s2] + bq - 1) // bq
                if n2 > n or (n2 == n and s2 < s):
                    place += 1
            for k in range(n):
                i = work[2 * bound + k] + place
                work[i] = s
                work[bound + i] = n - 1 - k
        for i in range(work[2 * bound + n_max] + tid, bound, PLAN_THREADS):
            work[i] = -1
            work[bound + i] = 0

    return plan


def get_plan():
    key = ("plan",)
    if key not in _KERNELS:
        _KERNELS[key] = bridge.enable_disk_cache(_build_plan(), ("kernels_numba.paged_prefill_fa2",) + key,
                                                 recipe=(__name__, "get_plan", (), (), None))
    return _KERNELS[key]


# ----------------------------------------------------------------------------------------
# Launch plan

MAX_SPLITS = 16
MIN_TILES_PER_SPLIT = 4  # 256 keys: shorter parts cost more in partials and merge than they gain


def num_tiles_bound(total_q, num_seqs, group, version, head_dim):
    """Grid x: an upper bound of sum_s ceil(q_len_s / BQ) that needs no host sync."""
    bq = tile_rows(version, head_dim) // group
    return (total_q + bq - 1) // bq + num_seqs


def plan_words(total_q, num_seqs, group, version, head_dim):
    """int32 words of v7's work list (sequence, q tile and C(k) per item); 1 for the versions that search."""
    return 3 * num_tiles_bound(total_q, num_seqs, group, version, head_dim) if version in PLANNED else 1


def split_plan(num_ctas, max_context_len, num_sms, bn=BN):
    """v6, v7: KV parts per q tile. 1 while the grid covers every SM; otherwise as many parts as fit
    one wave of resident CTAs (LAUNCH_BOUNDS[1] per SM: a second, partial wave would cost a whole
    part's time), each at least MIN_TILES_PER_SPLIT tiles of 64 keys long, at most MAX_SPLITS.
    bn: the kernel's keys per KV tile (v7 at d=128: 32)."""
    if num_ctas >= num_sms:
        return 1
    fit = LAUNCH_BOUNDS[1] * num_sms // num_ctas
    longest = -(-max_context_len // BN) // MIN_TILES_PER_SPLIT
    longest = min(longest, -(-max_context_len // bn))  # a part has at least one of the kernel's tiles
    return max(1, min(fit, MAX_SPLITS, longest))


VERSION = 7  # the version the engine runs: the work list (v7); 6: v5's kernel and the split plan
KERNEL_VERSIONS = (4, 5, 6, 7, 8, 9)  # the kernels this file builds (v4, v5 are v6's building blocks)
SPLITS_KV = (6, 7, 8)
PLANNED = (7, 8, 9)  # the versions whose CTAs read a work list (build_plan) instead of searching
PERSISTENT = (9,)  # the versions whose CTAs loop over the work list (a grid of at most one wave)

# v9 for short prompts: paged_prefill(short_prompts=True) runs it instead of VERSION where short_plan says
# so. Off by default (the engine runs VERSION) until the GPU measures where v9 is the faster one.
SHORT_PROMPTS = False
SHORT_CONTEXT = 1024  # predicted: v9 where no context is longer (docs/prefill.md, "v9", says why)


def short_plan(num_ctas, max_context_len, num_sms, head_dim=64):
    """Whether a launch of v7's shape should run as v9: its grid is more than one wave of resident CTAs
    (LAUNCH_BOUNDS[1] per SM: with fewer, each of v9's CTAs would run one item, as v7's do, and v7 may
    split the KV range) and no context is longer than SHORT_CONTEXT, so a work item is a few KV tiles and a
    CTA's fixed cost (the chain of dependent loads before its first tile, the epilogue) is a large part
    of an item's time: v9 hides part of it behind the item before. Longer items amortise it themselves,
    and v9's static order (item_index) balances them worse than the hardware's dispatch of v7's CTAs.
    head_dim 64 only: at 128, v9's item loop costs ptxas ~1.7 KB of spill reloads (v7: 64 bytes)."""
    return head_dim == 64 and num_ctas > LAUNCH_BOUNDS[1] * num_sms and max_context_len <= SHORT_CONTEXT


def persistent_grid(items, num_kv_heads, num_sms, ctas=None):
    """v9's grid x: CTAs per KV head (at most the items; by default one wave of LAUNCH_BOUNDS[1] per SM
    over all heads; ctas: a test's or a bench's override) times num_kv_heads."""
    per_head = max(1, LAUNCH_BOUNDS[1] * num_sms // num_kv_heads) if ctas is None else ctas
    return min(items, per_head) * num_kv_heads


def launch(version, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, part_o, part_lse, work,
           num_heads, num_kv_heads, head_dim, block_size, scale, kind, splits=1, stream=0, stages=None,
           planned=False, num_sms=None, ctas=None, prefetch=None):
    """Launch on raw arrays, no checks (v7+: the plan kernel, then attention, then the merge of a split).

    q, out: 1-D uint32 views of [total_q, num_heads, head_dim], 16-byte aligned
    k_cache, v_cache: 1-D uint32 views of [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables [num_seqs, max_blocks], cu_seqlens_q [num_seqs + 1], context_lens [num_seqs]: int32
    part_o: float32 [splits * total_q * num_heads * head_dim], part_lse: float32
        [splits * total_q * num_heads] (any 1-element arrays when splits == 1)
    work: int32 [plan_words(total_q, num_seqs, group, version, head_dim)] for v7 (PLANNED): the
        work list's space; any 1-element array before
    planned: `work` already holds this launch's work list (the plan of the same cu_seqlens_q, tile shape
        and sizes, built by an earlier launch of the step): the plan kernel is not launched again
    num_sms, ctas: v9's grid (persistent_grid); without num_sms one CTA per item (correct, not persistent)
    prefetch: v9's placement of the next item's copies (PREFETCH)
    numba device arrays or contiguous torch tensors of those dtypes (numpy in the simulator).
    """
    total_q = q.shape[0] // (num_heads * head_dim // 2)
    num_seqs = context_lens.shape[0]
    if total_q == 0 or num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    items = num_tiles_bound(total_q, num_seqs, group, version, head_dim)
    if version in PERSISTENT and splits != 1:
        raise KernelLaunchError(f"v{version} does not split the KV range (splits={splits})")
    x = items * num_kv_heads
    if version in PERSISTENT and (num_sms is not None or ctas is not None):
        x = persistent_grid(items, num_kv_heads, num_sms or 1, ctas)
    grid = (x, 1, splits)
    if version in PLANNED and not planned:
        bq = tile_rows(version, head_dim) // group
        launch_kernel(get_plan(), 1, PLAN_THREADS, (cu_seqlens_q, bq, work), stream)
    kernel = get_kernel(version, head_dim, kind, block_size, stages, prefetch)
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, part_o, part_lse, work,
            num_heads, num_kv_heads, np.float32(scale))
    nbytes = smem_bytes(version, head_dim, stages)
    bridge.allow_dynamic_smem(kernel, args, nbytes)
    launch_kernel(kernel, grid, THREADS, args, stream, nbytes)
    if splits > 1:
        words = total_q * num_heads * head_dim // 2
        launch_kernel(get_merge(kind), (words + MERGE_THREADS - 1) // MERGE_THREADS, MERGE_THREADS,
                      (part_o, part_lse, out, head_dim, splits), stream)


# ----------------------------------------------------------------------------------------
# torch entry point


def _words(name, t):
    """1-D uint32 view of a contiguous fp16/bf16 tensor, 16-byte aligned (for 16-byte copies)."""
    if t.data_ptr() % 16 != 0:
        raise KernelLaunchError(f"{name} must be 16-byte aligned")
    return bridge.words(t)


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                  validate=False, max_context_len=None, splits=None, stages=None, plans=None, short_prompts=None):
    """Causal prefill attention over the paged pool (new K/V already written): VERSION, the engine's kernel.

    q: [total_q, num_heads, head_dim] float16/bfloat16, the chunks of num_seqs sequences packed
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim], q's dtype, contiguous
    block_tables: [num_seqs, max_blocks] int32 (entries past a sequence's end are never read)
    cu_seqlens_q: [num_seqs + 1] int32, sequence s owns q[cu[s]:cu[s+1]] (each >= 1 token)
    context_lens: [num_seqs] int32, tokens in the pool for s after the write (prefix + chunk)
    scale: softmax scale (default 1/sqrt(head_dim)); out: optional [total_q, num_heads, head_dim]
    validate: also check the metadata values on the host (one sync; skipped inside CUDA-graph
        capture). Off by default.
    max_context_len: an upper bound of context_lens for the split plan (default max_blocks * block_size)
    splits: force the number of KV parts (tests); None: split_plan
    stages: override the ring's number of stages (2; bench sweeps, tests)
    plans: a dict that lives as long as one step's metadata (pagedattn's AttentionMetadata.prefill_plans):
        the first launch of the step stores its work list there, the step's later launches (its other
        layers) reuse it instead of launching the plan kernel again. Never share one across steps.
    short_prompts: run v9 where short_plan says so (default SHORT_PROMPTS)
    Returns out [total_q, num_heads, head_dim] in q's dtype. Runs on torch's current stream; with
    validate=False (or while capturing) there is no host sync.
    """
    version = VERSION
    if SHORT_PROMPTS if short_prompts is None else short_prompts:
        version = choose_version(q, k_cache, block_tables, context_lens, max_context_len, splits)
    return launch_torch(version, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, validate,
                        max_context_len, splits, stages, plans)


def choose_version(q, k_cache, block_tables, context_lens, max_context_len=None, splits=None):
    """9 where short_plan picks v9 for this launch (from shapes and max_context_len: no host sync), else VERSION."""
    if splits not in (None, 1) or q.dim() != 3 or k_cache.dim() != 4 or q.shape[1] % k_cache.shape[1]:
        return VERSION  # launch_torch reports what is wrong
    total_q, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    if head_dim not in HEAD_DIMS or num_heads // num_kv_heads > tile_rows(9, head_dim):
        return VERSION
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    ctas = num_tiles_bound(total_q, context_lens.shape[0], num_heads // num_kv_heads, 9, head_dim) * num_kv_heads
    return 9 if short_plan(ctas, max_context_len, bridge.num_sms(q.device), head_dim) else VERSION


def launch_torch(version, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                 validate=False, max_context_len=None, splits=None, stages=None, plans=None, ctas=None,
                 prefetch=None):
    """The kernel of `version` (KERNEL_VERSIONS) on torch tensors: paged_prefill's arguments after
    the version. paged_prefill runs VERSION; the journey (prefill_journey.py) runs the others here.
    ctas: v9's CTAs per KV head (persistent_grid); prefetch: v9's PREFETCH placement (tests, bench sweeps)."""
    out, group = check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, HEAD_DIMS, BLOCK_SIZES)
    total_q, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    if version not in KERNEL_VERSIONS:
        raise KernelLaunchError(f"version must be one of {list(KERNEL_VERSIONS)}, got {version!r}")
    version_config(version, head_dim, stages, prefetch)  # KernelLaunchError for overrides the version lacks
    if group > tile_rows(version, head_dim):
        raise KernelLaunchError(f"GQA group {group} must be <= {tile_rows(version, head_dim)} rows for v{version}")
    if validate and not bridge.capturing():
        check_values(block_tables, cu_seqlens_q, context_lens, total_q, num_blocks, block_size)
    if total_q == 0 or num_seqs == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if splits is None:
        splits = 1
        if version in SPLITS_KV:
            ctas_needed = num_tiles_bound(total_q, num_seqs, group, version, head_dim) * num_kv_heads
            splits = split_plan(ctas_needed, max_context_len, bridge.num_sms(q.device),
                                version_config(version, head_dim).bn)
    elif version not in SPLITS_KV and splits != 1:
        raise KernelLaunchError(f"splits={splits}: only v{SPLITS_KV} split the KV range")
    rows = total_q * num_heads
    part_o = torch.empty(splits * rows * head_dim if splits > 1 else 1, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(splits * rows if splits > 1 else 1, dtype=torch.float32, device=q.device)
    work, planned = work_list(plans, version, cu_seqlens_q, total_q, num_seqs, group, head_dim, q.device)
    q_c = q.contiguous()
    if q_c.data_ptr() % 16:
        q_c = q_c.clone()
    target = out if out.is_contiguous() and out.data_ptr() % 16 == 0 else torch.empty_like(q_c)
    # torch tensors go to the kernels as they are (kernels_numba.launcher passes them as numba arrays)
    launch(version, _words("q", q_c), _words("k_cache", k_cache), _words("v_cache", v_cache),
           block_tables.contiguous(), cu_seqlens_q.contiguous(), context_lens.contiguous(), _words("out", target),
           part_o, part_lse, work, num_heads, num_kv_heads, head_dim, block_size, scale, DTYPES[q.dtype], splits,
           bridge.torch_stream(q.device), stages, planned, bridge.num_sms(q.device), ctas, prefetch)
    if target is not out:
        out.copy_(target)
    return out


def work_list(plans, version, cu_seqlens_q, total_q, num_seqs, group, head_dim, device):
    """(work, planned): the int32 work list's space for a launch of `version`, and whether it already holds
    the plan (an earlier launch of the same step built it: plans[key], keyed on what the plan depends on,
    the cu_seqlens_q tensor, the tile's queries and the sizes, and on whether a CUDA graph is being
    captured: a plan written outside a capture is not one a graph's replay would rebuild, and one written
    inside it holds nothing until the graph replays)."""
    words = plan_words(total_q, num_seqs, group, version, head_dim)
    if plans is None or version not in PLANNED:
        return torch.empty(words, dtype=torch.int32, device=device), False
    key = ("work", cu_seqlens_q.data_ptr(), str(device), tile_rows(version, head_dim) // group, total_q,
           num_seqs, bridge.capturing())
    if key in plans:
        return plans[key], True
    work = plans[key] = torch.empty(words, dtype=torch.int32, device=device)
    return work, False
