"""RMSNorm as in Qwen2, alone or fused with the residual add (nano-vllm's `forward(x, residual)` shape).

    norm(x)            -> out                       out = w * x / sqrt(mean(x^2) + eps)
    norm(x, residual)  -> (out, residual + x)       the residual stream's add, then the norm of the sum

fp32 math with Hugging Face's roundings (the sum is stored in the dtype before it is normed; the normed row
is cast back before the weight multiplies it; see reference/layers.py). The model's ops table
(pagedattn/layers/ops.py) runs it: torch ops, one CUDA kernel that updates `residual` in place
(kernels_numba/rmsnorm.py), or in a small float32 CPU step one numba call (kernels_numba/cpu_glue.py).
"""
import torch
from torch import nn


class RMSNorm(nn.Module):
    """hidden_size: the normed width; eps: added to the mean square; ops: the model's ops table
    (pagedattn.layers.ops). Parameter: weight [hidden_size]."""

    def __init__(self, hidden_size, eps, ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps, self.ops = eps, ops

    def forward(self, x, residual=None):
        """x, residual: [T, hidden]. Returns out [T, hidden], or (out, the new residual) given a residual."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
