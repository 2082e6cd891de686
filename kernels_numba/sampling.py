"""Sampling on the GPU, the engine's: numba CUDA kernels from logits to tokens (v2 of the sampling journey).

The rule is sampling_rule.py's (reference/sampling.py writes it out in numpy); these kernels, the CPU
sampler (sampling_cpu.py) and the reference give the same tokens bit for bit. The kernels are built from
sampling_parts.py's device pieces (the rule's device functions, the loads, the CTA reductions and the
merges of partials).

CUDA: no sort, no global atomics; the row is read in groups of 4 tokens (one 16-byte load of float32
or one 8-byte load of fp16/bf16 when V % 4 == 0, and one Philox call for all 4). The versions
(sampling_journey.py holds v1 and {version: entry}, and runs any one; this file ships v2 and stands alone):
    v1: one CTA per row: the hot kernel (passes 1-3) and the fallback kernel.
    v2: adds rows split over several CTAs: the split path below (the engine's), whose last kernel is
        v1's fallback kernel run on the merged partials.
The passes (both versions):
    pass 1  raw max, logsumexp (online) and argmax.                       greedy rows end here.
    pass 2  m = max x; the Gumbel argmax j over all tokens and Z = sum of weights; tokens that cannot
            beat a score already known draw no noise.                     rows without top_k/top_p end.
    pass 3  count and mass of the tokens ranked before j. j is in S when count < top_k and mass <
            top_p * Z (S is a prefix of the ranking); then j, which beat a superset, is S's argmax.
            That happens with probability 1 - (mass outside S): ~95% of top_p = 0.95 rows end here.
split path (v2): each pass is a kernel over split_chunks(N, V) CTAs per row (64 at N = 1, 1 from
    N = 264 on), the next kernel merging the row's partials; pass 2 draws noise only for tokens that
    could beat the raw argmax's score, and top_k with top_p bounds Z_k from below before it falls back
    to a selection (the notes above make_split_kernels say how and why both are exact); the last kernel
    decides every row and runs the fallback below for the rows left undecided.
fallback kernel (v1 launches it after its hot kernel; it returns at once for the rows that ended):
    top_k with top_p needs Z_k, the mass of the top k: a selection by count first, then pass 3's test.
    Else S's boundary by radix selection over the order-preserving uint32 keys of x: 2048 bins of
    (count, mass) in shared memory per level, the first level spanning only the keys that can matter
    (those ranked before j), a tie group at the boundary cut by index the same way; then one pass for
    the argmax over S with the same noise, regenerated from Philox.

Entry points:
    sample_cuda(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs)
        v2 on torch CUDA tensors (CPU tensors under the simulator); launches on torch's current stream
        with no host sync and no allocation (after a first call per batch size), so it can be captured
        in a CUDA graph. The engine's entry (pagedattn/layers/sampler.py).
    launch_split(words, ...)   v2 on numba device arrays (numpy under the simulator), no checks;
        torch_launch_args and run_on_stream build its arguments from torch (the journey's v1 uses them too).
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda

from kernels_numba.bridge import as_array, cached_view, check_tensor, disk_cached, enable_disk_cache, scratch
from kernels_numba.common import SIMULATOR, torch_stream
from kernels_numba.launcher import launch as launch_kernel
from kernels_numba.sampling_parts import FAST_MARGIN, GPU, fast_gumbel, make_block_ops, make_loaders
from kernels_numba.sampling_rule import F32, G_MAX, G_MIN, G_TOP, NEG_INF, check_args

THREADS = 448           # per CTA of the hot kernel and the split passes: two CTAs per SM at <= 72 registers
TARGET_CTAS = 264       # the split aims at two CTAs per SM of an H200 (132 SMs) ...
MAX_CHUNKS = 64         # ... with at most this many CTAs per row
INVARIANT_CHUNKS = 16   # ... and in the batch-invariant mode, whatever the rows (invariant_chunks)
FALLBACK_THREADS = 384  # per CTA of the fallback kernel (at 512 its 128 registers spill)
NBINS_LOG2 = 11        # 2048 radix bins: 24 KiB of shared memory
LADDER = (F32(2.0), F32(4.0), F32(8.0), F32(16.0))   # top-k selection starts at the first m - d holding k

# The record one kernel leaves to the next, per row: state_i [N, 9] int64 and state_f [N, 2] float32
# (v1's hot kernel or v2's split passes write it, the fallback kernel reads it; "pending": the row is
# left to the fallback, v1 only).
STATE_I64 = ("j", "count", "mass", "total", "ladder0", "ladder1", "ladder2", "ladder3", "pending")
STATE_F32 = ("rmax", "lse")


# ----------------------------------------------------------------------------------------
# The split path: each row over `chunks` CTAs, one kernel per pass
#
# CTA b works on row b // chunks, chunk c = b % chunks: the groups [c * gpc, (c + 1) * gpc) with
# gpc = ceil(groups / chunks), so chunk boundaries fall on groups of 4 tokens (one Philox call). Each
# kernel reduces its chunk to a partial record (part_f / part_i[b]); the next kernel starts by merging
# the row's partials (ops.parts_*: every CTA of the row gets bit-identical values) and the first CTA of
# the row stores what later kernels need in the row's state. Kernel boundaries order the writes and the
# reads: no global atomics, no fences, no counters to reset, so graph replays need nothing extra.
#
#   split pass 1   raw max / sum of exp / argmax of the chunk
#   split pass 2   merge pass 1 -> state (rmax, lse; greedy token); greedy rows stop. The Gumbel argmax
#                  of the chunk with the skip bound below, and the chunk's total weight (top_k/top_p)
#   split pass 3   merge pass 2 -> state (j, Z); rows without top_k/top_p stop. Count and mass ranked
#                  before j; for top_k with top_p also the count and mass at or above m - LADDER[q]
#   split fallback merge pass 3, decide (below), write the token; rows left undecided continue with the
#                  single-CTA fallback (fallback_row), as in the one-CTA path
#
# The skip bound (pass 2). Let a be the raw argmax (x_a = m) and s_a = fl(x_a + g_a) its score; the
# winner's score S (the largest score) is >= s_a, and >= every score a thread has seen (its `best`),
# so B = max(s_a, best) <= S. Every noise g_i <= G_TOP (the noise of the largest uniform; the noise is
# monotone in u, tests/test_sampler.py checks both on every uniform), and float rounding is monotone,
# so s_i = fl(x_i + g_i) <= fl(x_i + G_TOP). A token with fl(x_i + G_TOP) < B therefore has s_i < S:
# it can neither win nor tie the winner (a tie would need s_i == S), so it needs no noise. The test is
# applied to a group's largest x first (x is monotone in l), so a group of 4 below it draws no Philox
# at all. A token at the bound (fl(x_i + G_TOP) == B) is drawn.
#
# Z_k without a selection (split fallback, top_k with top_p): j is in S iff count < K' and
# float64(mass) < float64(top_p) * float64(Z_k). Lower bounds of Z_k: the mass of the first count + 1
# ranks (those before j, and j), and the mass M_q of the tokens with x >= m - LADDER[q] when there are
# at most K' of them (they are a prefix of the ranking). Both roundings are monotone, so mass <
# top_p * (lower bound) proves j in S; otherwise the fallback computes Z_k exactly, as before.


def split_chunks(n, vocab, threads=THREADS):
    """CTAs per row for n rows of vocab logits: enough for TARGET_CTAS in all, at most MAX_CHUNKS, and
    at least one group of 4 per thread. A fixed function of (n, vocab): a captured graph stays valid."""
    groups = (vocab + 3) // 4
    return max(1, min(MAX_CHUNKS, -(-TARGET_CTAS // n), groups // threads))


def invariant_chunks(vocab, threads=THREADS):
    """CTAs per row in the batch-invariant mode (pagedattn.layers.sampler): a function of the vocabulary
    alone, so a row's partial sums and their merge are the same whatever the batch."""
    return max(1, min(INVARIANT_CHUNKS, (vocab + 3) // 4 // threads))


PART_I64 = ("ridx", "j", "total", "count", "mass", "count0", "count1", "count2", "count3", "mass0", "mass1",
            "mass2", "mass3")
PART_F32 = ("rmax", "rsum", "best")


def make_split_kernels(kind, vec, threads=THREADS):
    """(pass 1, pass 2, pass 3) kernels of the split path (_make_split_kernels), each kept in the disk cache."""
    kernels = _make_split_kernels(kind, vec, threads)
    for i, k in enumerate(kernels):
        enable_disk_cache(k, (__name__, "make_split_kernels", kind, vec, threads, i),
                          recipe=(__name__, "make_split_kernels", (kind, vec, threads), (), i))
    return kernels


@lru_cache(maxsize=None)
def _make_split_kernels(kind, vec, threads=THREADS):
    """(pass 1, pass 2, pass 3) kernels of the split path for logits of `kind` read as in make_loaders.
    Grid: rows * chunks CTAs of `threads`. All take the arguments of launch_split's kernels."""
    load4, load1 = make_loaders(kind, vec)
    ops = make_block_ops(threads)
    block_sum, block_argmax, block_lse = ops.sum, ops.argmax, ops.lse
    parts_lse, parts_argmax, parts_sum = ops.parts_lse, ops.parts_argmax, ops.parts_sum
    philox, gumbel, weight, scaled, add = GPU.philox, GPU.gumbel, GPU.weight, GPU.scaled, GPU.add
    inverse_temperature = GPU.inverse_temperature
    NW = threads // 32

    @cuda.jit(device=True)
    def chunk_range(vocab, chunks, c):
        """The groups [g0, g1) of chunk c."""
        groups = (vocab + 3) // 4
        gpc = (groups + chunks - 1) // chunks
        g0 = c * gpc
        return g0, min(groups, g0 + gpc)

    def pass1(words, vocab, chunks, temperature, top_k, top_p, seed, comp_index, position, out_tokens,
              out_logprobs, state_i, state_f, part_i, part_f):
        b = cuda.blockIdx.x
        row = b // chunks
        tid = cuda.threadIdx.x
        shf = cuda.shared.array(NW, np.float32)
        shg = cuda.shared.array(NW, np.float32)
        shi = cuda.shared.array(NW, np.int64)
        g0, g1 = chunk_range(vocab, chunks, b - row * chunks)
        rmax, rsum, ridx = NEG_INF, np.float32(0), np.int64(vocab)
        for g in range(g0 + tid, g1, threads):
            ls = load4(words, row, g, vocab)
            for e in range(4):
                v = ls[e]
                if v > rmax:
                    rsum = rsum * math.exp(rmax - v) + np.float32(1)
                    rmax, ridx = v, np.int64(4 * g + e)
                elif v > NEG_INF:
                    rsum += math.exp(v - rmax)
        rmax, rsum, ridx = block_lse(rmax, rsum, ridx, shf, shg, shi)
        if tid == 0:
            part_f[b, 0] = rmax
            part_f[b, 1] = rsum
            part_i[b, 0] = ridx

    def pass2(words, vocab, chunks, temperature, top_k, top_p, seed, comp_index, position, out_tokens,
              out_logprobs, state_i, state_f, part_i, part_f):
        b = cuda.blockIdx.x
        row = b // chunks
        c = b - row * chunks
        tid = cuda.threadIdx.x
        shf = cuda.shared.array(NW, np.float32)
        shi = cuda.shared.array(NW, np.int64)
        rmax, rsum, ridx = parts_lse(part_f, part_i, row * chunks, chunks, np.int64(vocab))
        if ridx >= vocab:                                # a row of -inf: token 0
            ridx = np.int64(0)
        if c == 0 and tid == 0:
            state_f[row, 0] = rmax
            state_f[row, 1] = rmax + math.log(rsum) if rsum > 0 else NEG_INF
            state_i[row, 0] = ridx                       # the greedy token (pass 3 puts j here)
        t = temperature[row]
        if not (t > 0) or rmax == NEG_INF:
            return
        inv_t = inverse_temperature(t)
        m = scaled(rmax, inv_t)                          # = max x = x_a
        k0, k1 = np.uint32(seed[row] & 0xFFFFFFFF), np.uint32((seed[row] >> 32) & 0xFFFFFFFF)
        pos, ci = position[row], comp_index[row]
        filtered = (0 < top_k[row] < vocab) or top_p[row] < 1
        ra = philox(pos, ci, ridx >> 2, 0, k0, k1)       # the raw argmax's noise: s_a bounds the winner
        wa, ea = ra[0], ridx & 3
        if ea == 1:
            wa = ra[1]
        elif ea == 2:
            wa = ra[2]
        elif ea == 3:
            wa = ra[3]
        s_a = add(m, gumbel(wa))
        g0, g1 = chunk_range(vocab, chunks, c)
        best, j, total = NEG_INF, np.int32(vocab), np.int64(0)
        for g in range(g0 + tid, g1, threads):
            ls = load4(words, row, g, vocab)
            bound = max(s_a, best)
            if add(scaled(max(max(ls[0], ls[1]), max(ls[2], ls[3])), inv_t), G_TOP) >= bound:
                r = philox(pos, ci, g, 0, k0, k1)
                for e in range(4):
                    x = scaled(ls[e], inv_t)
                    if add(x, G_TOP) >= max(s_a, best) and x + fast_gumbel(r[e]) + FAST_MARGIN >= best:
                        s = add(x, gumbel(r[e]))
                        if s > best:
                            best, j = s, np.int32(4 * g + e)
            if filtered:
                for e in range(4):
                    total += weight(scaled(ls[e], inv_t), m)
        best, jj = block_argmax(best, np.int64(j), shf, shi)
        if filtered:
            total = block_sum(total, shi)
        if tid == 0:
            part_f[b, 2] = best
            part_i[b, 1] = jj
            part_i[b, 2] = total

    def pass3(words, vocab, chunks, temperature, top_k, top_p, seed, comp_index, position, out_tokens,
              out_logprobs, state_i, state_f, part_i, part_f):
        b = cuda.blockIdx.x
        row = b // chunks
        c = b - row * chunks
        tid = cuda.threadIdx.x
        shi = cuda.shared.array(NW, np.int64)
        t = temperature[row]
        rmax = state_f[row, 0]
        if not (t > 0) or rmax == NEG_INF:
            return
        _, j = parts_argmax(part_f, part_i, row * chunks, chunks, np.int64(vocab))
        kk = np.int64(top_k[row]) if 0 < top_k[row] < vocab else np.int64(vocab)
        use_p = top_p[row] < 1
        if c == 0 and tid == 0:
            state_i[row, 0] = j
        if not (kk < vocab or use_p):
            return
        total = parts_sum(part_i, row * chunks, chunks, 2)   # every thread: shuffles need whole warps
        if c == 0 and tid == 0:
            state_i[row, 3] = total
        inv_t = inverse_temperature(t)
        m = scaled(rmax, inv_t)
        xj = scaled(load1(words, row, j, vocab), inv_t)
        ladder = kk < vocab and use_p
        taus = (add(m, -LADDER[0]), add(m, -LADDER[1]), add(m, -LADDER[2]), add(m, -LADDER[3]))
        cnt, mass = np.int32(0), np.int64(0)             # counts < 2**21 fit int32
        c0, c1, c2, c3 = np.int32(0), np.int32(0), np.int32(0), np.int32(0)
        w0, w1, w2, w3 = np.int64(0), np.int64(0), np.int64(0), np.int64(0)
        g0, g1 = chunk_range(vocab, chunks, c)
        for g in range(g0 + tid, g1, threads):
            ls = load4(words, row, g, vocab)
            for e in range(4):
                i = 4 * g + e
                x = scaled(ls[e], inv_t)
                before = x > xj or (x == xj and i < j)
                if before or (ladder and x >= taus[3]):
                    w = weight(x, m)
                    if before:
                        cnt += np.int32(1)
                        mass += w
                    if ladder:
                        if x >= taus[0]:
                            c0 += np.int32(1)
                            w0 += w
                        if x >= taus[1]:
                            c1 += np.int32(1)
                            w1 += w
                        if x >= taus[2]:
                            c2 += np.int32(1)
                            w2 += w
                        c3 += np.int32(1)
                        w3 += w
        cnt64 = block_sum(np.int64(cnt), shi)
        mass = block_sum(mass, shi)
        if tid == 0:
            part_i[b, 3] = cnt64
            part_i[b, 4] = mass
        if ladder:
            c0, c1 = block_sum(np.int64(c0), shi), block_sum(np.int64(c1), shi)
            c2, c3 = block_sum(np.int64(c2), shi), block_sum(np.int64(c3), shi)
            w0, w1, w2, w3 = block_sum(w0, shi), block_sum(w1, shi), block_sum(w2, shi), block_sum(w3, shi)
            if tid == 0:
                part_i[b, 5], part_i[b, 6], part_i[b, 7], part_i[b, 8] = c0, c1, c2, c3
                part_i[b, 9], part_i[b, 10], part_i[b, 11], part_i[b, 12] = w0, w1, w2, w3

    if SIMULATOR:
        return cuda.jit(pass1), cuda.jit(pass2), cuda.jit(pass3)
    jit = cuda.jit(launch_bounds=(threads, 2 if vec else 1))
    return jit(pass1), jit(pass2), jit(pass3)


@disk_cached
@lru_cache(maxsize=None)
def make_fallback_kernel(kind, vec, threads=FALLBACK_THREADS, nbins_log2=NBINS_LOG2, split=False):
    """The exact fallback for the rows v1's hot kernel (sampling_journey.py) left pending; `threads` per
    CTA (a multiple of 32), 2**nbins_log2 radix bins. split: the split path's last kernel (v2's), which
    first merges pass 3's partials, decides every row and writes its token, and continues only with the
    undecided rows."""
    assert threads % 32 == 0
    load4, load1 = make_loaders(kind, vec)
    ops = make_block_ops(threads)
    block_max, block_argmax, block_exclusive_scan = ops.max, ops.argmax, ops.exclusive_scan
    parts_sum = ops.parts_sum
    philox, gumbel, weight, scaled, key, add = GPU.philox, GPU.gumbel, GPU.weight, GPU.scaled, GPU.key, GPU.add
    inverse_temperature = GPU.inverse_temperature
    NB, NW = 1 << nbins_log2, threads // 32
    BPT = -(-NB // threads)                              # bins per thread (the last threads may own fewer)

    @cuda.jit(device=True)
    def select(words, row, vocab, inv_t, m, lo, hi, by_index, kb, target, want_mass, by_mass, thr,
               hist_c, hist_w, sh1, sh2):
        """Walk the ranking from the top to the group of equal values that holds the boundary.

        Values: key(x_i) for every token (by_index false), or vocab - 1 - i for the tokens whose key is
        kb (by_index: ranks ties by index); only values in [lo, hi] take part, and nothing above hi
        exists. The boundary is the `target`-th value from the top (by count), or (by_mass) the last
        one whose mass ranked before it, as float64, is < thr. Each level bins [lo, hi] into NB bins of
        (count, mass), finds the last bin the boundary touches and narrows [lo, hi] to it.
        Returns (value, count above its group, mass above, group size, group mass)."""
        tid = cuda.threadIdx.x
        above_c, above_w = np.int64(0), np.int64(0)
        while True:
            shift = 0
            while ((hi - lo) >> shift) >= NB:
                shift += 1
            for b in range(tid, NB, threads):
                hist_c[b] = 0
                hist_w[b] = 0
            cuda.syncthreads()
            for g in range(tid, (vocab + 3) // 4, threads):
                ls = load4(words, row, g, vocab)
                for e in range(4):
                    i = 4 * g + e
                    if i < vocab:
                        x = scaled(ls[e], inv_t)
                        v = np.int64(key(x))
                        if by_index:
                            v = vocab - 1 - i if v == kb else np.int64(-1)
                        if v >= lo and v <= hi:
                            b = (v - lo) >> shift
                            cuda.atomic.add(hist_c, b, 1)
                            if want_mass:
                                w = weight(x, m)
                                if w != 0:
                                    cuda.atomic.add(hist_w, b, w)
            cuda.syncthreads()
            # thread tid owns the bins at walk positions q = tid * BPT + s (top first): bin NB - 1 - q
            tc, tw = np.int64(0), np.int64(0)
            for s in range(BPT):
                b = NB - 1 - (tid * BPT + s)
                if b >= 0:
                    tc += hist_c[b]
                    tw += hist_w[b]
            ac, aw = block_exclusive_scan(tc, tw, sh1, sh2)   # count and mass of the bins before ours
            last = np.int64(-1)
            at_c, at_w, at_n, at_g = np.int64(0), np.int64(0), np.int64(0), np.int64(0)
            for s in range(BPT):
                q = tid * BPT + s
                b = NB - 1 - q
                c, wsum = (np.int64(hist_c[b]), hist_w[b]) if b >= 0 else (np.int64(0), np.int64(0))
                if c > 0:
                    if by_mass:
                        touched = np.float64(above_w + aw) < thr
                    else:
                        touched = above_c + ac < target
                    if touched:
                        last, at_c, at_w, at_n, at_g = q, ac, aw, c, wsum
                ac += c
                aw += wsum
            q_star = block_max(last, sh1)
            if last == q_star and last >= 0:                  # the owner of the boundary bin publishes it
                sh2[0], sh2[1], sh2[2], sh2[3] = at_c, at_w, at_n, at_g
            cuda.syncthreads()
            above_c += sh2[0]
            above_w += sh2[1]
            n, gw = sh2[2], sh2[3]
            cuda.syncthreads()
            lo = lo + ((NB - 1 - q_star) << shift)
            hi = min(hi, lo + (np.int64(1) << shift) - 1)
            if shift == 0 or q_star < 0:
                return lo, above_c, above_w, n, gw

    @cuda.jit(device=True)
    def tie_share(above_w, n, gw, thr):
        """How many of a group of n equal weights (sum gw), the first with mass above_w ranked before
        it, stay in the nucleus: the number of s in [0, n) with float64(above_w + s w) < thr."""
        w = gw // n if n > 0 else np.int64(0)
        lo, hi = np.int64(1), n                          # s = 0 stays: the group was touched
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if np.float64(above_w + (mid - 1) * w) < thr:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @cuda.jit(device=True)
    def fallback_row(words, row, vocab, temperature, top_k, top_p, seed, comp_index, position, rmax, st,
                     hist_c, hist_w, shf, sh1, sh2):
        tid = cuda.threadIdx.x
        j, cnt, mass, total = st[0], st[1], st[2], st[3]
        inv_t = inverse_temperature(temperature)
        m = scaled(rmax, inv_t)
        lb = add(m, G_MIN)
        k0, k1 = np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)
        kk = np.int64(top_k) if 0 < top_k < vocab else np.int64(vocab)
        use_p = top_p < 1
        xj = scaled(load1(words, row, j, vocab), inv_t)
        key_m, key_j = np.int64(key(m)), np.int64(key(xj))
        thr = np.float64(np.inf)
        if use_p:
            if kk < vocab:                                    # Z_k by a selection of the top k
                if cnt >= kk:
                    lo = key_j                                # the top k all rank before j
                elif st[4] >= kk:
                    lo = np.int64(key(add(m, -LADDER[0])))
                elif st[5] >= kk:
                    lo = np.int64(key(add(m, -LADDER[1])))
                elif st[6] >= kk:
                    lo = np.int64(key(add(m, -LADDER[2])))
                elif st[7] >= kk:
                    lo = np.int64(key(add(m, -LADDER[3])))
                else:
                    lo = np.int64(0)
                _, ab_c, ab_w, n, gw = select(words, row, vocab, inv_t, m, lo, key_m, False, 0, kk, True, False,
                                              0.0, hist_c, hist_w, sh1, sh2)
                w = gw // n if n > 0 else np.int64(0)          # the k-th token's group shares one weight
                thr = np.float64(np.float32(top_p)) * np.float64(ab_w + (kk - ab_c) * w)
            else:
                thr = np.float64(np.float32(top_p)) * np.float64(total)
        if cnt < kk and np.float64(mass) < thr:
            return j

        # S is a prefix of the ranking inside the tokens ranked before j: find its last element. With
        # top_p the nucleus ends at or before rank k (the mass before rank k is Z_k > thr).
        if use_p:
            vb, ab_c, ab_w, n, gw = select(words, row, vocab, inv_t, m, key_j, key_m, False, 0, 0, True, True, thr,
                                           hist_c, hist_w, sh1, sh2)
            t = tie_share(ab_w, n, gw, thr)
        else:
            vb, ab_c, ab_w, n, gw = select(words, row, vocab, inv_t, m, key_j, key_m, False, 0, kk, False, False,
                                           0.0, hist_c, hist_w, sh1, sh2)
            t = kk - ab_c
        last = np.int64(vocab - 1)                            # tokens with key vb and index <= last are in S
        if t < n:
            v, _, _, _, _ = select(words, row, vocab, inv_t, m, np.int64(0), np.int64(vocab - 1), True, vb, t,
                                   False, False, 0.0, hist_c, hist_w, sh1, sh2)
            last = vocab - 1 - v

        # the argmax over S with the same noise
        best, tok = NEG_INF, np.int64(vocab)
        for g in range(tid, (vocab + 3) // 4, threads):
            ls = load4(words, row, g, vocab)
            drawn = False
            r = (np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0))
            for e in range(4):
                i = 4 * g + e
                x = scaled(ls[e], inv_t)
                kx = np.int64(key(x))
                if i < vocab and (kx > vb or (kx == vb and i <= last)) and add(x, G_MAX) >= lb:
                    if not drawn:
                        r = philox(position, comp_index, g, 0, k0, k1)
                        drawn = True
                    if x + fast_gumbel(r[e]) + FAST_MARGIN >= best:
                        s = add(x, gumbel(r[e]))
                        if s > best:
                            best, tok = s, np.int64(i)
        best, tok = block_argmax(best, tok, shf, sh1)
        return tok

    def fallback(words, vocab, temperature, top_k, top_p, seed, comp_index, position, out_tokens, out_logprobs,
                 state_i, state_f):
        row = cuda.blockIdx.x
        if state_i[row, 8] == 0:                              # the hot kernel finished this row
            return
        hist_c = cuda.shared.array(NB, np.int32)
        hist_w = cuda.shared.array(NB, np.int64)
        shf = cuda.shared.array(NW, np.float32)
        sh1 = cuda.shared.array(NW if NW > 4 else 4, np.int64)
        sh2 = cuda.shared.array(NW if NW > 4 else 4, np.int64)
        st = (state_i[row, 0], state_i[row, 1], state_i[row, 2], state_i[row, 3], state_i[row, 4],
              state_i[row, 5], state_i[row, 6], state_i[row, 7])
        token = fallback_row(words, row, np.int64(vocab), temperature[row], top_k[row], top_p[row], seed[row],
                             comp_index[row], position[row], state_f[row, 0], st, hist_c, hist_w, shf, sh1, sh2)
        if cuda.threadIdx.x == 0:
            out_tokens[row] = token
            out_logprobs[row] = load1(words, row, token, np.int64(vocab)) - state_f[row, 1]

    def split_fallback(words, vocab, chunks, temperature, top_k, top_p, seed, comp_index, position, out_tokens,
                       out_logprobs, state_i, state_f, part_i, part_f):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        hist_c = cuda.shared.array(NB, np.int32)
        hist_w = cuda.shared.array(NB, np.int64)
        shf = cuda.shared.array(NW, np.float32)
        sh1 = cuda.shared.array(NW if NW > 4 else 4, np.int64)
        sh2 = cuda.shared.array(NW if NW > 4 else 4, np.int64)
        vocab = np.int64(vocab)
        t, tk, tp = temperature[row], top_k[row], top_p[row]
        rmax = state_f[row, 0]
        token = state_i[row, 0]                               # greedy: the argmax; sampled: j
        kk = np.int64(tk) if 0 < tk < vocab else vocab
        use_p = tp < 1
        base = row * chunks
        total = state_i[row, 3]
        cnt, mass = np.int64(0), np.int64(0)
        c0, c1, c2, c3 = np.int64(0), np.int64(0), np.int64(0), np.int64(0)
        # every thread merges (the conditions are the row's, so whole warps shuffle); exact sums: all agree
        if t > 0 and rmax > NEG_INF and (kk < vocab or use_p):
            cnt, mass = parts_sum(part_i, base, chunks, 3), parts_sum(part_i, base, chunks, 4)
            if kk < vocab and use_p:                          # Z_k from below: see the split path's notes
                c0, c1 = parts_sum(part_i, base, chunks, 5), parts_sum(part_i, base, chunks, 6)
                c2, c3 = parts_sum(part_i, base, chunks, 7), parts_sum(part_i, base, chunks, 8)
                if cnt < kk:
                    inv_t = inverse_temperature(t)
                    m = scaled(rmax, inv_t)
                    zlo = mass + weight(scaled(load1(words, row, token, vocab), inv_t), m)
                    if c0 <= kk:                              # M_q: a prefix of at most K' ranks
                        zlo = max(zlo, parts_sum(part_i, base, chunks, 9))
                    if c1 <= kk:
                        zlo = max(zlo, parts_sum(part_i, base, chunks, 10))
                    if c2 <= kk:
                        zlo = max(zlo, parts_sum(part_i, base, chunks, 11))
                    if c3 <= kk:
                        zlo = max(zlo, parts_sum(part_i, base, chunks, 12))
                    if not np.float64(mass) < np.float64(np.float32(tp)) * np.float64(zlo):
                        token = np.int64(-1)
                else:
                    token = np.int64(-1)
            elif use_p:
                if not np.float64(mass) < np.float64(tp) * np.float64(total):
                    token = np.int64(-1)
            elif cnt >= kk:
                token = np.int64(-1)
        if token < 0:
            st = (state_i[row, 0], cnt, mass, total, c0, c1, c2, c3)
            token = fallback_row(words, row, vocab, t, tk, tp, seed[row], comp_index[row], position[row], rmax, st,
                                 hist_c, hist_w, shf, sh1, sh2)
        if tid == 0:
            out_tokens[row] = token
            out_logprobs[row] = load1(words, row, token, vocab) - state_f[row, 1]

    kernel = split_fallback if split else fallback
    return cuda.jit(kernel) if SIMULATOR else cuda.jit(launch_bounds=(threads, 1))(kernel)

# ----------------------------------------------------------------------------------------
# launchers


def launch_split(words, vocab, kind, vec, chunks, temperature, top_k, top_p, seed, comp_index, position,
                 out_tokens, out_logprobs, state_i, state_f, part_i, part_f, stream=0, threads=THREADS,
                 fallback_threads=FALLBACK_THREADS, nbins_log2=NBINS_LOG2):
    """Launch the split path, no checks: passes 1-3 on rows * chunks CTAs, then the split fallback on
    one CTA per row.

    words: the [N, V] logits as one flat array of words (see sampling_parts.make_loaders): f32 ->
        int32/uint32 bits; fp16/bf16 -> int64 (vec) or int16/uint16 (not vec). kind: "f32", "f16" or
        "bf16"; vec needs V % 4 == 0 and a base aligned to the load (16 bytes f32, 8 bytes fp16/bf16).
    chunks: CTAs per row (>= 1). temperature [N] float32; top_k [N] int32; top_p [N] float32; seed [N]
    int64; comp_index, position [N] int32; out_tokens [N] int32; out_logprobs [N] float32; scratch
    passed from one kernel to the next: state_i [N, 9] int64 and state_f [N, 2] float32 (STATE_I64,
    STATE_F32), part_i [N * chunks, len(PART_I64)] int64 and part_f [N * chunks, len(PART_F32)]
    float32. numba device arrays (numpy under the simulator). stream: a numba stream.
    """
    n = out_tokens.shape[0]
    if n == 0:
        return
    args = (words, vocab, chunks, temperature, top_k, top_p, seed, comp_index, position, out_tokens, out_logprobs,
            state_i, state_f, part_i, part_f)
    for kernel in make_split_kernels(kind, bool(vec), threads):
        launch_kernel(kernel, n * chunks, threads, args, stream)
    launch_kernel(make_fallback_kernel(kind, bool(vec), fallback_threads, nbins_log2, True), n, fallback_threads,
                  args, stream)


_KINDS = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16"}


def _state(device, n, chunks=0):
    """The scratch one kernel leaves to the next, one per (device, stream, rows, chunks): (state_i, state_f)
    and, for the split path (chunks >= 1), the partials (part_i, part_f); bridge.scratch's buffers, so each
    engine's share goes when it closes (bridge.release). Calls on one stream run in order, so reusing it is
    safe, also inside a captured graph. Zeroed once: the split fallback sums partials a row does not use
    (never their values), which then stay finite."""
    shapes = [((n, len(STATE_I64)), np.int64), ((n, len(STATE_F32)), np.float32)]
    if chunks:
        shapes += [((n * chunks, len(PART_I64)), np.int64), ((n * chunks, len(PART_F32)), np.float32)]
    return tuple(scratch(device, shape, dtype, zero=True, tag="sampling") for shape, dtype in shapes)




def torch_launch_args(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs, chunks):
    """The launchers' arguments for torch tensors (checked by the caller): (words, vocab, kind, vec, args),
    args = the parameters' and outputs' views and the scratch of `chunks` CTAs per row (0: the one-CTA
    path's). Shared by sample_cuda and the journey's v1 (sampling_journey.py)."""
    import torch

    n, vocab = logits.shape
    kind = _KINDS[str(logits.dtype)]
    align = 16 if kind == "f32" else 8
    vec = vocab % 4 == 0 and logits.data_ptr() % align == 0
    words = as_array(logits.view(torch.int32 if kind == "f32" else (torch.int64 if vec else torch.int16)), flat=True)
    # the engine passes the same small static buffers step after step: their views are cached
    params = (temperature, top_k, top_p, seed, index, position)
    args = [cached_view(t) for t in params] + [cached_view(out_tokens), cached_view(out_logprobs)]
    args += list(_state(logits.device, n, chunks))
    return words, vocab, kind, vec, args


def run_on_stream(device, go):
    """go() under the simulator, else go(stream=) on torch's current stream of `device` (made current)."""
    import torch

    if SIMULATOR:
        go()
    elif torch.cuda.current_device() != device.index:
        with torch.cuda.device(device):
            go(stream=torch_stream(device))
    else:
        go(stream=torch_stream(device))


def sample_cuda(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs,
                threads=THREADS, fallback_threads=FALLBACK_THREADS, nbins_log2=NBINS_LOG2, chunks=None,
                validate=True):
    """Sample one token per row on the GPU (v2, the split path), on torch's current stream: no host sync,
    no allocation, launch configuration fixed by (N, V, dtype), so a CUDA graph can capture it.

    chunks: CTAs per row (>= 1; tests and benches force it); None: split_chunks(N, V, threads).
    validate: check every argument first (KernelLaunchError naming it); the engine, whose step arrays are
    checked once on the host, passes False.

    logits [N, V] float32/float16/bfloat16; temperature [N] float32 (<= 0: greedy); top_k [N] int32
    (<= 0 or >= V: off); top_p [N] float32 (>= 1: off); seed [N] int64 (the 64-bit key); index [N]
    int32 (completion index); position [N] int32 (tokens this completion generated before);
    out_tokens [N] int32, out_logprobs [N] float32 (written). All contiguous, on one CUDA device
    (CPU under the simulator). Returns (out_tokens, out_logprobs).
    """
    params = (temperature, top_k, top_p, seed, index, position)
    if validate:
        check_args(logits, params, out_tokens, out_logprobs, check_tensor)
    n, vocab = logits.shape
    if n == 0:
        return out_tokens, out_logprobs
    if chunks is None:
        chunks = split_chunks(n, vocab, threads)
    if chunks < 1:
        from kernels_numba.errors import KernelLaunchError

        raise KernelLaunchError(f"chunks={chunks}: the split path runs >= 1 CTA per row "
                                "(the one-CTA path is the journey's v1, sampling_journey.py)")
    words, vocab, kind, vec, args = torch_launch_args(logits, *params, out_tokens, out_logprobs, chunks)
    config = dict(threads=threads, fallback_threads=fallback_threads, nbins_log2=nbins_log2)
    run_on_stream(logits.device, lambda **kw: launch_split(words, vocab, kind, vec, chunks, *args, **kw, **config))
    return out_tokens, out_logprobs
