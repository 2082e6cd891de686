"""Paged prefill: the kernel the engine runs (v7, the FlashAttention-2 structure), its plan and merge
kernels, its launch plan and the torch entry point.

Contract: q [total_q, H, D] packs the chunks of num_seqs sequences (cu_seqlens_q); their K/V are
already in the pool; query i of a chunk of q_len sits at position context_len - q_len + i and sees
positions 0..that position (the cached prefix and its own chunk). Unused pool slots may hold anything
(NaN in the tests): no position at or past context_len is ever read.

v7 is the journey's v6 (prefill_journey_fa2.py: v4's cp.async ring of swizzled K/V tiles and
ldmatrix fragments, v5's 128 rows per CTA, v6's split-KV) with a work list written by a one-CTA plan
kernel and 128 rows per CTA at both head dims; it stands here on its own, its pieces (the copies, the
mma step, the online softmax, the epilogue) from prefill_parts.py:

Rows. A CTA owns BM = 128 rows = (query, head-in-group) pairs of one sequence and KV head g: row r
is query q0 + r // G of head g * G + r % G (G = num_heads / num_kv_heads), so a K/V tile is read
from the pool once for all G heads (G = 7: 18 queries x 7 heads = 126 of 128 rows). Warp w owns
rows 16 (2 w + mt) .. + 15 for its two m-tiles mt: every K/V fragment read from shared memory feeds
two mma. Rows past the chunk are computed (as the chunk's last position: finite) and never stored.
Q stays in shared memory past the ring and its fragments are re-read by ldmatrix at every tile (its
32 registers would not fit beside O and S).

Tiles. KV tiles of 64 keys at d=64, 32 at d=128 (128 rows x 32 keys keep S at 32 registers beside
O's 128). O is held in two halves (dims 0 .. D/2 - 1, D/2 .. D - 1) so the compiler unrolls every
loop over it; row positions are int32; at d=64 Q's rows are stepped, not divided.

Grid. (tiles x num_kv_heads, 1, splits): tiles is an upper bound of sum_s ceil(q_len_s / BQ),
BQ = BM // G (no host sync to size it). CTA x takes KV head x % num_kv_heads and the work list's
item x // num_kv_heads: two words, (sequence, q tile). The plan kernel (one CTA, before the attention
kernel) writes the list in rank-major order: first every sequence's last tile (its last queries see
the most keys), then every sequence's tile before it, and so on, within a rank the sequences with
more tiles first. Blocks are dispatched in x order, so the heaviest CTAs start first and the light
ones fill the SMs at the end (longest-processing-time-first), across heads and sequences. A step's
later launches (its other layers) reuse the first one's work list (paged_prefill's plans=).

Split-KV. When the grid is short (fewer CTAs than SMs, e.g. a short chunk behind a long prefix:
split_plan), the KV range of each tile is cut into gridDim.z parts; each part's CTA writes a
normalised fp32 partial and its log2-sum-exp, and the merge kernel combines them. The batch-invariant
mode cuts by position instead (part_keys: parts of a fixed number of keys from position 0, as many as
the longest context needs), so that a query's keys fall in the same parts in a prompt, a chunk and a
decode, whatever else the launch holds.

Pipeline per CTA (ST = 2 stages of [K tile | V tile], dynamic shared memory, then the Q tile):
    Q tile -> past the ring by cp.async (zeros for rows past the chunk), commit
    tiles 0 .. ST-2 -> stages 0 .. ST-2, one commit group each
    for each KV tile j: wait for tile j (cp.async.wait_group ST-2), barrier (every thread's
        copies of j have landed and every warp is done with tile j - 1), issue tile j + ST - 1
        into the stage tile j - 1 used, then S = Q K^T, mask (diagonal tiles only), online
        softmax, O += P V on stage j
    O / l -> shared (packed) -> 16-byte coalesced stores (split: fp32 partials + lse)
A tile's rows at or past the CTA's last visible position are zero-filled by ordinary shared
stores, never copied: the pool's unused slots are not read and stale shared memory (which the
simulator poisons with NaN) never reaches P V (0 * NaN would be NaN). The shared layout, the
fragments and the softmax are prefill_parts.py's (its header).

Occupancy: 2 CTAs of 128 threads per SM (launch bounds: <= 255 registers). d=64: 48 KB of dynamic
shared memory (2 stages of 64-key K and V tiles, 16 KB of Q), no spills. d=128: 64 KB (2 stages of
32-key tiles, 32 KB of Q), 255 registers and ~40 bytes of spills (ptxas).

Supported: fp16 and bf16, head_dim 64 and 128, block_size 8/16/32, any GQA group G <= 128 (MHA
included).

Entry points (this file stands alone: the journey's versions are in prefill_journey_fa2.py, and
prefill_journey.py numbers every version):
    paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                  validate=False, max_context_len=None, splits=None, stages=None, plans=None, warps=4,
                  part_keys=None)   torch tensors; plans: a step's dict of work lists (built by its first
                                    layer, reused by the others)
    launch(q, k_cache, ...)         raw-bit numba device arrays, or numpy under the simulator
"""
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32

from kernels_numba import bridge, common
from kernels_numba.common import cp_async_commit, cp_async_wait, ex2
from kernels_numba.errors import KernelLaunchError
from kernels_numba.launcher import launch as launch_kernel
from kernels_numba.prefill_parts import (BN, LAUNCH_BOUNDS, LOG2E, NEG_INF, SMEM_ALIGN, THREADS, make_copies,
                                         make_epilogue, make_poison, make_tile_math, prepare)

BM = 128  # (query, head) rows per CTA: 4 warps x 2 m-tiles of 16
MT = 2  # m-tiles per warp
BN_D128 = 32  # keys per KV tile at d=128: 128 rows x 32 keys keep S in 32 registers beside O's 128
STAGES = 2  # the ring's stages of [K tile | V tile]
WARPS = 4  # warps per CTA; the one-warp CTA (16 rows) serves one-query chunks (rows_per_cta)


def rows_per_cta(warps=WARPS):
    """(query, head) rows a CTA of `warps` warps owns: 4 warps x 2 m-tiles (BM), or one warp's one m-tile.
    Each row's arithmetic is the same in both (a row's scores, softmax and P V never meet another row's):
    a one-query chunk of 7 heads in the one-warp CTA gets the bits it gets in the 128-row one, for an
    eighth of the mma work and 4x fewer threads (the batch-invariant mode's decodes)."""
    return 16 * (MT if warps > 1 else 1) * warps


def tile_keys(head_dim):
    """Keys per KV tile: BN (64) at d=64, BN_D128 (32) at d=128."""
    return BN_D128 if head_dim == 128 else BN


def smem_bytes(head_dim, stages=STAGES, warps=WARPS):
    """Dynamic shared memory of one CTA: `stages` stages of a K and a V tile, then the Q tile."""
    return stages * 2 * tile_keys(head_dim) * head_dim * 2 + rows_per_cta(warps) * head_dim * 2


# ----------------------------------------------------------------------------------------
# The kernels


@bridge.disk_cached
@lru_cache(maxsize=None)
def make_prefill_kernel(head_dim, kind, block_size, stages=STAGES, warps=WARPS):
    """The attention kernel for one (head_dim, "f16" | "bf16", block_size), ring depth and CTA size (4 warps
    of 2 m-tiles, or one warp of one: rows_per_cta)."""
    D, BS, ST = head_dim, block_size, stages
    MT_ = MT if warps > 1 else 1
    BM_, THREADS_ = rows_per_cta(warps), 32 * warps
    BN_ = tile_keys(D)
    W = D // 2  # words (pairs of halves) per row
    NT = BN_ // 8  # n-tiles of S per m-tile
    KS = D // 16  # k-steps of S = Q K^T
    DH = D // 16  # O's d-tiles in each half
    STAGE = 2 * BN_ * W  # words of a stage: K tile, then V tile
    RING = ST * STAGE  # the Q tile follows the ring; O is staged at the start of shared memory
    SMEM_WORDS = RING + BM_ * W
    copy_roles, tile_range, issue_q, issue_tile = make_copies(D, BS, BM_, BN_, step_rows=D == 64, threads=THREADS_)
    tile_math = make_tile_math(D, kind, MT_, BN_, True)  # Q's fragments re-read from shared memory at every tile
    start_rows, scores, mask, softmax, accumulate = (tile_math.start_rows, tile_math.scores, tile_math.mask,
                                                     tile_math.softmax, tile_math.accumulate)
    empty_part, row_sums, store_out, store_partials = make_epilogue(D, kind, MT_, threads=THREADS_)
    poison = make_poison(THREADS_)
    wait_tile = cp_async_wait(ST - 2)  # tile j done, tiles j+1 .. j+ST-2 may pend
    jit_options = {} if bridge.SIMULATOR else {"launch_bounds": (THREADS_, 2 * WARPS // warps)}

    @cuda.jit(**jit_options)
    def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, part_o, part_lse,
                                work, num_heads, num_kv_heads, scale, part_tiles):
        # q, out: flat uint32 views of [total_q, num_heads, D]; k_cache, v_cache: flat uint32
        # views of [num_blocks, num_kv_heads, BS, D]; block_tables [num_seqs, max_blocks],
        # cu_seqlens_q [num_seqs + 1], context_lens [num_seqs] int32; part_o float32
        # [splits, total_q * num_heads, D] and part_lse float32 [splits, total_q * num_heads]
        # (used when gridDim.z > 1); work int32 [3 * gridDim.x / num_kv_heads], the plan's work
        # list; scale float32; part_tiles: KV tiles per part of a split (0: gridDim.z equal parts).
        ring = cuda.shared.array(0, uint32, alignment=SMEM_ALIGN)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        fg = lane >> 2  # fragment row group
        ft = lane & 3  # fragment column pair
        split = cuda.blockIdx.z
        num_splits = cuda.gridDim.z
        group = num_heads // num_kv_heads
        bq = BM_ // group  # queries per tile
        rows_used = bq * group

        # ---- which (sequence, q tile, KV head): two loads from the plan's work list, heads interleaved
        head = cuda.blockIdx.x % num_kv_heads
        item = cuda.blockIdx.x // num_kv_heads
        bound = work.shape[0] // 3  # items in the work list: the grid's x // num_kv_heads
        s = work[item]
        tile = work[bound + item]
        if s < 0:
            return  # past the last tile: the grid is an upper bound
        total_rows = q.shape[0] // W  # total_q * num_heads
        chunk, row0, tdst, tsrc = copy_roles(tid, head)
        block_words = num_kv_heads * BS * W
        pos = cuda.local.array((MT_, 2), np.int32)  # the positions of this lane's rows
        qa = cuda.local.array((MT_, KS, 4), uint32)  # Q fragments, re-read at every tile
        sc = cuda.local.array((MT_, NT, 4), float32)  # S, then P, of this tile
        oa = cuda.local.array((MT_, DH, 4), float32)  # O's first half of dims ...
        ob = cuda.local.array((MT_, DH, 4), float32)  # ... and its second
        m = cuda.local.array((MT_, 2), float32)  # running max per row (raw score units)
        lsum = cuda.local.array((MT_, 2), float32)  # this lane's part of the row sums
        lrow = (lane & 7) + ((lane >> 3) & 1) * 8  # ldmatrix row of Q this lane addresses
        sl = scale * float32(LOG2E)

        # ---- the tile's queries (chunk at q_start, its query 0 at first_pos, the tile's first q0; keys below
        # kv_end visible to some row, below unmasked_end to all), this split's KV tiles [t_lo, t_hi)
        q_start, q_len, first_pos, q0, kv_end, unmasked_end, t_lo, t_hi = tile_range(cu_seqlens_q, context_lens, s,
                                                                                     tile, bq, split, num_splits,
                                                                                     part_tiles)
        if t_lo >= t_hi:  # an empty part of a split tile: nothing to add to the merge
            empty_part(part_lse, tid, split, total_rows, q_start, q_len, q0, head, num_heads, group, rows_used)
            return
        kv_stop = min(kv_end, t_hi * BN_)

        poison(ring, SMEM_WORDS, tid)  # the simulator: NaN in every word first (a read of an unwritten one shows)
        # ---- Q tile past the ring (rows past the chunk: zeros), then tiles t_lo .. t_lo + ST - 2
        issue_q(ring, RING, q, q_start, q_len, q0, head, num_heads, group, rows_used, row0, chunk)
        cp_async_commit()
        for k in range(ST - 1):
            if t_lo + k < t_hi:
                issue_tile(ring, k * STAGE, k_cache, v_cache, block_tables, s, block_words, (t_lo + k) * BN_, kv_stop,
                           row0, tdst, tsrc)
            cp_async_commit()

        start_rows(pos, m, lsum, oa, ob, warp, fg, q0, group, rows_used, q_len, first_pos, kv_end)
        qrow = RING + (warp * MT_ * 16 + lrow) * W  # + 16 W mt: this lane's ldmatrix row of Q
        read = 0  # word offset of tile j's stage
        write = (ST - 1) * STAGE  # ... and of the stage tile j + ST - 1 goes to
        for j in range(t_lo, t_hi):
            wait_tile()
            cuda.syncthreads()
            if j + ST - 1 < t_hi:
                issue_tile(ring, write, k_cache, v_cache, block_tables, s, block_words, (j + ST - 1) * BN_, kv_stop,
                           row0, tdst, tsrc)
            cp_async_commit()
            n0 = j * BN_
            scores(sc, qa, ring, read, qrow, lane)
            if n0 + BN_ > unmasked_end:  # the causal mask, only where some key is past some row's position
                mask(sc, pos, n0, ft)
            softmax(sc, m, lsum, oa, ob, sl)
            accumulate(oa, ob, sc, ring, read, lane)
            write = read
            read += STAGE
            if read == RING:
                read = 0

        # ---- full row sums; O / l through shared memory, or this part's partials
        row_sums(lsum)
        if num_splits == 1:
            store_out(ring, 0, out, oa, ob, lsum, warp, lane, row0, chunk, q_start, q_len, q0, head, num_heads, group,
                      rows_used)
        else:
            store_partials(part_o, part_lse, oa, ob, lsum, m, sl, warp, lane, split, total_rows, q_start, q_len, q0,
                           head, num_heads, group, rows_used)

    return paged_prefill_attention


MERGE_THREADS = 128


@bridge.disk_cached
@lru_cache(maxsize=None)
def make_merge_kernel(kind):
    """O[row] = sum_p 2^(lse_p - lse) O_p over the parts p of a split row (lse = log2 sum 2^lse_p)."""
    pack = common.f32x2_to_bf16x2 if kind == "bf16" else common.f32x2_to_f16x2

    @cuda.jit
    def merge_prefill_splits(part_o, part_lse, out, head_dim, num_splits):
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
                wgt = float32(1.0) if lse == mx else ex2(lse - mx)  # a row's one part: exactly its O
                total += wgt
                a0 += wgt * part_o[(p * rows + row) * head_dim + 2 * w]
                a1 += wgt * part_o[(p * rows + row) * head_dim + 2 * w + 1]
        out[row * w_per_row + w] = pack(a0 / total, a1 / total)

    return merge_prefill_splits


PLAN_THREADS = 256
PLAN_SEQS = 4096  # sequences whose tile counts the plan keeps in shared memory (more: recomputed)


@bridge.disk_cached
@lru_cache(maxsize=None)
def make_plan_kernel():
    """The work list: item i of the attention grid (x // num_kv_heads) -> (sequence, q tile), rank-major
    (rank k: every sequence's tile n_s - 1 - k) with each rank's sequences by falling tile count, written
    once per launch (or step) by one CTA so that no attention CTA searches.

    Item (s, rank k) (s's tile n_s - 1 - k) sits at C(k) + p(s): C(k) = sum_s min(n_s, k) items
    come before rank k, and p(s), s's place among the sequences sorted by falling n_s (ties by
    index), is its place among the n_s > k sequences of rank k (they come first in that order)."""

    @cuda.jit
    def plan_work_list(cu_seqlens_q, bq, work):
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

    return plan_work_list


# ----------------------------------------------------------------------------------------
# Launch plan

MAX_SPLITS = 16
MIN_TILES_PER_SPLIT = 4  # 256 keys: shorter parts cost more in partials and merge than they gain


def num_tiles_bound(total_q, num_seqs, bq):
    """Grid x per KV head (the work list's items): an upper bound of sum_s ceil(q_len_s / bq), bq queries
    per tile, that needs no host sync."""
    return (total_q + bq - 1) // bq + num_seqs


def split_plan(num_ctas, max_context_len, num_sms, bn=BN):
    """KV parts per q tile. 1 while the grid covers every SM; otherwise as many parts as fit one wave
    of resident CTAs (LAUNCH_BOUNDS[1] per SM: a second, partial wave would cost a whole part's time),
    each at least MIN_TILES_PER_SPLIT tiles of 64 keys long, at most MAX_SPLITS. bn: the kernel's keys
    per KV tile (d=128: 32)."""
    if num_ctas >= num_sms:
        return 1
    fit = LAUNCH_BOUNDS[1] * num_sms // num_ctas
    longest = -(-max_context_len // BN) // MIN_TILES_PER_SPLIT
    longest = min(longest, -(-max_context_len // bn))  # a part has at least one of the kernel's tiles
    return max(1, min(fit, MAX_SPLITS, longest))


def work_list(plans, cu_seqlens_q, total_q, num_seqs, bq, device):
    """(work, planned): the int32 work list's space for a launch of bq queries per tile, and whether it
    already holds the plan (an earlier launch of the same step built it: plans[key], keyed on what the
    plan depends on, the cu_seqlens_q tensor, the tile's queries and the sizes, and on whether a CUDA
    graph is being captured: a plan written outside a capture is not one a graph's replay would rebuild,
    and one written inside it holds nothing until the graph replays)."""
    import torch

    words = 3 * num_tiles_bound(total_q, num_seqs, bq)
    if plans is None:
        return torch.empty(words, dtype=torch.int32, device=device), False
    key = ("work", cu_seqlens_q.data_ptr(), str(device), bq, total_q, num_seqs, bridge.capturing())
    if key in plans:
        return plans[key], True
    work = plans[key] = torch.empty(words, dtype=torch.int32, device=device)
    return work, False


def launch_plan(cu_seqlens_q, bq, work, stream):
    """The plan kernel: the work list of tiles of bq queries into work (int32 [3 * bound])."""
    launch_kernel(make_plan_kernel(), 1, PLAN_THREADS, (cu_seqlens_q, bq, work), stream)


def launch_attention(kernel, grid, args, nbytes, stream, threads=THREADS):
    """An attention kernel of `threads` threads and nbytes of dynamic shared memory (opted in past 48 KB)."""
    bridge.allow_dynamic_smem(kernel, args, nbytes)
    launch_kernel(kernel, grid, threads, args, stream, nbytes)


def launch_merge(part_o, part_lse, out, total_q, num_heads, head_dim, kind, splits, stream):
    """The merge kernel over a split launch's partials into out (uint32 words)."""
    words = total_q * num_heads * head_dim // 2
    launch_kernel(make_merge_kernel(kind), (words + MERGE_THREADS - 1) // MERGE_THREADS, MERGE_THREADS,
                  (part_o, part_lse, out, head_dim, splits), stream)


def launch(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, part_o, part_lse, work, num_heads,
           num_kv_heads, head_dim, block_size, scale, kind, splits=1, stream=0, stages=None, planned=False,
           warps=WARPS, part_tiles=0):
    """Launch on raw arrays, no checks: the plan kernel, then attention, then the merge of a split.

    q, out: 1-D uint32 views of [total_q, num_heads, head_dim], 16-byte aligned
    k_cache, v_cache: 1-D uint32 views of [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables [num_seqs, max_blocks], cu_seqlens_q [num_seqs + 1], context_lens [num_seqs]: int32
    part_o: float32 [splits * total_q * num_heads * head_dim], part_lse: float32
        [splits * total_q * num_heads] (any 1-element arrays when splits == 1)
    work: int32 [3 * num_tiles_bound(total_q, num_seqs, rows_per_cta(warps) // group)]: the work list's space
    planned: `work` already holds this launch's work list (the plan of the same cu_seqlens_q and sizes,
        built by an earlier launch of the step): the plan kernel is not launched again
    warps: the CTA's warps (4; 1: the one-warp CTA of 16 rows, rows_per_cta)
    part_tiles: KV tiles per part of a split, parts fixed by position (0: a tile's keys in `splits` equal parts)
    numba device arrays or contiguous torch tensors of those dtypes (numpy in the simulator).
    """
    total_q = q.shape[0] // (num_heads * head_dim // 2)
    num_seqs = context_lens.shape[0]
    if total_q == 0 or num_seqs == 0:
        return
    bq = rows_per_cta(warps) // (num_heads // num_kv_heads)
    if not planned:
        launch_plan(cu_seqlens_q, bq, work, stream)
    stages = STAGES if stages is None else stages
    kernel = make_prefill_kernel(head_dim, kind, block_size, stages, warps)
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, part_o, part_lse, work, num_heads,
            num_kv_heads, np.float32(scale), np.int32(part_tiles))
    grid = (num_tiles_bound(total_q, num_seqs, bq) * num_kv_heads, 1, splits)
    launch_attention(kernel, grid, args, smem_bytes(head_dim, stages, warps), stream, 32 * warps)
    if splits > 1:
        launch_merge(part_o, part_lse, out, total_q, num_heads, head_dim, kind, splits, stream)


# ----------------------------------------------------------------------------------------
# torch entry point


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                  validate=False, max_context_len=None, splits=None, stages=None, plans=None, warps=WARPS,
                  part_keys=None):
    """Causal prefill attention over the paged pool (new K/V already written): the engine's kernel.

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
    warps: 4, or 1 for CTAs of one warp and 16 rows (chunks of one or two queries: each row the same bits
        as in the 4-warp CTA; rows_per_cta)
    part_keys: KV parts of this many keys from position 0 (a multiple of the kernel's tile_keys), as many as
        max_context_len needs, whatever the launch: a row's keys are summed in the same parts, each in the
        same tiles, and merged in the same order in every launch it is in (the batch-invariant mode; a row
        of one part gets that part's O exactly, merged or not). None: split_plan's count (or `splits`).
    Returns out [total_q, num_heads, head_dim] in q's dtype. Runs on torch's current stream; with
    validate=False (or while capturing) there is no host sync.
    """
    a, out = prepare(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, validate,
                     max_context_len, rows_per_cta(warps))
    if a is None:
        return out
    bq = rows_per_cta(warps) // a.group
    part_tiles = 0
    if part_keys is not None:
        if splits is not None or part_keys <= 0 or part_keys % tile_keys(a.head_dim):
            raise KernelLaunchError(f"part_keys must be a positive multiple of {tile_keys(a.head_dim)} (the "
                                    f"kernel's keys per tile at head_dim {a.head_dim}) and excludes splits; got "
                                    f"part_keys={part_keys}, splits={splits}")
        part_tiles = part_keys // tile_keys(a.head_dim)
        splits = max(1, -(-a.max_context_len // part_keys))
    if splits is None:
        ctas = num_tiles_bound(a.total_q, a.num_seqs, bq) * a.num_kv_heads
        splits = split_plan(ctas, a.max_context_len, a.num_sms, tile_keys(a.head_dim))
    part_o, part_lse = a.partials(splits)
    work, planned = work_list(plans, cu_seqlens_q, a.total_q, a.num_seqs, bq, q.device)
    launch(a.q, a.k, a.v, a.block_tables, a.cu_seqlens_q, a.context_lens, a.out_words, part_o, part_lse, work,
           a.num_heads, a.num_kv_heads, a.head_dim, a.block_size, a.scale, a.kind, splits, a.stream, stages, planned,
           warps, part_tiles)
    return a.finish()
