"""SiLU-and-mul, the gate of Qwen2's MLP, over the merged gate_up projection's output.

    x = [gate | up]  [T, 2 I]  ->  silu(gate) * up  [T, I]

with Hugging Face's roundings (silu's result is stored in the dtype before the product). The model's ops
table (pagedattn/layers/ops.py) runs it: torch ops, or one CUDA kernel (kernels_numba/activation.py).
"""
from torch import nn


class SiluAndMul(nn.Module):
    """ops: the model's ops table (pagedattn.layers.ops)."""

    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def forward(self, x):
        """x: [T, 2 I] (gate then up). Returns [T, I]."""
        return self.ops.silu_and_mul(x)
