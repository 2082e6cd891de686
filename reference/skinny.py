"""Reference versions of the skinny GEMM and its fused variants (kernels_numba/skinny_gemm.py) in numpy.

The product itself is the ground truth in float64 (x @ W^T of the stored fp16/bf16 values, exact up to
float64's rounding); the roundings to the storage dtype then follow the unfused path the fused kernel
replaces, each at the point where it rounds:

    linear                    y = round(acc + bias)                        (one rounding; bias optional)
    linear with residual      y = round(round(acc) + residual)             (the GEMM, then the residual add)
    silu_mul_linear           y = round(round(silu(round(acc_gate))) * round(acc_up))
                                                                           (the GEMM, then silu_and_mul)
    norm_linear               x' = rms_norm(x) or rms_norm(round(residual + x)) with reference/layers.py's
                              float32 recipe (Hugging Face's roundings), then linear on x'

Inputs: numpy arrays or torch tensors holding values of the storage dtype; `dtype` names it ("float16" or
"bfloat16"). Outputs: float32 numpy arrays whose values are representable in that dtype. Each function also
gives the float64 scale sum_k |x_mk| |W_nk| of every output, the size the fp32 accumulation error of a
kernel is measured against.
"""
import numpy as np

from reference.layers import _f32, rms_norm, round_to


def _f64(x):
    return _f32(x).astype(np.float64)


def _round64(v, dtype):
    # float64 -> float32 -> dtype: a second rounding that can differ from a direct one only on exact ties of
    # the float32 value, far below the tolerances that use these references
    return round_to(np.asarray(v, dtype=np.float64).astype(np.float32), dtype)


def gemm(x, weight):
    """acc [M, N] = x [M, K] @ weight [N, K]^T in float64, and its scale |x| @ |weight|^T."""
    x, w = _f64(x), _f64(weight)
    return x @ w.T, np.abs(x) @ np.abs(w).T


def linear(x, weight, dtype, bias=None, residual=None):
    """y [M, N] of the plain GEMM (+ bias) (+ the residual add after it). Returns (y, scale)."""
    acc, scale = gemm(x, weight)
    if bias is not None:
        acc = acc + _f64(bias)[None, :]
    y = _round64(acc, dtype)
    if residual is not None:
        y = round_to(y + _f32(residual), dtype)            # two dtype values: float32 adds them exactly enough
    return y, scale


def silu_mul_linear(x, weight, dtype, bias=None):
    """weight = [gate; up] ([2 I, K]): y [M, I] = silu(gate) * up with the unfused roundings.
    Returns (y, scale of the gate rows, scale of the up rows)."""
    acc, scale = gemm(x, weight)
    if bias is not None:
        acc = acc + _f64(bias)[None, :]
    inter = acc.shape[1] // 2
    g = _round64(acc[:, :inter], dtype).astype(np.float64)
    u = _round64(acc[:, inter:], dtype).astype(np.float64)
    s = _round64(g / (1.0 + np.exp(-g)), dtype).astype(np.float64)
    return _round64(s * u, dtype), scale[:, :inter], scale[:, inter:]


def norm_linear(x, norm_weight, eps, weight, dtype, norm_residual=None, bias=None):
    """The RMSNorm prologue, then linear: (y [M, N], scale, normed x [M, K], the new residual or None)."""
    normed, new_residual = rms_norm(x, norm_weight, eps, dtype, residual=norm_residual)
    y, scale = linear(normed, weight, dtype, bias=bias)
    return y, scale, normed, new_residual
