"""The host pieces every prefill version shares, written once: the shipped kernel
(paged_prefill_fa2.py) and the journey (paged_prefill.py) both import them, and neither imports
the other's.

    HEAD_DIMS, BLOCK_SIZES, DTYPES   what the kernels support (DTYPES: torch dtype -> kernel kind)
    check_args(...)                  shapes, dtypes, contiguity (KernelLaunchError naming the argument)
    check_values(...)                the metadata's values against each other and the pool (one sync)
"""
import torch

from kernels_numba import bridge
from kernels_numba.errors import KernelLaunchError

HEAD_DIMS = (64, 128)
BLOCK_SIZES = (8, 16, 32)
DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}


def check_values(block_tables, cu_seqlens_q, context_lens, total_q, num_blocks, block_size):
    """Metadata values against each other and the pool (one device->host sync)."""
    cu, ctx = cu_seqlens_q.cpu().long(), context_lens.cpu().long()
    q_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total_q or bool((q_lens < 1).any()):
        raise KernelLaunchError(f"cu_seqlens_q must rise from 0 to total_q={total_q} by >= 1 per sequence")
    if bool((ctx < q_lens).any()):
        raise KernelLaunchError("context_lens must be >= each sequence's q_len")
    need = (ctx + block_size - 1) // block_size
    if len(ctx) and int(need.max()) > block_tables.shape[1]:
        raise KernelLaunchError(f"block_tables has {block_tables.shape[1]} columns, a sequence needs {int(need.max())}")
    bt = block_tables.cpu().long()
    used = torch.arange(bt.shape[1])[None, :] < need[:, None]
    if bool((used & ((bt < 0) | (bt >= num_blocks))).any()):
        raise KernelLaunchError(f"block_tables has block ids outside [0, {num_blocks})")


def check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, head_dims, block_sizes):
    """The host checks every prefill version shares (shapes, dtypes, contiguity; KernelLaunchError naming the
    argument). Returns (out, or a new [total_q, H, D] tensor, and the GQA group)."""
    half = tuple(DTYPES)
    bridge.check_tensor("q", q, 3, half)
    bridge.check_tensor("k_cache", k_cache, 4, half)
    bridge.check_tensor("v_cache", v_cache, 4, half)
    bridge.check_tensor("block_tables", block_tables, 2, (torch.int32,))
    bridge.check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    bridge.check_tensor("context_lens", context_lens, 1, (torch.int32,))
    total_q, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, cache_head_dim = k_cache.shape
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise KernelLaunchError(f"k_cache/v_cache dtype must equal q.dtype={q.dtype}, got {k_cache.dtype}/{v_cache.dtype}")
    if v_cache.shape != k_cache.shape:
        raise KernelLaunchError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelLaunchError("k_cache and v_cache must be contiguous")
    if cache_head_dim != head_dim:
        raise KernelLaunchError(f"q head_dim={head_dim} must equal the cache's head_dim={cache_head_dim}")
    if head_dim not in head_dims:
        raise KernelLaunchError(f"head_dim must be one of {head_dims}, got {head_dim}")
    if block_size not in block_sizes:
        raise KernelLaunchError(f"block_size must be one of {block_sizes}, got {block_size}")
    if num_heads % num_kv_heads != 0:
        raise KernelLaunchError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    num_seqs = context_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise KernelLaunchError(f"cu_seqlens_q must be [num_seqs + 1 = {num_seqs + 1}], got {tuple(cu_seqlens_q.shape)}")
    if block_tables.shape[0] != num_seqs:
        raise KernelLaunchError(f"block_tables must have num_seqs={num_seqs} rows, got {block_tables.shape[0]}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        bridge.check_tensor("out", out, 3, (q.dtype,))
        if out.shape != q.shape:
            raise KernelLaunchError(f"out must be {tuple(q.shape)}, got {tuple(out.shape)}")
    return out, num_heads // num_kv_heads
