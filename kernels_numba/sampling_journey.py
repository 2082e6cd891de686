"""The sampling journey's versions side by side: v1 itself, {version: entry} and the entry point that runs any one.

v1: one CTA per row: the hot kernel (make_hot_kernel below) and the fallback kernel
    (sampling.make_fallback_kernel, which v2 reuses) after it.
v2: adds rows split over several CTAs (split_chunks(N, V) per row, partials merged by the next
    pass; the skip bound against the raw argmax, a lower bound of Z_k): the engine's path,
    sampling.sample_cuda (sampling.py stands alone; this file imports it, never the reverse).

v1's hot kernel (two CTAs of 448 threads per SM, 72 registers):
    pass 1  raw max, logsumexp (online) and argmax.                       greedy rows end here.
    pass 2  m = max x; the Gumbel argmax j over all tokens and Z = sum of weights. A token whose
            x + 17 (above the largest noise) is below m - 3 (below the smallest noise of the top
            token) cannot win: no noise is drawn for it.                  rows without top_k/top_p end.
    pass 3  count and mass of the tokens ranked before j: j is S's argmax when it is in S (the test of
            sampling.py's pass 3); for top_k with top_p, the counts at or above m - LADDER[q], where
            the fallback's selection of the top k starts.
It finishes every row it can and leaves, for the others, its results in the state record
(sampling.STATE_I64, STATE_F32). The fallback kernel (the radix selections; ~160 registers at
FALLBACK_THREADS, 24 KiB of shared memory), launched right after on the same stream with the same grid,
returns at once for the rows that are done. (One kernel with both needs 128 registers: one CTA of 512
threads per SM for every row.)

Every version takes the same arguments in the same order (torch tensors, CUDA or the simulator's CPU):
    VERSIONS[n](logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs,
                threads=, fallback_threads=, nbins_log2=)
and v2 also takes chunks= (CTAs per row). Both return (out_tokens, out_logprobs) and give the same
tokens as reference/sampling.py (tests/test_sampler.py); scripts/bench_sampling.py times both.
launch_v1(words, ...) runs v1 on numba device arrays (sampling.launch_split's arguments without chunks
and the partials).
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda

from kernels_numba.bridge import check_tensor, disk_cached
from kernels_numba.common import SIMULATOR
from kernels_numba.errors import KernelLaunchError
from kernels_numba.launcher import launch as launch_kernel
from kernels_numba.sampling import (FALLBACK_THREADS, LADDER, NBINS_LOG2, THREADS, make_fallback_kernel, run_on_stream,
                                    sample_cuda, torch_launch_args)
from kernels_numba.sampling_parts import FAST_MARGIN, GPU, fast_gumbel, make_block_ops, make_loaders
from kernels_numba.sampling_rule import G_MAX, G_MIN, NEG_INF, check_args

# ----------------------------------------------------------------------------------------
# v1: one CTA per row


@disk_cached
@lru_cache(maxsize=None)
def make_hot_kernel(kind, vec, threads=THREADS):
    """Passes 1-3 for logits of `kind` read as in make_loaders, one CTA of `threads` per row."""
    load4, load1 = make_loaders(kind, vec)
    ops = make_block_ops(threads)
    block_sum, block_argmax, block_lse = ops.sum, ops.argmax, ops.lse
    philox, gumbel, weight, scaled, add = GPU.philox, GPU.gumbel, GPU.weight, GPU.scaled, GPU.add
    inverse_temperature = GPU.inverse_temperature
    NW = threads // 32

    @cuda.jit(device=True)
    def hot_row(words, row, vocab, temperature, top_k, top_p, seed, comp_index, position, state_f, shf, shg, shi):
        """Returns (token or -1 when the row is left to the fallback kernel, the state). Writes
        (rmax, lse) to state_f[row] at once: fewer live registers in passes 2 and 3."""
        tid = cuda.threadIdx.x
        groups = (vocab + 3) // 4
        zero = np.int64(0)

        # pass 1: raw max, sum of exp(l - max) (online), argmax
        rmax, rsum, ridx = NEG_INF, np.float32(0), np.int64(vocab)
        for g in range(tid, groups, threads):
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
            state_f[row, 0] = rmax
            state_f[row, 1] = rmax + math.log(rsum) if rsum > 0 else NEG_INF
        if ridx >= vocab:                                # a row of -inf: token 0
            ridx = zero
        if not (temperature > 0) or rmax == NEG_INF:
            return ridx, (zero, zero, zero, zero, zero, zero, zero, zero)

        # pass 2: the Gumbel argmax j over all tokens; the total weight Z
        inv_t = inverse_temperature(temperature)
        m = scaled(rmax, inv_t)                          # = max x (x is monotone in l)
        lb = add(m, G_MIN)                               # the top token scores at least this
        k0, k1 = np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)
        kk = np.int64(top_k) if 0 < top_k < vocab else np.int64(vocab)
        use_p = top_p < 1
        filtered = kk < vocab or use_p
        best, j, total = NEG_INF, np.int32(vocab), zero     # j: int32 (V < 2**21), one register
        for g in range(tid, groups, threads):
            ls = load4(words, row, g, vocab)
            # x is monotone in l: the group's largest x decides whether any of the 4 can win
            if add(scaled(max(max(ls[0], ls[1]), max(ls[2], ls[3])), inv_t), G_MAX) >= lb:
                r = philox(position, comp_index, g, 0, k0, k1)
                for e in range(4):
                    x = scaled(ls[e], inv_t)
                    if add(x, G_MAX) >= lb and x + fast_gumbel(r[e]) + FAST_MARGIN >= best:
                        s = add(x, gumbel(r[e]))
                        if s > best:
                            best, j = s, np.int32(4 * g + e)
            if filtered:
                for e in range(4):
                    total += weight(scaled(ls[e], inv_t), m)
        best, j = block_argmax(best, np.int64(j), shf, shi)
        if not filtered:
            return j, (zero, zero, zero, zero, zero, zero, zero, zero)
        total = block_sum(total, shi)

        # pass 3: count and mass ranked before j; for top_k with top_p, the counts above m - LADDER[q]
        xj = scaled(load1(words, row, j, vocab), inv_t)
        ladder = kk < vocab and use_p
        taus = (add(m, -LADDER[0]), add(m, -LADDER[1]), add(m, -LADDER[2]), add(m, -LADDER[3]))
        cnt, mass = np.int32(0), zero                    # counts < 2**21 fit int32 (fewer registers)
        c0, c1, c2, c3 = np.int32(0), np.int32(0), np.int32(0), np.int32(0)
        for g in range(tid, groups, threads):
            ls = load4(words, row, g, vocab)
            for e in range(4):
                i = 4 * g + e
                x = scaled(ls[e], inv_t)
                if x > xj or (x == xj and i < j):
                    cnt += np.int32(1)
                    mass += weight(x, m)
                if ladder:
                    c0 += np.int32(x >= taus[0])
                    c1 += np.int32(x >= taus[1])
                    c2 += np.int32(x >= taus[2])
                    c3 += np.int32(x >= taus[3])
        cnt = block_sum(np.int64(cnt), shi)
        mass = block_sum(mass, shi)
        c0, c1, c2, c3 = np.int64(c0), np.int64(c1), np.int64(c2), np.int64(c3)
        if ladder:
            c0, c1, c2, c3 = block_sum(c0, shi), block_sum(c1, shi), block_sum(c2, shi), block_sum(c3, shi)
            token = np.int64(-1)                         # needs Z_k: the fallback kernel decides
        elif use_p:
            token = j if np.float64(mass) < np.float64(top_p) * np.float64(total) else np.int64(-1)
        else:
            token = j if cnt < kk else np.int64(-1)
        return token, (j, cnt, mass, total, c0, c1, c2, c3)

    def hot(words, vocab, temperature, top_k, top_p, seed, comp_index, position, out_tokens, out_logprobs,
            state_i, state_f):
        row = cuda.blockIdx.x
        shf = cuda.shared.array(NW, np.float32)
        shg = cuda.shared.array(NW, np.float32)
        shi = cuda.shared.array(NW, np.int64)
        token, st = hot_row(words, row, np.int64(vocab), temperature[row], top_k[row], top_p[row], seed[row],
                            comp_index[row], position[row], state_f, shf, shg, shi)
        if cuda.threadIdx.x == 0:
            for k in range(8):
                state_i[row, k] = st[k]
            state_i[row, 8] = token < 0
            if token >= 0:
                out_tokens[row] = token
                out_logprobs[row] = load1(words, row, token, np.int64(vocab)) - state_f[row, 1]

    # two CTAs per SM (72 registers at 448 threads; at 512, 64 registers spill); the element-wise loads
    # of the unaligned path need more
    return cuda.jit(hot) if SIMULATOR else cuda.jit(launch_bounds=(threads, 2 if vec else 1))(hot)


def launch_v1(words, vocab, kind, vec, temperature, top_k, top_p, seed, comp_index, position, out_tokens,
              out_logprobs, state_i, state_f, stream=0, threads=THREADS, fallback_threads=FALLBACK_THREADS,
              nbins_log2=NBINS_LOG2):
    """Launch the hot kernel, then the fallback kernel, one CTA per row each, no checks. Arguments as in
    sampling.launch_split, without chunks and the partials: state_i [N, 9] int64 and state_f [N, 2]
    float32 carry the hot kernel's results to the fallback kernel."""
    n = out_tokens.shape[0]
    if n == 0:
        return
    args = (words, vocab, temperature, top_k, top_p, seed, comp_index, position, out_tokens, out_logprobs,
            state_i, state_f)
    launch_kernel(make_hot_kernel(kind, bool(vec), threads), n, threads, args, stream)
    launch_kernel(make_fallback_kernel(kind, bool(vec), fallback_threads, nbins_log2), n, fallback_threads, args,
                  stream)


def sample_v1(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs,
              threads=THREADS, fallback_threads=FALLBACK_THREADS, nbins_log2=NBINS_LOG2):
    """v1: the arguments of sampling.sample_cuda (without chunks), one CTA per row."""
    params = (temperature, top_k, top_p, seed, index, position)
    check_args(logits, params, out_tokens, out_logprobs, check_tensor)
    if logits.shape[0] == 0:
        return out_tokens, out_logprobs
    words, vocab, kind, vec, args = torch_launch_args(logits, *params, out_tokens, out_logprobs, 0)
    config = dict(threads=threads, fallback_threads=fallback_threads, nbins_log2=nbins_log2)
    run_on_stream(logits.device, lambda **kw: launch_v1(words, vocab, kind, vec, *args, **kw, **config))
    return out_tokens, out_logprobs


# ----------------------------------------------------------------------------------------
# the journey

PRODUCTION_VERSION = 2
VERSIONS = {1: sample_v1, PRODUCTION_VERSION: sample_cuda}


def entry(version):
    """VERSIONS[version]; KernelLaunchError for a version the journey does not have."""
    if version not in VERSIONS:
        raise KernelLaunchError(f"version={version!r} is not one of {sorted(VERSIONS)}")
    return VERSIONS[version]


def sample(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs,
           version=PRODUCTION_VERSION, **options):
    """Version `version` (1, 2) with sampling.sample_cuda's arguments; options: threads=,
    fallback_threads=, nbins_log2=, and chunks= for v2. Returns (out_tokens, out_logprobs)."""
    return entry(version)(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs,
                          **options)
