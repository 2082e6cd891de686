"""Reference versions of the decoder layer's glue in numpy: RMSNorm (plain and fused with the residual add),
rotary embedding fused with the KV-cache write, SiLU-and-mul.

The ground truth here is not float64: it is Hugging Face's Qwen2 in torch eager mode, which computes these ops
in float32 and rounds to the storage dtype (float16 / bfloat16) at fixed points. Each function computes in
float32 and rounds at exactly those points (`round_to`), so a kernel that follows the same recipe can differ
from it only where float32 arithmetic is reordered (a sum of squares, a fused multiply-add): by at most one
unit in the last place of an output. The places where a kernel's math deliberately departs from HF's are
stated below (rotary in float32 where HF rounds cos/sin to fp16 first).

Inputs are numpy arrays or torch tensors holding values of the storage dtype (any device; copied to float32
numpy); `dtype` names the storage dtype ("float16", "bfloat16" or "float32"). Outputs are float32 numpy
arrays whose values are representable in that dtype.
"""
import numpy as np


def _f32(x):
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().float().cpu().numpy()
    return np.array(x, dtype=np.float32)


def _ints(x):
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64)


def round_to(x, dtype):
    """float32 values rounded to the nearest `dtype` value (ties to even), returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x.copy()
    if dtype == "float16":
        with np.errstate(over="ignore"):  # beyond 65504 -> inf, as the hardware conversion
            return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":  # keep the top 16 bits of the float32, rounding the rest to nearest even
        bits = x.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32)
    raise ValueError(f"dtype must be 'float16', 'bfloat16' or 'float32', got {dtype!r}")


def rms_norm(x, weight, eps, dtype, residual=None):
    """Qwen2RMSNorm, optionally after the residual add.

    x: [T, hidden]; weight: [hidden]; eps: float; residual: optional [T, hidden].
    Without residual: out = round(w * round(x / sqrt(mean(x^2) + eps))).
    With residual: r = round(residual + x) is normed instead (HF stores the sum in the dtype first).
    Returns (out [T, hidden], r or None).
    """
    x, w = _f32(x), _f32(weight)
    r = None
    if residual is not None:
        r = round_to(_f32(residual) + x, dtype)                      # (T, hidden)
        x = r
    variance = np.sum(x * x, axis=-1, keepdims=True, dtype=np.float32) / np.float32(x.shape[-1])
    normed = round_to(x * (np.float32(1.0) / np.sqrt(variance + np.float32(eps))), dtype)
    return round_to(w * normed, dtype), r


def rotate(x, positions, cos_sin_cache, dtype):
    """Neox-style rotary embedding (Qwen2's rotate-half): each head's halves (x1, x2) become
    (x1 cos - x2 sin, x2 cos + x1 sin), in float32 with one rounding to the dtype.

    x: [T, heads, head_dim]; positions: [T] ints; cos_sin_cache: [max_position, head_dim] float32 with
    cos in [:, :head_dim/2] and sin in [:, head_dim/2:] (HF's angles: position * inv_freq in float32).
    In float32 this is HF's apply_rotary_pos_emb bit for bit; in fp16/bf16 HF rounds cos/sin and each
    product to the dtype first, so the two differ by rounding.
    """
    x, cache, pos = _f32(x), _f32(cos_sin_cache), _ints(positions)
    half = x.shape[-1] // 2
    cos, sin = cache[pos, None, :half], cache[pos, None, half:]      # (T, 1, head_dim/2)
    x1, x2 = x[..., :half], x[..., half:]
    return round_to(np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1), dtype)


def rotary_and_cache(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, dtype):
    """q rotated; k rotated and, with v, written into the paged pool at each token's slot.

    q: [T, H, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, Hkv, block_size, D] (not modified);
    slot_mapping: [T] ints, slot = block * block_size + offset, -1 = padding (written nowhere).
    Returns (q rotated [T, H, D], k_cache after the write, v_cache after the write), float32.
    """
    q_rot = rotate(q, positions, cos_sin_cache, dtype)
    k_rot, v = rotate(k, positions, cos_sin_cache, dtype), _f32(v)
    k_out, v_out = _f32(k_cache), _f32(v_cache)
    block_size = k_out.shape[2]
    for t, slot in enumerate(_ints(slot_mapping)):
        if slot < 0:
            continue
        block, offset = slot // block_size, slot % block_size
        k_out[block, :, offset] = k_rot[t]
        v_out[block, :, offset] = v[t]
    return q_rot, k_out, v_out


def silu_and_mul(x, dtype):
    """x: [T, 2 I] = (gate | up) -> [T, I] = round(round(silu(gate)) * up), as HF's act_fn(gate) * up."""
    x = _f32(x)
    n = x.shape[-1] // 2
    gate, up = x[..., :n], x[..., n:]
    with np.errstate(over="ignore"):  # exp(-gate) = inf for very negative gate: silu -> -0, as torch
        silu = round_to(gate / (np.float32(1.0) + np.exp(-gate)), dtype)
    return round_to(silu * up, dtype)
