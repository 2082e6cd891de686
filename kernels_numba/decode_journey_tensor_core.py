"""Paged decode attention on tensor cores: the journey's second era (v5-v9), one version at a time.

Same function as decode_journey_cuda_core.py (v1-v4): one query token per sequence over its paged
history, GQA, fp32 accumulation; from v5 on the arithmetic is mma.sync.m16n8k16 with the group's
query heads as the mma's rows. The pieces these versions share with v10 (q fragments, the mma
step, the warps' merge, the cp.async ring) are in attention_parts.py; v4's split-KV launch and its
merge kernel, which v10 replaced, in decode_journey_cuda_core.py.

v5: v4's grid, loads and split-KV, with the arithmetic on tensor cores: per warp and 16-token
    step, S = Q K^T and O += P V are mma.sync.m16n8k16 (fp16/bf16 in, fp32 accumulate) with
    the group's query heads as the 16 rows (G <= 16; larger groups run v4). The softmax
    needs 2 shuffles per step instead of v4's ~25 per head, and v4's ~900 FFMA per token
    become 16 HMMA per 16 tokens: the kernel is left with loads and a few dozen
    instructions of bookkeeping, i.e. memory bound. P is rounded to fp16/bf16 for the
    second product, as in FlashAttention.
v6: adds two 16-token sub-chunks per warp step at d=64 (16 loads of 16 bytes in flight per
    lane instead of 8; 152 registers, 3 CTAs per SM) and a split-KV plan that sizes the grid
    to whole waves of resident CTAs (v4/v5 could launch 1.2-1.5 waves, the last one mostly
    idle) with partitions down to 128 tokens, so one short sequence still spreads over SMs.
v7: v5's step, software-pipelined: adds a second register set, the loads of the warp's next
    16-token chunk are issued before the math of the current one (a load is always in flight),
    heads in one mma row block when G <= 8 (142 registers at d=64, 3 CTAs per SM); v6's wave
    plan with partitions a multiple of 4 warps x 16 tokens. d=128 runs v5's kernel with that
    plan (two register sets of d=128 K/V spill).
v8: v7's step fed through shared memory by cp.async: adds a ring of 3 stages per warp that keeps
    two 16-token chunks in flight without registers (127 registers, 48 KiB, 4 CTAs per SM). The
    copies are shaped for the memory system: each instruction copies 4 whole 128-byte rows
    (as few L2 requests as a dense kernel), and the lanes read their mma fragments back from
    XOR-swizzled rows after a syncwarp. Offsets are hoisted out of the loop and whole chunks
    run unmasked. d=64 (d=128 runs v7's launcher).
v9: v8's kernel, launched by occupancy: about 8 warps per SM stream the pool as fast as 16, and
    each split costs a merge kernel and shorter partitions, so a (sequence, KV head) gets one CTA
    of 2 to 8 warps over its whole context before any split (4-warp CTAs when more are needed).
    The warps of a CTA are merged in shared memory; the ring (12 KiB per warp) is dynamic
    shared memory, beyond the 48 KiB of a static array.

The kernel the engine runs (v10: v9's kernel made whole for every shape, with a split-KV merge
that is cheap at any batch size) is in paged_attention.py. Each version here: make_vN(...) builds
a kernel for one compile-time shape, launch_vN(args, stream) launches it.
"""
from functools import lru_cache

from numba import cuda, float32, uint32

from kernels_numba.attention_parts import (
    CHUNK,
    LOG2E,
    lane_roles,
    make_mma_step,
    make_ring,
    make_warp_merge,
    make_warp_start,
    ring_bytes,
)
from kernels_numba.bridge import SIMULATOR, disk_cached
from kernels_numba.common import load_u32x4
from kernels_numba.decode_journey_cuda_core import NUM_WARPS, converters, launch_split_kv, launch_v4, split_plan

V5_MAX_GROUP = 16  # heads per KV head that fit the mma's 16 rows; larger groups run v4


@lru_cache(maxsize=None)
def make_merge_warps(head_dim, group, rows, warps, is_bf16):
    """(merge_warps, write_merged) for the end of a v5-v9 CTA. These helpers (and load_token / load_chunk
    below) stay inlined by numba (inline="always") rather than by NVVM (kernels_numba.common.inline_device):
    at head_dim 128 NVVM's inlining left v5's and v6's register arrays in local memory (spills in ptxas).

    merge_warps(buf, stride, warp, g, t, tid, lsum, m, acc, out, part_acc, part_ml, s, h0, split,
        num_splits): each warp stashes its (max, sum, accumulator) per head in its region of `buf`
        (uint32 shared memory, `stride` words per warp), then write_merged.
    write_merged(buf, stride, tid, out, part_acc, part_ml, s, h0, split, num_splits): the CTA
        combines its stashed warps and writes the output (one split) or the partition's partials for
        the merge kernel (part_acc [S, H, splits, D], part_ml [S, H, splits, 2])."""
    G, P = group, head_dim // 2
    stash, combine_pair = make_warp_merge(head_dim, group, rows, warps)
    store = converters(is_bf16)[2]

    @cuda.jit(device=True, inline="always")
    def write_merged(buf, stride, tid, out, part_acc, part_ml, s, h0, split, num_splits):
        for i in range(tid, G * P, warps * 32):  # pairs of dims (h, d), (h, d + 1)
            h = i // P
            d = 2 * (i - h * P)
            mx, num0, num1, den = combine_pair(buf, stride, h, d)
            if num_splits == 1:
                out[s, h0 + h, d] = store(num0 / den)
                out[s, h0 + h, d + 1] = store(num1 / den)
            else:
                part_acc[s, h0 + h, split, d] = num0
                part_acc[s, h0 + h, split, d + 1] = num1
                if d == 0:
                    part_ml[s, h0 + h, split, 0] = mx
                    part_ml[s, h0 + h, split, 1] = den

    @cuda.jit(device=True, inline="always")
    def merge_warps(buf, stride, warp, g, t, tid, lsum, m, acc, out, part_acc, part_ml, s, h0, split,
                    num_splits):
        stash(buf, warp * stride, G, g, t, lsum, m, acc)
        cuda.syncthreads()
        write_merged(buf, stride, tid, out, part_acc, part_ml, s, h0, split, num_splits)

    return merge_warps, write_merged


# ----------------------------------------------------------------------------------------------
# v5, v6, v7: tensor cores fed from registers


@lru_cache(maxsize=None)
def make_load_chunk(head_dim, block_size):
    """load_chunk(kw, ko, vw, vo, k_flat, v_flat, block_tables, s, c0, end, g, t, words_per_block,
    head_off): one 16-token chunk's K and V words this lane multiplies, loaded from the pool into
    kw[ko:] (K of tokens c0 + g, c0 + 8 + g: D/4 dims from t D/4) and vw[vo:] (V of tokens c0 + 2t,
    + 1, + 8, + 9: D/8 dims from DPC g) with 16-byte loads; zeros past `end`."""
    BS, P, QW, VW = block_size, head_dim // 2, head_dim // 8, head_dim // 16

    @cuda.jit(device=True, inline="always")
    def load_token(dst, o, flat, block_tables, s, j, end, col, nwords, words_per_block, head_off):
        # words col .. col + nwords - 1 of token j's row into dst[o:], zeros past the end
        if j < end:
            base = block_tables[s, j // BS] * words_per_block + head_off + (j % BS) * P + col
            for i in range(nwords // 4):
                w = load_u32x4(flat, base + 4 * i)
                for e in range(4):
                    dst[o + 4 * i + e] = w[e]
        else:
            for i in range(nwords):
                dst[o + i] = 0

    @cuda.jit(device=True, inline="always")
    def load_chunk(kw, ko, vw, vo, k_flat, v_flat, block_tables, s, c0, end, g, t, words_per_block, head_off):
        for n in range(2):
            load_token(kw, ko + n * QW, k_flat, block_tables, s, c0 + 8 * n + g, end, t * QW, QW, words_per_block,
                       head_off)
        for u in range(4):
            load_token(vw, vo + u * VW, v_flat, block_tables, s, c0 + 2 * t + (u % 2) + 8 * (u // 2), end, g * VW, VW,
                       words_per_block, head_off)

    return load_chunk


@disk_cached
@lru_cache(maxsize=None)
def make_v5(head_dim, block_size, group, is_bf16, unroll=1, pipelined=False):
    """v5's kernel; unroll=2: v6's (two sub-chunks' loads in flight per step); pipelined=True: v7's
    (a second register set: the next chunk loads while this one computes; heads in one mma row
    block when G <= 8)."""
    D, G, NW, CH, U = head_dim, group, NUM_WARPS, CHUNK, unroll
    P = D // 2
    KS4, KWN, VWN, ACC = (D // 16) * 4, 2 * (D // 8), 4 * (D // 16), (D // 8) * 4
    KWU, VWU = KWN * U, VWN * U  # local array sizes must be plain constants
    ROWS = 1 if pipelined and G <= 8 else 2  # mma row blocks holding heads (g, and g+8)
    PART_WORDS = G * D + 2 * G  # per warp, for merge_warps
    PART_BUF = NW * PART_WORDS
    start_warp = make_warp_start(D, ROWS, False)
    load_chunk = make_load_chunk(D, block_size)
    compute_chunk = make_mma_step(D, ROWS, is_bf16)
    merge_warps = make_merge_warps(D, G, ROWS, NW, is_bf16)[0]
    QSCALE_LOG2E = float32(LOG2E)

    @cuda.jit
    def paged_attention_v5(q, k_flat, v_flat, block_tables, context_lens, out, part_acc, part_ml, scale,
                           partition):
        # q: [S, H, D/2] pairs; k_flat, v_flat: the pool as flat 32-bit pairs; out: [S, H, D] 16-bit;
        # part_acc [S, H, splits, D] / part_ml [S, H, splits, 2]: a partition's partials (splits > 1)
        kvh, s, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp, lane, g, t = lane_roles(tid)
        ctx = context_lens[s]
        start = split * partition
        if start >= ctx:
            return  # the whole CTA: this split lies past the sequence (the merge skips it)
        end = min(ctx, start + partition)
        h0 = kvh * G
        words_per_block = cuda.gridDim.x * block_size * P
        head_off = kvh * block_size * P
        sl = scale * QSCALE_LOG2E

        part_buf = cuda.shared.array(PART_BUF, uint32)  # the warps' results, for merge_warps
        qa = cuda.local.array(KS4, uint32)
        m = cuda.local.array(2, float32)
        lsum = cuda.local.array(2, float32)
        acc = cuda.local.array(ACC, float32)
        start_warp(qa, m, lsum, acc, q, s, h0, G, g, t)
        sc = cuda.local.array(8, float32)  # [row r][n-tile n][col c] -> r*4 + n*2 + c
        pw = cuda.local.array(4, uint32)  # P as A fragments
        kw = cuda.local.array(KWU, uint32)  # per sub-chunk: K of tokens g and 8+g
        vw = cuda.local.array(VWU, uint32)  # per sub-chunk: V of tokens 2t, 2t+1, 8+2t, 9+2t
        if not pipelined:
            # v5 / v6: a step is U sub-chunks of 16 tokens: all their loads are issued before any math
            num_steps = (end - start + CH * U - 1) // (CH * U)
            for c in range(warp, num_steps, NW):
                for sub in range(U):
                    load_chunk(kw, sub * KWN, vw, sub * VWN, k_flat, v_flat, block_tables, s,
                               start + (c * U + sub) * CH, end, g, t, words_per_block, head_off)
                for sub in range(U):
                    compute_chunk(kw, sub * KWN, vw, sub * VWN, qa, m, lsum, acc, sc, pw,
                                  start + (c * U + sub) * CH, end, t, sl, False)
        else:
            # v7: two register sets, a and b: one in flight, one in use
            kw_b = cuda.local.array(KWN, uint32)
            vw_b = cuda.local.array(VWN, uint32)
            num_chunks = (end - start + CH - 1) // CH
            c = warp
            if c < num_chunks:
                load_chunk(kw, 0, vw, 0, k_flat, v_flat, block_tables, s, start + c * CH, end, g, t,
                           words_per_block, head_off)
            while c < num_chunks:
                # set a holds chunk c: fetch chunk c + NW into set b, then do c's math
                if c + NW < num_chunks:
                    load_chunk(kw_b, 0, vw_b, 0, k_flat, v_flat, block_tables, s, start + (c + NW) * CH, end, g,
                               t, words_per_block, head_off)
                compute_chunk(kw, 0, vw, 0, qa, m, lsum, acc, sc, pw, start + c * CH, end, t, sl, False)
                c += NW
                if c >= num_chunks:
                    break
                if c + NW < num_chunks:
                    load_chunk(kw, 0, vw, 0, k_flat, v_flat, block_tables, s, start + (c + NW) * CH, end, g, t,
                               words_per_block, head_off)
                compute_chunk(kw_b, 0, vw_b, 0, qa, m, lsum, acc, sc, pw, start + c * CH, end, t, sl, False)
                c += NW

        merge_warps(part_buf, PART_WORDS, warp, g, t, tid, lsum, m, acc, out, part_acc, part_ml, s, h0, split,
                    cuda.gridDim.z)

    return paged_attention_v5


def launch_v5(a, stream):
    if a.group > V5_MAX_GROUP:
        return launch_v4(a, stream)
    kernel = make_v5(a.head_dim, a.block_size, a.group, a.is_bf16)
    splits, partition = split_plan(a.num_seqs, a.num_kv_heads, a.max_context_len, CHUNK)
    launch_split_kv(a, stream, kernel, a.q32, splits, partition)


V6_MIN_PARTITION = 128  # tokens: one 32-token step for each of the 4 warps


def v6_unroll_and_occupancy(head_dim):
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


def launch_v6(a, stream):
    if a.group > V5_MAX_GROUP:
        return launch_v4(a, stream)
    unroll, ctas_per_sm = v6_unroll_and_occupancy(a.head_dim)
    kernel = make_v5(a.head_dim, a.block_size, a.group, a.is_bf16, unroll)
    splits, partition = split_plan_waves(a.num_seqs, a.num_kv_heads, a.max_context_len, CHUNK * unroll,
                                         ctas_per_sm * a.num_sms)
    launch_split_kv(a, stream, kernel, a.q32, splits, partition)


V7_CTAS_PER_SM = {64: 3, 128: 2}  # ptxas: 142 registers at d=64 (v7), 204 at d=128 (v5 kernel)


def launch_v7(a, stream):
    if a.group > V5_MAX_GROUP:
        return launch_v4(a, stream)
    # two register sets of d=128 K/V spill: d=128 keeps v5's kernel, with v7's plan
    kernel = make_v5(a.head_dim, a.block_size, a.group, a.is_bf16, pipelined=a.head_dim == 64)
    # partitions a multiple of 4 warps x 16 tokens, so the warps of a CTA get equal work
    splits, partition = split_plan_waves(a.num_seqs, a.num_kv_heads, a.max_context_len, CHUNK * NUM_WARPS,
                                         V7_CTAS_PER_SM[a.head_dim] * a.num_sms)
    launch_split_kv(a, stream, kernel, a.q32, splits, partition)


# ----------------------------------------------------------------------------------------------
# v8: v7's tensor-core step fed by cp.async through a ring of shared-memory stages per warp, so
# that STAGES - 1 chunks of loads are in flight per warp without holding them in registers

V8_STAGES = 3  # 3 x 4 KiB per warp: 48 KiB of ring per CTA of 4 warps at d=64
V8_LAUNCH_BOUNDS = (NUM_WARPS * 32, 4)  # <= 128 registers, so 4 CTAs (the ring allows 4) per SM
V8_CTAS_PER_SM = V8_LAUNCH_BOUNDS[1]


@disk_cached
@lru_cache(maxsize=None)
def make_v8(head_dim, block_size, group, is_bf16, stages=V8_STAGES, ctas_per_sm=V8_CTAS_PER_SM, dynamic=False,
            warps=NUM_WARPS):
    """v8's kernel for CTAs of `warps` warps; dynamic: the ring is dynamic shared memory of
    ring_bytes(head_dim, stages, warps) (v9), so that it may exceed the 48 KiB a static array can have."""
    D, G, NW = head_dim, group, warps
    WARP_WORDS = ring_bytes(D, stages, 1) // 4
    RING_DECL = 0 if dynamic else NW * WARP_WORDS  # 0: dynamic shared memory, sized at launch
    assert D == 64, "v8's static ring is sized for head_dim 64 (d=128 runs v7's launcher)"
    assert WARP_WORDS >= G * D + 2 * G, "the ring must hold a warp's partial results"
    attend_partition = make_ring(D, block_size, G, is_bf16, NW, stages)
    write_merged = make_merge_warps(D, G, 1 if G <= 8 else 2, NW, is_bf16)[1]
    jit_options = {} if SIMULATOR else {"launch_bounds": (NW * 32, ctas_per_sm)}

    @cuda.jit(**jit_options)
    def paged_attention_v8(q, k_flat, v_flat, block_tables, context_lens, out, part_acc, part_ml, scale,
                           partition):
        # same arguments as v5
        kvh, s, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        ctx = context_lens[s]
        start = split * partition
        if start >= ctx:
            return
        ring = cuda.shared.array(RING_DECL, uint32)
        # the warps stream the partition through their rings; the idle ring then carries each
        # warp's (max, sum, accumulator) to the CTA's combine
        attend_partition(ring, q, k_flat, v_flat, block_tables, s, kvh, cuda.gridDim.x, kvh * G, G, start,
                         min(ctx, start + partition), scale, cuda.threadIdx.x)
        write_merged(ring, WARP_WORDS, cuda.threadIdx.x, out, part_acc, part_ml, s, kvh * G, split, cuda.gridDim.z)

    return paged_attention_v8


def launch_v8(a, stream):
    if a.group > V5_MAX_GROUP or a.head_dim != 64:  # d=128: a stage would be 8 KiB per warp
        return launch_v7(a, stream)
    kernel = make_v8(a.head_dim, a.block_size, a.group, a.is_bf16)
    splits, partition = split_plan_waves(a.num_seqs, a.num_kv_heads, a.max_context_len, CHUNK * NUM_WARPS,
                                         V8_CTAS_PER_SM * a.num_sms)
    launch_split_kv(a, stream, kernel, a.q32, splits, partition)


# ----------------------------------------------------------------------------------------------
# v9: v8's kernel, its launch shaped by occupancy. Measured (docs/kernels.md, scripts/tune_splits.py):
# about 8 warps per SM stream the pool as fast as 16, and every split costs (a merge kernel,
# short partitions), so each (sequence, KV head) gets its share of 8 warps per SM, as one CTA of
# 2 to 8 warps when that is enough and as partitions of 4-warp CTAs beyond. The CTA's warps are
# combined in shared memory; an 8-warp ring (96 KiB) is dynamic shared memory.

V9_WARPS_PER_SM = 8


def v9_plan(num_seqs, num_kv_heads, max_context_len, num_sms):
    """(splits, partition, warps): warps per (sequence, KV head) = the power of two nearest below
    V9_WARPS_PER_SM * num_sms / pairs, at least 2; up to 8 of them form one CTA over the whole
    context, more are 4-warp CTAs over partitions of >= 2 chunks (128 tokens) per warp."""
    pairs = max(1, num_seqs * num_kv_heads)
    per_pair = max(2, 1 << max(0, (V9_WARPS_PER_SM * num_sms // pairs).bit_length() - 1))
    warps = per_pair if per_pair <= 8 else NUM_WARPS
    step = CHUNK * warps
    max_splits = max(1, max_context_len // (2 * step))
    part = -(-max_context_len // min(max_splits, per_pair // warps))
    part = -(-part // step) * step
    return -(-max_context_len // part), part, warps


def make_v9(head_dim, block_size, group, is_bf16, warps=8, stages=V8_STAGES):
    """v8's kernel for CTAs of `warps` warps with a dynamic ring; launch bounds that allow 16
    warps per SM (<= 128 registers), as v8."""
    return make_v8(head_dim, block_size, group, is_bf16, stages, max(1, 16 // warps), dynamic=True, warps=warps)


def launch_v9(a, stream, splits=None, warps=None, stages=V8_STAGES):
    """splits, warps, stages: override the plan (scripts/tune_splits.py measured the choices)."""
    if a.group > V5_MAX_GROUP or a.head_dim != 64:
        return launch_v7(a, stream)
    plan_splits, partition, plan_warps = v9_plan(a.num_seqs, a.num_kv_heads, a.max_context_len, a.num_sms)
    warps = plan_warps if warps is None else warps
    if splits is not None or warps != plan_warps:
        n = plan_splits if splits is None else splits
        partition = -(-a.max_context_len // n)
        partition = -(-partition // (CHUNK * warps)) * (CHUNK * warps)
    splits = -(-a.max_context_len // partition)
    kernel = make_v9(a.head_dim, a.block_size, a.group, a.is_bf16, warps, stages)
    launch_split_kv(a, stream, kernel, a.q32, splits, partition, ring_bytes(a.head_dim, stages, warps), warps)


VERSIONS = {5: launch_v5, 6: launch_v6, 7: launch_v7, 8: launch_v8, 9: launch_v9}
