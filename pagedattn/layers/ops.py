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
    ops.decoder_layer(layer, positions, x, residual, k_cache, v_cache, attn_metadata)
                                                     -> the layer's (output, residual): its own forward,
                                                        or the backend's whole-layer call
    ops.step_scope(num_rows)                         a context around a step of num_rows rows (the runner's)
    ops.backend                                      the attention backend (copy_blocks, can_capture)

The layers (pagedattn/layers/*.py, pagedattn/models/qwen2.py) get the table at construction and make one
call per op; which kernel runs each op is the backend's choice, made here once from the device and the
dtype (`backend.ops_table`):

    backend                                glue (norms, rotary + K/V write, SiLU-and-mul)   linear     layer
    NumbaBackend (pagedattn/layers/        numba CUDA kernels on fp16/bf16 on the GPU (CPU    torch      its forward
      attention.py)                        tensors under the simulator) where the widths
                                           allow; torch ops + the backend's K/V write else
    CpuNumbaBackend (pagedattn/layers/     float32: numba CPU kernels in a small step, torch  cpu_linear one numba call
      cpu.py)                              ops + the backend's K/V write in a large one       in a small in a small
                                                                                              step       float32 step
    TorchPagedBackend                      torch ops + the backend's K/V write                torch      its forward

weights="quantized" (float32 CPU models loaded from a GGUF file, pagedattn/models/loader.py: load_gguf_model):
the same table, while `linear`, the LM head and `embedding` read the GGUF blocks the layers hold
(pagedattn.models.gguf_weights.QuantWeight, kernels_numba/cpu_quant.py) on the step's threads; a layer
still holding a float32 tensor goes to the float32 linear above.

Every variant has the same math and the same roundings (Hugging Face's; reference/layers.py).
"""
import contextlib
import os
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F

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
    decoder_layer: Callable = None        # None: the layer's own forward (run_layer)

    def __post_init__(self):
        if self.decoder_layer is None:
            self.decoder_layer = run_layer


def run_layer(layer, positions, x, residual, k_cache, v_cache, attn_metadata):
    """A decoder layer through its own forward (its ops one by one)."""
    return layer(positions, x, residual, k_cache, v_cache, attn_metadata)


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


def _gemm_rows(x, M):
    """x as M >= len(x) contiguous, 256-byte aligned rows for a GEMM call: x itself where it is one already,
    else a fresh buffer with x's rows first (the rest as the allocator gives them: a row's product reads only
    its own row)."""
    if M == x.shape[0] and x.is_contiguous() and x.data_ptr() % 256 == 0:
        return x
    buf = torch.empty(M, x.shape[1], dtype=x.dtype, device=x.device)
    buf[:x.shape[0]] = x
    return buf


def fixed_rows_linear(rows, x, weight, bias=None, product=None):
    """x weight^T + bias computed `rows` rows at a time, the last piece padded to `rows`: every product is one
    shape, so the GEMM library runs one algorithm on it and a row's result never depends on how many rows came
    with it (the GPU's batch-invariant mode: docs/batch_invariance.md). Each row of a product reads only its own
    row of x, so the padding rows (left as the allocator gives them: one copy, no fill) and the rows beside it
    change nothing, and their results are dropped. The library may also choose by the leading dimension and the
    pointers' alignment: x is copied into a fresh contiguous buffer unless it is one already (SiLU-and-mul's
    output is a strided view). product: a piece's product (x, weight, bias) -> out (default torch.mm / addmm,
    which is F.linear)."""
    T = x.shape[0]
    pad = -T % rows
    x = _gemm_rows(x, T + pad)
    out = torch.empty(T + pad, weight.shape[0], dtype=x.dtype, device=x.device)
    wt = weight.t()
    for i in range(0, T + pad, rows):
        if product is not None:
            out[i:i + rows] = product(x[i:i + rows], weight, bias)
        elif bias is None:
            torch.mm(x[i:i + rows], wt, out=out[i:i + rows])
        else:
            torch.addmm(bias, x[i:i + rows], wt, out=out[i:i + rows])
    return out[:T]


class InvariantLinear:
    """The batch-invariant mode's products: fixed_rows_linear's bits (`rows` rows a call), by one plain call
    where the GEMM library gives those bits anyway.

    The library chooses its algorithm by the product's shape, so whether one call of M rows gives each row the
    bits of the `rows`-row pieces is a property of (weight shape, dtype, bias, M): checked the first time a
    weight shape meets a row count outside a CUDA-graph capture (the engine's warm-up runs meet every graph's
    row count before its capture), on M random rows. A product takes the one call where its M was checked
    equal, the pieces elsewhere (and inside a capture at a row count not met before): the bits are the pieces'
    whichever runs, the check only decides the speed. x goes to the one call as fixed_rows_linear gives it to
    the pieces: contiguous and 256-byte aligned (copied once otherwise), as in the check.

    plain: the product (F.linear; a test passes a library of its own, for the pieces too). What a check finds
    is the library's, so the process keeps it for every model (`checked`).

    min_rows: a one call of fewer rows, on a long reduction over few outputs (K >= 4 N: the MLP's `down`), runs
    on min_rows rows instead (padded as the pieces are; checked so). cuBLAS without split-K (no_split_k) has a
    slow kernel for one row of `down` (14.7 us on the H200, where 16 rows take 9.5: docs/batch_invariance.md).
    """

    checked = {}        # (plain, rows, weight shape, dtype, device, has bias, M) -> one call gives the pieces' bits

    def __init__(self, rows, plain=None, min_rows=1):
        self.rows = rows
        self.plain = plain if plain is not None else F.linear
        self.product = plain
        self.min_rows = min_rows

    def __call__(self, x, weight, bias=None):
        T = x.shape[0]
        M = self.rows_called(weight, T)
        if not self.one_call(weight, bias, M, _capturing(x)):
            return fixed_rows_linear(self.rows, x, weight, bias, self.product)
        return self.plain(_gemm_rows(x, M), weight, bias)[:T]

    def rows_called(self, weight, T):
        """The rows one call of T rows runs on (T, or min_rows for a short product on a long reduction)."""
        N, K = weight.shape
        return self.min_rows if T < self.min_rows and K >= 4 * N else T

    def one_call(self, weight, bias, M, capturing=False):
        """Whether one call of M rows gives the pieces' bits (checked once; False while unchecked inside a
        capture)."""
        key = (self.plain, self.rows, weight.shape, weight.dtype, weight.device, bias is not None, M)
        ok = self.checked.get(key)
        if ok is None:
            if capturing:
                return False
            gen = torch.Generator(device=weight.device).manual_seed(M)
            x = torch.randn(M, weight.shape[1], generator=gen, device=weight.device).to(weight.dtype)
            want = fixed_rows_linear(self.rows, x, weight, bias, self.product)
            ok = self.checked[key] = torch.equal(self.plain(x, weight, bias), want)
        return ok


NO_SPLIT_K = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}


def no_split_k():
    """Give cuBLAS no workspace for the rest of the process, so that it cannot split a product's K over CTAs:
    split-K is what makes a row's bits depend on the row count on the H200 (a row of `down` got other bits than
    in 8,192 rows at 255 of 306 row counts, fp16); without it every 0.5B product gave a row the same bits at 1
    to 8,192 rows, fp16 and bf16 (scripts/probe_no_split_k.py). torch reads both settings once, at the
    process's first cuBLAS call, so this acts only before it (the engine calls it before loading the model; the
    engine core's own process always meets it in time); a setting already in the environment is kept. Only
    speed depends on it: InvariantLinear checks the bits whatever cuBLAS does."""
    for name, value in NO_SPLIT_K.items():
        os.environ.setdefault(name, value)


def _capturing(x):
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def no_scope(num_rows):
    return contextlib.nullcontext()


def torch_ops(backend):
    """Torch ops for every piece, the backend's K/V write and attention."""
    return Ops(rms_norm=rms_norm, add_rms_norm=add_rms_norm,
               rotary_and_cache_write=partial(rotary_then_write, backend.write), attention=backend.attend,
               silu_and_mul=silu_and_mul, linear=torch_linear, step_scope=no_scope, backend=backend)


# ---- GGUF blocks (weights="quantized") ---------------------------------------------------------
class TorchThreads:
    """The step of a backend that has none (CpuNumbaBackend has its CpuStep): torch's thread count, the
    products' own choice of kernel."""

    threads = staticmethod(torch.get_num_threads)
    invariant = False


def quantized_linear(step, float_linear, x, weight, bias=None):
    """x weight^T + bias where weight is a QuantWeight (its blocks, on the step's threads; the block kernel
    at any row count in the batch-invariant mode, CpuStep.invariant); a float32 tensor goes to float_linear."""
    if isinstance(weight, torch.Tensor):
        return float_linear(x, weight, bias)
    return weight(x, bias, num_threads=step.threads(), any_rows=step.invariant)


def quantized_embedding(step, ids, weight):
    if isinstance(weight, torch.Tensor):
        return F.embedding(ids, weight)
    return weight.embedding(ids, num_threads=step.threads())


def quantize_ops(ops, device, dtype):
    """The table `ops` (float32 on the CPU) made for layers holding GGUF blocks: `linear` and `embedding`
    read QuantWeights, the rest stays. make_ops calls it when a model is built with weights="quantized"
    (pagedattn/models/loader.py: load_gguf_model). Returns ops."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        raise ValueError(f"quantized weights run on the CPU in float32, not on {device} in {dtype}")
    step = getattr(ops.backend, "step", None) or TorchThreads()
    ops.linear = partial(quantized_linear, step, ops.linear)
    ops.embedding = partial(quantized_embedding, step)
    return ops


def make_ops(backend, device, dtype, hidden_size, intermediate_size, head_dim, weights="float32", tp_size=1):
    """The ops table of a model on `device` in `dtype`, as the backend chooses it (backend.ops_table).

    backend: "auto" / "torch" / "numba" / "cpu" or a backend object (pagedattn.layers.attention.get_backend).
    hidden_size: the normed width; intermediate_size: this rank's MLP width I (SiLU-and-mul's output);
    head_dim: D. The widths decide whether the glue kernels cover the layers (16-byte pieces).
    weights: "float32" (tensors) or "quantized" (the layers hold GGUF blocks: CPU, float32 only).
    tp_size: the ranks the model is sharded over (a backend's whole-layer call has no all-reduce: one rank only).
    """
    from pagedattn.layers.attention import get_backend

    backend = get_backend(backend, device)
    device, dtype = torch.device(device), getattr(torch, dtype) if isinstance(dtype, str) else dtype
    ops = backend.ops_table(device, dtype, hidden_size, intermediate_size, head_dim, tp_size=tp_size)
    if weights == "quantized":
        return quantize_ops(ops, device, dtype)
    if weights != "float32":
        raise ValueError(f"weights must be 'float32' or 'quantized', got {weights!r}")
    return ops
