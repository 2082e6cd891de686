"""CpuNumbaBackend: attention on the CPU through numba-compiled kernels that read the paged pool in place.

TorchPagedBackend (pagedattn.layers.attention) gathers every sequence's K/V into a dense float32
tensor in every layer and step, then builds a mask and calls SDPA; on a 2-core CPU that is ~10% of a
decode step of the bundled model (docs/cpu.md). This backend keeps the interface and replaces the
three pieces with kernels_numba.cpu_attention:

    write    the step's K/V into the pool at slot_mapping (float32 pools; 16-bit pools: torch)
    prefill  causal chunks over the cached prefix, straight through the block tables
    decode   one query per sequence, the same kernel with a one-query tile

Tensors on another device go to the torch pieces. The kernels are compiled on first use and cached
on disk (numba cache=True): the first process pays ~10-20 s per pool dtype, later ones well under a
second. Large calls are split over torch.get_num_threads() threads.
"""
import torch

from kernels_numba import cpu_attention as kernels
from pagedattn.layers.attention import TorchPagedBackend

_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CpuNumbaBackend(TorchPagedBackend):
    """Paged attention on CPU tensors with numba kernels; same call as every backend:

        out = backend(q, k, v, k_cache, v_cache, attn_metadata)   # q [T, H, D], k/v [T, Hkv, D]
    """

    name = "cpu-numba"

    @staticmethod
    def _on_cpu(*tensors):
        return all(t.device.type == "cpu" for t in tensors)

    def write(self, k, v, k_cache, v_cache, slot_mapping):
        if k_cache.dtype != torch.float32 or not self._on_cpu(k, k_cache, slot_mapping):
            return super().write(k, v, k_cache, v_cache, slot_mapping)
        kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out):
        """q, out: [Np, H, D]; sequence s owns rows cu_seqlens_q[s]:cu_seqlens_q[s+1]."""
        if k_cache.dtype not in _POOL_DTYPES or not self._on_cpu(q, k_cache, block_tables):
            return super().prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out)
        kernels.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out,
                                        num_threads=torch.get_num_threads())

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len=None):
        """q, out: [num_decodes, H, D]; each query sees its sequence's context_len tokens.
        max_context_len: unused here (the kernel reads each sequence's own length)."""
        if k_cache.dtype not in _POOL_DTYPES or not self._on_cpu(q, k_cache, block_tables):
            return super().decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len)
        kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out,
                                       num_threads=torch.get_num_threads())
