"""RMSNorm over rows of fp16/bf16 hidden states, alone or fused with the residual add, in numba.cuda.

A decoder layer runs two norms; in torch each is ~6 kernels (cast to fp32, pow, mean, rsqrt, mul, cast
back) plus the residual add. Here each is one kernel, one CTA per row (token):

    rms_norm:            out = round(w * round(x / sqrt(mean(x^2) + eps)))
    fused_add_rms_norm:  residual = round(residual + x)                       (in place)
                         out = round(w * round(residual / sqrt(mean(residual^2) + eps)))

fp32 math, rounded to the storage dtype exactly where Hugging Face's Qwen2 rounds in torch eager mode (the
residual sum is stored before it is normed; the normed row is cast back before the weight multiplies it).
So the kernel differs from HF's fp16/bf16 path only in the order of the sum of squares and in the last bit
of the reciprocal square root: at most one unit in the last place of an output (reference/layers.py).

Each thread moves 16 bytes (8 halves) per load and store (LDG.E.128 / STG.E.128), so hidden must be a
multiple of 8 and every row 16-byte aligned. Pass 1 adds (fused), stores the new residual and sums squares;
a block reduction (warp shuffles, then one shared slot per warp); pass 2 re-reads the thread's own 16-byte
pieces (L1-resident) and writes the output. Qwen2-0.5B's row is 1.75 KiB: the kernel is latency bound at
decode and streams at memory speed in prefill.

The three fused glue kernels (this file, rotary.py, activation.py) share the device helpers of
common.py (store_u32x4, pack2, unpack2), the views of bridge.py (words, ints) and the host checks here
(check_rows, row_words, threads_for).
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from kernels_numba import bridge
from kernels_numba.bridge import words
from kernels_numba.common import check_tensor, load_u32x4, pack2, store_u32x4, unpack2, warp_sum
from kernels_numba.errors import KernelLaunchError
from kernels_numba.launcher import launch as launch_kernel

MAX_THREADS = 1024

# ----------------------------------------------------------------------------------------------
# host helpers shared by the fused glue kernels

def check_rows(name, t, width, dtypes):
    """t: [rows, width] with unit stride along a row, rows 16-byte aligned (for 16-byte loads)."""
    check_tensor(name, t, 2, dtypes)
    if t.shape[1] != width:
        raise KernelLaunchError(f"{name} must have {width} columns, got shape {tuple(t.shape)}")
    if t.stride(1) != 1 or (t.shape[0] > 1 and (t.stride(0) * t.element_size()) % 16):
        raise KernelLaunchError(f"{name} rows must be contiguous and start 16 bytes apart, strides {t.stride()}")
    if t.data_ptr() % 16:
        raise KernelLaunchError(f"{name} must start at a 16-byte aligned address")


def row_words(t):
    """Row stride of a 2-D fp16/bf16 tensor in 32-bit words (0 for a single row)."""
    return t.stride(0) // 2 if t.shape[0] > 1 else 0


def threads_for(units):
    """Threads of a CTA that loops over `units` pieces: a multiple of 32, at most MAX_THREADS."""
    return min(MAX_THREADS, max(32, -(-units // 32) * 32))


# ----------------------------------------------------------------------------------------------
# the kernel


@cuda.jit(device=True)
def _add_pair(r, x, bf16):
    r0, r1 = unpack2(r, bf16)
    x0, x1 = unpack2(x, bf16)
    return pack2(r0 + x0, r1 + x1, bf16)


@cuda.jit(device=True)
def _square_pair(z, bf16):
    lo, hi = unpack2(z, bf16)
    return lo * lo + hi * hi


@cuda.jit(device=True)
def _norm_pair(z, w, inv, bf16):
    lo, hi = unpack2(z, bf16)
    n0, n1 = unpack2(pack2(lo * inv, hi * inv, bf16), bf16)    # cast back to the dtype before the weight
    g0, g1 = unpack2(w, bf16)
    return pack2(n0 * g0, n1 * g1, bf16)


@bridge.disk_cached
@lru_cache(maxsize=None)
def _make_kernel(is_bf16, add_residual):
    BF16, ADD = is_bf16, add_residual

    @cuda.jit
    def rms_norm_kernel(x, x_stride, residual, r_stride, weight, out, o_stride, chunks, hidden, eps):
        # x, residual, out: rows of hidden halves as words (row t at t * stride); weight: hidden / 2 words.
        # chunks = hidden / 8: one 16-byte piece per chunk. residual is x itself when not ADD.
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        partial = cuda.shared.array(32, float32)
        src = residual if ADD else x
        s_stride = r_stride if ADD else x_stride
        ss = float32(0.0)
        for c in range(tid, chunks, cuda.blockDim.x):
            i = t * s_stride + 4 * c
            z0, z1, z2, z3 = load_u32x4(src, i)
            if ADD:  # residual = round(residual + x), stored; the rounded sum is what gets normed
                a0, a1, a2, a3 = load_u32x4(x, t * x_stride + 4 * c)
                z0, z1 = _add_pair(z0, a0, BF16), _add_pair(z1, a1, BF16)
                z2, z3 = _add_pair(z2, a2, BF16), _add_pair(z3, a3, BF16)
                store_u32x4(residual, i, z0, z1, z2, z3)
            ss += _square_pair(z0, BF16) + _square_pair(z1, BF16) + _square_pair(z2, BF16) + _square_pair(z3, BF16)
        # block sum of squares: lanes of a warp by shuffles, then one shared slot per warp
        ss = warp_sum(ss)
        if tid % 32 == 0:
            partial[tid // 32] = ss
        cuda.syncthreads()
        total = float32(0.0)
        for w in range((cuda.blockDim.x + 31) // 32):
            total += partial[w]
        inv = float32(1.0) / float32(math.sqrt(total / hidden + eps))
        for c in range(tid, chunks, cuda.blockDim.x):
            z0, z1, z2, z3 = load_u32x4(src, t * s_stride + 4 * c)  # this thread's own 16 bytes of pass 1
            w0, w1, w2, w3 = load_u32x4(weight, 4 * c)
            store_u32x4(out, t * o_stride + 4 * c, _norm_pair(z0, w0, inv, BF16), _norm_pair(z1, w1, inv, BF16),
                        _norm_pair(z2, w2, inv, BF16), _norm_pair(z3, w3, inv, BF16))

    return rms_norm_kernel


# ----------------------------------------------------------------------------------------------
# torch entry points


def _launch(x, residual, weight, eps, out, validate):
    import torch

    T, hidden = x.shape
    if validate:
        check_tensor("x", x, 2, (torch.float16, torch.bfloat16))
        if hidden % 8:
            raise KernelLaunchError(f"hidden size {hidden} must be a multiple of 8 (16-byte pieces)")
        check_rows("x", x, hidden, (x.dtype,))
        for name, t in (("residual", residual), ("out", out)):
            if t is not None:
                check_rows(name, t, hidden, (x.dtype,))
                if t.shape[0] != T:
                    raise KernelLaunchError(f"{name} must have {T} rows like x, got {t.shape[0]}")
        check_tensor("weight", weight, 1, (x.dtype,))
        if weight.shape[0] != hidden or weight.stride(0) != 1 or weight.data_ptr() % 16:
            raise KernelLaunchError(f"weight must be a contiguous, 16-byte aligned [{hidden}], got {tuple(weight.shape)}")
    if out is None:
        out = torch.empty_like(x)
    if T == 0:
        return out
    add = residual is not None
    kernel = _make_kernel(x.dtype == torch.bfloat16, add)
    r = residual if add else x
    chunks = hidden // 8
    launch_kernel(kernel, T, threads_for(chunks), (words(x), row_words(x), words(r), row_words(r), words(weight),
                                                   words(out), row_words(out), chunks, np.float32(hidden), np.float32(eps)))
    return out


def rms_norm(x, weight, eps, out=None, validate=True):
    """out = weight * x / sqrt(mean(x^2) + eps) per row, fp32 math with HF's roundings.

    x: [T, hidden] float16/bfloat16 (rows contiguous, 16-byte aligned; hidden % 8 == 0)
    weight: [hidden] x's dtype, contiguous. eps: float.
    out: optional [T, hidden] x's dtype (may be x itself). validate: check shapes, dtypes, strides and
    alignment on the host (no device sync).
    Returns out. Runs on torch's current stream (capturable in a CUDA graph).
    """
    return _launch(x, None, weight, eps, out, validate)


def fused_add_rms_norm(x, residual, weight, eps, out=None, validate=True):
    """residual = round(residual + x) in place; out = rms_norm(residual) * weight.

    x, residual: [T, hidden] float16/bfloat16 of one dtype (rows contiguous, 16-byte aligned)
    weight: [hidden]; eps: float; out: optional [T, hidden] (may be x itself, not residual).
    Returns (out, residual). Runs on torch's current stream (capturable in a CUDA graph).
    """
    return _launch(x, residual, weight, eps, out, validate), residual
