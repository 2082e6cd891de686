"""The CPU backend: attention through numba kernels that read the paged pool in place, a small step's ops,
and a whole decoder layer as one numba call.

TorchPagedBackend (pagedattn.layers.torch_attention) gathers every sequence's K/V into a dense float32
tensor in every layer and step, then builds a mask and calls SDPA (docs/cpu.md measures what that
costs). CpuNumbaBackend keeps the interface and runs kernels_numba.cpu_attention instead:

    write    the step's K/V into the pool at slot_mapping (float32 pools; 16-bit pools: torch)
    attend   prefill chunks and decodes of the step in ONE kernel call per layer, straight through
             the block tables; the work list (a `Plan`) is made at the first layer of a step and kept in
             the step's AttentionMetadata for the other layers

A small step (at most kernels_numba.cpu_linear.MAX_ROWS rows: decodes, short chunks) runs inside a
`CpuStep.scope(num_rows)`: its GEMMs (CpuStep.linear, kernels_numba.cpu_linear, which streams the weight
once where torch's float32 GEMM packs it first from 4 rows on) and attention on numba's thread pool, its
RMSNorms, rotary + KV write and SiLU-and-mul as one numba call each (kernels_numba.cpu_layer), and torch's
remaining ops (sampling) on one thread. Torch's OpenMP threads spin for a while after every parallel op
(GNU OpenMP's default wait policy), and on a machine with as many threads as cores a spinning one takes the
core a kernel thread needs: measured, 24 [8, 896] x [896, 9728] GEMMs took 75 ms alone and ~150 ms with a
small torch op after each; with torch on one thread, 78 ms. Larger steps (prefill) run their GEMMs through
torch (docs/cpu.md).

In a small step on float32 pools, the ops table's `decoder_layer` runs each whole layer as one numba call
(kernels_numba.cpu_layer.run_layer: the same kernels in the same order as the layer's ops, bit for bit),
its weights gathered once per layer into the tuples the kernel reads; the layers' matrices are GGUF blocks
(weights="quantized") or float32 tensors. Elsewhere (large steps, 16-bit pools, weights of mixed kinds) the
layer's own forward runs, op by op.

The batch-invariant mode (`CpuNumbaBackend.batch_invariant`, EngineConfig.batch_invariant) makes every step
a small step, runs every product through its small-step kernel at any row count and plans attention one query
per work item, so that a row's arithmetic depends on the row alone (docs/batch_invariance.md).

Tensors on another device go to the torch pieces. The kernels are compiled on first use and cached
on disk (numba cache=True): the first process pays ~10 s of CPU per pool dtype, later ones about a
second. Outside small steps, calls big enough are split over torch.get_num_threads() Python threads.
"""
import math
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from kernels_numba import cpu_attention as kernels
from kernels_numba import cpu_layer, cpu_linear, cpu_quant
from pagedattn.errors import KernelLaunchError
from pagedattn.layers import ops as torch_ops
from pagedattn.layers.torch_attention import TorchPagedBackend

_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CpuStep:
    """The threads of a small CPU step and its GEMMs: shared by the step's ops and the attention backend.

        with step.scope(num_rows):       # a forward (or LM head) of num_rows rows
            step.small                   # True inside a small step's scope
            step.threads()               # the kernels' thread count
            step.linear(x, weight, bias) # x weight^T + bias: cpu_linear in a small step, else torch

    validate: the small step's kernels check their arguments (the engine, whose tensors fit by construction,
    turns it off through its backend's `validate`).
    invariant: the batch-invariant mode (docs/batch_invariance.md): every step is a small step whatever its
    rows and every product runs its small-step kernel whatever its rows, so each row's arithmetic is what it
    would be in a step of that row alone. (The block kernels compute a row alike at any row count;
    cpu_linear's result for a row depends on whether it sits in a group of 4 rows or among the leftovers,
    so its calls get zero rows up to a multiple of 4.)
    """

    def __init__(self):
        self.small = False           # inside a small step's scope
        self._threads = None         # then: the kernels' thread count (torch runs on one)
        self.validate = True
        self.invariant = False

    @contextmanager
    def scope(self, num_rows):
        """At most cpu_linear.MAX_ROWS rows (any number in the batch-invariant mode) run their GEMMs through
        the kernel, on torch.get_num_threads() threads, with torch set to one thread meanwhile (see the
        module docstring). Larger ones, and scopes inside a scope, change nothing."""
        if (num_rows > cpu_linear.MAX_ROWS and not self.invariant) or self.small:
            yield
            return
        threads = torch.get_num_threads()
        self._threads, self.small = threads, True
        cpu_linear.numba_threads(threads)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            self._threads, self.small = None, False

    def threads(self):
        """Threads of the kernels: torch's count, or the count it had before a small step's scope."""
        return self._threads or torch.get_num_threads()

    def linear(self, x, weight, bias=None):
        if self.invariant and cpu_linear.use_kernel(x[:1], weight):
            M = x.shape[0]
            if M % 4:                            # every row in a group of 4 (the class docstring)
                x = torch.cat([x, x.new_zeros(4 - M % 4, x.shape[1])])
            return cpu_linear.linear(x.contiguous(), weight, bias, num_threads=self.threads(),
                                     validate=self.validate)[:M]
        if self.small and cpu_linear.use_kernel(x, weight):
            return cpu_linear.linear(x, weight, bias, num_threads=self._threads, validate=self.validate)
        return F.linear(x, weight, bias)


class CpuNumbaBackend(TorchPagedBackend):
    """Paged attention on CPU tensors with numba kernels; the call every backend has:

        backend.write(k, v, k_cache, v_cache, slot_mapping)
        out = backend.attend(q, k_cache, v_cache, attn_metadata)   # q [T, H, D] -> out [T, H, D]

    step: the CpuStep whose threads the kernels use (default: a new one).
    """

    name = "cpu-numba"

    def __init__(self, step=None):
        self.step = CpuStep() if step is None else step
        self._layers = {}            # decoder layer -> its weights as the fused kernel reads them, or None

    @property
    def validate(self):
        """The small step's kernels check their arguments (off in the engine: ModelRunner checks each step)."""
        return self.step.validate

    @validate.setter
    def validate(self, on):
        self.step.validate = on

    @property
    def batch_invariant(self):
        """The batch-invariant mode (CpuStep.invariant; docs/batch_invariance.md): every step runs the small
        step's kernels whatever its rows, attention one query per work item."""
        return self.step.invariant

    @batch_invariant.setter
    def batch_invariant(self, on):
        self.step.invariant = bool(on)

    @staticmethod
    def _runs_here(q, k_cache):
        return q.device.type == "cpu" and k_cache.device.type == "cpu" and k_cache.dtype in _POOL_DTYPES

    def ops_table(self, device, dtype, hidden_size, intermediate_size, head_dim, tp_size=1):
        """The model's ops table (pagedattn.layers.ops.make_ops asks the backend): cpu_ops below."""
        return cpu_ops(self, device, dtype, tp_size)

    def plan(self, meta, k_cache):
        """kernels.Plan of a step's AttentionMetadata for this pool geometry: made at the first layer and kept
        in the metadata (meta.cpu_plan) for the others (a new step is a new metadata object)."""
        geometry = tuple(k_cache.shape[:3])
        if meta.cpu_plan is not None and meta.cpu_plan[0] == geometry:
            return meta.cpu_plan[1]
        P, Np, num_decodes = meta.num_prefills, meta.num_prefill_tokens, meta.num_decode_tokens
        # One query range per sequence: the prefill chunks' boundaries, then one row per decode.
        cu_prefill = kernels.as_numpy(meta.cu_seqlens_q)[:P + 1] if P else np.zeros(1, np.int32)
        cu = np.concatenate([cu_prefill.astype(np.int32), Np + np.arange(1, num_decodes + 1, dtype=np.int32)])
        plan = kernels.make_plan(kernels.as_numpy(meta.block_tables), cu, kernels.as_numpy(meta.context_lens),
                                 *geometry, query_tile=1 if self.step.invariant else kernels.QUERY_TILE)
        meta.cpu_plan = (geometry, plan)
        return plan

    def write(self, k, v, k_cache, v_cache, slot_mapping):
        if k_cache.dtype != torch.float32 or not self._runs_here(k, k_cache):
            return super().write(k, v, k_cache, v_cache, slot_mapping)
        kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, attn_metadata, out=None, scale=None):
        """Attention of the step's queries (prefill chunks first, then decodes) over the pool, which
        already holds the step's K/V. q: [T, H, D]; out: optional [T, H, D]. Returns out."""
        if not self._runs_here(q, k_cache):
            return super().attend(q, k_cache, v_cache, attn_metadata, out=out, scale=scale)
        if q.shape[0] != attn_metadata.num_tokens:
            raise KernelLaunchError(f"q has {q.shape[0]} tokens but the metadata describes {attn_metadata.num_tokens}")
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        return kernels.attention(q, k_cache, v_cache, self.plan(attn_metadata, k_cache), scale, out,
                                 self.step.threads(), numba_threads=self.step.small)

    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, plans=None):
        """q, out: [Np, H, D]; sequence s owns rows cu_seqlens_q[s]:cu_seqlens_q[s+1]."""
        if not self._runs_here(q, k_cache):
            return super().prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out)
        kernels.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out,
                                        self.step.threads())

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len=None,
               plans=None):
        """q, out: [num_decodes, H, D]; each query sees its sequence's context_len tokens.
        max_context_len, plans: unused (the kernel reads each sequence's own length)."""
        if not self._runs_here(q, k_cache):
            return super().decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len)
        kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out,
                                       self.step.threads())

    # ---- a whole decoder layer in one call --------------------------------------------------------
    def decoder_layer(self, layer, positions, x, residual, k_cache, v_cache, meta):
        """The ops table's `decoder_layer` on float32 CPU models: in a small step on float32 pools, the layer
        as one numba call (the module docstring); otherwise the layer's own forward. Returns (the layer's
        output, the residual stream)."""
        w = self._layers.get(layer, False)
        if w is False:
            w = self._layers[layer] = _fused_weights(layer)
        # the batch-invariant mode takes any rows on the blocks; float32 weights' rows would go unpadded here
        unfit = w is not None and (w[0] == "dense" if self.step.invariant else x.shape[0] > cpu_quant.MAX_ROWS)
        if w is None or unfit or not self.step.small or k_cache.dtype != torch.float32:
            return layer(positions, x, residual, k_cache, v_cache, meta)
        plan, threads = self.plan(meta, k_cache), self.step._threads
        attn = layer.self_attn
        pool = (k_cache.numpy(), v_cache.numpy(), attn.rotary_emb.cos_sin_cache.numpy(), attn.num_heads,
                attn.num_kv_heads, attn.head_dim, np.float32(1.0 / math.sqrt(attn.head_dim)))   # cpu_attention's scale
        step = (positions.numpy(), meta.slot_mapping.numpy(), plan.block_tables, plan.cu_seqlens_q,
                plan.context_lens, plan.tile_seq, plan.tile_q0, plan.order, min(threads, len(plan.order)),
                plan.query_tile)
        out, residual = cpu_layer.run_layer(w[0], x.numpy(), None if residual is None else residual.numpy(), w[1],
                                            pool, step, threads)
        return torch.from_numpy(out), torch.from_numpy(residual)


def _product(linear):
    """(kind, the product's tuple): a linear layer holding a QuantWeight -> (its activations, (codes, parts,
    offsets, bias)); holding a float32 tensor -> (None, (weight, bias)); bias float32 numpy, empty for none.
    (None, None) for anything else (a 16-bit or non-contiguous weight)."""
    w = linear.weight
    bias = cpu_quant._NO_BIAS if linear.bias is None else linear.bias.detach().numpy()
    if isinstance(w, torch.Tensor):
        if w.dtype != torch.float32 or not w.is_contiguous() or w.device.type != "cpu":
            return None, None
        return None, (w.detach().numpy(), bias)
    return w.activations, (*w.checked.kernel_args, bias)


def _fused_weights(layer):
    """(the kernel's kind, the layer's weight tuple) for cpu_layer.run_layer, or None when the layer's four
    products are not of one kind (blocks with one activations, or float32 tensors)."""
    attn, mlp = layer.self_attn, layer.mlp
    products = [_product(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    kinds = {kind for kind, _ in products}
    if len(kinds) != 1 or any(p is None for _, p in products):
        return None
    w = (layer.input_layernorm.weight.detach().numpy(), layer.post_attention_layernorm.weight.detach().numpy(),
         np.float32(layer.input_layernorm.eps), *(p for _, p in products))
    return cpu_layer.layer_kind(kinds.pop()), w


# ---- the ops of a float32 CPU model: numba calls in a small step, torch ops in a large one -------
def rms_norm(step, x, weight, eps):
    if step.small:
        return cpu_layer.add_rms_norm(x, None, weight, eps, validate=step.validate)
    return torch_ops.rms_norm(x, weight, eps)


def add_rms_norm(step, x, residual, weight, eps):
    if step.small:
        return cpu_layer.add_rms_norm(x, residual, weight, eps, validate=step.validate)
    return torch_ops.add_rms_norm(x, residual, weight, eps)


def rotary_and_cache_write(step, write, positions, qkv, num_heads, num_kv_heads, head_dim, cos_sin_cache, k_cache,
                           v_cache, slot_mapping):
    if step.small:
        return cpu_layer.rotary_cache(positions, qkv, num_heads, num_kv_heads, head_dim, cos_sin_cache, k_cache,
                                      v_cache, slot_mapping)
    return torch_ops.rotary_then_write(write, positions, qkv, num_heads, num_kv_heads, head_dim, cos_sin_cache,
                                        k_cache, v_cache, slot_mapping)


def silu_and_mul(step, x):
    return cpu_layer.silu_and_mul(x) if step.small else torch_ops.silu_and_mul(x)


def cpu_ops(backend, device, dtype, tp_size=1):
    """The ops table of a model using `backend` (a CpuNumbaBackend): the numba calls above on float32 CPU
    tensors, torch's ops otherwise; GEMMs through the backend's CpuStep; the fused layer on float32 at one rank
    (it has no all-reduce: a tensor-parallel rank runs each layer's own forward)."""
    step = backend.step
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        ops = torch_ops.torch_ops(backend)
        ops.linear, ops.step_scope = step.linear, step.scope
        return ops
    return torch_ops.Ops(
        rms_norm=partial(rms_norm, step), add_rms_norm=partial(add_rms_norm, step),
        rotary_and_cache_write=partial(rotary_and_cache_write, step, backend.write), attention=backend.attend,
        silu_and_mul=partial(silu_and_mul, step), linear=step.linear, step_scope=step.scope, backend=backend,
        decoder_layer=backend.decoder_layer if tp_size == 1 else None)


