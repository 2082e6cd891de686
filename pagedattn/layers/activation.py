"""SiLU-and-mul, the gate of Qwen2's MLP, over the merged gate_up projection's output.

    x = [gate | up]  [T, 2 I]  ->  silu(gate) * up  [T, I]

with Hugging Face's roundings (silu's result is stored in the dtype before the product). With the numba
backend on fp16/bf16 this is one kernel (kernels_numba/activation.py); otherwise torch ops.
"""
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self, intermediate_size=None):
        super().__init__()
        self.backend = None        # the model's attention backend when its kernels may run here (None: torch)
        self.kernel_ok = intermediate_size is None or intermediate_size % 8 == 0   # 16-byte pieces

    def forward(self, x):
        """x: [T, 2 I] (gate then up). Returns [T, I]."""
        backend = self.backend
        if backend is not None and self.kernel_ok and backend.fused(x):
            from kernels_numba.activation import silu_and_mul
            return silu_and_mul(x, validate=backend.validate)
        gate, up = x.chunk(2, dim=-1)                                       # (T, I) each
        # in place, in x's gate half (a step's temporary): no new [T, I] buffers to fault in, which at a
        # 2,000-token CPU prefill was two thirds of this op's time
        return F.silu(gate, inplace=True).mul_(up)                          # (T, I), a view of x
