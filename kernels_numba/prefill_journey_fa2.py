"""Paged prefill v4-v9: the FlashAttention-2 structure in numba, one version at a time.

Same contract as the journey's first era, paged_prefill.py (v1-v3): q [total_q, H, D] packs the chunks
of num_seqs sequences (cu_seqlens_q); their K/V are already in the pool; query i of a chunk of
q_len sits at position context_len - q_len + i and sees positions 0..that position. The kernel the
engine runs, v7, stands alone in paged_prefill_fa2.py (its plan and merge kernels, split plan and work
lists are used here too); every version here is built from the same pieces (prefill_parts.py: the
cp.async copies, the mma step, the online softmax, the epilogue) by one builder, make_kernel, whose
switches are the versions' differences (version_config).

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
        The engine's kernel: paged_prefill_fa2.py (the entry 7 of prefill_journey.VERSIONS).
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

What differs from v7's design (paged_prefill_fa2.py's header has the rows, the pipeline and the split):
    Tiles. v4: 64 rows per CTA (one m-tile per warp); v5, v6: 128 rows at d=64, 64 at d=128 (two
        m-tiles of 64-key tiles need more than 255 registers there: O alone is 128, S 64); KV tiles of
        64 keys at both head dims; int64 row positions.
    Grid. v4-v6: CTA x takes the (x // num_kv_heads)-th (sequence, q tile) in the same rank-major
        order, found by each CTA itself (find_tile: a binary search over ranks, O(num_seqs log tiles)).
    Q. v4: the Q tile goes to the ring's last stage, and after its wait and a barrier its fragments
        go to registers by ldmatrix.x4, held for the whole loop; from v5 on Q has its own region past
        the ring and its fragments are re-read per tile.
    v9: a second Q region; O is staged in this item's Q tile (the ring holds the next item's tile).

Entry points (every version here takes paged_prefill_fa2.paged_prefill's arguments; prefill_journey.py
numbers them with the first era's and the shipped one):
    launch_torch(version, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None,
                 out=None, validate=False, max_context_len=None, splits=None, stages=None, plans=None,
                 ctas=None, prefetch=None)
                                    v4, v5, v6, v8, v9 on torch tensors (VERSIONS: launch_vN)
    launch(version, q, ...)         raw-bit numba device arrays, or numpy under the simulator
    get_kernel(version, head_dim, kind, block_size, stages=None, prefetch=None)
                                    a version's kernel (7: the shipped one, for side-by-side codegen)
    choose_version(q, ...)          9 where short_plan would run v9 (for short prompts), else 7
"""
from functools import lru_cache, partial

import numpy as np
import torch
from numba import cuda, float32, uint32

from kernels_numba import bridge
from kernels_numba import paged_prefill_fa2 as shipped
from kernels_numba.common import cp_async16, cp_async_commit, cp_async_wait, ex2, inline_device, store_u32x4
from kernels_numba.errors import KernelLaunchError
from kernels_numba.prefill_parts import (BN, HEAD_DIMS, JIT_OPTIONS, LAUNCH_BOUNDS, LOG2E, NEG_INF, SMEM_ALIGN, THREADS,
                                         inline_math, make_copies, make_epilogue, make_tile_math, poison, prepare)

PRODUCTION_VERSION = 7  # the shipped kernel's place in the journey (paged_prefill_fa2.py)
SPLITS_KV = (6, 7, 8)  # the versions that split the KV range
PLANNED = (7, 8, 9)  # the versions whose CTAs read a work list (the plan kernel) instead of searching
PERSISTENT = (9,)  # the versions whose CTAs loop over the work list (a grid of at most one wave)
RESCALE_LOG2 = 8.0  # v8: the running max moves once a p would exceed 2^8 (fp16 holds 65504, bf16 more)
PREFETCH = ("tile", "epilogue")  # v9: where the next item's copies are issued (the first is the default)


class Config:
    """Compile-time shape of one version's kernel: MT m-tiles of 16 rows per warp, ST stages,
    Q's fragments held in registers or read from shared memory at every KV tile, bn keys per KV
    tile, and where a CTA finds its (sequence, q tile): find_tile's search (v4-v6) or the work
    list the plan kernel wrote before it (v7+)."""

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


def version_config(version, head_dim, stages=None, prefetch=None):
    """v4: 64 rows per CTA; v5, v6: 128 at d=64, 64 at d=128; v7 (the shipped kernel's shape): 128
    rows at both, d=128 with tiles of 32 keys, and the work list; v8: v7's shape with the block ids
    loaded a tile ahead and the lazy rescale; v9: v7's shape in a persistent loop over the work list
    (two Q buffers, 2 stages only). stages: override the ring's 2 stages (bench sweeps); prefetch: v9's
    PREFETCH placement (default the first)."""
    if version not in (4, 5, 6, 7, 8, 9):
        raise KernelLaunchError(f"version must be one of 4-9 (the FlashAttention-2 era), got {version!r}")
    stages = 2 if stages is None else stages
    if version == 9:
        if stages != 2:
            raise KernelLaunchError(f"v9 runs a ring of 2 stages (its prefetch across items), got stages={stages}")
        prefetch = PREFETCH[0] if prefetch is None else prefetch
        if prefetch not in PREFETCH:
            raise KernelLaunchError(f"prefetch must be one of {PREFETCH}, got {prefetch!r}")
        return Config(m_tiles=2, stages=2, q_in_smem=True, bn=shipped.tile_keys(head_dim), planned=True,
                      persistent=True, prefetch=prefetch)
    if prefetch is not None:
        raise KernelLaunchError(f"prefetch={prefetch!r}: only v9 prefetches across work items")
    if version in (7, 8):
        return Config(m_tiles=2, stages=stages, q_in_smem=True, bn=shipped.tile_keys(head_dim), planned=True,
                      ahead=version == 8)
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


# ----------------------------------------------------------------------------------------
# The versions' own pieces: v4-v6's search for a tile, v8's block ids ahead and lazy rescale,
# v9's next work item


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


@lru_cache(maxsize=None)
def make_blocks_ahead(head_dim, block_size, bn):
    """v8: (tile_blocks, issue_blocks), prefill_parts' issue_tile in two halves.

    tile_blocks(nb, block_tables, s, n0, kv_stop, row0): the pool block of each of this thread's copy
        passes of the tile at n0 (issue_tile's block, 0 where the pass copies nothing), all loaded at once
        and a tile before issue_blocks needs them: the loads' latency hides behind a tile of math instead
        of stalling the copies.
    issue_blocks(ring, dst0, k_cache, v_cache, nb, block_words, n0, kv_stop, row0, tdst, tsrc): issue_tile
        with the blocks tile_blocks loaded before."""
    W, BS = head_dim // 2, block_size
    RPP = THREADS // (head_dim // 8)
    PASSES = bn // RPP
    TILE = bn * W
    BS_SHIFT = BS.bit_length() - 1

    @inline_device
    def tile_blocks(nb, block_tables, s, n0, kv_stop, row0):
        rem = kv_stop - n0 - row0
        b0 = (n0 >> BS_SHIFT) + (row0 >> BS_SHIFT)
        for i in range(PASSES):
            nb[i] = block_tables[s, b0 + ((RPP * i) >> BS_SHIFT)] if RPP * i < rem else 0

    @inline_device
    def issue_blocks(ring, dst0, k_cache, v_cache, nb, block_words, n0, kv_stop, row0, tdst, tsrc):
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

    return tile_blocks, issue_blocks


@lru_cache(maxsize=None)
def make_lazy_softmax(head_dim, kind, m_tiles, bn):
    """v8: softmax_lazy(sc, m, lsum, oa, ob, tmax, sl), prefill_parts' softmax with a lazy rescale: the
    running max m moves only when some row of the warp would see a p above 2^RESCALE_LOG2 (or sees its
    first key); otherwise p = 2^((s - m) sl) <= 2^RESCALE_LOG2 with the old m and O, l need no rescale:
    O / l is the same for any m (fp16/bf16 P and fp32 sums hold 2^8 without loss). Warp-uniform (rows'
    flags OR-ed by shuffles), so the branch costs 3 shuffles a tile and skips MT * D / 2 multiplies most
    tiles. tmax (MT, 2) float32: the tile's row maxima."""
    MT, NT = m_tiles, bn // 8
    tile_math = make_tile_math(head_dim, kind, m_tiles, bn, True)
    probabilities, rescale = tile_math.probabilities, tile_math.rescale

    @inline_math
    def softmax_lazy(sc, m, lsum, oa, ob, tmax, sl):
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
                    rescale(oa, ob, mt, h, alpha)
        for mt in range(MT):
            for h in range(2):
                ms = m[mt, h] * sl if m[mt, h] != NEG_INF else float32(0.0)  # nothing seen: p = 0
                lsum[mt, h] += probabilities(sc, mt, h, ms, sl)

    return softmax_lazy


@inline_device
def item_index(rnd, first, per_round):
    """v9: the work-list item of a CTA's round rnd (first: its item in round 0; per_round: CTAs per KV
    head). Rounds run the list in a snake, forward then backward, so a CTA given one of a round's heaviest
    items gets one of the next round's lightest (the list falls in weight)."""
    return rnd * per_round + (first if rnd % 2 == 0 else per_round - 1 - first)


# ----------------------------------------------------------------------------------------
# The journey's kernel builder


@bridge.disk_cached
@lru_cache(maxsize=None)
def make_kernel(head_dim, kind, block_size, m_tiles, stages, q_in_smem, bn, planned, ahead, persistent, prefetch):
    """The kernel for one (head_dim, "f16" | "bf16", block_size) and Config (its key's fields)."""
    D, BS, MT, ST, Q_SMEM, BN_, PLANNED, AHEAD = head_dim, block_size, m_tiles, stages, q_in_smem, bn, planned, ahead
    PERSISTENT = persistent
    AT_TILE = prefetch == "tile"  # v9: the next item's copies at the last tile's start, else after its math
    # v9's prefetch of the next item: its Q into the other Q buffer, its first tile into the stage the last
    # tile's predecessor used (2 stages: the ring's only free one); the work list says what comes next
    assert not PERSISTENT or (ST == 2 and Q_SMEM and PLANNED and not AHEAD)
    BM = 64 * MT  # rows per CTA
    W = D // 2  # words (pairs of halves) per row
    PASSES = BN_ // (THREADS // (D // 8))  # copy passes per K (and V) tile
    NT = BN_ // 8  # n-tiles of S per m-tile
    KS = D // 16  # k-steps of S = Q K^T
    DH = D // 16  # O's d-tiles in each half
    POS_TYPE = np.int32 if PLANNED else np.int64  # a row's position
    STAGE = 2 * BN_ * W
    RING = ST * STAGE
    QW = BM * W  # words of a Q tile (and of a CTA's O tile)
    SMEM_WORDS = RING + (QW * (2 if PERSISTENT else 1) if Q_SMEM else 0)
    # Q (v4) goes to the ring's last stage; O is staged at the start of shared memory (v9: in the Q tile)
    assert BM * W <= (SMEM_WORDS if Q_SMEM else STAGE), "the Q and O tiles fit"
    # v7+ at d=64: Q's rows by steps, not divisions (at d=128 ptxas then spills more: 68 B, not 40)
    copy_roles, tile_range, issue_q, issue_tile = make_copies(D, BS, BM, BN_, step_rows=PLANNED and D == 64)
    tile_math = make_tile_math(D, kind, MT, BN_, Q_SMEM)
    start_rows, load_q, scores, mask, softmax, accumulate = (tile_math.start_rows, tile_math.load_q, tile_math.scores,
                                                             tile_math.mask, tile_math.softmax, tile_math.accumulate)
    empty_part, row_sums, store_out, store_partials = make_epilogue(D, kind, MT)
    tile_blocks, issue_blocks = make_blocks_ahead(D, BS, BN_)
    softmax_lazy = make_lazy_softmax(D, kind, MT, BN_)
    wait_q = cp_async_wait(ST - 1)  # Q's group done, the prologue's ST-1 tile groups may pend
    wait_tile = cp_async_wait(ST - 2)  # tile j done, tiles j+1 .. j+ST-2 may pend

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

    @cuda.jit(**JIT_OPTIONS)
    def kernel(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, part_o, part_lse, work,
               num_heads, num_kv_heads, scale):
        # the shipped kernel's arguments (paged_prefill_fa2.make_prefill_kernel); work: any 1-element
        # array before v7
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
        bound = work.shape[0] // 3  # v7+: items in the work list (v8: the grid's x // num_kv_heads)
        if PLANNED:  # two loads from the plan's work list
            s = work[item]
            tile = work[bound + item]
        else:
            s, tile = find_tile(item, cu_seqlens_q, context_lens.shape[0], bq)
        if s < 0:
            return  # past the last tile: the grid is an upper bound
        total_rows = q.shape[0] // W  # total_q * num_heads
        chunk, row0, tdst, tsrc = copy_roles(tid, head)
        block_words = num_kv_heads * BS * W
        nb = cuda.local.array(PASSES, np.int32)  # v8: the blocks of the next tile to issue
        pos = cuda.local.array((MT, 2), POS_TYPE)
        qa = cuda.local.array((MT, KS, 4), uint32)  # Q fragments (v4: held in registers)
        sc = cuda.local.array((MT, NT, 4), float32)  # S, then P, of this tile
        oa = cuda.local.array((MT, DH, 4), float32)  # O's two halves (prefill_parts.make_tile_math)
        ob = cuda.local.array((MT, DH, 4), float32)
        m = cuda.local.array((MT, 2), float32)
        lsum = cuda.local.array((MT, 2), float32)
        tmax = cuda.local.array((MT, 2), float32)  # v8: this tile's row maxima
        lrow = (lane & 7) + ((lane >> 3) & 1) * 8  # ldmatrix row of Q this lane addresses
        sl = scale * float32(LOG2E)

        read = 0  # word offset of tile j's stage
        write = (ST - 1) * STAGE  # ... and of the stage tile j + ST - 1 goes to
        rnd = 0  # v9: this CTA's round (its item is item_index(rnd, ...)); Q buffer rnd % 2
        while True:  # v9: one work item per pass, until the list ends; v4-v8: one pass
            # ---- the tile's queries, this split's KV tiles [t_lo, t_hi) (paged_prefill_fa2's kernel says more)
            q_start, q_len, first_pos, q0, kv_end, unmasked_end, t_lo, t_hi = tile_range(cu_seqlens_q, context_lens,
                                                                                         s, tile, bq, split, num_splits, 0)
            if t_lo >= t_hi:  # an empty part of a split tile: nothing to add to the merge
                empty_part(part_lse, tid, split, total_rows, q_start, q_len, q0, head, num_heads, group, rows_used)
                return
            kv_stop = min(kv_end, t_hi * BN_)
            # Q tile (v5+: past the ring; v9: buffer rnd % 2 there; v4: the last stage, its fragments go to
            # registers)
            qs = RING + (rnd % 2) * QW if PERSISTENT else (RING if Q_SMEM else (ST - 1) * STAGE)

            if rnd == 0:  # v9: later items' Q and first tile were copied during the item before
                poison(ring, SMEM_WORDS, tid)
                # ---- Q tile (rows past the chunk: zeros), then tiles t_lo .. t_lo + ST - 2
                issue_q(ring, qs, q, q_start, q_len, q0, head, num_heads, group, rows_used, row0, chunk)
                cp_async_commit()
                for k in range(ST - 1):
                    if t_lo + k < t_hi:
                        if AHEAD:
                            tile_blocks(nb, block_tables, s, (t_lo + k) * BN_, kv_stop, row0)
                            issue_blocks(ring, k * STAGE, k_cache, v_cache, nb, block_words, (t_lo + k) * BN_, kv_stop,
                                         row0, tdst, tsrc)
                        else:
                            issue_tile(ring, k * STAGE, k_cache, v_cache, block_tables, s, block_words,
                                       (t_lo + k) * BN_, kv_stop, row0, tdst, tsrc)
                    cp_async_commit()
                if AHEAD and t_lo + ST - 1 < t_hi:
                    tile_blocks(nb, block_tables, s, (t_lo + ST - 1) * BN_, kv_stop, row0)

            start_rows(pos, m, lsum, oa, ob, warp, fg, q0, group, rows_used, q_len, first_pos, kv_end)
            qrow = qs + (warp * MT * 16 + lrow) * W  # + 16 W mt: this lane's ldmatrix row of Q
            if not Q_SMEM:  # v4: Q's fragments into registers, once
                wait_q()
                cuda.syncthreads()
                load_q(qa, ring, qrow, lane, 0, KS)
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
                        issue_blocks(ring, write, k_cache, v_cache, nb, block_words, (j + ST - 1) * BN_, kv_stop, row0,
                                     tdst, tsrc)
                    else:
                        issue_tile(ring, write, k_cache, v_cache, block_tables, s, block_words, (j + ST - 1) * BN_,
                                   kv_stop, row0, tdst, tsrc)
                elif PERSISTENT and AT_TILE and s_n >= 0:
                    # v9, the item's last tile: the next item's Q into the other Q buffer and its first KV tile
                    # into the free stage, in flight during this tile's math and the epilogue
                    issue_next(ring, write, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, s_n,
                               tile_n * bq, RING + ((rnd + 1) % 2) * QW, head, num_heads, group, bq, rows_used,
                               block_words, row0, chunk, tdst, tsrc)
                cp_async_commit()
                if AHEAD and j + ST < t_hi:  # the blocks of the tile the next iteration issues
                    tile_blocks(nb, block_tables, s, (j + ST) * BN_, kv_stop, row0)
                n0 = j * BN_
                scores(sc, qa, ring, read, qrow, lane)
                if n0 + BN_ > unmasked_end:  # the causal mask, only where some key is past some row's position
                    mask(sc, pos, n0, ft)
                if AHEAD:
                    softmax_lazy(sc, m, lsum, oa, ob, tmax, sl)
                else:  # v4-v7: the max moves with every tile
                    softmax(sc, m, lsum, oa, ob, sl)
                accumulate(oa, ob, sc, ring, read, lane)
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

            # ---- full row sums; O / l (v9: staged in this item's Q tile, the next item's tile is in flight
            # into the ring), or this part's partials
            row_sums(lsum)
            if num_splits == 1:
                store_out(ring, qs if PERSISTENT else 0, out, oa, ob, lsum, warp, lane, row0, chunk, q_start, q_len, q0,
                          head, num_heads, group, rows_used)
            else:
                store_partials(part_o, part_lse, oa, ob, lsum, m, sl, warp, lane, split, total_rows, q_start, q_len,
                               q0, head, num_heads, group, rows_used)

            # ---- v9: the next item (its Q and first tile are in flight), or the end of the work list
            if not PERSISTENT:
                break
            if s_n < 0:
                break
            rnd += 1
            s = s_n
            tile = tile_n

    return kernel


def get_kernel(version, head_dim, kind, block_size, stages=None, prefetch=None):
    """The attention kernel of `version` for (head_dim, "f16" | "bf16", block_size), built once; 7: the
    shipped kernel (paged_prefill_fa2.make_prefill_kernel)."""
    cfg = version_config(version, head_dim, stages, prefetch)  # KernelLaunchError for overrides the version lacks
    if version == PRODUCTION_VERSION:
        return shipped.make_prefill_kernel(head_dim, kind, block_size, cfg.stages)
    return make_kernel(head_dim, kind, block_size, *cfg.key())


# ----------------------------------------------------------------------------------------
# v9's plan: where it would run (short prompts) and its grid

SHORT_CONTEXT = 1024  # predicted: v9 where no context is longer (docs/prefill.md, "v9", says why)


def short_plan(num_ctas, max_context_len, num_sms, head_dim=64):
    """Whether a launch of v7's shape should run as v9: its grid is more than one wave of resident CTAs
    (LAUNCH_BOUNDS[1] per SM: with fewer, each of v9's CTAs would run one item, as v7's do, and v7 may
    split the KV range) and no context is longer than SHORT_CONTEXT, so a work item is a few KV tiles and a
    CTA's fixed cost (the chain of dependent loads before its first tile, the epilogue) is a large part
    of an item's time: v9 hides part of it behind the item before. Longer items amortise it themselves,
    and v9's static order (item_index) balances them worse than the hardware's dispatch of v7's CTAs.
    head_dim 64 only: at 128, v9's item loop costs ptxas ~1.7 KB of spill reloads (v7: 64 bytes).
    Measured (docs/prefill.md, "v9"): v9 is slower than v7 at every shape, so the engine runs v7 always."""
    return head_dim == 64 and num_ctas > LAUNCH_BOUNDS[1] * num_sms and max_context_len <= SHORT_CONTEXT


def choose_version(q, k_cache, block_tables, context_lens, max_context_len=None, splits=None):
    """9 where short_plan picks v9 for this launch (from shapes and max_context_len: no host sync), else 7."""
    if splits not in (None, 1) or q.dim() != 3 or k_cache.dim() != 4 or q.shape[1] % k_cache.shape[1]:
        return PRODUCTION_VERSION  # the launch reports what is wrong
    total_q, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if head_dim not in HEAD_DIMS or group > tile_rows(9, head_dim):
        return PRODUCTION_VERSION
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    ctas = shipped.num_tiles_bound(total_q, context_lens.shape[0], tile_rows(9, head_dim) // group) * num_kv_heads
    return 9 if short_plan(ctas, max_context_len, bridge.num_sms(q.device), head_dim) else PRODUCTION_VERSION


def persistent_grid(items, num_kv_heads, num_sms, ctas=None):
    """v9's grid x: CTAs per KV head (at most the items; by default one wave of LAUNCH_BOUNDS[1] per SM
    over all heads; ctas: a test's or a bench's override) times num_kv_heads."""
    per_head = max(1, LAUNCH_BOUNDS[1] * num_sms // num_kv_heads) if ctas is None else ctas
    return min(items, per_head) * num_kv_heads


# ----------------------------------------------------------------------------------------
# Launches


def launch(version, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, part_o, part_lse, work,
           num_heads, num_kv_heads, head_dim, block_size, scale, kind, splits=1, stream=0, stages=None,
           planned=False, num_sms=None, ctas=None, prefetch=None):
    """Launch `version` on raw arrays, no checks: paged_prefill_fa2.launch's arguments after the version
    (v7+: the plan kernel, then attention, then the merge of a split), and
    work: int32 [3 * num_tiles_bound(...)] for the versions with a work list (PLANNED); any 1-element
        array before v7
    num_sms, ctas: v9's grid (persistent_grid); without num_sms one CTA per item (correct, not persistent)
    prefetch: v9's placement of the next item's copies (PREFETCH)."""
    total_q = q.shape[0] // (num_heads * head_dim // 2)
    num_seqs = context_lens.shape[0]
    if total_q == 0 or num_seqs == 0:
        return
    bq = tile_rows(version, head_dim) // (num_heads // num_kv_heads)
    items = shipped.num_tiles_bound(total_q, num_seqs, bq)
    if version in PERSISTENT and splits != 1:
        raise KernelLaunchError(f"v{version} does not split the KV range (splits={splits})")
    x = items * num_kv_heads
    if version in PERSISTENT and (num_sms is not None or ctas is not None):
        x = persistent_grid(items, num_kv_heads, num_sms or 1, ctas)
    if version in PLANNED and not planned:
        shipped.launch_plan(cu_seqlens_q, bq, work, stream)
    kernel = get_kernel(version, head_dim, kind, block_size, stages, prefetch)
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, part_o, part_lse, work,
            num_heads, num_kv_heads, np.float32(scale))
    if version == PRODUCTION_VERSION:
        args += (np.int32(0),)  # the shipped kernel's part_tiles: a split in equal parts
    shipped.launch_attention(kernel, (x, 1, splits), args, smem_bytes(version, head_dim, stages), stream)
    if splits > 1:
        shipped.launch_merge(part_o, part_lse, out, total_q, num_heads, head_dim, kind, splits, stream)


def launch_torch(version, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                 validate=False, max_context_len=None, splits=None, stages=None, plans=None, ctas=None,
                 prefetch=None):
    """The kernel of `version` (VERSIONS) on torch tensors: paged_prefill_fa2.paged_prefill's arguments
    after the version. ctas: v9's CTAs per KV head (persistent_grid); prefetch: v9's PREFETCH placement
    (tests, bench sweeps). Returns out."""
    if version not in VERSIONS:
        raise KernelLaunchError(f"version must be one of {sorted(VERSIONS)}, got {version!r} "
                                f"(v{PRODUCTION_VERSION}: paged_prefill_fa2.paged_prefill)")
    head_dim = q.shape[-1] if q.dim() else 0  # prepare checks q's shape
    version_config(version, head_dim, stages, prefetch)  # KernelLaunchError for overrides the version lacks
    rows = tile_rows(version, head_dim)
    a, out = prepare(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, validate,
                     max_context_len, rows)
    if a is None:
        return out
    bq = rows // a.group
    if splits is None:
        splits = 1
        if version in SPLITS_KV:
            ctas_needed = shipped.num_tiles_bound(a.total_q, a.num_seqs, bq) * a.num_kv_heads
            splits = shipped.split_plan(ctas_needed, a.max_context_len, a.num_sms,
                                        version_config(version, a.head_dim).bn)
    elif version not in SPLITS_KV and splits != 1:
        raise KernelLaunchError(f"splits={splits}: only v{SPLITS_KV} split the KV range")
    part_o, part_lse = a.partials(splits)
    if version in PLANNED:
        work, planned = shipped.work_list(plans, cu_seqlens_q, a.total_q, a.num_seqs, bq, q.device)
    else:
        work, planned = torch.empty(1, dtype=torch.int32, device=q.device), False
    launch(version, a.q, a.k, a.v, a.block_tables, a.cu_seqlens_q, a.context_lens, a.out_words, part_o, part_lse,
           work, a.num_heads, a.num_kv_heads, a.head_dim, a.block_size, a.scale, a.kind, splits, a.stream, stages,
           planned, a.num_sms, ctas, prefetch)
    return a.finish()


launch_v4 = partial(launch_torch, 4)
launch_v5 = partial(launch_torch, 5)
launch_v6 = partial(launch_torch, 6)
launch_v8 = partial(launch_torch, 8)
launch_v9 = partial(launch_torch, 9)
VERSIONS = {4: launch_v4, 5: launch_v5, 6: launch_v6, 8: launch_v8, 9: launch_v9}
