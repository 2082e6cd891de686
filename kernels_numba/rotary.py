"""Rotary embedding fused with the KV-cache write, in numba.cuda: one kernel between the qkv GEMM and attention.

Per token t at position p = positions[t], for every head of q and of k (Qwen2's neox-style rotate-half):

    (x1, x2) = (x[:D/2], x[D/2:]),   (c, s) = cos_sin_cache[p, :D/2], cos_sin_cache[p, D/2:]
    x <- (x1 c - x2 s,  x2 c + x1 s)                                   float32 math, one rounding

q is rotated into q_out (default: in place); k is rotated on its way into the pool and v copied there, at
slot = slot_mapping[t] (block slot // block_size, offset slot % block_size; -1 = padding, nothing
written). k itself is left as it was. q, k and v may be strided views into the merged qkv projection's output
[T, (H + 2 Hkv) D]: each is read through its own row stride. The cos/sin cache is float32
[max_position, D] (cos in the first half, sin in the second) built once at load (pagedattn/layers/rotary.py),
with Hugging Face's float32 angles, so this is HF's rotary bit for bit in float32 math and within rounding
of HF's fp16/bf16 path (which rounds cos, sin and each product to the dtype).

One CTA per token; its threads loop over 16-byte units: a (q or k head, 8-element piece of the first half)
unit loads 8 elements of x1 and the 8 matching elements of x2 (two LDG.E.128), 8 cos and 8 sin (four
LDG.E.128 of float32), and stores two STG.E.128; a (v head, 8-element piece) unit copies 16 bytes. For
Qwen2-0.5B (14 + 2 heads, D = 64) that is 64 + 16 units, one per thread. D must be a multiple of 16.
Replaces torch's ~15 kernels (cat, slices, casts, multiplies) plus the cache write.
"""
from functools import lru_cache

from numba import cuda

from kernels_numba import bridge
from kernels_numba.bridge import capturing, ints, words
from kernels_numba.common import check_tensor, f32_from_bits, load_u32x4, pack2, store_u32x4, unpack2
from kernels_numba.errors import KernelLaunchError
from kernels_numba.launcher import launch as launch_kernel
from kernels_numba.rmsnorm import threads_for


@cuda.jit(device=True)
def _rotate_pair(a, b, cos_lo, cos_hi, sin_lo, sin_hi, bf16):
    """a: 2 elements of the first half, b: the matching 2 of the second half; cos/sin as float32 bits.
    Returns the rotated (first-half pair, second-half pair)."""
    a0, a1 = unpack2(a, bf16)
    b0, b1 = unpack2(b, bf16)
    c0, c1 = f32_from_bits(cos_lo), f32_from_bits(cos_hi)
    s0, s1 = f32_from_bits(sin_lo), f32_from_bits(sin_hi)
    return pack2(a0 * c0 - b0 * s0, a1 * c1 - b1 * s1, bf16), pack2(b0 * c0 + a0 * s0, b1 * c1 + a1 * s1, bf16)


@cuda.jit(device=True)
def _load_rotated(x, w, half_w, cos_sin, cw, half, bf16):
    """The rotated 8-element pieces of one head: x[w:w+4] (first half) and x[w+half_w:...] (second half),
    by cos_sin[cw:cw+8] and sin at cw + half. Returns 4 words of the first half, then 4 of the second."""
    a0, a1, a2, a3 = load_u32x4(x, w)
    b0, b1, b2, b3 = load_u32x4(x, w + half_w)
    c0, c1, c2, c3 = load_u32x4(cos_sin, cw)
    c4, c5, c6, c7 = load_u32x4(cos_sin, cw + 4)
    s0, s1, s2, s3 = load_u32x4(cos_sin, cw + half)
    s4, s5, s6, s7 = load_u32x4(cos_sin, cw + half + 4)
    x0, y0 = _rotate_pair(a0, b0, c0, c1, s0, s1, bf16)
    x1, y1 = _rotate_pair(a1, b1, c2, c3, s2, s3, bf16)
    x2, y2 = _rotate_pair(a2, b2, c4, c5, s4, s5, bf16)
    x3, y3 = _rotate_pair(a3, b3, c6, c7, s6, s7, bf16)
    return x0, x1, x2, x3, y0, y1, y2, y3


@bridge.disk_cached
@lru_cache(maxsize=None)
def _make_kernel(head_dim, is_bf16):
    D, BF16 = head_dim, is_bf16
    HALF = D // 2            # elements in half a head (and float32 words of its cos, of its sin)
    HEAD_W = D // 2          # 32-bit words in a head of fp16/bf16
    HALF_W = D // 4          # ... and in half a head
    PIECES = D // 16         # 8-element pieces in half a head: one unit each
    V_PIECES = D // 8        # 8-element pieces in a whole head (the v copy)

    @cuda.jit
    def rotary_cache_kernel(positions, q, q_stride, k, k_stride, v, v_stride, q_out, qo_stride, cos_sin,
                            k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, block_size):
        # q, k, v, q_out: rows of heads x D halves as words (row t at t * stride, head h at h * D / 2);
        # cos_sin: [max_position, D] float32 as words; k_cache, v_cache: [blocks, Hkv, block_size, D] as words.
        t = cuda.blockIdx.x
        cos_row = positions[t] * D
        slot = slot_mapping[t]
        block = slot // block_size
        offset = slot - block * block_size
        num_q, num_k = num_heads * PIECES, num_kv_heads * PIECES
        for u in range(cuda.threadIdx.x, num_q + num_k + num_kv_heads * V_PIECES, cuda.blockDim.x):
            if u < num_q:                            # q head h, elements 8p .. 8p+7 of each half
                h, p = u // PIECES, u % PIECES
                x0, x1, x2, x3, y0, y1, y2, y3 = _load_rotated(q, t * q_stride + h * HEAD_W + 4 * p, HALF_W,
                                                               cos_sin, cos_row + 8 * p, HALF, BF16)
                o = t * qo_stride + h * HEAD_W + 4 * p
                store_u32x4(q_out, o, x0, x1, x2, x3)
                store_u32x4(q_out, o + HALF_W, y0, y1, y2, y3)
            elif slot < 0:                           # padding token: nothing goes into the pool
                continue
            elif u < num_q + num_k:                  # k head h: rotated straight into the pool
                h, p = (u - num_q) // PIECES, (u - num_q) % PIECES
                x0, x1, x2, x3, y0, y1, y2, y3 = _load_rotated(k, t * k_stride + h * HEAD_W + 4 * p, HALF_W,
                                                               cos_sin, cos_row + 8 * p, HALF, BF16)
                o = ((block * num_kv_heads + h) * block_size + offset) * HEAD_W + 4 * p
                store_u32x4(k_cache, o, x0, x1, x2, x3)
                store_u32x4(k_cache, o + HALF_W, y0, y1, y2, y3)
            else:                                    # v head h, elements 8p .. 8p+7: copied
                j = u - num_q - num_k
                h, p = j // V_PIECES, j % V_PIECES
                v0, v1, v2, v3 = load_u32x4(v, t * v_stride + h * HEAD_W + 4 * p)
                store_u32x4(v_cache, ((block * num_kv_heads + h) * block_size + offset) * HEAD_W + 4 * p,
                            v0, v1, v2, v3)

    return rotary_cache_kernel


def _check_heads(name, t, T, heads, head_dim, dtype):
    """t: [T, heads, head_dim] with contiguous heads and 16-byte aligned rows (a view of a merged row is fine)."""
    check_tensor(name, t, 3, (dtype,))
    if tuple(t.shape) != (T, heads, head_dim):
        raise KernelLaunchError(f"{name} must be [{T}, {heads}, {head_dim}], got {tuple(t.shape)}")
    if t.stride(2) != 1 or (heads > 1 and t.stride(1) != head_dim):
        raise KernelLaunchError(f"{name} must hold each token's heads contiguously, got strides {t.stride()}")
    if (T > 1 and t.stride(0) % 8) or t.data_ptr() % 16:
        raise KernelLaunchError(f"{name} rows must be 16-byte aligned (row stride {t.stride(0)} elements)")


def _validate(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, q_out):
    import torch

    check_tensor("q", q, 3, (torch.float16, torch.bfloat16))
    T, H, D = q.shape
    if D % 16:
        raise KernelLaunchError(f"head_dim={D} must be a multiple of 16 (16-byte pieces of each half)")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, cache, 4, (q.dtype,))
        if not cache.is_contiguous() or cache.shape[3] != D or cache.shape != k_cache.shape:
            raise KernelLaunchError(f"{name} must be a contiguous [num_blocks, num_kv_heads, block_size, {D}] "
                                    f"like k_cache, got {tuple(cache.shape)}")
    num_blocks, Hkv, block_size, _ = k_cache.shape
    _check_heads("q", q, T, H, D, q.dtype)
    _check_heads("k", k, T, Hkv, D, q.dtype)
    _check_heads("v", v, T, Hkv, D, q.dtype)
    if q_out is not None:
        _check_heads("q_out", q_out, T, H, D, q.dtype)
    check_tensor("cos_sin_cache", cos_sin_cache, 2, (torch.float32,))
    if cos_sin_cache.shape[1] != D or not cos_sin_cache.is_contiguous():
        raise KernelLaunchError(f"cos_sin_cache must be a contiguous float32 [max_position, {D}], "
                                f"got {tuple(cos_sin_cache.shape)}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_tensor(name, t, 1, (torch.int32, torch.int64))
        if t.shape[0] != T or not t.is_contiguous():
            raise KernelLaunchError(f"{name} must be a contiguous [{T}], got {tuple(t.shape)}")
    if T and not capturing():  # value checks: one device->host sync
        lo_hi = torch.stack([positions.min().long(), positions.max().long(),
                             slot_mapping.min().long(), slot_mapping.max().long()]).tolist()
        if lo_hi[0] < 0 or lo_hi[1] >= cos_sin_cache.shape[0]:
            raise KernelLaunchError(f"positions must lie in [0, {cos_sin_cache.shape[0]}) (the cos/sin cache), "
                                    f"got [{lo_hi[0]}, {lo_hi[1]}]")
        if lo_hi[2] < -1 or lo_hi[3] >= num_blocks * block_size:
            raise KernelLaunchError(f"slot_mapping must lie in [-1, {num_blocks * block_size}), "
                                    f"got [{lo_hi[2]}, {lo_hi[3]}]")


def rotary_embedding_and_cache(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, q_out=None,
                               validate=True):
    """Rotate q (into q_out, default in place) and k, and write the rotated k and v into the pool.

    positions: [T] int32/int64 in [0, max_position)
    q: [T, H, D]; k, v: [T, Hkv, D] float16/bfloat16, each token's heads contiguous, rows 16-byte aligned
        (views into a merged qkv output [T, (H + 2 Hkv) D] qualify); D % 16 == 0
    cos_sin_cache: [max_position, D] float32, cos in [:, :D/2], sin in [:, D/2:]
    k_cache, v_cache: [num_blocks, Hkv, block_size, D] q's dtype, contiguous (written in place)
    slot_mapping: [T] int32/int64, slot = block * block_size + offset, -1 = nothing written
    q_out: optional [T, H, D] (e.g. a contiguous buffer for the attention kernels)
    validate: check shapes, dtypes, strides and alignment, and (one device sync, skipped inside CUDA-graph
        capture) that positions and slots lie in range.
    Returns the rotated q (q_out, or q). Runs on torch's current stream (capturable in a CUDA graph).
    """
    import torch

    if validate:
        _validate(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, q_out)
    if q_out is None:
        q_out = q
    T, H, D = q.shape
    if T == 0:
        return q_out
    Hkv, block_size = k_cache.shape[1], k_cache.shape[2]
    kernel = _make_kernel(D, q.dtype == torch.bfloat16)
    units = (H + Hkv) * (D // 16) + Hkv * (D // 8)
    launch_kernel(kernel, T, threads_for(units),
           (ints(positions), words(q), q.stride(0) // 2, words(k), k.stride(0) // 2, words(v), v.stride(0) // 2,
            words(q_out), q_out.stride(0) // 2, words(cos_sin_cache), words(k_cache), words(v_cache),
            ints(slot_mapping), H, Hkv, block_size))
    return q_out
