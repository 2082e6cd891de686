"""Paged decode attention: the kernel the engine runs (v10), its launch plan, and the torch entry point.

One query token per sequence attends to that sequence's whole history, found block by block
through its block table in the shared pool (layout [num_blocks, num_kv_heads, block_size,
head_dim]). GQA: query head h reads KV head h // (num_heads // num_kv_heads). fp32 accumulation,
scale 1/sqrt(head_dim), one launch for sequences of different lengths.

v10 is v9's kernel (decode_journey_tensor_core.py) standing on its own, for every
supported shape, with a split-KV merge that stays cheap however many partitions there are:
  * a CTA of `warps` warps owns a partition of one sequence's context for one head group (the
    KV head's query heads, in blocks of at most 16: the mma's rows); each warp streams its
    16-token chunks through a cp.async ring of 3 stages in dynamic shared memory and runs the
    tensor-core step on them (attention_parts.make_ring, make_mma_step); the CTA's warps are
    merged in shared memory. d=64 and d=128, any group size: no fallback to older versions.
  * plan (decode_plan): each (sequence, head group) gets its share of 8 warps per SM: one CTA of
    2, 4 or 8 warps over the whole context when that share is <= 8 warps (large batches: v9's
    plan, no split) or the context is short (<= 512 tokens: 8 warps); else partitions of 4-warp
    (one or two sequences) or 8-warp CTAs, up to MAX_SPLITS, so that one wave of resident CTAs
    covers the batch (1-8 sequences fill the 132 SMs).
  * the merge of a split context: each partition writes a record (accumulators, max, sum) and
    the partitions are merged with every load in flight at once (make_split_merge below):
    v4-v9's merge kernel looped over the partitions one dependent L2 round trip after another
    (64 partitions: ~2 x 64 round trips, most of B=1 x 8192's 20 us). Two ways, per plan:
      merge="fused": the last CTA of a (sequence, head group) to finish merges, elected by an
        atomic counter after a __threadfence (the counter is zeroed again by that CTA, so a
        launch leaves it as it found it: CUDA-graph replays need nothing else);
      merge="kernel": a second kernel, one CTA per (sequence, query head), for many partitions
        (the fused merge would put all of a head group's records on one SM).
A sequence of a ragged batch whose context fits one partition writes its output directly.

Entry points (this file stands alone: the journey's versions are in decode_journey.py):
    paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, out=None,
                    validate=True, max_context_len=None, plan=None)   torch tensors on CUDA
    launch(q, k_cache, v_cache, block_tables, context_lens, out, scale, ...)
                                    raw-bit numba device arrays, or numpy under the simulator
    decode_plan(...)                the launch plan of v10 for a shape (DecodePlan)
    launch_v10(args, stream, plan=None)   v10 on attention_parts.LaunchArgs (the journey's entry 10)
"""
from dataclasses import dataclass, replace
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32

from kernels_numba import bridge
from kernels_numba.attention_parts import (
    CHUNK,
    MAX_SPLITS,
    NEG_INF,
    launch_args,
    make_ring,
    make_warp_merge,
    ring_bytes,
    torch_launch_args,
)
from kernels_numba.common import (f32_bits, f32_from_bits, f32x2_to_bf16x2, f32x2_to_f16x2, inline_device,
                                  load_u32x4, warp_max, warp_sum)
from kernels_numba.errors import KernelLaunchError
from kernels_numba.launcher import launch as launch_kernel

MAX_HEADS_PER_CTA = 16  # the mma's 16 rows; a larger group is cut into head blocks
STAGES = 3  # ring stages per warp: 2 chunks in flight (deeper rings measured <= 5% better, docs/kernels.md, "v9")
WARPS_PER_SM = 8  # about 8 warps per SM stream the pool as fast as 16 (docs/kernels.md, "v9's sweep")
SPLIT_WARPS = 4  # warps per CTA once a context is split, for the fewest (sequence, head group) pairs ...
SPLIT_WARPS_MANY = 8  # ... and once a pair's share is at most MANY_PAIRS_SHARE warps (3 or more sequences)
MANY_PAIRS_SHARE = 128
SHORT_CONTEXT = 512  # up to this many tokens a context is never split: one CTA of up to 8 warps
FUSED_MERGE_MAX_SPLITS = 16  # beyond, the merge kernel spreads the records over more SMs
MERGE_THREADS = 128


def head_blocks(group):
    """(blocks, heads per block) of a KV head's `group` query heads: blocks of <= 16 heads."""
    blocks = -(-group // MAX_HEADS_PER_CTA)
    return blocks, -(-group // blocks)


# ----------------------------------------------------------------------------------------------
# the split-KV records and their merge


def record_words(head_dim, heads):
    """Words of one partition's record: accumulators [heads * D], then max [heads] and sum [heads]
    (f32 bits), padded to whole 16-byte units."""
    return heads * head_dim + -(-2 * heads // 4) * 4


@lru_cache(maxsize=None)
def make_split_merge(head_dim, heads, per_call, threads, is_bf16):
    """merge_splits(part, base, n, h_first, h_count, smem, out, s, h_out, tid): the output of heads
    h_first .. h_first + h_count - 1 (h_count <= per_call) of a head group from its n partitions'
    records (record i at part[base + i * record_words(head_dim, heads)], flat uint32 f32 bits), into
    out [S, H, D/2] pairs at heads h_out ... Called by every thread of a CTA of `threads` threads;
    smem: uint32 shared memory of merge_smem_words(...) words (synchronised inside).

    Every load is issued before its value is needed, so a merge costs a couple of L2 round trips
    whatever n is: (1) per head, a warp loads all n maxima and sums at once (lane i + 32 k), reduces
    them with shuffles and writes the weights 2^(m_i - M) / L to shared memory; (2) the threads split
    into J groups of splits x (h_count * D/4) quads, each loads 8 records' 16-byte quads before
    adding them, and the groups' sums meet in shared memory."""
    D, GB, HC, NT = head_dim, heads, per_call, threads
    NWM = NT // 32
    REC = record_words(D, GB)
    MK = MAX_SPLITS // 32
    Q4 = D // 4  # 16-byte quads of one head's accumulators
    QT = min(NT, HC * Q4)  # threads across quads
    J = NT // QT  # split groups
    UN = 8  # records loaded together
    R_OFF = MAX_SPLITS * HC  # the split groups' sums follow the weights
    pack = f32x2_to_bf16x2 if is_bf16 else f32x2_to_f16x2

    @inline_device
    def merge_splits(part, base, n, h_first, h_count, smem, out, s, h_out, tid):
        warp = tid >> 5
        lane = tid & 31
        for hh in range(warp, h_count, NWM):
            h = h_first + hh
            mw = cuda.local.array(MK, float32)
            for k in range(MK):
                i = lane + 32 * k
                mw[k] = f32_from_bits(part[base + i * REC + GB * D + h]) if i < n else NEG_INF
            mx = mw[0]
            for k in range(1, MK):
                mx = max(mx, mw[k])
            mx = warp_max(mx)
            den = float32(0.0)
            for k in range(MK):
                i = lane + 32 * k
                if i < n:
                    mw[k] = math.exp2(mw[k] - mx)
                    den += mw[k] * f32_from_bits(part[base + i * REC + GB * D + GB + h])
            inv = float32(1.0) / warp_sum(den)
            for k in range(MK):
                i = lane + 32 * k
                if i < n:
                    smem[i * HC + hh] = f32_bits(mw[k] * inv)
        cuda.syncthreads()
        jj = tid // QT
        q0 = tid - jj * QT
        for q in range(q0, h_count * Q4, QT):
            if jj < J:
                hh = q // Q4
                off = (h_first + hh) * D + 4 * (q - hh * Q4)
                a0 = float32(0.0)
                a1 = float32(0.0)
                a2 = float32(0.0)
                a3 = float32(0.0)
                for i0 in range(jj * UN, n, J * UN):
                    for u in range(UN):
                        i = i0 + u
                        if i < n:
                            w = f32_from_bits(smem[i * HC + hh])
                            x = load_u32x4(part, base + i * REC + off)
                            a0 += w * f32_from_bits(x[0])
                            a1 += w * f32_from_bits(x[1])
                            a2 += w * f32_from_bits(x[2])
                            a3 += w * f32_from_bits(x[3])
                if J == 1:
                    out[s, h_out + hh, 2 * (q - hh * Q4)] = pack(a0, a1)
                    out[s, h_out + hh, 2 * (q - hh * Q4) + 1] = pack(a2, a3)
                else:
                    smem[R_OFF + 4 * tid] = f32_bits(a0)
                    smem[R_OFF + 4 * tid + 1] = f32_bits(a1)
                    smem[R_OFF + 4 * tid + 2] = f32_bits(a2)
                    smem[R_OFF + 4 * tid + 3] = f32_bits(a3)
        if J > 1:
            cuda.syncthreads()
            if tid < h_count * Q4:  # J > 1: one quad per thread, tid = q of group 0
                hh = tid // Q4
                a0 = float32(0.0)
                a1 = float32(0.0)
                a2 = float32(0.0)
                a3 = float32(0.0)
                for j in range(J):
                    a0 += f32_from_bits(smem[R_OFF + 4 * (j * QT + tid)])
                    a1 += f32_from_bits(smem[R_OFF + 4 * (j * QT + tid) + 1])
                    a2 += f32_from_bits(smem[R_OFF + 4 * (j * QT + tid) + 2])
                    a3 += f32_from_bits(smem[R_OFF + 4 * (j * QT + tid) + 3])
                out[s, h_out + hh, 2 * (tid - hh * Q4)] = pack(a0, a1)
                out[s, h_out + hh, 2 * (tid - hh * Q4) + 1] = pack(a2, a3)

    return merge_splits


def merge_smem_words(per_call, threads):
    """Shared memory (uint32 words) make_split_merge's function needs."""
    return MAX_SPLITS * per_call + 4 * threads


# ----------------------------------------------------------------------------------------------
# the kernels


@bridge.disk_cached
@lru_cache(maxsize=None)
def make_decode_kernel(head_dim, block_size, group, is_bf16, warps, stages=STAGES, fused_merge=True):
    """v10's kernel for one compile-time shape; grid (num_kv_heads * head blocks, num_seqs, splits),
    `warps` * 32 threads, ring_bytes(head_dim, stages, warps) bytes of dynamic shared memory."""
    D, G, NW = head_dim, group, warps
    P = D // 2
    HB, GB = head_blocks(G)
    WARP_WORDS = ring_bytes(D, stages, 1) // 4
    FLAG = NW * WARP_WORDS - 1  # a ring word for the election's result
    REC = record_words(D, GB)
    assert WARP_WORDS >= GB * D + 2 * GB, "the ring must hold a warp's partial results"
    assert FLAG >= merge_smem_words(GB, NW * 32), "the ring must hold the merge's weights"
    attend_partition = make_ring(D, block_size, GB, is_bf16, NW, stages)
    combine_pair = make_warp_merge(D, GB, 1 if GB <= 8 else 2, NW)[1]
    merge_splits = make_split_merge(D, GB, GB, NW * 32, is_bf16)
    pack = f32x2_to_bf16x2 if is_bf16 else f32x2_to_f16x2
    warps_per_sm = 16 if D == 64 else 8  # registers: <= 128 per thread at d=64, <= 255 at d=128
    jit_options = {} if bridge.SIMULATOR else {"launch_bounds": (NW * 32, max(1, warps_per_sm // NW))}

    @cuda.jit(**jit_options)
    def paged_attention_decode(q, k_flat, v_flat, block_tables, context_lens, out, part, counters, scale,
                               partition):
        # q, out: [S, H, D/2] pairs; k_flat, v_flat: the pool [NB, KVH, BS, D] as flat 32-bit pairs;
        # part: flat uint32 records [S, KVH * HB, splits, REC] (when split); counters: int32
        # [S * KVH * HB], zero before and after a launch (fused merge)
        hgi, s, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        groups = cuda.gridDim.x
        tid = cuda.threadIdx.x
        kvh = hgi // HB
        hb = hgi - kvh * HB
        h0 = kvh * G + hb * GB  # first query head of this head group
        nh = min(GB, G - hb * GB)  # its heads
        ctx = context_lens[s]
        # this sequence's partitions (never more than the grid has: a context past max_context_len
        # is cut short, and the election below still counts to n)
        n = min((ctx + partition - 1) // partition, cuda.gridDim.z)
        if split >= n:
            return  # the whole CTA: this split lies past the sequence
        start = split * partition
        ring = cuda.shared.array(0, uint32)
        attend_partition(ring, q, k_flat, v_flat, block_tables, s, kvh, groups // HB, h0, nh, start,
                         min(ctx, start + partition), scale, tid)
        rec0 = (s * groups + hgi) * cuda.gridDim.z * REC  # this (sequence, head group)'s first record
        rec = rec0 + split * REC
        for i in range(tid, nh * P, NW * 32):  # pairs of dims (h, d), (h, d + 1)
            h = i // P
            d = 2 * (i - h * P)
            mx, num0, num1, den = combine_pair(ring, WARP_WORDS, h, d)
            if n == 1:
                out[s, h0 + h, d >> 1] = pack(num0 / den, num1 / den)
            else:
                part[rec + h * D + d] = f32_bits(num0)
                part[rec + h * D + d + 1] = f32_bits(num1)
                if d == 0:
                    part[rec + GB * D + h] = f32_bits(mx)
                    part[rec + GB * D + GB + h] = f32_bits(den)
        if fused_merge and n > 1:
            # the last of the sequence's n CTAs for this head group merges their records
            cuda.threadfence()  # this thread's record words are visible GPU-wide before the count
            cuda.syncthreads()  # ... every thread's
            if tid == 0:
                done = cuda.atomic.add(counters, s * groups + hgi, 1)
                ring[FLAG] = 1 if done == n - 1 else 0
            cuda.syncthreads()
            if ring[FLAG] == 1:
                cuda.threadfence()  # ... and the other CTAs' records to this one
                if tid == 0:
                    counters[s * groups + hgi] = 0  # as the launch found it (graph replays)
                merge_splits(part, rec0, n, 0, nh, ring, out, s, h0, tid)

    return paged_attention_decode


@bridge.disk_cached
@lru_cache(maxsize=None)
def make_merge_kernel(head_dim, group, is_bf16):
    """v10's merge kernel (merge="kernel"): grid (num_kv_heads * head blocks * heads per block,
    num_seqs), MERGE_THREADS threads: one CTA per (query head, sequence) merges that head's records."""
    D, G = head_dim, group
    HB, GB = head_blocks(G)
    REC = record_words(D, GB)
    SMEM = merge_smem_words(1, MERGE_THREADS)
    merge_splits = make_split_merge(D, GB, 1, MERGE_THREADS, is_bf16)

    @cuda.jit
    def merge_decode_splits(part, context_lens, out, partition, splits):
        # part, out: as paged_attention_decode's; splits: its grid z
        x, s = cuda.blockIdx.x, cuda.blockIdx.y
        hgi = x // GB
        h = x - hgi * GB  # head within the head group
        kvh = hgi // HB
        hb = hgi - kvh * HB
        n = min((context_lens[s] + partition - 1) // partition, splits)
        if h >= min(GB, G - hb * GB) or n <= 1:
            return  # a head slot past the group, or a sequence the main kernel finished
        smem = cuda.shared.array(SMEM, uint32)
        base = (s * (cuda.gridDim.x // GB) + hgi) * splits * REC
        merge_splits(part, base, n, h, 1, smem, out, s, kvh * G + hb * GB + h, cuda.threadIdx.x)

    return merge_decode_splits


# ----------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class DecodePlan:
    """How v10 is launched for one shape: `splits` partitions of `partition` tokens (a multiple of
    16 * warps) per context, CTAs of `warps` warps with rings of `stages` stages, and how split
    contexts are merged ("fused" into the last CTA, or a "kernel" of its own; "none": no split)."""

    splits: int
    partition: int
    warps: int
    stages: int = STAGES
    merge: str = "none"


def decode_plan(num_seqs, num_kv_heads, group, max_context_len, num_sms, splits=None, warps=None, merge=None):
    """v10's plan for a batch whose contexts are at most max_context_len tokens.

    Each (sequence, head group) gets w = the power of two at or below WARPS_PER_SM * num_sms / pairs
    warps (at least 2):
        w <= 8       one CTA of w warps over the whole context (large batches, as v9)
        w > 8        contexts of <= SHORT_CONTEXT tokens: one CTA of 8 warps (a split's records and merge
                     cost more than its parallelism gains there); longer ones: CTAs of c warps over
                     min(w / c, MAX_SPLITS, ctx / (32 c)) partitions, so that the batch's CTAs are about one
                     wave; c = 4 for the fewest pairs (w > MANY_PAIRS_SHARE at 132 SMs: 1-4 pairs, e.g. one
                     or two sequences of 2 KV heads), 8 for more; merged "fused" up to FUSED_MERGE_MAX_SPLITS
                     partitions, by the merge "kernel" beyond
    (the choices measured by scripts/tune_splits.py: docs/kernels.md, "v10's sweep")
    splits, warps, merge: override the plan's choice."""
    pairs = max(1, num_seqs * num_kv_heads * head_blocks(group)[0])
    share = max(2, 1 << max(0, (WARPS_PER_SM * num_sms // pairs).bit_length() - 1))
    short = share > 8 and max_context_len <= SHORT_CONTEXT
    if share <= 8:
        plan_warps = share
    elif short:
        plan_warps = 8
    else:
        plan_warps = SPLIT_WARPS if share > MANY_PAIRS_SHARE else SPLIT_WARPS_MANY
    w = plan_warps if warps is None else warps
    step = CHUNK * w
    if splits is None:
        splits = 1 if share <= 8 or short else min(share // w, MAX_SPLITS, max(1, max_context_len // (2 * step)))
    partition = -(-max_context_len // min(splits, MAX_SPLITS))
    partition = -(-partition // step) * step
    splits = -(-max_context_len // partition)
    if merge is None:
        merge = "none" if splits == 1 else ("fused" if splits <= FUSED_MERGE_MAX_SPLITS else "kernel")
    return DecodePlan(splits, partition, w, STAGES, merge)


def launch_v10(a, stream, plan=None):
    """v10 on LaunchArgs `a`; plan: a DecodePlan to use instead of decode_plan's."""
    plan = plan or decode_plan(a.num_seqs, a.num_kv_heads, a.group, a.max_context_len, a.num_sms)
    if plan.splits * plan.partition < a.max_context_len or not 1 <= plan.splits <= MAX_SPLITS:
        raise KernelLaunchError(f"{plan} does not cover max_context_len={a.max_context_len} in <= {MAX_SPLITS} splits")
    if plan.splits > 1 and plan.merge == "none":
        plan = replace(plan, merge="fused")
    fused = plan.merge == "fused"
    num_blocks, per_block = head_blocks(a.group)
    groups = a.num_kv_heads * num_blocks
    kernel = make_decode_kernel(a.head_dim, a.block_size, a.group, a.is_bf16, plan.warps, plan.stages, fused)
    if plan.splits > 1:
        part = a.scratch((a.num_seqs * groups * plan.splits * record_words(a.head_dim, per_block),), np.uint32)
        counters = a.scratch((a.num_seqs * groups,), np.int32, zero=True)
    else:  # unused
        part = a.scratch((4,), np.uint32)
        counters = a.scratch((1,), np.int32, zero=True)
    args = (a.q32, a.k32, a.v32, a.block_tables, a.context_lens, a.out32, part, counters, a.scale, plan.partition)
    smem = ring_bytes(a.head_dim, plan.stages, plan.warps)
    bridge.allow_dynamic_smem(kernel, args, smem)
    launch_kernel(kernel, (groups, a.num_seqs, plan.splits), plan.warps * 32, args, stream, smem)
    if plan.splits > 1 and not fused:
        merge = make_merge_kernel(a.head_dim, a.group, a.is_bf16)
        launch_kernel(merge, (groups * per_block, a.num_seqs), MERGE_THREADS,
                      (part, a.context_lens, a.out32, plan.partition, plan.splits), stream)


# ----------------------------------------------------------------------------------------------
# entry points


def launch(q, k_cache, v_cache, block_tables, context_lens, out, scale=None, is_bf16=False, max_context_len=None,
           stream=0, scratch=None, plan=None):
    """Low-level launcher of v10: raw-bit arrays, no validation of values.

    q, out: [num_seqs, num_heads, head_dim] uint16/int16 holding fp16 or bf16 bits
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] uint16/int16 bits
    block_tables: [num_seqs, max_blocks] int32; context_lens: [num_seqs] int32 (>= 1)
    Arrays are numba device arrays (any stream) or, under the simulator, numpy arrays.
    is_bf16: the bits are bf16 (else fp16). max_context_len: >= every context length
    (default max_blocks * block_size); it sizes scratch buffers and the split plans.
    scratch(shape, dtype=np.float32, zero=False) -> array (default: numpy under the simulator,
    numba device arrays otherwise). plan: a DecodePlan instead of decode_plan's.
    """
    args = launch_args(q, k_cache, v_cache, block_tables, context_lens, out, scale, is_bf16, max_context_len,
                       stream, scratch)
    launch_v10(args, stream, plan)
    return out


def clear_caches():
    """Drop the cached numba views (they keep their tensors alive) and scratch buffers."""
    bridge.clear_caches()


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, out=None, validate=True,
                    max_context_len=None, plan=None):
    """Decode attention over the paged KV pool (v10), launched on torch's current CUDA stream.

    q: [num_seqs, num_heads, head_dim] float16/bfloat16, one query token per sequence
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim], q's dtype
    block_tables: [num_seqs, max_blocks] int32 physical block ids (entries past a sequence's
        last block are never read)
    context_lens: [num_seqs] int32, tokens each query attends to (>= 1, the new one included)
    scale: softmax scale, default 1/sqrt(head_dim).
    out: optional [num_seqs, num_heads, head_dim] in q's dtype, written in place.
    validate: also check context lengths and block-table entries against the pool (one
        device->host sync, ~0.1 ms; skipped automatically inside CUDA-graph capture).
    max_context_len: an upper bound on context_lens (default max_blocks * block_size); the split
        plans are chosen from it (fixed for a captured graph), so a tight bound helps short batches.
    plan: a DecodePlan instead of decode_plan's (scripts/tune_splits.py).
    Supported: head_dim 64/128, block_size 8/16/32, any num_heads % num_kv_heads == 0.
    Returns out: [num_seqs, num_heads, head_dim], q's dtype. Under NUMBA_ENABLE_CUDASIM=1 the
    tensors are CPU tensors and the kernels run in numba's simulator.
    """
    args, out = torch_launch_args(q, k_cache, v_cache, block_tables, context_lens, scale, out, validate,
                                  max_context_len, tensors=True)
    with bridge.device_guard(q.device):
        launch_v10(args, bridge.torch_stream(q.device), plan)
    return out
