"""The decoder layer's glue on the CPU, compiled by numba's CPU target: residual add + RMSNorm, and rotary
fused with the KV-cache write. float32 only (the CPU engine's dtype).

A small CPU step (at most 16 rows: decodes) spends little on the glue's arithmetic and much on dispatch:
torch's RMSNorm is eight ops (~150 us per call at one row on the 2-core Xeon of docs/cpu.md, 48 calls a
step) and rotary plus the write another six. Here each is one call of a few microseconds. The math is
the torch path's (pagedattn/layers/norm.py, rotary.py) in float32, checked against reference/layers.py:

    add_rms_norm   s = x + residual (stored into residual); out = weight * s / sqrt(mean(s^2) + eps)
    rotary_cache   q, k rotated by cos/sin of each token's position (the first half of the head dim
                   against the second, as HF's rotate_half); q into a new [T, H, D] tensor, the rotated
                   k and v into the pool at slot_mapping (-1: not written)

Safety: positions and slots are checked before any write (numba does not check bounds); a bad one
raises KernelLaunchError naming the field.
"""
import numpy as np
import torch
from numba import njit

from kernels_numba.errors import KernelLaunchError


@njit(cache=True, nogil=True)
def _add_rms_norm(x, residual, weight, eps, out, has_residual):
    T, E = x.shape
    for t in range(T):
        ss = np.float32(0)
        for e in range(E):
            s = x[t, e] + residual[t, e] if has_residual else x[t, e]
            if has_residual:
                residual[t, e] = s
            ss += s * s
        inv = np.float32(1) / np.sqrt(ss / np.float32(E) + eps)
        for e in range(E):
            s = residual[t, e] if has_residual else x[t, e]
            out[t, e] = weight[e] * (s * inv)


@njit(cache=True, nogil=True)
def _rotary_cache(positions, qkv, H, Hkv, D, cos_sin, k_cache, v_cache, slots, q_out):
    """Returns 0, 1 (a position outside the cos/sin cache) or 2 (a slot outside the pool)."""
    T = qkv.shape[0]
    num_slots = k_cache.shape[0] * k_cache.shape[2]
    BS = k_cache.shape[2]
    for t in range(T):
        if positions[t] < 0 or positions[t] >= cos_sin.shape[0]:
            return 1
        if slots[t] >= num_slots:
            return 2
    for t in range(T):
        cs = cos_sin[positions[t]]
        for h in range(H):
            _rotate(qkv[t, h * D:(h + 1) * D], cs, q_out[t, h])
        slot = slots[t]
        if slot < 0:
            continue
        blk, off = slot // BS, slot % BS
        for h in range(Hkv):
            _rotate(qkv[t, (H + h) * D:(H + h + 1) * D], cs, k_cache[blk, h, off])
            v_cache[blk, h, off, :] = qkv[t, (H + Hkv + h) * D:(H + Hkv + h + 1) * D]
    return 0


@njit(inline="always")
def _rotate(x, cs, out):
    """out = x rotated: (x1 cos - x2 sin, x2 cos + x1 sin) over the halves of one head; cs = [cos | sin]."""
    half = x.shape[0] // 2
    for i in range(half):
        c, s = cs[i], cs[half + i]
        x1, x2 = x[i], x[half + i]
        out[i] = x1 * c - x2 * s
        out[half + i] = x2 * c + x1 * s


def _f32(t, name, ndim):
    if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != ndim or not t.is_contiguous():
        raise KernelLaunchError(f"{name}: needs a contiguous {ndim}-D float32 CPU tensor "
                                f"(got {tuple(t.shape)} {t.dtype} on {t.device})")
    return t.numpy()


def add_rms_norm(x, residual, weight, eps):
    """x, residual (or None): [T, E] float32; weight: [E]. Returns out, or (out, residual) with the sum
    x + residual written into residual."""
    xa, wa = _f32(x, "x", 2), _f32(weight, "weight", 1)
    if wa.shape[0] != xa.shape[1]:
        raise KernelLaunchError(f"weight: {wa.shape[0]} elements for rows of {xa.shape[1]}")
    ra = xa
    if residual is not None:
        ra = _f32(residual, "residual", 2)
        if ra.shape != xa.shape:
            raise KernelLaunchError(f"residual: shape {tuple(ra.shape)}, x has {tuple(xa.shape)}")
    out = torch.empty_like(x)
    _add_rms_norm(xa, ra, wa, np.float32(eps), out.numpy(), residual is not None)
    return out if residual is None else (out, residual)


def rotary_error(err):
    """The KernelLaunchError of _rotary_cache's error code err (1 or 2), naming the field."""
    return KernelLaunchError("positions: a position outside the cos/sin cache" if err == 1
                             else "slot_mapping: a slot outside the pool")


def rotary_cache(positions, qkv, num_heads, num_kv_heads, head_dim, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """qkv: [T, (H + 2 Hkv) D] float32 (the merged projection's output); positions, slot_mapping: [T] int;
    cos_sin_cache: [max_position, D] float32; k_cache, v_cache: [num_blocks, Hkv, block_size, D] float32.
    Returns q rotated, [T, H, D]; writes the rotated k and v into the pool."""
    qa = _f32(qkv, "qkv", 2)
    if qa.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise KernelLaunchError(f"qkv: {qa.shape[1]} features, expected (H + 2 Hkv) D = "
                                f"{(num_heads + 2 * num_kv_heads) * head_dim}")
    kc, vc = _f32(k_cache, "k_cache", 4), _f32(v_cache, "v_cache", 4)
    q_out = torch.empty(qa.shape[0], num_heads, head_dim)
    err = _rotary_cache(positions.numpy(), qa, num_heads, num_kv_heads, head_dim, _f32(cos_sin_cache, "cos_sin_cache", 2),
                        kc, vc, slot_mapping.numpy(), q_out.numpy())
    if err:
        raise rotary_error(err)
    return q_out
