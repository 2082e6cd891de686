"""RMSNorm as in Qwen2, alone or fused with the residual add (nano-vllm's `forward(x, residual)` shape).

    norm(x)            -> out                       out = w * x / sqrt(mean(x^2) + eps)
    norm(x, residual)  -> (out, residual + x)       the residual stream's add, then the norm of the sum

fp32 math with Hugging Face's roundings (the sum is stored in the dtype before it is normed; the normed row
is cast back before the weight multiplies it; see reference/layers.py). With the numba backend on fp16/bf16
this is one kernel (kernels_numba/rmsnorm.py) that updates `residual` in place, in a small float32 CPU step one
numba call (kernels_numba/cpu_glue.py) that does the same; otherwise torch ops with the same math.
"""
import torch
from torch import nn


class RMSNorm(nn.Module):
    """hidden_size: the normed width; eps: added to the mean square. Parameter: weight [hidden_size]."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.backend = None        # the model's attention backend when its kernels may run here (None: torch)
        self.kernel_ok = hidden_size % 8 == 0           # the kernel moves rows in 16-byte pieces

    def forward(self, x, residual=None):
        """x, residual: [T, hidden]. Returns out [T, hidden], or (out, the new residual) given a residual."""
        backend = self.backend
        if backend is not None and self.kernel_ok and backend.fused(x):
            from kernels_numba import rmsnorm
            if residual is None:
                return rmsnorm.rms_norm(x, self.weight, self.eps, validate=backend.validate)
            return rmsnorm.fused_add_rms_norm(x, residual, self.weight, self.eps, validate=backend.validate)
        if backend is not None and backend.cpu_glue(x):                   # a small float32 CPU step
            from kernels_numba import cpu_glue
            return cpu_glue.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = residual = x + residual                                     # (T, hidden) in the dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)
