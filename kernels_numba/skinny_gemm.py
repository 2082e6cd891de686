"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with 1 <= M <= 16 rows, in numba.cuda.

At decode a step multiplies a handful of activation rows by every weight of the model once: the time is
the time to stream W from HBM, so the kernel is built to read each weight byte exactly once, 16 bytes per
load, with enough loads in flight to fill the H200's memory pipes. fp16/bf16 weights and activations
(carried as raw 16-bit bits, kernels_numba/common.py), fp32 accumulation.

Two versions (skinny_linear(variant=...); docs/kernels.md has the measurements and the reasons):
    v1  a CTA stages its K range of the activation rows in shared memory and its warps walk over tiles;
        split-K over CTAs (a split spans at most 1,024 k), partials added by the tile's last warp or a
        second kernel.
    v2  one CTA per tile, its 4-16 warps splitting the tile's K (chunks of 128 k, interleaved), the
        activation pieces read from global memory (L1/L2), the next chunk's weight loads issued before
        this chunk's mma (8 KB per warp in flight, never a gap), the warps' sums added in warp order
        through shared memory: no split over CTAs, no partials, no atomics. The default.
Both have every fused variant below.

Layout of the work (v1; v2 keeps the tile, the lanes' pieces and the mma, and differs as said above)
------------------
* A *tile* is 16 weight rows (8 gate + 8 up rows when SiLU-and-mul is fused). One warp owns a tile for
  a range of K and computes the 16 x M block of dot products on the tensor cores (mma.sync m16n8k16,
  A = 16 weight rows x 16 k, B = 16 k x 8 activation rows, C/D fp32). The dot product's k order is free,
  so each lane reads its A fragment as ONE 16-byte load per row (LDG.E.128): lane (g, t) reads the halves
  k0 + 8t .. 8t + 8 of weight rows g and g + 8, a 32-k step of the warp covers 64 contiguous bytes of 16
  rows, and the halves split into two mma's (words 0, 1 and words 2, 3 of the load). The B fragment uses
  the same k order: the lane reads the same 8 halves of activation row g (and g + 8 when M > 8) from
  shared memory, one 16-byte load. Rows of x beyond M are zeros; M <= 8 uses one mma per 16 k, M > 8 two.
* Each lane issues the loads of 4 steps (8 x 16 bytes) before it multiplies: 4 KB in flight per warp.
* A CTA is 4 warps. It stages the activation rows of its K range in shared memory once (zeros past M and
  past K; by cp.async, every copy in flight at once, or with NORM 4 pieces per thread ahead), then each warp
  walks over tiles (bx * 4 + w, then every 4 * gridDim.x tiles) for that K range.
* Split-K: grid (G, S). With S = 1 the warp applies the epilogue and stores y from its fragments. With
  S > 1 each warp writes its fp32 partial sums to part[s, m, row]; then the S partials of every output are
  added in the fixed order s = 0, 1, ..., S-1 and the epilogue applied, either by the last warp to finish
  the tile (reduce="warp", the default: a fence, then an atomic count per tile elects it; the count only
  decides *who* adds, never the order, so the bits are the same on every run) or by a second small kernel
  (reduce="kernel": one more launch, no atomics at all). A split covers at most 32 steps (1,024 k: the
  staged rows fit 33 KB of shared memory at M = 16); small N gets more splits so that enough warps stream
  (plan()).

Fused variants (compile-time flags; the plain GEMM is the reference path)
----------------------------------------------------------------------
    NORM   prologue: every CTA normalises its rows itself,  z = x  or  z = round(residual + x)  (ADD),
           x' = round(w * round(z / sqrt(mean(z^2) + eps)))   (kernels_numba/rmsnorm.py's roundings);
           CTA (0, 0) also stores z to residual_out, all of K, in its sum-of-squares pass (residual_out must
           be neither `residual` nor x: other CTAs still read them). v1 stages x' in shared memory; v2's CTA
           finds the M rows' 1 / rms first (the whole CTA over all of K, while its first weight loads are in
           flight; with at most one 16-byte piece a thread the sum is rmsnorm.py's, bit for bit) and norms
           each activation piece as it loads it: no extra pass over memory, no buffer.
    BIAS   y = round(acc + bias)                    (one rounding, as a GEMM with a bias epilogue)
    SILU   W = [gate; up] (2 I rows); y[:, j] = round(round(silu(round(acc_g))) * round(acc_u)), the
           roundings of the unfused GEMM (output rounded) followed by activation.silu_and_mul.
    RESID  y = round(round(acc) + r)                 the residual add after the GEMM (r: [M, N])

Rounding differences from the unfused torch path: the sum over K is the tensor cores' fp32 accumulation in
this kernel's k order (cuBLAS has its own order), and with a bias cuBLAS rounds acc + bias once like this
kernel while torch on the CPU may round acc first; the norm prologue's sum of squares has its own order
(rmsnorm.py's kernel too; v2's is the same as rmsnorm.py's while K / 8 <= 32 kwarps / R, R the power of
two >= M). Everything else rounds where the unfused ops round.

Limits: K % 8 == 0 (16-byte pieces; a clear error otherwise), every row 16-byte aligned, W contiguous.

Entry point: skinny_linear(x, weight, ...) (torch tensors; torch's current stream; capturable in a CUDA
graph). plan(M, N, K, silu) gives the launch shape.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint32

from kernels_numba import bridge
from kernels_numba.bridge import words
from kernels_numba.common import (FULL_MASK, bf16_to_f32, check_tensor, cp_async16, cp_async_commit,
                                  cp_async_wait, f16_to_f32, f32_to_bf16, f32_to_f16, load_u32x4,
                                  mma_m16n8k16_bf16, mma_m16n8k16_f16, store_u32x4, warp_sum)
from kernels_numba.errors import KernelLaunchError
from kernels_numba.launcher import launch as launch_kernel
from kernels_numba.rmsnorm import _add_pair, _norm_pair, _square_pair  # the norm rounds as rmsnorm does

if bridge.SIMULATOR:
    load_u32x4_no_l1 = load_u32x4            # the simulator has no caches
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from kernels_numba.common import _asm, _space_address

    @intrinsic
    def load_u32x4_no_l1(typingctx, arr, idx):
        """load_u32x4 of a global array without allocating the line in L1 (PTX ld.global.L1::no_allocate):
        streamed weights, read once, leave L1 to the activation rows that every tile reads again."""
        if not (isinstance(arr, types.Array) and arr.dtype in (types.uint32, types.int32) and arr.ndim == 1):
            return None
        sig = types.UniTuple(types.uint32, 4)(arr, idx)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            addr = _space_address(context, builder, sig.args[0], args[0], sig.args[1], args[1], 1, ir.IntType(64))
            res = _asm(builder, ir.LiteralStructType([i32] * 4), [addr],
                       "ld.global.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                       side_effect=True)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, k) for k in range(4)])

        return sig, codegen

MAX_ROWS = 16            # activation rows (M) the kernel takes
WARPS = 4                # warps per CTA
THREADS = 32 * WARPS
UNROLL = 4               # steps (32 k each) whose loads a lane issues before it multiplies
MAX_STEPS = 32           # steps per split: the staged rows are 32 * 32 = 1024 halves long
ROW_WORDS = MAX_STEPS * 16 + 4   # a staged row in 32-bit words, padded 4 words against bank conflicts
SPLIT_TARGET = 132 * 8   # (tile, split) pairs that keep enough loads in flight (4 KB per warp)
GRID_TARGET = 132 * 16   # warps the grid aims at (16 per SM of the H200)
REDUCE_THREADS = 128
cp_async_wait_all = cp_async_wait(0)
SPLIT_KERNEL, SPLIT_WARP = 1, 2   # split-K's reduction: a second kernel, or the last warp of each tile
V2_TARGET_WARPS = 132 * 12   # v2: warps the grid aims at (2 chunks, 8 KB, in flight each)
V2_MAX_WARPS = 16            # v2: warps sharing one tile's K (512 threads)
VARIANTS = (1, 2)


# ----------------------------------------------------------------------------------------------
# device helpers


@cuda.jit(device=True)
def _to_f32(u, bf16):
    if bf16:
        return bf16_to_f32(u)
    return f16_to_f32(u)


@cuda.jit(device=True)
def _round(v, bf16):
    """v rounded to fp16/bf16 and back to float32."""
    if bf16:
        return bf16_to_f32(f32_to_bf16(v))
    return f16_to_f32(f32_to_f16(v))


@cuda.jit(device=True)
def _bits(v, bf16):
    if bf16:
        return f32_to_bf16(v)
    return f32_to_f16(v)


@cuda.jit(device=True)
def _load_or_zero(arr, i, ok):
    if ok:
        return load_u32x4(arr, i)
    z = uint32(0)
    return z, z, z, z


@cuda.jit(device=True)
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, bf16):
    if bf16:
        return mma_m16n8k16_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    return mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


# the norm prologue rounds as rmsnorm.py does: its pair helpers (_add_pair, _square_pair, _norm_pair)


@cuda.jit(device=True)
def _z_piece(x, x_stride, nres, nres_stride, m, c, ok, add, bf16):
    """Piece c of row m: x, or round(residual + x) with add; zeros unless ok."""
    z = uint32(0)
    z0, z1, z2, z3 = z, z, z, z
    if ok:
        z0, z1, z2, z3 = load_u32x4(x, m * x_stride + 4 * c)
        if add:
            r0, r1, r2, r3 = load_u32x4(nres, m * nres_stride + 4 * c)
            z0, z1 = _add_pair(r0, z0, bf16), _add_pair(r1, z1, bf16)
            z2, z3 = _add_pair(r2, z2, bf16), _add_pair(r3, z3, bf16)
    return z0, z1, z2, z3


@cuda.jit(device=True)
def _square4(z0, z1, z2, z3, bf16):
    return _square_pair(z0, bf16) + _square_pair(z1, bf16) + _square_pair(z2, bf16) + _square_pair(z3, bf16)


@cuda.jit(device=True)
def _silu(g):
    return g / (float32(1.0) + float32(math.exp(-g)))


def _make_epilogue(BF16, BIAS, SILU, RESID):
    """store(out, m, j, acc, acc_up, bias, res, n_out, half_rows): output j of row m from the fp32 sum(s)."""

    @cuda.jit(device=True)
    def store(out, m, j, acc, acc_up, bias, res, n_out, half_rows):
        if SILU:
            if BIAS:
                acc += _to_f32(bias[j], BF16)
                acc_up += _to_f32(bias[half_rows + j], BF16)
            g = _round(acc, BF16)
            u = _round(acc_up, BF16)
            y = _round(_silu(g), BF16) * u
        else:
            if BIAS:
                acc += _to_f32(bias[j], BF16)
            y = acc
            if RESID:
                y = _round(y, BF16) + _to_f32(res[m * n_out + j], BF16)
        out[m * n_out + j] = _bits(y, BF16)

    return store


# ----------------------------------------------------------------------------------------------
# the kernels


@bridge.disk_cached
@lru_cache(maxsize=None)
def make_gemm_kernel(is_bf16, two_groups, norm, add, bias, silu, resid, split):
    """The main kernel. is_bf16: dtype; two_groups: M > 8 (two mma per 16 k); norm/add: RMSNorm prologue
    (add: with the residual add); bias/silu/resid: epilogues; split: 0 (S = 1: the warp stores y),
    SPLIT_KERNEL (write fp32 partials for make_reduce_kernel) or SPLIT_WARP (write them, and the tile's
    last warp to finish adds them in split order and stores y)."""
    BF16, MG, NORM, ADD, SPLIT, LAST_WARP = is_bf16, 2 if two_groups else 1, norm, add, split != 0, split == SPLIT_WARP
    MP = 8 * MG                                       # staged activation rows
    SMEM_WORDS = MP * ROW_WORDS
    store = _make_epilogue(is_bf16, bias, silu, resid)
    SILU = silu

    @cuda.jit(device=True)
    def step(p0, p1, p2, p3, q0, q1, q2, q3, xs, xo, d0, d1, d2, d3, e0, e1, e2, e3):
        # one 32-k step: the lane's 16-byte pieces p (row g) and q (row g + 8) times the staged activation
        # rows g (and g + 8) at word xo. Words 0, 1 of a piece are the mma's k 2t.. and 2t+8..; words 2, 3
        # a second mma: the same k order for A and B, so the sum is the dot product.
        v0, v1, v2, v3 = load_u32x4(xs, xo)
        d0, d1, d2, d3 = _mma(p0, q0, p1, q1, v0, v1, d0, d1, d2, d3, BF16)
        d0, d1, d2, d3 = _mma(p2, q2, p3, q3, v2, v3, d0, d1, d2, d3, BF16)
        if MG == 2:
            y0, y1, y2, y3 = load_u32x4(xs, xo + 8 * ROW_WORDS)
            e0, e1, e2, e3 = _mma(p0, q0, p1, q1, y0, y1, e0, e1, e2, e3, BF16)
            e0, e1, e2, e3 = _mma(p2, q2, p3, q3, y2, y3, e0, e1, e2, e3, BF16)
        return d0, d1, d2, d3, e0, e1, e2, e3

    @cuda.jit(device=True)
    def staged_piece(x, x_stride, nres, nres_stride, gamma, inv, i, span, c_lo, c_hi, M):
        # NORM: staged piece i (row i // span, piece c_lo + i % span) normed; zeros outside the rows
        m = i // span
        c = c_lo + i % span
        ok = i < MP * span and m < M and c < c_hi
        z0, z1, z2, z3 = _z_piece(x, x_stride, nres, nres_stride, m, c, ok, ADD, BF16)
        if ok:
            q = inv[m]
            g0, g1, g2, g3 = load_u32x4(gamma, 4 * c)
            z0, z1 = _norm_pair(z0, g0, q, BF16), _norm_pair(z1, g1, q, BF16)
            z2, z3 = _norm_pair(z2, g2, q, BF16), _norm_pair(z3, g3, q, BF16)
        return z0, z1, z2, z3

    @cuda.jit
    def skinny_gemm_kernel(x, x_stride, w, out, part, counters, bias, res, nres, nres_stride, gamma, res_out,
                           eps, M, N, K, tiles, steps_per_split, n_out):
        # x: M rows of K halves as words (row m at m * x_stride); w: N rows of K halves as words, contiguous;
        # out: [M, n_out] halves (int16 bits); part: [S, M, N] float32 (SPLIT); counters: [tiles] int32,
        # zero (LAST_WARP: splits done per tile, set back to zero by the tile's last warp); bias: [N] halves;
        # res: [M, n_out] halves (RESID); nres: residual stream rows (ADD, stride nres_stride words);
        # gamma: the norm weight [K] as words; res_out: [M, K] halves as words (ADD; row stride K / 2).
        # N: weight rows; tiles: 16-row tiles (8 outputs each with SILU); n_out: output columns.
        xs = cuda.shared.array(SMEM_WORDS, uint32)
        inv = cuda.shared.array(MAX_ROWS, float32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        split_id = cuda.blockIdx.y
        chunks = K // 8                                 # 16-byte pieces of a row
        c_lo = split_id * steps_per_split * 4           # this split's pieces: [c_lo, c_hi)
        c_hi = min(chunks, c_lo + steps_per_split * 4)
        kw = K // 2                                     # a weight row in words

        # ---- prologue: the activation rows of [c_lo, c_hi) into shared memory (normed with NORM) ----------
        # loads are issued 4 pieces (or all, by cp.async) ahead of their use: these phases are a few round
        # trips to L2, not one per piece
        span = steps_per_split * 4                      # staged pieces per row
        if NORM:
            # a warp per row: the sum of squares over all of K; the first CTA stores the new residual rows
            writer = ADD and cuda.blockIdx.x == 0 and cuda.blockIdx.y == 0
            for m in range(warp, M, WARPS):
                ss = float32(0.0)
                for c in range(lane, chunks, 128):
                    a0, a1, a2, a3 = _z_piece(x, x_stride, nres, nres_stride, m, c, c < chunks, ADD, BF16)
                    b0, b1, b2, b3 = _z_piece(x, x_stride, nres, nres_stride, m, c + 32, c + 32 < chunks, ADD, BF16)
                    f0, f1, f2, f3 = _z_piece(x, x_stride, nres, nres_stride, m, c + 64, c + 64 < chunks, ADD, BF16)
                    h0, h1, h2, h3 = _z_piece(x, x_stride, nres, nres_stride, m, c + 96, c + 96 < chunks, ADD, BF16)
                    ss += _square4(a0, a1, a2, a3, BF16) + _square4(b0, b1, b2, b3, BF16) \
                        + _square4(f0, f1, f2, f3, BF16) + _square4(h0, h1, h2, h3, BF16)
                    if writer:
                        store_u32x4(res_out, m * kw + 4 * c, a0, a1, a2, a3)
                        if c + 32 < chunks:
                            store_u32x4(res_out, m * kw + 4 * c + 128, b0, b1, b2, b3)
                        if c + 64 < chunks:
                            store_u32x4(res_out, m * kw + 4 * c + 256, f0, f1, f2, f3)
                        if c + 96 < chunks:
                            store_u32x4(res_out, m * kw + 4 * c + 384, h0, h1, h2, h3)
                ss = warp_sum(ss)
                if lane == 0:
                    inv[m] = float32(1.0) / float32(math.sqrt(ss / float32(K) + eps))
            cuda.syncthreads()
            # the staged rows: round(gamma * round(z * inv)), zeros past M and past this split's K
            for i in range(tid, MP * span, 4 * THREADS):
                a0, a1, a2, a3 = staged_piece(x, x_stride, nres, nres_stride, gamma, inv, i, span, c_lo, c_hi, M)
                b0, b1, b2, b3 = staged_piece(x, x_stride, nres, nres_stride, gamma, inv, i + THREADS, span, c_lo,
                                              c_hi, M)
                f0, f1, f2, f3 = staged_piece(x, x_stride, nres, nres_stride, gamma, inv, i + 2 * THREADS, span,
                                              c_lo, c_hi, M)
                h0, h1, h2, h3 = staged_piece(x, x_stride, nres, nres_stride, gamma, inv, i + 3 * THREADS, span,
                                              c_lo, c_hi, M)
                for u in range(4):
                    j = i + u * THREADS
                    if j < MP * span:
                        if u == 0:
                            store_u32x4(xs, (j // span) * ROW_WORDS + 4 * (j % span), a0, a1, a2, a3)
                        elif u == 1:
                            store_u32x4(xs, (j // span) * ROW_WORDS + 4 * (j % span), b0, b1, b2, b3)
                        elif u == 2:
                            store_u32x4(xs, (j // span) * ROW_WORDS + 4 * (j % span), f0, f1, f2, f3)
                        else:
                            store_u32x4(xs, (j // span) * ROW_WORDS + 4 * (j % span), h0, h1, h2, h3)
        else:
            # the raw rows by asynchronous 16-byte copies, all in flight at once; zeros written directly
            z = uint32(0)
            for i in range(tid, MP * span, THREADS):
                m = i // span
                c = c_lo + i % span
                if m < M and c < c_hi:
                    cp_async16(xs, m * ROW_WORDS + 4 * (i % span), x, m * x_stride + 4 * c)
                else:
                    store_u32x4(xs, m * ROW_WORDS + 4 * (i % span), z, z, z, z)
            cp_async_commit()
            cp_async_wait_all()
        cuda.syncthreads()

        # ---- the warp's tiles: 16 weight rows x this split's k, on the tensor cores ----------------------
        half_rows = N // 2                              # SILU: up row j is w row half_rows + j
        for tile in range(cuda.blockIdx.x * WARPS + warp, tiles, cuda.gridDim.x * WARPS):
            if SILU:                                    # rows g: gate 8 tile + g; rows g + 8: its up row
                j = 8 * tile + g
                row_a, row_b = j, half_rows + j
                ok_a = j < half_rows
                ok_b = ok_a
            else:
                row_a, row_b = 16 * tile + g, 16 * tile + g + 8
                ok_a, ok_b = row_a < N, row_b < N
            base_a, base_b = row_a * kw, row_b * kw
            d0, d1, d2, d3 = float32(0.0), float32(0.0), float32(0.0), float32(0.0)
            e0, e1, e2, e3 = float32(0.0), float32(0.0), float32(0.0), float32(0.0)
            for s0 in range(0, steps_per_split, UNROLL):
                # issue the 8 weight loads of 4 steps first (piece c of rows a and b; zeros past K or N)
                c = c_lo + 4 * s0 + t
                a00, a01, a02, a03 = _load_or_zero(w, base_a + 4 * c, ok_a and c < c_hi)
                b00, b01, b02, b03 = _load_or_zero(w, base_b + 4 * c, ok_b and c < c_hi)
                a10, a11, a12, a13 = _load_or_zero(w, base_a + 4 * c + 16, ok_a and c + 4 < c_hi)
                b10, b11, b12, b13 = _load_or_zero(w, base_b + 4 * c + 16, ok_b and c + 4 < c_hi)
                a20, a21, a22, a23 = _load_or_zero(w, base_a + 4 * c + 32, ok_a and c + 8 < c_hi)
                b20, b21, b22, b23 = _load_or_zero(w, base_b + 4 * c + 32, ok_b and c + 8 < c_hi)
                a30, a31, a32, a33 = _load_or_zero(w, base_a + 4 * c + 48, ok_a and c + 12 < c_hi)
                b30, b31, b32, b33 = _load_or_zero(w, base_b + 4 * c + 48, ok_b and c + 12 < c_hi)
                xo = g * ROW_WORDS + 4 * (4 * s0 + t)   # the same 8 halves of activation row g
                d0, d1, d2, d3, e0, e1, e2, e3 = step(a00, a01, a02, a03, b00, b01, b02, b03, xs, xo,
                                                      d0, d1, d2, d3, e0, e1, e2, e3)
                d0, d1, d2, d3, e0, e1, e2, e3 = step(a10, a11, a12, a13, b10, b11, b12, b13, xs, xo + 16,
                                                      d0, d1, d2, d3, e0, e1, e2, e3)
                d0, d1, d2, d3, e0, e1, e2, e3 = step(a20, a21, a22, a23, b20, b21, b22, b23, xs, xo + 32,
                                                      d0, d1, d2, d3, e0, e1, e2, e3)
                d0, d1, d2, d3, e0, e1, e2, e3 = step(a30, a31, a32, a33, b30, b31, b32, b33, xs, xo + 48,
                                                      d0, d1, d2, d3, e0, e1, e2, e3)
            # lane (g, t) holds D[g, 2t], D[g, 2t+1], D[g+8, 2t], D[g+8, 2t+1]: weight row x activation row
            for grp in range(MG):
                if grp == 0:
                    f0, f1, f2, f3 = d0, d1, d2, d3
                else:
                    f0, f1, f2, f3 = e0, e1, e2, e3
                m0 = 8 * grp + 2 * t
                for h in range(2):
                    m = m0 + h
                    fa = f0 if h == 0 else f1           # row a (gate)
                    fb = f2 if h == 0 else f3           # row b (up)
                    if m < M:
                        if SPLIT:
                            pb = (split_id * M + m) * N
                            if ok_a:
                                part[pb + row_a] = fa
                            if ok_b:
                                part[pb + row_b] = fb
                        elif SILU:
                            if ok_a:
                                store(out, m, row_a, fa, fb, bias, res, n_out, half_rows)
                        else:
                            if ok_a:
                                store(out, m, row_a, fa, fa, bias, res, n_out, half_rows)
                            if ok_b:
                                store(out, m, row_b, fb, fb, bias, res, n_out, half_rows)
            if LAST_WARP:
                # the last of the tile's S warps adds the S partials in split order (the same bits whichever
                # warp that is) and stores y
                cuda.threadfence()                      # this lane's partials are visible GPU-wide ...
                cuda.syncwarp(FULL_MASK)                # ... every lane's, before the count
                done = int32(0)
                if lane == 0:
                    done = cuda.atomic.add(counters, tile, 1)
                done = cuda.shfl_sync(FULL_MASK, done, 0)
                if done == cuda.gridDim.y - 1:
                    cuda.threadfence()                  # ... and the other warps' partials to this one
                    if lane == 0:
                        counters[tile] = 0              # as the launch found it (graph replays)
                    per_tile = 8 if SILU else 16
                    for i in range(lane, per_tile * M, 32):
                        m = i // per_tile
                        j = per_tile * tile + i % per_tile
                        if j < n_out:
                            acc = float32(0.0)
                            acc_up = float32(0.0)
                            for sp in range(cuda.gridDim.y):
                                pb = (sp * M + m) * N
                                acc += part[pb + j]
                                if SILU:
                                    acc_up += part[pb + half_rows + j]
                            store(out, m, j, acc, acc_up, bias, res, n_out, half_rows)

    return skinny_gemm_kernel


def make_gemm_kernel_v2(is_bf16, two_groups, kwarps, bias, silu, resid, l1_no_allocate=True, norm=False,
                        add=False):
    """v2: one CTA per tile, its kwarps warps splitting K among themselves, the activation rows read from
    global memory (L1/L2 hits), the next chunk's weight loads issued before this chunk's mma; the warps'
    sums added through shared memory in warp order (no partial buffer, no atomics). Plain GEMM, the
    bias / SiLU-and-mul / residual epilogues and the RMSNorm prologue (norm; add: with the residual add).
    l1_no_allocate: the weight loads do not allocate in L1 (False: plain loads, to compare).
    One kernel object per configuration however the arguments are spelt."""
    return _gemm_kernel_v2(bool(is_bf16), bool(two_groups), int(kwarps), bool(bias), bool(silu), bool(resid),
                           bool(l1_no_allocate), bool(norm), bool(add))


@bridge.disk_cached
@lru_cache(maxsize=None)
def _gemm_kernel_v2(is_bf16, two_groups, kwarps, bias, silu, resid, l1_no_allocate, norm, add):
    BF16, MG, KW, SILU, NO_L1, NORM, ADD = is_bf16, 2 if two_groups else 1, kwarps, silu, l1_no_allocate, norm, add
    VALS = 4 * MG                                     # fp32 sums a lane holds
    RED_WORDS = KW * VALS * 32
    store = _make_epilogue(is_bf16, bias, silu, resid)
    # the prologue's loads come on top of the loop's: at most 128 registers a thread, so that plan_v2's one
    # wave of 16 warps per SM (and a CTA of 16 warps at all) still fits
    jit_options = {"launch_bounds": (32 * KW, max(1, 16 // KW))} if NORM and not bridge.SIMULATOR else {}

    @cuda.jit(device=True)
    def w_piece(w, i, ok):
        # a 16-byte weight piece, or zeros (no load) past N or K
        z = uint32(0)
        if ok:
            if NO_L1:
                return load_u32x4_no_l1(w, i)
            return load_u32x4(w, i)
        return z, z, z, z

    @cuda.jit(device=True)
    def step_mma(p0, p1, p2, p3, q0, q1, q2, q3, v0, v1, v2, v3, d0, d1, d2, d3):
        # one 32-k step of one group of 8 activation rows: weight pieces p (row a), q (row b) times the
        # activation piece v (row g of the group); words 0, 1 and 2, 3 of the pieces are two mma's k ranges
        d0, d1, d2, d3 = _mma(p0, q0, p1, q1, v0, v1, d0, d1, d2, d3, BF16)
        return _mma(p2, q2, p3, q3, v2, v3, d0, d1, d2, d3, BF16)

    @cuda.jit(device=True)
    def x_piece(x, x_stride, m, c, pieces, M):
        # 16-byte piece c of activation row m; zeros past M and past K
        return _load_or_zero(x, m * x_stride + 4 * c, m < M and c < pieces)

    @cuda.jit(device=True)
    def normed_piece(x, x_stride, nres, nres_stride, m, c, ok, q, h0, h1, h2, h3):
        # NORM: piece c of row m normed as it arrives, round(h * round(z * q)) with z = x or
        # round(residual + x), q the row's 1 / rms, h the piece's norm weights (rmsnorm.py's roundings)
        z0, z1, z2, z3 = _z_piece(x, x_stride, nres, nres_stride, m, c, ok, ADD, BF16)
        if ok:
            z0, z1 = _norm_pair(z0, h0, q, BF16), _norm_pair(z1, h1, q, BF16)
            z2, z3 = _norm_pair(z2, h2, q, BF16), _norm_pair(z3, h3, q, BF16)
        return z0, z1, z2, z3

    @cuda.jit(device=True)
    def normed_step(x, x_stride, nres, nres_stride, gamma, g, c, pieces, M, q_a, q_b, p0, p1, p2, p3, r0, r1, r2, r3,
                    d0, d1, d2, d3, e0, e1, e2, e3):
        # NORM: one 32-k step, its activation pieces (rows g, g + 8) loaded and normed just before their mma:
        # a step at a time, the loop stays within 128 registers at M = 16
        ok = g < M and c < pieces
        z = uint32(0)
        h0, h1, h2, h3 = z, z, z, z
        if ok:
            h0, h1, h2, h3 = load_u32x4(gamma, 4 * c)
        v0, v1, v2, v3 = normed_piece(x, x_stride, nres, nres_stride, g, c, ok, q_a, h0, h1, h2, h3)
        d0, d1, d2, d3 = step_mma(p0, p1, p2, p3, r0, r1, r2, r3, v0, v1, v2, v3, d0, d1, d2, d3)
        if MG == 2:
            y0, y1, y2, y3 = normed_piece(x, x_stride, nres, nres_stride, g + 8, c, g + 8 < M and c < pieces, q_b,
                                          h0, h1, h2, h3)
            e0, e1, e2, e3 = step_mma(p0, p1, p2, p3, r0, r1, r2, r3, y0, y1, y2, y3, e0, e1, e2, e3)
        return d0, d1, d2, d3, e0, e1, e2, e3

    @cuda.jit(device=True)
    def norm_scales(x, x_stride, nres, nres_stride, res_out, inv, part, eps, M, K, writer):
        # NORM: inv[m] = 1 / sqrt(mean(z_m^2) + eps) for the M rows, over all of K, by the whole CTA: the
        # rows get R = 1, 2, 4, 8 or 16 (>= M) equal groups of G = 32 KW / R threads; thread j of a group
        # sums the squares of pieces j, j + G, ... (4 loads ahead), the group adds its sums by a butterfly
        # (every thread of it gets the same bits) and, when it spans several warps, through part[] in warp
        # order. The same sums on every CTA. writer: also store z to res_out (all of K, [M, K] contiguous).
        # With at most one piece a thread this is rmsnorm.py's sum, bit for bit.
        tid = cuda.threadIdx.x
        R = 1
        while R < M:
            R *= 2
        G = 32 * KW // R
        m = tid // G
        j = tid % G
        pieces = K // 8
        kw = K // 2
        end = pieces if m < M else 0
        ss = float32(0.0)
        for c in range(j, end, 4 * G):
            a0, a1, a2, a3 = _z_piece(x, x_stride, nres, nres_stride, m, c, True, ADD, BF16)
            b0, b1, b2, b3 = _z_piece(x, x_stride, nres, nres_stride, m, c + G, c + G < pieces, ADD, BF16)
            f0, f1, f2, f3 = _z_piece(x, x_stride, nres, nres_stride, m, c + 2 * G, c + 2 * G < pieces, ADD, BF16)
            h0, h1, h2, h3 = _z_piece(x, x_stride, nres, nres_stride, m, c + 3 * G, c + 3 * G < pieces, ADD, BF16)
            ss += _square4(a0, a1, a2, a3, BF16) + _square4(b0, b1, b2, b3, BF16) \
                + _square4(f0, f1, f2, f3, BF16) + _square4(h0, h1, h2, h3, BF16)
            if writer:
                store_u32x4(res_out, m * kw + 4 * c, a0, a1, a2, a3)
                if c + G < pieces:
                    store_u32x4(res_out, m * kw + 4 * (c + G), b0, b1, b2, b3)
                if c + 2 * G < pieces:
                    store_u32x4(res_out, m * kw + 4 * (c + 2 * G), f0, f1, f2, f3)
                if c + 3 * G < pieces:
                    store_u32x4(res_out, m * kw + 4 * (c + 3 * G), h0, h1, h2, h3)
        # G >= 8 (>= 128 threads, <= 16 rows): lanes j ^ 4, 2, 1 are always in the group
        if G >= 32:
            ss += cuda.shfl_xor_sync(FULL_MASK, ss, 16)
        if G >= 16:
            ss += cuda.shfl_xor_sync(FULL_MASK, ss, 8)
        ss += cuda.shfl_xor_sync(FULL_MASK, ss, 4)
        ss += cuda.shfl_xor_sync(FULL_MASK, ss, 2)
        ss += cuda.shfl_xor_sync(FULL_MASK, ss, 1)
        if G > 32:                                    # the group's warps, in order
            if tid % 32 == 0:
                part[tid // 32] = ss
            cuda.syncthreads()
            if j == 0:
                ss = float32(0.0)
                for i in range(G // 32):
                    ss += part[m * (G // 32) + i]
        if j == 0 and m < M:
            inv[m] = float32(1.0) / float32(math.sqrt(ss / float32(K) + eps))
        cuda.syncthreads()

    @cuda.jit(**jit_options)
    def skinny_gemm_v2_kernel(x, x_stride, w, out, bias, res, nres, nres_stride, gamma, res_out, eps, M, N, K,
                              n_out):
        # x: M rows of K halves as words (row m at word m * x_stride); w: [N, K] halves as words, contiguous;
        # out: [M, n_out] halves (int16 bits); bias: [N] halves; res: [M, n_out] halves (RESID);
        # nres: residual stream rows (ADD, stride nres_stride words); gamma: the norm weight [K] as words;
        # res_out: [M, K] halves as words (ADD); eps: the norm's epsilon (NORM).
        # Grid: one CTA per 16-row tile (8 gate + 8 up rows with SILU); block: 32 * KW threads.
        red = cuda.shared.array(RED_WORDS, float32)   # [warp, value, lane]: conflict-free
        inv = cuda.shared.array(MAX_ROWS, float32)    # NORM: 1 / rms of each row
        part = cuda.shared.array(KW, float32)         # NORM: the warps' sums of squares
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        tile = cuda.blockIdx.x
        pieces = K // 8                                 # 16-byte pieces of a row
        chunks = (pieces + 15) // 16                    # a chunk: 4 steps of 32 k = 16 pieces of each row
        kw = K // 2                                     # a weight row in words
        half_rows = N // 2
        if SILU:                                        # rows g: gate 8 tile + g; rows g + 8: its up row
            row_a = 8 * tile + g
            row_b = half_rows + row_a
            ok_a = row_a < half_rows
            ok_b = ok_a
        else:
            row_a, row_b = 16 * tile + g, 16 * tile + g + 8
            ok_a, ok_b = row_a < N, row_b < N
        base_a, base_b = row_a * kw, row_b * kw
        d0, d1, d2, d3 = float32(0.0), float32(0.0), float32(0.0), float32(0.0)
        e0, e1, e2, e3 = float32(0.0), float32(0.0), float32(0.0), float32(0.0)
        # warp w takes chunks w, w + KW, ...: at any time the CTA's warps read KW neighbouring chunks, a
        # contiguous KW * 256 bytes of each of the 16 rows. The lane's piece of step u is c + 4 u.
        ci = warp
        c = 16 * ci + t
        a00, a01, a02, a03 = w_piece(w, base_a + 4 * c, ok_a and c < pieces)
        b00, b01, b02, b03 = w_piece(w, base_b + 4 * c, ok_b and c < pieces)
        a10, a11, a12, a13 = w_piece(w, base_a + 4 * c + 16, ok_a and c + 4 < pieces)
        b10, b11, b12, b13 = w_piece(w, base_b + 4 * c + 16, ok_b and c + 4 < pieces)
        a20, a21, a22, a23 = w_piece(w, base_a + 4 * c + 32, ok_a and c + 8 < pieces)
        b20, b21, b22, b23 = w_piece(w, base_b + 4 * c + 32, ok_b and c + 8 < pieces)
        a30, a31, a32, a33 = w_piece(w, base_a + 4 * c + 48, ok_a and c + 12 < pieces)
        b30, b31, b32, b33 = w_piece(w, base_b + 4 * c + 48, ok_b and c + 12 < pieces)
        q_a, q_b = float32(0.0), float32(0.0)
        if NORM:
            # while the first chunk's weights are on their way: every CTA finds the rows' 1 / rms itself
            # (M K halves, L2-resident); CTA 0 also stores the new residual rows
            norm_scales(x, x_stride, nres, nres_stride, res_out, inv, part, eps, M, K, ADD and tile == 0)
            q_a = inv[g]
            if MG == 2:
                q_b = inv[g + 8]
        while ci < chunks:
            # the next chunk's 8 weight loads go out before this chunk's mma: 2 chunks (8 KB) per warp in
            # flight while the mma wait on the older one (zeros, no load, past the last chunk)
            cn = c + 16 * KW
            n00, n01, n02, n03 = w_piece(w, base_a + 4 * cn, ok_a and cn < pieces)
            m00, m01, m02, m03 = w_piece(w, base_b + 4 * cn, ok_b and cn < pieces)
            n10, n11, n12, n13 = w_piece(w, base_a + 4 * cn + 16, ok_a and cn + 4 < pieces)
            m10, m11, m12, m13 = w_piece(w, base_b + 4 * cn + 16, ok_b and cn + 4 < pieces)
            n20, n21, n22, n23 = w_piece(w, base_a + 4 * cn + 32, ok_a and cn + 8 < pieces)
            m20, m21, m22, m23 = w_piece(w, base_b + 4 * cn + 32, ok_b and cn + 8 < pieces)
            n30, n31, n32, n33 = w_piece(w, base_a + 4 * cn + 48, ok_a and cn + 12 < pieces)
            m30, m31, m32, m33 = w_piece(w, base_b + 4 * cn + 48, ok_b and cn + 12 < pieces)
            if NORM:                                    # a step at a time: load, norm, mma
                d0, d1, d2, d3, e0, e1, e2, e3 = normed_step(
                    x, x_stride, nres, nres_stride, gamma, g, c, pieces, M, q_a, q_b, a00, a01, a02, a03,
                    b00, b01, b02, b03, d0, d1, d2, d3, e0, e1, e2, e3)
                d0, d1, d2, d3, e0, e1, e2, e3 = normed_step(
                    x, x_stride, nres, nres_stride, gamma, g, c + 4, pieces, M, q_a, q_b, a10, a11, a12, a13,
                    b10, b11, b12, b13, d0, d1, d2, d3, e0, e1, e2, e3)
                d0, d1, d2, d3, e0, e1, e2, e3 = normed_step(
                    x, x_stride, nres, nres_stride, gamma, g, c + 8, pieces, M, q_a, q_b, a20, a21, a22, a23,
                    b20, b21, b22, b23, d0, d1, d2, d3, e0, e1, e2, e3)
                d0, d1, d2, d3, e0, e1, e2, e3 = normed_step(
                    x, x_stride, nres, nres_stride, gamma, g, c + 12, pieces, M, q_a, q_b, a30, a31, a32, a33,
                    b30, b31, b32, b33, d0, d1, d2, d3, e0, e1, e2, e3)
            else:
                # this chunk's activation pieces (L1 hits after the first CTA on the SM), all 4 steps at once
                v00, v01, v02, v03 = x_piece(x, x_stride, g, c, pieces, M)
                v10, v11, v12, v13 = x_piece(x, x_stride, g, c + 4, pieces, M)
                v20, v21, v22, v23 = x_piece(x, x_stride, g, c + 8, pieces, M)
                v30, v31, v32, v33 = x_piece(x, x_stride, g, c + 12, pieces, M)
                if MG == 2:
                    y00, y01, y02, y03 = x_piece(x, x_stride, g + 8, c, pieces, M)
                    y10, y11, y12, y13 = x_piece(x, x_stride, g + 8, c + 4, pieces, M)
                    y20, y21, y22, y23 = x_piece(x, x_stride, g + 8, c + 8, pieces, M)
                    y30, y31, y32, y33 = x_piece(x, x_stride, g + 8, c + 12, pieces, M)
                d0, d1, d2, d3 = step_mma(a00, a01, a02, a03, b00, b01, b02, b03, v00, v01, v02, v03,
                                          d0, d1, d2, d3)
                d0, d1, d2, d3 = step_mma(a10, a11, a12, a13, b10, b11, b12, b13, v10, v11, v12, v13,
                                          d0, d1, d2, d3)
                d0, d1, d2, d3 = step_mma(a20, a21, a22, a23, b20, b21, b22, b23, v20, v21, v22, v23,
                                          d0, d1, d2, d3)
                d0, d1, d2, d3 = step_mma(a30, a31, a32, a33, b30, b31, b32, b33, v30, v31, v32, v33,
                                          d0, d1, d2, d3)
                if MG == 2:
                    e0, e1, e2, e3 = step_mma(a00, a01, a02, a03, b00, b01, b02, b03, y00, y01, y02, y03,
                                              e0, e1, e2, e3)
                    e0, e1, e2, e3 = step_mma(a10, a11, a12, a13, b10, b11, b12, b13, y10, y11, y12, y13,
                                              e0, e1, e2, e3)
                    e0, e1, e2, e3 = step_mma(a20, a21, a22, a23, b20, b21, b22, b23, y20, y21, y22, y23,
                                              e0, e1, e2, e3)
                    e0, e1, e2, e3 = step_mma(a30, a31, a32, a33, b30, b31, b32, b33, y30, y31, y32, y33,
                                              e0, e1, e2, e3)
            a00, a01, a02, a03, b00, b01, b02, b03 = n00, n01, n02, n03, m00, m01, m02, m03
            a10, a11, a12, a13, b10, b11, b12, b13 = n10, n11, n12, n13, m10, m11, m12, m13
            a20, a21, a22, a23, b20, b21, b22, b23 = n20, n21, n22, n23, m20, m21, m22, m23
            a30, a31, a32, a33, b30, b31, b32, b33 = n30, n31, n32, n33, m30, m31, m32, m33
            c = cn
            ci += KW
        # the KW warps' sums, added in warp order by warp 0 (the same bits on every run)
        if KW > 1:
            for i in range(VALS):
                if i < 4:
                    v = d0 if i == 0 else d1 if i == 1 else d2 if i == 2 else d3
                else:
                    v = e0 if i == 4 else e1 if i == 5 else e2 if i == 6 else e3
                red[(warp * VALS + i) * 32 + lane] = v
            cuda.syncthreads()
            if warp != 0:
                return
            d0, d1, d2, d3 = red[lane], red[32 + lane], red[64 + lane], red[96 + lane]
            if MG == 2:
                e0, e1, e2, e3 = red[128 + lane], red[160 + lane], red[192 + lane], red[224 + lane]
            for wp in range(1, KW):
                o = wp * VALS * 32 + lane
                d0 += red[o]
                d1 += red[o + 32]
                d2 += red[o + 64]
                d3 += red[o + 96]
                if MG == 2:
                    e0 += red[o + 128]
                    e1 += red[o + 160]
                    e2 += red[o + 192]
                    e3 += red[o + 224]
        # lane (g, t) holds D[g, 2t], D[g, 2t+1], D[g+8, 2t], D[g+8, 2t+1]: weight row x activation row
        for grp in range(MG):
            if grp == 0:
                f0, f1, f2, f3 = d0, d1, d2, d3
            else:
                f0, f1, f2, f3 = e0, e1, e2, e3
            for h in range(2):
                m = 8 * grp + 2 * t + h
                fa = f0 if h == 0 else f1               # row a (gate)
                fb = f2 if h == 0 else f3               # row b (up)
                if m < M:
                    if SILU:
                        if ok_a:
                            store(out, m, row_a, fa, fb, bias, res, n_out, half_rows)
                    else:
                        if ok_a:
                            store(out, m, row_a, fa, fa, bias, res, n_out, half_rows)
                        if ok_b:
                            store(out, m, row_b, fb, fb, bias, res, n_out, half_rows)

    return skinny_gemm_v2_kernel


@bridge.disk_cached
@lru_cache(maxsize=None)
def make_reduce_kernel(is_bf16, bias, silu, resid):
    """Split-K's second pass: y[m, j] from sum over s = 0..S-1 (in that order) of part[s, m, row]."""
    BF16, SILU = is_bf16, silu
    store = _make_epilogue(is_bf16, bias, silu, resid)

    @cuda.jit
    def skinny_reduce_kernel(part, splits, out, bias, res, M, N, n_out):
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i >= M * n_out:
            return
        m = i // n_out
        j = i % n_out
        half_rows = N // 2
        acc = float32(0.0)
        acc_up = float32(0.0)
        for s in range(splits):
            pb = (s * M + m) * N
            acc += part[pb + j]
            if SILU:
                acc_up += part[pb + half_rows + j]
        store(out, m, j, acc, acc_up, bias, res, n_out, half_rows)

    return skinny_reduce_kernel


# ----------------------------------------------------------------------------------------------
# host side


def plan(M, N, K, silu=False, steps_per_split=None, num_sms=132):
    """Launch shape (tiles, steps_per_split, splits, grid_x) of y[M, N] = x W^T for W [N, K].

    A split spans steps_per_split steps of 32 k (a multiple of UNROLL, at most MAX_STEPS). Unless given,
    it is the longest such span that still yields SPLIT_TARGET (tile, split) pairs, or the shortest
    (UNROLL steps) when the tiles are too few for that. grid_x: CTAs per split, sized so that the grid has
    about GRID_TARGET warps, each walking over tiles_per_warp tiles (never more CTAs than tiles need).
    """
    tiles = -(-(N // 2) // 8) if silu else -(-N // 16)
    steps = -(-K // 32)
    if steps_per_split is None:
        steps_per_split = UNROLL
        for sps in range(min(MAX_STEPS, -(-steps // UNROLL) * UNROLL), UNROLL - 1, -UNROLL):
            if tiles * -(-steps // sps) >= SPLIT_TARGET * num_sms // 132:
                steps_per_split = sps
                break
    splits = -(-steps // steps_per_split)
    warps_wanted = max(1, GRID_TARGET * num_sms // 132 // splits)          # per split
    tiles_per_warp = max(1, tiles // warps_wanted)
    grid_x = -(-tiles // (WARPS * tiles_per_warp))
    return tiles, steps_per_split, splits, grid_x


def plan_v2(M, N, K, silu=False, num_sms=132):
    """v2's launch shape (tiles, kwarps, chunks): one CTA of kwarps warps per tile, chunks of 128 k.

    kwarps starts at 4 and doubles (up to V2_MAX_WARPS) while the grid has fewer than V2_TARGET_WARPS warps,
    every warp still gets 2 chunks or more, and the grid stays one wave at 16 resident warps per SM (128
    registers a thread): small N with long K (down_proj, o_proj) gets up to 16 warps on one tile's K.
    """
    tiles = -(-(N // 2) // 8) if silu else -(-N // 16)
    chunks = -(-K // 128)
    kwarps = WARPS
    while (kwarps < V2_MAX_WARPS and tiles * kwarps < V2_TARGET_WARPS * num_sms // 132
           and chunks >= 4 * kwarps and tiles * 2 * kwarps <= 16 * num_sms):
        kwarps *= 2
    return tiles, kwarps, chunks


def _check_rows(name, t, rows, width, dtype):
    check_tensor(name, t, 2, (dtype,))
    if tuple(t.shape) != (rows, width):
        raise KernelLaunchError(f"{name} must be [{rows}, {width}], got {tuple(t.shape)}")
    if t.stride(1) != 1 or (rows > 1 and (t.stride(0) * t.element_size()) % 16) or t.data_ptr() % 16:
        raise KernelLaunchError(f"{name} rows must be contiguous, 16-byte aligned and 16 bytes apart, "
                                f"strides {t.stride()}")


def _check_vector(name, t, size, dtype):
    check_tensor(name, t, 1, (dtype,))
    if t.shape[0] != size or t.stride(0) != 1 or t.data_ptr() % 16:
        raise KernelLaunchError(f"{name} must be a contiguous, 16-byte aligned [{size}], got {tuple(t.shape)}")


def _halves(t):
    """1-D 16-bit view of a contiguous fp16/bf16 tensor (one element per entry): on the GPU a torch int16
    view (the launcher passes it as a numba int16 array); under the simulator a FakeCUDAArray over the
    tensor's memory: a plain numpy argument would be copied in and back out, and the same buffer passed
    twice (a dummy argument) would be written back twice."""
    import torch

    if not bridge.SIMULATOR:
        return t.reshape(-1).view(torch.int16)
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(t.reshape(-1).view(torch.int16).numpy().view(np.uint16))


def _row_words(t):
    return t.stride(0) // 2 if t.shape[0] > 1 else 0


def skinny_linear(x, weight, bias=None, *, out=None, residual=None, silu=False, norm_weight=None, eps=None,
                  norm_residual=None, residual_out=None, steps_per_split=None, reduce="warp", variant=None,
                  warps_per_tile=None, validate=True):
    """y = x weight^T (+ bias) for a few rows, with the optional fused prologue and epilogues.

    x: [M, K] float16/bfloat16, 1 <= M <= 16, K % 8 == 0, rows 16-byte aligned (strided rows allowed)
    weight: [N, K] x's dtype, contiguous. bias: optional [N] x's dtype.
    silu: weight is [gate; up] (N = 2 I): out = silu(gate) * up, [M, I].
    residual: optional [M, N] x's dtype, contiguous: out = round(round(x W^T) + residual) (not with silu).
    norm_weight, eps: RMSNorm prologue: x is normed (per row, over K) before the product.
    norm_residual, residual_out: with the prologue, z = round(norm_residual + x) is normed instead, and z
        is written to residual_out ([M, K], contiguous, a buffer other than norm_residual).
    out: optional [M, N or I] contiguous output (may be `residual`, not x or norm_residual).
    steps_per_split: force the split-K span (steps of 32 k; a multiple of 4, <= 32); None: plan().
    reduce: how v1's split-K partials are added (in split order either way): "warp" (the last warp of each
        tile, after an atomic count; one kernel) or "kernel" (a second kernel).
    variant: 1 (staged rows, split-K over CTAs) or 2 (a CTA per tile, K split over its warps); both have
        every prologue and epilogue. None: 2, or 1 where the call asks for steps_per_split or
        reduce="kernel".
    warps_per_tile: v2 only, force the warps sharing a tile's K (4, 8 or 16); None: plan_v2().
    Returns out. Runs on torch's current stream (capturable in a CUDA graph: the split-K partials live in a
    persistent scratch buffer per shape).
    """
    import torch

    dtypes = (torch.float16, torch.bfloat16)
    norm = norm_weight is not None
    add = norm_residual is not None
    if variant is None:
        variant = 1 if steps_per_split is not None or reduce != "warp" else 2
    if validate:
        check_tensor("x", x, 2, dtypes)
        check_tensor("weight", weight, 2, (x.dtype,))
    M, K = x.shape
    N = weight.shape[0]
    n_out = N // 2 if silu else N
    if validate:
        if not 1 <= M <= MAX_ROWS:
            raise KernelLaunchError(f"x must have 1 to {MAX_ROWS} rows, got {M}")
        if K % 8:
            raise KernelLaunchError(f"K={K} must be a multiple of 8 (16-byte pieces of every row)")
        _check_rows("x", x, M, K, x.dtype)
        if weight.shape[1] != K or not weight.is_contiguous() or weight.data_ptr() % 16:
            raise KernelLaunchError(f"weight must be a contiguous, 16-byte aligned [N, {K}], got "
                                    f"{tuple(weight.shape)} strides {weight.stride()}")
        if silu and N % 2:
            raise KernelLaunchError(f"weight must have an even number of rows [gate; up] with silu, got {N}")
        if silu and residual is not None:
            raise KernelLaunchError("residual is not supported with silu")
        if bias is not None:
            _check_vector("bias", bias, N, x.dtype)
        if residual is not None:
            check_tensor("residual", residual, 2, (x.dtype,))
            if tuple(residual.shape) != (M, n_out) or not residual.is_contiguous():
                raise KernelLaunchError(f"residual must be a contiguous [{M}, {n_out}], got {tuple(residual.shape)}")
        if out is not None:
            check_tensor("out", out, 2, (x.dtype,))
            if tuple(out.shape) != (M, n_out) or not out.is_contiguous():
                raise KernelLaunchError(f"out must be a contiguous [{M}, {n_out}], got {tuple(out.shape)}")
            if out.data_ptr() in (x.data_ptr(), norm_residual.data_ptr() if add else x.data_ptr()):
                raise KernelLaunchError("out must be neither x nor norm_residual (other CTAs still read them)")
        if norm:
            _check_vector("norm_weight", norm_weight, K, x.dtype)
            if eps is None or not eps > 0:
                raise KernelLaunchError(f"eps must be > 0 with norm_weight, got {eps}")
        elif add or residual_out is not None or eps is not None:
            raise KernelLaunchError("norm_residual, residual_out and eps need norm_weight")
        if add:
            _check_rows("norm_residual", norm_residual, M, K, x.dtype)
            if residual_out is None:
                raise KernelLaunchError("residual_out is needed with norm_residual")
            _check_rows("residual_out", residual_out, M, K, x.dtype)
            if not residual_out.is_contiguous() or residual_out.data_ptr() in (norm_residual.data_ptr(),
                                                                                 x.data_ptr()):
                raise KernelLaunchError("residual_out must be contiguous and neither norm_residual nor x "
                                        "itself (other CTAs still read them)")
        if variant not in VARIANTS:
            raise KernelLaunchError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if variant == 2 and (steps_per_split is not None or reduce != "warp"):
            raise KernelLaunchError("variant 2 has no steps_per_split or reduce: use variant=1")
        if warps_per_tile is not None and (variant != 2 or warps_per_tile not in (4, 8, 16)):
            raise KernelLaunchError(f"warps_per_tile must be 4, 8 or 16, with variant=2; got {warps_per_tile} "
                                    f"with variant={variant}")
        if reduce not in ("warp", "kernel"):
            raise KernelLaunchError(f"reduce must be 'warp' or 'kernel', got {reduce!r}")
        if steps_per_split is not None and (steps_per_split % UNROLL or not UNROLL <= steps_per_split <= MAX_STEPS):
            raise KernelLaunchError(f"steps_per_split must be a multiple of {UNROLL} in [{UNROLL}, {MAX_STEPS}], "
                                    f"got {steps_per_split}")
    if out is None:
        out = torch.empty(M, n_out, dtype=x.dtype, device=x.device)
    if variant == 2:
        return launch_v2(x, weight, bias, out, residual, silu, warps_per_tile, norm_weight=norm_weight, eps=eps,
                         norm_residual=norm_residual, residual_out=residual_out)
    tiles, sps, splits, grid_x = plan(M, N, K, silu, steps_per_split, bridge.num_sms(x.device))
    is_bf16 = x.dtype == torch.bfloat16
    split = 0 if splits == 1 else SPLIT_WARP if reduce == "warp" else SPLIT_KERNEL
    out16 = _halves(out)
    w_words = words(weight)
    x_words = words(x)
    bias16 = _halves(bias) if bias is not None else out16
    res16 = _halves(residual) if residual is not None else out16
    nres = words(norm_residual) if add else x_words
    gamma = words(norm_weight) if norm else x_words
    res_out = words(residual_out) if add else x_words
    part = bridge.scratch(x.device, (splits * M * N if split else 1,))
    counters = bridge.scratch(x.device, (tiles if split == SPLIT_WARP else 1,), np.int32, zero=True)
    in_kernel = split != SPLIT_KERNEL                    # the epilogue runs in the GEMM kernel
    kernel = make_gemm_kernel(is_bf16, M > 8, norm, add, bias is not None and in_kernel, silu,
                              residual is not None and in_kernel, split)
    launch_kernel(kernel, (grid_x, splits), THREADS,
                  (x_words, _row_words(x), w_words, out16, part, counters, bias16, res16, nres,
                   _row_words(norm_residual) if add else 0, gamma, res_out, np.float32(eps if norm else 0.0),
                   M, N, K, tiles, sps, n_out))
    if split == SPLIT_KERNEL:
        reducer = make_reduce_kernel(is_bf16, bias is not None, silu, residual is not None)
        launch_kernel(reducer, -(-(M * n_out) // REDUCE_THREADS), REDUCE_THREADS,
                      (part, splits, out16, bias16, res16, M, N, n_out))
    return out


def v2_kernel_flags(M, N, K, is_bf16, bias, silu, resid, norm=False, add=False, kwarps=None, l1_no_allocate=True,
                    num_sms=132):
    """make_gemm_kernel_v2's arguments for a v2 call of M rows on an [N, K] weight (launch_v2's choice):
    (is_bf16, M > 8, warps per tile (plan_v2's unless kwarps), bias, silu, resid, l1_no_allocate, norm, add)."""
    kwarps = kwarps or plan_v2(M, N, K, silu, num_sms)[1]
    return (bool(is_bf16), M > 8, kwarps, bool(bias), bool(silu), bool(resid), bool(l1_no_allocate), bool(norm),
            bool(add))


def launch_v2(x, weight, bias, out, residual, silu, kwarps=None, l1_no_allocate=True, norm_weight=None, eps=None,
              norm_residual=None, residual_out=None):
    """v2's launch with its tuning knobs, for the tests and the bench (skinny_linear checks the arguments;
    this does not): kwarps forces the warps per tile, l1_no_allocate=False uses plain weight loads;
    norm_weight, eps, norm_residual, residual_out: the norm prologue, as in skinny_linear."""
    import torch

    M, K = x.shape
    N = weight.shape[0]
    num_sms = bridge.num_sms(x.device)
    tiles = plan_v2(M, N, K, silu, num_sms)[0]
    norm = norm_weight is not None
    add = norm_residual is not None
    flags = v2_kernel_flags(M, N, K, x.dtype == torch.bfloat16, bias is not None, silu, residual is not None,
                            norm, add, kwarps, l1_no_allocate, num_sms)
    kwarps = flags[2]
    out16 = _halves(out)
    bias16 = _halves(bias) if bias is not None else out16
    res16 = _halves(residual) if residual is not None else out16
    x_words = words(x)
    kernel = make_gemm_kernel_v2(*flags)
    launch_kernel(kernel, tiles, 32 * kwarps,
                  (x_words, _row_words(x), words(weight), out16, bias16, res16,
                   words(norm_residual) if add else x_words, _row_words(norm_residual) if add else 0,
                   words(norm_weight) if norm else x_words, words(residual_out) if add else x_words,
                   np.float32(eps if norm else 0.0), M, N, K, out.shape[1]))
    return out
