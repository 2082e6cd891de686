"""Rotary position embedding (Qwen2's neox-style rotate-half) from a cos/sin cache built once.

    cos_sin_cache  [max_position, head_dim] float32: cos(p * inv_freq) in [:, :D/2], sin in [:, D/2:],
                   inv_freq_i = 1 / theta^(2i / D)

The angles are Hugging Face's (inv_freq computed on the CPU in float32, then p * inv_freq in float32 on the
model's device), so float32 results equal HF's apply_rotary_pos_emb bit for bit. Each head's halves
(x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin), computed in float32 and rounded once to the dtype
(HF's fp16/bf16 path rounds cos, sin and each product first: the two agree within rounding).

The model rotates through its ops table's one rotary + K/V write (pagedattn/layers/ops.py): the torch
ops here (`apply_rotary`) followed by the backend's K/V write, one CUDA kernel that rotates q into a buffer
and writes the rotated k and v into the paged pool (kernels_numba/rotary.py), or in a small float32 CPU
step one numba call doing the same (kernels_numba/cpu_glue.py). This module owns the cos/sin cache.
"""
import torch
from torch import nn


def rope_cos_sin_cache(head_dim, max_position, theta, device=None):
    """[max_position, head_dim] float32 on `device` (default: the current default device)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    device = torch.empty(0, device=device).device
    positions = torch.arange(max_position, dtype=torch.float32, device=device)            # (P,)
    freqs = positions[:, None] * inv_freq.to(device)[None, :]                             # (P, D/2)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()                     # (P, D)


class RotaryEmbedding(nn.Module):
    """head_dim: D (even); max_position: positions 0 .. max_position - 1; theta: the rope base."""

    def __init__(self, head_dim, max_position, theta):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(head_dim, max_position, theta), persistent=False)

    def forward(self, positions, q, k):
        """positions: [T] int; q: [T, H, D]; k: [T, Hkv, D] (views are fine). Returns rotated (q, k), new tensors."""
        return apply_rotary(positions, q, k, self.cos_sin_cache)


def apply_rotary(positions, q, k, cos_sin_cache):
    """Torch ops: q [T, H, D], k [T, Hkv, D] rotated at positions [T] with cos_sin_cache [P, D] float32."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)                   # (T, D/2) each
    return _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])


def _rotate(x, cos, sin):
    """x: [T, heads, D]; cos, sin: [T, 1, D/2] float32. float32 math, one rounding to x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)                                     # (T, heads, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
