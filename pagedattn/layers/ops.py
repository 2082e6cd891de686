"""The model's ops table: one callable per op, chosen once when the model is built.

    ops = make_ops(backend, device, dtype, hidden_size, intermediate_size, head_dim)
    ops.rms_norm(x, weight, eps)                     -> out                  x [T, E]
    ops.add_rms_norm(x, residual, weight, eps)       -> (out, residual + x)  residual updated in place or new
    ops.rotary_and_cache_write(positions, qkv, H, Hkv, D, cos_sin_cache, k_cache, v_cache, slot_mapping)
                                                     -> q [T, H, D] rotated; the rotated k and v written
                                                        into the pool at slot_mapping (-1: skipped)
    ops.attention(q, k_cache, v_cache, attn_metadata) -> out [T, H, D] (the backend's `attend`)
    ops.silu_and_mul(x)                              -> silu(gate) * up      x [T, 2 I] -> [T, I]
    ops.linear(x, weight, bias)                      -> x weight^T + bias
    ops.embedding(ids, weight)                       -> rows ids of the table weight [V, E]
    ops.step_scope(num_rows)                         a context around a forward of num_rows rows
    ops.backend                                      the attention backend (copy_blocks, can_capture)

The layers (pagedattn/layers/*.py, pagedattn/models/qwen2.py) get the table at construction and make one
call per op; which kernel runs is decided here, once, from the backend, the device and the dtype:

    backend             glue (norms, rotary + K/V write, SiLU-and-mul)         linear
    NumbaBackend        numba CUDA kernels on fp16/bf16 on the GPU (CPU         torch
                        tensors under the simulator) where the widths allow;
                        torch ops + the backend's K/V write otherwise
    CpuNumbaBackend     float32: kernels_numba.cpu_glue in a small step,         kernels_numba.cpu_linear in a
                        torch ops + the backend's K/V write in a large one       small step, torch otherwise
    any other           torch ops + the backend's K/V write                      torch

weights="quantized" (float32 CPU models loaded from a GGUF file, pagedattn/models/loader.py: load_gguf_model):
the same glue, while `linear`, the LM head and `embedding` read the GGUF blocks the layers hold
(pagedattn.models.gguf_weights.QuantWeight, kernels_numba/cpu_quant.py) on the step's threads; a layer
still holding a float32 tensor goes to the float32 linear above.

Every variant has the same math and the same roundings (Hugging Face's; reference/layers.py).
"""
import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pagedattn.layers.attention import CpuNumbaBackend, NumbaBackend, get_backend
from pagedattn.layers.rotary import apply_rotary


@dataclass
class Ops:
    """One callable per op (the module docstring gives each one's arguments). The layers look an entry up at
    each call, so a profiler may wrap one (scripts/bench_cpu.py)."""

    rms_norm: Callable
    add_rms_norm: Callable
    rotary_and_cache_write: Callable
    attention: Callable
    silu_and_mul: Callable
    linear: Callable
    step_scope: Callable
    backend: Any
    embedding: Callable = F.embedding


# ---- torch ops: every device and dtype ----------------------------------------------------------
def rms_norm(x, weight, eps):
    """out = weight * x / sqrt(mean(x^2) + eps): float32 math, the normed row cast back before the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x, residual, weight, eps):
    """The residual stream's add (stored in the dtype), then the norm of the sum: (out, the new residual)."""
    x = residual = x + residual                                             # (T, hidden) in the dtype
    return rms_norm(x, weight, eps), residual


def silu_and_mul(x):
    """x: [T, 2 I] (gate then up) -> silu(gate) * up [T, I], a view of x's gate half."""
    gate, up = x.chunk(2, dim=-1)                                           # (T, I) each
    # in place, in x's gate half (a step's temporary): no new [T, I] buffers to fault in, which at a
    # 2,000-token CPU prefill was two thirds of this op's time
    return F.silu(gate, inplace=True).mul_(up)


def split_qkv(qkv, num_heads, num_kv_heads, head_dim):
    """qkv [T, (H + 2 Hkv) D] -> views q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]."""
    T, H, Hkv, D = qkv.shape[0], num_heads, num_kv_heads, head_dim
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)


def rotary_then_write(write, positions, qkv, num_heads, num_kv_heads, head_dim, cos_sin_cache, k_cache, v_cache,
                      slot_mapping):
    """Rotary in torch ops, then `write(k, v, k_cache, v_cache, slot_mapping)` (the backend's K/V write)."""
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q, k = apply_rotary(positions, q, k, cos_sin_cache)
    write(k, v, k_cache, v_cache, slot_mapping)
    return q


def torch_linear(x, weight, bias=None):
    return F.linear(x, weight, bias)


def no_scope(num_rows):
    return contextlib.nullcontext()


# ---- the numba CUDA glue kernels ----------------------------------------------------------------
def fused_rotary_and_cache_write(validate, positions, qkv, num_heads, num_kv_heads, head_dim, cos_sin_cache,
                                 k_cache, v_cache, slot_mapping):
    """One kernel (kernels_numba/rotary.py): q rotated into a new contiguous buffer, k rotated and v copied
    into the pool."""
    from kernels_numba.rotary import rotary_embedding_and_cache

    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return rotary_embedding_and_cache(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                      q_out=q_out, validate=validate)


def _numba_ops(backend, hidden_size, intermediate_size, head_dim):
    from kernels_numba import activation, rmsnorm

    v = backend.validate
    norm_ok = hidden_size % 8 == 0                  # the kernels move rows in 16-byte pieces
    act_ok = intermediate_size % 8 == 0
    rotary_ok = head_dim % 16 == 0                  # 8-element pieces of each half
    return Ops(
        rms_norm=partial(rmsnorm.rms_norm, validate=v) if norm_ok else rms_norm,
        add_rms_norm=partial(rmsnorm.fused_add_rms_norm, validate=v) if norm_ok else add_rms_norm,
        rotary_and_cache_write=(partial(fused_rotary_and_cache_write, v) if rotary_ok
                                else partial(rotary_then_write, backend.write)),
        attention=backend.attend,
        silu_and_mul=partial(activation.silu_and_mul, validate=v) if act_ok else silu_and_mul,
        linear=torch_linear, step_scope=no_scope, backend=backend)


# ---- the numba CPU kernels of a small step -------------------------------------------------------
def cpu_rms_norm(step, x, weight, eps):
    """A small step: one numba call (kernels_numba.cpu_glue); a large one: torch ops."""
    from kernels_numba import cpu_glue

    return cpu_glue.add_rms_norm(x, None, weight, eps) if step.small else rms_norm(x, weight, eps)


def cpu_add_rms_norm(step, x, residual, weight, eps):
    from kernels_numba import cpu_glue

    return cpu_glue.add_rms_norm(x, residual, weight, eps) if step.small else add_rms_norm(x, residual, weight, eps)


def cpu_rotary_and_cache_write(step, write, positions, qkv, num_heads, num_kv_heads, head_dim, cos_sin_cache,
                               k_cache, v_cache, slot_mapping):
    """A small step: one numba call (kernels_numba.cpu_glue); a large one: torch rotary + the backend's write."""
    if step.small:
        from kernels_numba import cpu_glue

        return cpu_glue.rotary_cache(positions, qkv, num_heads, num_kv_heads, head_dim, cos_sin_cache, k_cache,
                                     v_cache, slot_mapping)
    return rotary_then_write(write, positions, qkv, num_heads, num_kv_heads, head_dim, cos_sin_cache, k_cache,
                             v_cache, slot_mapping)


def cpu_silu_and_mul(step, x):
    """A small step: one numba call (kernels_numba.cpu_layer, the fused CPU layer's own); a large one: torch."""
    if step.small:
        from kernels_numba import cpu_layer

        return cpu_layer.silu_and_mul(x)
    return silu_and_mul(x)


def _cpu_ops(backend, device, dtype):
    step = backend.step
    glue = device.type == "cpu" and dtype == torch.float32          # the CPU glue kernels: float32 CPU tensors
    return Ops(
        rms_norm=partial(cpu_rms_norm, step) if glue else rms_norm,
        add_rms_norm=partial(cpu_add_rms_norm, step) if glue else add_rms_norm,
        rotary_and_cache_write=(partial(cpu_rotary_and_cache_write, step, backend.write) if glue
                                else partial(rotary_then_write, backend.write)),
        attention=backend.attend, silu_and_mul=partial(cpu_silu_and_mul, step) if glue else silu_and_mul,
        linear=step.linear, step_scope=step.scope, backend=backend)


def torch_ops(backend):
    """Torch ops for every piece, the backend's K/V write and attention."""
    return Ops(rms_norm=rms_norm, add_rms_norm=add_rms_norm,
               rotary_and_cache_write=partial(rotary_then_write, backend.write), attention=backend.attend,
               silu_and_mul=silu_and_mul, linear=torch_linear, step_scope=no_scope, backend=backend)


# ---- GGUF blocks (weights="quantized") ---------------------------------------------------------
def quantized_linear(threads, float_linear, x, weight, bias=None):
    """x weight^T + bias where weight is a QuantWeight (its blocks, on `threads()` threads); a float32
    tensor goes to float_linear."""
    if isinstance(weight, torch.Tensor):
        return float_linear(x, weight, bias)
    return weight(x, bias, num_threads=threads())


def quantized_embedding(threads, ids, weight):
    if isinstance(weight, torch.Tensor):
        return F.embedding(ids, weight)
    return weight.embedding(ids, num_threads=threads())


def quantize_ops(ops, device, dtype):
    """The table `ops` (float32 on the CPU) made for layers holding GGUF blocks: `linear` and `embedding`
    read QuantWeights, the rest stays. make_ops calls it when a model is built with weights="quantized"
    (pagedattn/models/loader.py: load_gguf_model). Returns ops."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        raise ValueError(f"quantized weights run on the CPU in float32, not on {device} in {dtype}")
    step = getattr(ops.backend, "step", None)
    threads = step.threads if step is not None else torch.get_num_threads
    ops.linear = partial(quantized_linear, threads, ops.linear)
    ops.embedding = partial(quantized_embedding, threads)
    return ops


def make_ops(backend, device, dtype, hidden_size, intermediate_size, head_dim, weights="float32"):
    """The ops table of a model on `device` in `dtype`.

    backend: "auto" / "torch" / "numba" / "cpu" or a backend object (pagedattn.layers.attention.get_backend).
    hidden_size: the normed width; intermediate_size: this rank's MLP width I (SiLU-and-mul's output);
    head_dim: D. The widths decide whether the glue kernels cover the layers (16-byte pieces).
    weights: "float32" (tensors) or "quantized" (the layers hold GGUF blocks: CPU, float32 only).
    """
    backend = get_backend(backend, device)
    device, dtype = torch.device(device), getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if isinstance(backend, NumbaBackend) and backend.glue_kernels_for(device, dtype):
        ops = _numba_ops(backend, hidden_size, intermediate_size, head_dim)
    elif CpuNumbaBackend is not None and isinstance(backend, CpuNumbaBackend):
        ops = _cpu_ops(backend, device, dtype)
    else:
        ops = torch_ops(backend)
    if weights == "quantized":
        return quantize_ops(ops, device, dtype)
    if weights != "float32":
        raise ValueError(f"weights must be 'float32' or 'quantized', got {weights!r}")
    return ops
