"""Sampling on the CPU: the rule of sampling_rule.py in numba @njit, one row after the other.

The same passes as the CUDA kernels (sampling.py), so the CPU engine returns the GPU's tokens on the same
logits and keys, and reference/sampling.py's: the raw max, logsumexp and argmax (greedy rows end here);
the Gumbel argmax j over every token (tokens that cannot win draw no noise; rows without top_k / top_p
end here); the count and mass ranked before j, and j when it lies in S; otherwise a sort of the few
tokens ranked before j (the candidates) finds S and the argmax over S with the same noise. Z_k, the
top-k mass a top_p cut needs, comes from the K'-th largest x and its tie group's shared weight.

Entry point:
    sample_cpu(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs)
        sampling.sample_cuda's arguments as CPU tensors (pagedattn/layers/sampler.py calls it).

This module never imports numba.cuda (its scalar math is sampling_rule.py's CPU build): a CPU engine's
start does not pay for it.
"""
import math

import numpy as np
import torch
from numba import njit

from kernels_numba.cpu_attention import _exp_inplace
from kernels_numba.errors import KernelLaunchError
from kernels_numba.sampling_rule import (CPU, G_MAX, G_MIN, MASK32, NEG_INF, SHIFT32, check_args, clean, gumbel,
                                         inverse_temperature, key, philox, scaled, weight)

# module-level names: numba resolves globals, not attributes of a namespace
_add_cpu = CPU.add


# ----------------------------------------------------------------------------------------
# the rule, the same passes as the kernels, a sort of the few candidates for the fallback


LSE_CHUNK = 2048


@njit(cache=True)
def _exp_total(l, top):
    """sum_i exp(clean(l[i]) - top) for the row's max `top` (finite): each term by cpu_attention's
    vectorised float32 exp (within ~4 ulp), the terms added in float64 in four interleaved sums (a fixed
    order, so the same bits every call). The raw logprob's error stays ~1e-7, far inside what its float32
    output holds; a scalar float64 exp per token cost ~1 ms of a CPU decode step at V = 152k."""
    vocab = l.shape[0]
    x, bits = np.empty(LSE_CHUNK, np.float32), np.empty(LSE_CHUNK, np.uint32)
    s0 = s1 = s2 = s3 = 0.0
    for c in range(0, vocab, LSE_CHUNK):
        n = min(LSE_CHUNK, vocab - c)
        for j in range(n):
            x[j] = clean(l[c + j]) - top                       # NaN counts as -inf: exp gives 0
        _exp_inplace(x, n, bits)
        n4 = n - n % 4
        for j in range(0, n4, 4):
            s0 += np.float64(x[j])
            s1 += np.float64(x[j + 1])
            s2 += np.float64(x[j + 2])
            s3 += np.float64(x[j + 3])
        for j in range(n4, n):
            s0 += np.float64(x[j])
    return (s0 + s1) + (s2 + s3)


@njit(cache=True)
def _row_cpu(l, temperature, top_k, top_p, seed, comp_index, position):
    """One row: l [V] float32. Returns (token, raw logprob)."""
    vocab = l.shape[0]
    top, arg = NEG_INF, 0
    for i in range(vocab):
        v = clean(l[i])
        if v > top:
            top, arg = v, i
    total = _exp_total(l, top) if top > NEG_INF else 0.0
    logprob = np.float64(clean(l[arg])) - (np.float64(top) + math.log(total)) if top > NEG_INF else np.nan
    if not (temperature > 0) or top == NEG_INF:
        return arg, logprob

    inv_t = inverse_temperature(temperature)
    x = np.empty(vocab, dtype=np.float32)
    for i in range(vocab):
        x[i] = scaled(clean(l[i]), inv_t)
    m = scaled(top, inv_t)
    lb = _add_cpu(m, G_MIN)
    k0, k1 = np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)
    kk = top_k if 0 < top_k < vocab else vocab
    use_p = top_p < 1

    # the Gumbel argmax over every token (tokens that cannot win draw no noise)
    best, j = NEG_INF, 0
    for g in range((vocab + 3) // 4):
        r = (np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0))
        drawn = False
        for e in range(4):
            i = 4 * g + e
            if i < vocab and _add_cpu(x[i], G_MAX) >= lb:
                if not drawn:
                    r = philox(position, comp_index, g, 0, k0, k1)
                    drawn = True
                s = _add_cpu(x[i], gumbel(r[e]))
                if s > best:
                    best, j = s, i
    if kk == vocab and not use_p:
        return j, np.float64(clean(l[j])) - (np.float64(top) + math.log(total))

    w = np.empty(vocab, dtype=np.int64)
    for i in range(vocab):
        w[i] = weight(x[i], m)
    xj = x[j]
    count_before, mass_before = 0, np.int64(0)
    for i in range(vocab):
        if x[i] > xj or (x[i] == xj and i < j):
            count_before += 1
            mass_before += w[i]
    thr = np.inf
    if use_p:
        if kk < vocab:                                   # Z_k: the k-th largest x and its ties' share
            tau = np.sort(x)[vocab - kk]                  # (np.partition compiles for 13 s)
            above, mass_k = 0, np.int64(0)
            for i in range(vocab):
                if x[i] > tau:
                    above += 1
                    mass_k += w[i]
            mass_k += (kk - above) * weight(tau, m)
        else:
            mass_k = w.sum()
        thr = np.float64(np.float32(top_p)) * np.float64(mass_k)
    if count_before < kk and np.float64(mass_before) < thr:
        token = j
    else:                                                # S lies in the tokens ranked before j
        cand = np.empty(count_before, dtype=np.uint64)
        n = 0
        for i in range(vocab):
            if x[i] > xj or (x[i] == xj and i < j):
                cand[n] = (np.uint64(key(x[i])) << SHIFT32) | np.uint64(0xFFFFFFFF - i)
                n += 1
        cand = np.sort(cand)[::-1]                       # rank order: key desc, index asc
        size = min(kk, count_before)
        if use_p:
            cum, size = np.int64(0), 0
            while size < min(kk, count_before) and np.float64(cum) < thr:
                cum += w[0xFFFFFFFF - np.int64(cand[size] & MASK32)]
                size += 1
        best, token = NEG_INF, -1
        for r_ in range(size):
            i = 0xFFFFFFFF - np.int64(cand[r_] & MASK32)
            s = _add_cpu(x[i], gumbel(philox(position, comp_index, i // 4, 0, k0, k1)[i % 4]))
            if s > best or (s == best and i < token):
                best, token = s, i
    return token, np.float64(clean(l[token])) - (np.float64(top) + math.log(total))


@njit(cache=True)
def _rows_cpu(logits, temperature, top_k, top_p, seed, comp_index, position, out_tokens, out_logprobs):
    for r in range(logits.shape[0]):
        token, logprob = _row_cpu(logits[r], temperature[r], top_k[r], top_p[r], seed[r], comp_index[r],
                                  position[r])
        out_tokens[r] = token
        out_logprobs[r] = logprob


def check_cpu_tensor(name, t, dim, dtypes):
    """KernelLaunchError naming `name` unless t is a CPU torch tensor with `dim` dims and a dtype in `dtypes`."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise KernelLaunchError(f"{name} must be a CPU torch.Tensor")
    if t.dim() != dim or t.dtype not in dtypes:
        raise KernelLaunchError(f"{name} must be {dim}-D {[str(d) for d in dtypes]}, got "
                                f"{tuple(t.shape)} {t.dtype}")


def sample_cpu(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs, validate=True):
    """Sample one token per row on the CPU (compiled by numba @njit, cached on disk; one row at a time).

    logits [N, V] float32/float16/bfloat16; temperature [N] float32 (<= 0: greedy); top_k [N] int32
    (<= 0 or >= V: off); top_p [N] float32 (>= 1: off); seed [N] int64 (the 64-bit key); index [N]
    int32 (completion index); position [N] int32 (tokens this completion generated before);
    out_tokens [N] int32, out_logprobs [N] float32 (written). All CPU tensors (the outputs contiguous).
    validate: check every argument first (KernelLaunchError naming it); the engine, whose step arrays are
    checked once on the host (contiguous views of the right dtypes), passes False. Returns (out_tokens,
    out_logprobs).
    """
    if validate:
        temperature, top_k, top_p, seed, index, position = (
            t.contiguous() for t in (temperature, top_k, top_p, seed, index, position))
        check_args(logits.contiguous(), (temperature, top_k, top_p, seed, index, position), out_tokens,
                   out_logprobs, check_cpu_tensor)
    if logits.shape[0] == 0:
        return out_tokens, out_logprobs
    x = logits.detach().float().contiguous().numpy()     # fp16/bf16 widen exactly
    tokens = np.empty(logits.shape[0], dtype=np.int64)
    logprobs = np.empty(logits.shape[0], dtype=np.float64)
    _rows_cpu(x, temperature.numpy(), top_k.numpy(), top_p.numpy(), seed.numpy(), index.numpy(), position.numpy(),
              tokens, logprobs)
    out_tokens.numpy()[:] = tokens
    out_logprobs.numpy()[:] = logprobs
    return out_tokens, out_logprobs
