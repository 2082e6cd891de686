"""RMSNorm as in Qwen2, alone or fused with the residual add (nano-vllm's `forward(x, residual)` shape).

    norm(x)            -> out                       out = w * x / sqrt(mean(x^2) + eps)
    norm(x, residual)  -> (out, residual + x)       the residual stream's add, then the norm of the sum

fp32 math with Hugging Face's roundings (the sum is stored in the dtype before it is normed; the normed row
is cast back before the weight multiplies it; see reference/layers.py). The model's ops table
(pagedattn/layers/ops.py) runs it: torch ops, one CUDA kernel that updates `residual` in place
(kernels_numba/rmsnorm.py), or in a small float32 CPU step one numba call (kernels_numba/cpu_glue.py).

Under tensor parallelism a norm after a row-parallel layer may take the layer's all-reduce in too
(`fused`, a FusedAllReduceNorm; pagedattn/distributed/allreduce_norm.py): in a step it takes, x is this
rank's partial sum and residual this rank's rows of the residual stream,

    norm(partial, residual_rows) -> (out, residual_rows + sum of partials over ranks, this rank's rows)

with out whole on every rank (a reduce-scatter, the add-norm on this rank's rows, an all-gather).
"""
import torch
from torch import nn

from pagedattn.distributed.allreduce_norm import all_reduce_add_rms_norm


class RMSNorm(nn.Module):
    """hidden_size: the normed width; eps: added to the mean square; ops: the model's ops table
    (pagedattn.layers.ops); fused: None, or the model's FusedAllReduceNorm (a norm after a row-parallel
    layer). Parameter: weight [hidden_size]."""

    def __init__(self, hidden_size, eps, ops, fused=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps, self.ops, self.fused = eps, ops, fused

    def forward(self, x, residual=None):
        """x, residual: [T, hidden]. Returns out [T, hidden], or (out, the new residual) given a residual.
        In a step that `fused` takes: x is this rank's partial sum [T, hidden] and residual this rank's rows
        [token_rows(T, P), hidden]; the new residual is this rank's rows too (module docstring)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        if self.fused is not None and self.fused.takes(x.shape[0]):
            return all_reduce_add_rms_norm(x, residual, self.weight, self.eps, self.ops.add_rms_norm)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
