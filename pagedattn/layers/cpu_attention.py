"""CpuNumbaBackend: attention on the CPU through numba-compiled kernels that read the paged pool in place.

TorchPagedBackend (pagedattn.layers.torch_attention) gathers every sequence's K/V into a dense float32
tensor in every layer and step, then builds a mask and calls SDPA (docs/cpu.md measures what that
costs). This backend keeps the interface and runs kernels_numba.cpu_attention instead:

    write    the step's K/V into the pool at slot_mapping (float32 pools; 16-bit pools: torch)
    attend   prefill chunks and decodes of the step in ONE kernel call per layer, straight through
             the block tables; the checked metadata and the work list (a `Plan`) are made at the
             first layer of a step and reused by the other layers (same metadata contents)

A small step (at most kernels_numba.cpu_linear.MAX_ROWS rows: decodes, short chunks) runs inside a
`CpuStep.scope(num_rows)`: its GEMMs (CpuStep.linear, kernels_numba.cpu_linear, which streams the weight
once where torch's float32 GEMM packs it first from 4 rows on) and attention on numba's thread pool, its
RMSNorms and rotary + KV write as one numba call each (kernels_numba.cpu_glue, chosen in
pagedattn/layers/ops.py), and torch's remaining ops (activation, sampling) on one thread. Torch's OpenMP
threads spin for a while after every parallel op (GNU OpenMP's default wait policy), and on a machine
with as many threads as cores a spinning one takes the core a kernel thread needs: measured, 24
[8, 896] x [896, 9728] GEMMs took 75 ms alone and ~150 ms with a small torch op after each; with torch
on one thread, 78 ms. Larger steps (prefill) run their GEMMs through torch (docs/cpu.md).

Tensors on another device go to the torch pieces. The kernels are compiled on first use and cached
on disk (numba cache=True): the first process pays ~10 s of CPU per pool dtype, later ones about a
second. Outside small steps, calls big enough are split over torch.get_num_threads() Python threads.
"""
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from kernels_numba import cpu_attention as kernels
from kernels_numba import cpu_linear
from pagedattn.errors import KernelLaunchError
from pagedattn.layers.torch_attention import TorchPagedBackend

_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CpuStep:
    """The threads of a small CPU step and its GEMMs: shared by the step's ops and the attention backend.

        with step.scope(num_rows):       # a forward (or LM head) of num_rows rows
            step.small                   # True inside a small step's scope
            step.threads()               # the kernels' thread count
            step.linear(x, weight, bias) # x weight^T + bias: cpu_linear in a small step, else torch
    """

    def __init__(self):
        self._threads = None         # inside a small step's scope: the kernels' thread count (torch runs on one)

    @contextmanager
    def scope(self, num_rows):
        """At most cpu_linear.MAX_ROWS rows run their GEMMs through the kernel, on torch.get_num_threads()
        threads, with torch set to one thread meanwhile (see the module docstring). Larger ones, and
        scopes inside a scope, change nothing."""
        if num_rows > cpu_linear.MAX_ROWS or self._threads is not None:
            yield
            return
        threads = torch.get_num_threads()
        self._threads = threads
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            self._threads = None

    @property
    def small(self):
        return self._threads is not None

    def threads(self):
        """Threads of the kernels: torch's count, or the count it had before a small step's scope."""
        return self._threads or torch.get_num_threads()

    def linear(self, x, weight, bias=None):
        if self._threads is not None and cpu_linear.use_kernel(x, weight):
            return cpu_linear.linear(x, weight, bias, num_threads=self._threads)
        return F.linear(x, weight, bias)


class CpuNumbaBackend(TorchPagedBackend):
    """Paged attention on CPU tensors with numba kernels; the call every backend has:

        backend.write(k, v, k_cache, v_cache, slot_mapping)
        out = backend.attend(q, k_cache, v_cache, attn_metadata)   # q [T, H, D] -> out [T, H, D]

    step: the CpuStep whose threads the kernels use (default: a new one).
    """

    name = "cpu-numba"

    def __init__(self, step=None):
        self._plan_for = None        # the metadata contents and pool geometry of the cached plan
        self._plan = None
        self.step = CpuStep() if step is None else step

    @staticmethod
    def _runs_here(q, k_cache):
        return q.device.type == "cpu" and k_cache.device.type == "cpu" and k_cache.dtype in _POOL_DTYPES

    def plan(self, meta, k_cache):
        """kernels.Plan of a step's AttentionMetadata for this pool: made at the first layer, reused by
        the others (the key is the metadata's contents, a few hundred bytes to compare)."""
        P, Np, num_decodes = meta.num_prefills, meta.num_prefill_tokens, meta.num_decode_tokens
        # One query range per sequence: the prefill chunks' boundaries, then one row per decode.
        cu_prefill = kernels.as_numpy(meta.cu_seqlens_q)[:P + 1] if P else np.zeros(1, np.int32)
        cu = np.concatenate([cu_prefill.astype(np.int32), Np + np.arange(1, num_decodes + 1, dtype=np.int32)])
        tables, ctx = kernels.as_numpy(meta.block_tables), kernels.as_numpy(meta.context_lens)
        key = (tables.shape, tables.tobytes(), ctx.tobytes(), cu.tobytes(), tuple(k_cache.shape[:3]))
        if key != self._plan_for:
            self._plan = kernels.make_plan(tables, cu, ctx, *k_cache.shape[:3])
            self._plan_for = key
        return self._plan

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

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len=None):
        """q, out: [num_decodes, H, D]; each query sees its sequence's context_len tokens.
        max_context_len: unused (the kernel reads each sequence's own length)."""
        if not self._runs_here(q, k_cache):
            return super().decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len)
        kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out,
                                       self.step.threads())
