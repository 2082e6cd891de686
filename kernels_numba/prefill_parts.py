"""The pieces the prefill versions share, written once.

Host pieces of every version (the first era, paged_prefill.py, v1-v3; the shipped kernel,
paged_prefill_fa2.py, v7; the FlashAttention-2 journey, prefill_journey_fa2.py, v4-v6, v8, v9):

    HEAD_DIMS, BLOCK_SIZES, DTYPES   what the kernels support (DTYPES: torch dtype name -> kernel kind;
                                     kind_of(dtype) looks one up)
    check_args(...)                  shapes, dtypes, contiguity (KernelLaunchError naming the argument)
    check_values(...)                the metadata's values against each other and the pool (one sync)

The pieces of the FlashAttention-2 structure (v4+), which the shipped v7 and the journey's versions
are built from:

    THREADS, LAUNCH_BOUNDS, BN, ...  a CTA of 4 warps, 2 CTAs per SM, KV tiles of BN keys
    mma_f16, mma_bf16                the mma step (common's; under the simulator one vectorised over the warp)
    make_copies(...)                 a CTA's copies: which chunks a thread copies, a tile's queries and
                                     KV range, the Q tile and a K/V tile into the ring by cp.async
    poison(...)                      the simulator's NaN in shared memory before the copies
    make_tile_math(...)              a warp's math on one KV tile (TileMath): Q fragments, S = Q K^T, the
                                     causal mask, the online softmax, O += P V
    make_epilogue(...)               a warp's rows at the end: row sums, O / l stored (through shared
                                     memory) or a split's fp32 partials and log2-sum-exp
    prepare(...) -> Launch           the torch side of a launch: checks, word views, scale, out

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

The math pieces take the warp's register arrays (S, O, Q fragments, m, l) and are inlined by numba
(inline="always": the kernel's IR is the one written out by hand, and NVVM keeps every array in
registers); the copies take none and are inlined by NVVM (common.inline_device). Under
NUMBA_ENABLE_CUDASIM=1 they run in the simulator: cp.async copies at issue, and ldmatrix, mma and
the shuffles go through warp-collective fallbacks that follow the fragment layouts above element
by element.
"""
import math
from collections import namedtuple
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32

from kernels_numba import bridge, common
from kernels_numba.common import (cp_async16, ex2, inline_device, ldmatrix_x4, ldmatrix_x4_trans, load_u32x4, mul_rn,
                                  store_u32x4)
from kernels_numba.errors import KernelLaunchError

HEAD_DIMS = (64, 128)
BLOCK_SIZES = (8, 16, 32)
DTYPES = {"float16": "f16", "bfloat16": "bf16"}     # names: torch is imported where a launch needs it, so
                                                     # a compile worker imports this module without it


def kind_of(dtype):
    """The kernel kind of a torch dtype ("f16" / "bf16"); KeyError for any other."""
    return DTYPES[str(dtype).removeprefix("torch.")]


def check_values(block_tables, cu_seqlens_q, context_lens, total_q, num_blocks, block_size):
    """Metadata values against each other and the pool (one device->host sync)."""
    import torch

    cu, ctx = cu_seqlens_q.cpu().long(), context_lens.cpu().long()
    q_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total_q or bool((q_lens < 1).any()):
        raise KernelLaunchError(f"cu_seqlens_q must rise from 0 to total_q={total_q} by >= 1 per sequence")
    if bool((ctx < q_lens).any()):
        raise KernelLaunchError("context_lens must be >= each sequence's q_len")
    need = (ctx + block_size - 1) // block_size
    if len(ctx) and int(need.max()) > block_tables.shape[1]:
        raise KernelLaunchError(f"block_tables has {block_tables.shape[1]} columns, a sequence needs {int(need.max())}")
    bt = block_tables.cpu().long()
    used = torch.arange(bt.shape[1])[None, :] < need[:, None]
    if bool((used & ((bt < 0) | (bt >= num_blocks))).any()):
        raise KernelLaunchError(f"block_tables has block ids outside [0, {num_blocks})")


def check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, head_dims, block_sizes):
    """The host checks every prefill version shares (shapes, dtypes, contiguity; KernelLaunchError naming the
    argument). Returns (out, or a new [total_q, H, D] tensor, and the GQA group)."""
    import torch

    half = tuple(getattr(torch, name) for name in DTYPES)
    bridge.check_tensor("q", q, 3, half)
    bridge.check_tensor("k_cache", k_cache, 4, half)
    bridge.check_tensor("v_cache", v_cache, 4, half)
    bridge.check_tensor("block_tables", block_tables, 2, (torch.int32,))
    bridge.check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    bridge.check_tensor("context_lens", context_lens, 1, (torch.int32,))
    total_q, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, cache_head_dim = k_cache.shape
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise KernelLaunchError(f"k_cache/v_cache dtype must equal q.dtype={q.dtype}, got {k_cache.dtype}/{v_cache.dtype}")
    if v_cache.shape != k_cache.shape:
        raise KernelLaunchError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelLaunchError("k_cache and v_cache must be contiguous")
    if cache_head_dim != head_dim:
        raise KernelLaunchError(f"q head_dim={head_dim} must equal the cache's head_dim={cache_head_dim}")
    if head_dim not in head_dims:
        raise KernelLaunchError(f"head_dim must be one of {head_dims}, got {head_dim}")
    if block_size not in block_sizes:
        raise KernelLaunchError(f"block_size must be one of {block_sizes}, got {block_size}")
    if num_heads % num_kv_heads != 0:
        raise KernelLaunchError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    num_seqs = context_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise KernelLaunchError(f"cu_seqlens_q must be [num_seqs + 1 = {num_seqs + 1}], got {tuple(cu_seqlens_q.shape)}")
    if block_tables.shape[0] != num_seqs:
        raise KernelLaunchError(f"block_tables must have num_seqs={num_seqs} rows, got {block_tables.shape[0]}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        bridge.check_tensor("out", out, 3, (q.dtype,))
        if out.shape != q.shape:
            raise KernelLaunchError(f"out must be {tuple(q.shape)}, got {tuple(out.shape)}")
    return out, num_heads // num_kv_heads


# ----------------------------------------------------------------------------------------
# The FlashAttention-2 structure (v4+): constants and the mma step

SIMULATOR = bridge.SIMULATOR
THREADS = 128  # 4 warps
LAUNCH_BOUNDS = (THREADS, 2)  # (threads, CTAs per SM the registers must allow)
BN = 64  # keys per KV tile (v7 at d=128: 32)
NEG_INF = float32(-np.inf)
LOG2E = 1.4426950408889634
NAN_WORD = 0x7FC07FC0  # two halves that are NaN as fp16 and as bf16 (the simulator's poison)
SMEM_ALIGN = None if SIMULATOR else 16  # cp.async and ldmatrix move 16-byte units (the simulator has no alignment)
JIT_OPTIONS = {} if SIMULATOR else {"launch_bounds": LAUNCH_BOUNDS}  # the attention kernels' cuda.jit options

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


def inline_math(fn):
    """A device function on a warp's register arrays, inlined by numba into each caller's IR."""
    return cuda.jit(device=True, inline="always")(fn)


# ----------------------------------------------------------------------------------------
# A CTA's copies: cp.async into the ring of shared memory


@lru_cache(maxsize=None)
def make_poison(threads):
    """poison(ring, words, tid) for CTAs of `threads` threads: under the simulator, shared memory's first
    `words` words filled with NaN (then a barrier), so that a read of a word nobody wrote shows in the
    output. Nothing on the GPU."""

    @inline_device
    def poison(ring, words, tid):
        if SIMULATOR:
            for i in range(tid, words, threads):
                ring[i] = uint32(NAN_WORD)
            cuda.syncthreads()

    return poison


poison = make_poison(THREADS)


@lru_cache(maxsize=None)
def make_copies(head_dim, block_size, rows, bn, step_rows=False, threads=THREADS):
    """(copy_roles, tile_range, issue_q, issue_tile) for CTAs of `threads` threads, `rows` (query, head) rows
    and K/V tiles of `bn` keys.

    tile_range(cu_seqlens_q, context_lens, s, tile, bq, split, num_splits, part_tiles) -> (q_start, q_len,
        first_pos, q0, kv_end, unmasked_end, t_lo, t_hi): q tile `tile` of sequence s (bq queries a tile): its
        chunk's first query and length, the position of the chunk's query 0, its first query, one past its
        last visible position, the end of the keys every row sees; and the KV tiles [t_lo, t_hi) of part
        `split` of num_splits (all of them without a split; empty when the part has none). The tile's keys
        are cut into num_splits parts of equal length, or with part_tiles > 0 into parts of part_tiles
        tiles from position 0 (fixed by position, not by the launch: the batch-invariant mode's parts).
    copy_roles(tid, head) -> (chunk, row0, tdst, tsrc): thread tid copies 16-byte chunk `chunk` of rows
        row0 + RPP i (RPP = threads / chunks per row); tdst: the chunk's swizzled word in row row0 of a
        tile (row & 7 is the same for every pass when RPP is a multiple of 8); tsrc: its word in a pool block
        (KV head, row0's slot).
    issue_q(ring, qs, q, q_start, q_len, q0, head, num_heads, group, rows_used, row0, chunk): the Q tile of
        queries q0 .. q0 + rows / group - 1 of the chunk at q_start (q_len queries) into the region at word
        qs (rows past the chunk: zeros). step_rows: each pass's (query, head) stepped from row0's (two
        divisions a thread instead of two a pass; v7 at d=64, where it costs no registers).
    issue_tile(ring, dst0, k_cache, v_cache, block_tables, s, block_words, n0, kv_stop, row0, tdst, tsrc):
        K and V rows n0 .. n0 + bn - 1 into the stage at word dst0; rows at or past kv_stop become zeros
        (ordinary shared stores: the pool's unused slots are never read)."""
    D, BS, BM, BN_ = head_dim, block_size, rows, bn
    W = D // 2  # words (pairs of halves) per row
    CPR = D // 8  # 16-byte chunks per row
    RPP = threads // CPR  # rows a copy pass covers (one chunk per thread)
    PASSES = BN_ // RPP  # copy passes per K (and V) tile
    Q_PASSES = BM // RPP
    TILE = BN_ * W  # words of a K (or V) tile
    BS_SHIFT = BS.bit_length() - 1  # block_tables index: pos >> BS_SHIFT, offset: pos & (BS - 1)
    assert BS == 1 << BS_SHIFT and PASSES >= 1 and BN_ % 16 == 0
    STEP_ROWS = step_rows
    SWIZZLE_STEADY = RPP % 8 == 0  # every pass's rows have row0's swizzle

    @inline_device
    def copy_roles(tid, head):
        chunk = tid % CPR
        row0 = tid // CPR
        tdst = row0 * W + ((chunk ^ (row0 & 7)) << 2)
        tsrc = (head * BS + (row0 & (BS - 1))) * W + chunk * 4
        return chunk, row0, tdst, tsrc

    @inline_device
    def tile_range(cu_seqlens_q, context_lens, s, tile, bq, split, num_splits, part_tiles):
        q_start = cu_seqlens_q[s]
        q_len = cu_seqlens_q[s + 1] - q_start
        first_pos = context_lens[s] - q_len  # position of the chunk's query 0
        q0 = tile * bq
        kv_end = first_pos + min(q0 + bq, q_len)  # one past the tile's last visible position
        unmasked_end = first_pos + q0 + 1  # keys below it are visible to every row of the tile
        n_tiles = (kv_end + BN_ - 1) // BN_
        per_split = part_tiles if part_tiles > 0 else (n_tiles + num_splits - 1) // num_splits
        t_lo = split * per_split
        t_hi = min(n_tiles, t_lo + per_split)
        return q_start, q_len, first_pos, q0, kv_end, unmasked_end, t_lo, t_hi

    @inline_device
    def issue_q(ring, qs, q, q_start, q_len, q0, head, num_heads, group, rows_used, row0, chunk):
        # row r = row0 + RPP i is query r // group of head-in-group r % group; with STEP_ROWS both are
        # stepped from row0's by RPP's (the epilogue divides: keeping the steps live through the KV loop
        # costs registers there)
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
    def issue_tile(ring, dst0, k_cache, v_cache, block_tables, s, block_words, n0, kv_stop, row0, tdst, tsrc):
        # As n0 is a multiple of bn and RPP, BS are powers of two, pass i's block is
        # (n0 + RPP i) / BS + row0 / BS and its slot (RPP i) % BS + row0 % BS: compile-time offsets
        # from per-tile values. A pass of fewer than 8 rows (a one-warp CTA) moves the swizzle: row
        # row0 + RPP i's chunk sits at chunk ^ ((row0 + RPP i) & 7)
        rem = kv_stop - n0 - row0  # pass i copies while RPP i < rem
        b0 = (n0 >> BS_SHIFT) + (row0 >> BS_SHIFT)
        chunk = ((tdst - row0 * W) >> 2) ^ (row0 & 7)
        for i in range(PASSES):
            if SWIZZLE_STEADY:
                dst = dst0 + tdst + RPP * i * W
            else:
                r = row0 + RPP * i
                dst = dst0 + r * W + ((chunk ^ (r & 7)) << 2)
            if RPP * i < rem:
                block = block_tables[s, b0 + ((RPP * i) >> BS_SHIFT)]
                src = block * block_words + tsrc + ((RPP * i) & (BS - 1)) * W
                cp_async16(ring, dst, k_cache, src)
                cp_async16(ring, dst + TILE, v_cache, src)
            else:
                store_u32x4(ring, dst, 0, 0, 0, 0)
                store_u32x4(ring, dst + TILE, 0, 0, 0, 0)

    return copy_roles, tile_range, issue_q, issue_tile


# ----------------------------------------------------------------------------------------
# A warp's math on one KV tile


TileMath = namedtuple("TileMath", "start_rows load_q scores mask softmax probabilities rescale accumulate")


@lru_cache(maxsize=None)
def make_tile_math(head_dim, kind, m_tiles, bn, q_in_smem):
    """TileMath(start_rows, load_q, scores, mask, softmax, probabilities, rescale, accumulate) for a warp of
    m_tiles m-tiles of 16 rows over K/V tiles of bn keys. Register arrays (per lane): qa (MT, D/16, 4)
    uint32 Q fragments; sc (MT, bn/8, 4) float32 S, then P; oa, ob (MT, D/16, 4) float32 O's d-tiles in
    two halves (dims 0 .. D/2 - 1 and D/2 .. D - 1: each loop over O runs over one half, short enough that
    the compiler unrolls it fully at MT = 2, d = 128; one loop over all 128 accumulators stays a loop, and
    O moves to local memory); m, lsum (MT, 2) float32 running max (raw score units) and this lane's part
    of the row sum, for its rows fg and fg + 8 of each m-tile; pos (MT, 2) those rows' positions.

    start_rows(pos, m, lsum, oa, ob, warp, fg, q0, group, rows_used, q_len, first_pos, kv_end): positions
        (rows past the chunk: kv_end - 1, computed and never stored), m = -inf, l = 0, O = 0.
    load_q(qa, ring, qrow, lane, ks0, ks1): Q fragments of k-steps ks0 .. ks1 - 1 by ldmatrix.x4 from the
        Q tile whose row `qrow` (this lane's ldmatrix row of m-tile 0) is at word qrow.
    scores(sc, qa, ring, read, qrow, lane): S = Q K^T on the K tile at word `read`: per n-tile D/32
        ldmatrix.x4 of K, each feeding 2 MT mma; q_in_smem: Q's fragments re-read per k-step pair (the
        tile stays in shared memory), else qa holds them all.
    mask(sc, pos, n0, ft): -inf where a key of the tile at n0 is past the row's position.
    softmax(sc, m, lsum, oa, ob, sl): the online softmax in base 2 (sl = scale log2 e); the max moves with
        every tile, O and l are rescaled.
    probabilities(sc, mt, h, ms, sl) -> this lane's sum: row h of m-tile mt's scores s become
        p = 2^(s sl - ms) (ms: the row's max times sl, 0 for a row that has seen nothing: p = 0).
    rescale(oa, ob, mt, h, alpha): row h of m-tile mt's O times alpha (the running max moved).
    accumulate(oa, ob, sc, ring, read, lane): O += P V, P from the S fragments, V by ldmatrix.trans from
        the V tile (bn * D / 2 words past `read`)."""
    D, MT, BN_, Q_SMEM = head_dim, m_tiles, bn, q_in_smem
    W = D // 2
    NT = BN_ // 8  # n-tiles of S per m-tile
    KS = D // 16  # k-steps of S = Q K^T
    KP = KS // 2  # ldmatrix.x4 of K per n-tile (two k-steps each)
    KK = BN_ // 16  # k-steps of O += P V
    DT = D // 8  # n-tiles (8 dims) of O
    DH = DT // 2  # ... in each half of O
    DP = DT // 2  # ldmatrix.x4.trans of V per k-step (two d-tiles each)
    TILE = BN_ * W
    mma = mma_bf16 if kind == "bf16" else mma_f16
    pack = common.f32x2_to_bf16x2 if kind == "bf16" else common.f32x2_to_f16x2

    @inline_math
    def start_rows(pos, m, lsum, oa, ob, warp, fg, q0, group, rows_used, q_len, first_pos, kv_end):
        for mt in range(MT):
            for h in range(2):
                r = (warp * MT + mt) * 16 + fg + 8 * h
                qi = q0 + r // group
                pos[mt, h] = first_pos + qi if (r < rows_used and qi < q_len) else kv_end - 1
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

    @inline_math
    def load_q(qa, ring, qrow, lane, ks0, ks1):
        for mt in range(MT):
            for ks in range(ks0, ks1):
                a0, a1, a2, a3 = ldmatrix_x4(ring, qrow + mt * 16 * W + (((2 * ks + (lane >> 4)) ^ (lane & 7)) << 2))
                qa[mt, ks, 0] = a0
                qa[mt, ks, 1] = a1
                qa[mt, ks, 2] = a2
                qa[mt, ks, 3] = a3

    @inline_math
    def scores(sc, qa, ring, read, qrow, lane):
        for mt in range(MT):
            for nt in range(NT):
                for e in range(4):
                    sc[mt, nt, e] = float32(0.0)
        for kp in range(KP):
            if Q_SMEM:
                load_q(qa, ring, qrow, lane, 2 * kp, 2 * kp + 2)
            # this lane addresses key 8 nt + lane % 8 of chunk 4 kp + lane // 8
            kaddr = read + (lane & 7) * W + (((4 * kp + (lane >> 3)) ^ (lane & 7)) << 2)
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

    @inline_math
    def mask(sc, pos, n0, ft):
        for mt in range(MT):
            for nt in range(NT):
                for e in range(4):
                    if n0 + nt * 8 + 2 * ft + (e & 1) > pos[mt, e >> 1]:
                        sc[mt, nt, e] = NEG_INF

    @inline_math
    def probabilities(sc, mt, h, ms, sl):
        total = float32(0.0)
        for nt in range(NT):
            p0 = ex2(sc[mt, nt, 2 * h] * sl - ms)
            p1 = ex2(sc[mt, nt, 2 * h + 1] * sl - ms)
            sc[mt, nt, 2 * h] = p0
            sc[mt, nt, 2 * h + 1] = p1
            total += p0 + p1
        return total

    @inline_math
    def rescale(oa, ob, mt, h, alpha):
        for dt in range(DH):
            oa[mt, dt, 2 * h] *= alpha
            oa[mt, dt, 2 * h + 1] *= alpha
        for dt in range(DH):
            ob[mt, dt, 2 * h] *= alpha
            ob[mt, dt, 2 * h + 1] *= alpha

    @inline_math
    def softmax(sc, m, lsum, oa, ob, sl):
        # a row lives in the 4 lanes of its fg
        for mt in range(MT):
            for h in range(2):
                mx = m[mt, h]
                for nt in range(NT):
                    mx = max(mx, max(sc[mt, nt, 2 * h], sc[mt, nt, 2 * h + 1]))
                mx = max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 1))
                mx = max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 2))
                ms = mx * sl if mx != NEG_INF else float32(0.0)  # a fully masked row: p = 0
                # 0 while the row has seen nothing; exactly 1 while its max stands (ex2 of m * sl - ms would be
                # 2^(the rounding of m * sl) once the compiler fuses it into an FMA): a tile masked whole for a
                # row then leaves its O and l as they were, so a query gets the same bits in a tile that reads
                # keys past it as alone (the batch-invariant mode's prompt row == its decode)
                alpha = float32(1.0) if mx == m[mt, h] else ex2(m[mt, h] * sl - ms)
                m[mt, h] = mx
                lsum[mt, h] = lsum[mt, h] * alpha + probabilities(sc, mt, h, ms, sl)
                rescale(oa, ob, mt, h, alpha)

    @inline_math
    def accumulate_half(o, half, pa, ring, vaddr, lane):
        # d-tiles 2 dp, 2 dp + 1 of O's half `half` (o: oa or ob): this lane addresses V's chunk 2 dp + lane // 16
        # of that half
        for dp in range(DP // 2):
            chunk = 2 * (dp + half * (DP // 2)) + (lane >> 4)
            b0, b1, b2, b3 = ldmatrix_x4_trans(ring, vaddr + ((chunk ^ (lane & 7)) << 2))
            for mt in range(MT):
                o[mt, 2 * dp, 0], o[mt, 2 * dp, 1], o[mt, 2 * dp, 2], o[mt, 2 * dp, 3] = mma(
                    pa[mt, 0], pa[mt, 1], pa[mt, 2], pa[mt, 3], b0, b1,
                    o[mt, 2 * dp, 0], o[mt, 2 * dp, 1], o[mt, 2 * dp, 2], o[mt, 2 * dp, 3])
                o[mt, 2 * dp + 1, 0], o[mt, 2 * dp + 1, 1], o[mt, 2 * dp + 1, 2], o[mt, 2 * dp + 1, 3] = mma(
                    pa[mt, 0], pa[mt, 1], pa[mt, 2], pa[mt, 3], b2, b3,
                    o[mt, 2 * dp + 1, 0], o[mt, 2 * dp + 1, 1], o[mt, 2 * dp + 1, 2], o[mt, 2 * dp + 1, 3])

    @inline_math
    def accumulate(oa, ob, sc, ring, read, lane):
        # this lane addresses V's key 16 kk + lrow
        lrow = (lane & 7) + ((lane >> 3) & 1) * 8
        for kk in range(KK):
            vaddr = read + TILE + kk * 16 * W + lrow * W
            pa = cuda.local.array((MT, 4), uint32)
            for mt in range(MT):
                pa[mt, 0] = pack(sc[mt, 2 * kk, 0], sc[mt, 2 * kk, 1])
                pa[mt, 1] = pack(sc[mt, 2 * kk, 2], sc[mt, 2 * kk, 3])
                pa[mt, 2] = pack(sc[mt, 2 * kk + 1, 0], sc[mt, 2 * kk + 1, 1])
                pa[mt, 3] = pack(sc[mt, 2 * kk + 1, 2], sc[mt, 2 * kk + 1, 3])
            accumulate_half(oa, 0, pa, ring, vaddr, lane)
            accumulate_half(ob, 1, pa, ring, vaddr, lane)

    return TileMath(start_rows, load_q, scores, mask, softmax, probabilities, rescale, accumulate)


# ----------------------------------------------------------------------------------------
# A warp's rows at the end: O / l, or a split's partials


@lru_cache(maxsize=None)
def make_epilogue(head_dim, kind, m_tiles, threads=THREADS):
    """(empty_part, row_sums, store_out, store_partials) for CTAs of `threads` threads, 16 m_tiles rows a warp.

    empty_part(part_lse, tid, split, total_rows, q_start, q_len, q0, head, num_heads, group, rows_used):
        a split's part with no KV tile for this CTA: its rows' log2-sum-exp -inf (the merge skips them).
    row_sums(lsum): the 4 lanes' parts of each row sum added (every lane of the row gets it).
    store_out(ring, obase, out, oa, ob, lsum, warp, lane, row0, chunk, q_start, q_len, q0, head, num_heads,
        group, rows_used): O / l packed into the shared tile at word obase (swizzled as the tiles; a barrier
        first: every warp is done reading the ring), then 16-byte coalesced stores of the chunk's rows.
    store_partials(part_o, part_lse, oa, ob, lsum, m, sl, warp, lane, split, total_rows, q_start, q_len, q0,
        head, num_heads, group, rows_used): this part's normalised O (fp32) and log2-sum-exp per row (the
        merge kernel combines the parts)."""
    D, MT = head_dim, m_tiles
    BM = threads // 32 * 16 * MT
    W = D // 2
    DH = D // 16  # d-tiles in each half of O
    CPR = D // 8
    RPP = threads // CPR
    Q_PASSES = BM // RPP
    pack = common.f32x2_to_bf16x2 if kind == "bf16" else common.f32x2_to_f16x2

    @inline_device
    def empty_part(part_lse, tid, split, total_rows, q_start, q_len, q0, head, num_heads, group, rows_used):
        for r in range(tid, rows_used, threads):
            qi = q0 + r // group
            if qi < q_len:
                part_lse[split * total_rows + (q_start + qi) * num_heads + head * group + r % group] = NEG_INF

    @inline_math
    def row_sums(lsum):
        for mt in range(MT):
            for h in range(2):
                x = lsum[mt, h]
                x += cuda.shfl_xor_sync(0xFFFFFFFF, x, 1)
                x += cuda.shfl_xor_sync(0xFFFFFFFF, x, 2)
                lsum[mt, h] = x

    @inline_math
    def store_out(ring, obase, out, oa, ob, lsum, warp, lane, row0, chunk, q_start, q_len, q0, head, num_heads,
                  group, rows_used):
        fg = lane >> 2
        ft = lane & 3
        cuda.syncthreads()
        for mt in range(MT):
            for h in range(2):
                r = (warp * MT + mt) * 16 + fg + 8 * h  # r & 7 == fg
                inv = float32(1.0) / lsum[mt, h]
                for dt in range(DH):
                    ring[obase + r * W + ((dt ^ fg) << 2) + ft] = pack(oa[mt, dt, 2 * h] * inv,
                                                                      oa[mt, dt, 2 * h + 1] * inv)
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

    @inline_math
    def store_partials(part_o, part_lse, oa, ob, lsum, m, sl, warp, lane, split, total_rows, q_start, q_len, q0,
                       head, num_heads, group, rows_used):
        fg = lane >> 2
        ft = lane & 3
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
                    if ft == 0:  # the product rounded alone: an FMA here would give a row bits by its place
                        part_lse[row] = mul_rn(m[mt, h], sl) + math.log2(x) if x > float32(0.0) else NEG_INF

    return empty_part, row_sums, store_out, store_partials


# ----------------------------------------------------------------------------------------
# The torch side of a launch


class Launch:
    """A v4+ launch's arguments from torch tensors (prepare): word views of q, the pool and the output
    target, the int32 metadata, sizes, the kernel kind, scale, max_context_len, torch's stream and SM
    count. finish() copies the target into `out` where they differ and returns out."""

    def __init__(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, group, scale,
                 max_context_len):
        import torch

        self.total_q, self.num_heads, self.head_dim = q.shape
        _, self.num_kv_heads, self.block_size, _ = k_cache.shape
        self.num_seqs = context_lens.shape[0]
        self.group = group
        self.kind = kind_of(q.dtype)
        self.scale = 1.0 / math.sqrt(self.head_dim) if scale is None else float(scale)
        self.max_context_len = block_tables.shape[1] * self.block_size if max_context_len is None else max_context_len
        self.device = q.device
        self.num_sms = bridge.num_sms(q.device)
        self.stream = bridge.torch_stream(q.device)
        self.out = out
        q_c = q.contiguous()
        if q_c.data_ptr() % 16:
            q_c = q_c.clone()
        self.target = out if out.is_contiguous() and out.data_ptr() % 16 == 0 else torch.empty_like(q_c)
        # torch tensors go to the kernels as they are (kernels_numba.launcher passes them as numba arrays)
        self.q, self.k, self.v, self.out_words = (_words(n, t) for n, t in (("q", q_c), ("k_cache", k_cache),
                                                                           ("v_cache", v_cache), ("out", self.target)))
        self.block_tables = block_tables.contiguous()
        self.cu_seqlens_q = cu_seqlens_q.contiguous()
        self.context_lens = context_lens.contiguous()

    def partials(self, splits):
        """(part_o, part_lse): float32 [splits * total_q * num_heads * head_dim] and [splits * total_q *
        num_heads] for a split launch, 1-element placeholders otherwise."""
        import torch

        rows = self.total_q * self.num_heads
        part_o = torch.empty(splits * rows * self.head_dim if splits > 1 else 1, dtype=torch.float32,
                             device=self.device)
        part_lse = torch.empty(splits * rows if splits > 1 else 1, dtype=torch.float32, device=self.device)
        return part_o, part_lse

    def finish(self):
        if self.target is not self.out:
            self.out.copy_(self.target)
        return self.out


def _words(name, t):
    """1-D uint32 view of a contiguous fp16/bf16 tensor, 16-byte aligned (for 16-byte copies)."""
    if t.data_ptr() % 16 != 0:
        raise KernelLaunchError(f"{name} must be 16-byte aligned")
    return bridge.words(t)


def prepare(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, validate, max_context_len,
            rows):
    """check_args and, with validate (outside a capture), check_values; KernelLaunchError for a GQA group
    larger than the kernel's `rows`. Returns a Launch, or None with out when there is nothing to compute
    (no query or no sequence): (launch, out)."""
    out, group = check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, HEAD_DIMS, BLOCK_SIZES)
    if group > rows:
        raise KernelLaunchError(f"GQA group {group} must be <= {rows} rows per tile")
    if validate and not bridge.capturing():
        check_values(block_tables, cu_seqlens_q, context_lens, q.shape[0], k_cache.shape[0], k_cache.shape[2])
    if q.shape[0] == 0 or context_lens.shape[0] == 0:
        return None, out
    return Launch(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, group, scale,
                  max_context_len), out
