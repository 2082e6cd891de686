"""The physical KV cache: one preallocated pool of K and one of V per layer.

Layout, per layer:

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]

so one block of one KV head is a contiguous block_size x head_dim tile (2 KiB in fp16 at
block_size 16, head_dim 64): the unit a kernel loads with wide, coalesced reads. A token's
place in the pool is its *slot*:

    slot = block_id * block_size + offset          (slot -1 = padding, written nowhere)

The torch functions here are the portable implementations (CPU, and the GPU fallback); the
numba kernels in kernels_numba.cache_ops must match them exactly.
"""
from dataclasses import dataclass, field

import numpy as np
import torch


def slots_for(block_tables, rows, positions, block_size):
    """Pool slots of tokens: slot = block_tables[row, pos // block_size] * block_size + pos % block_size.

    block_tables: [S, W] int (numpy); rows, positions: [T] int arrays (the token's sequence row, its
    position in that sequence). Returns [T] int64. The one place the slot formula is written.
    """
    positions = np.asarray(positions, dtype=np.int64)
    return block_tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size


def write_kv(k_cache, v_cache, key, value, slot_mapping):
    """Store new K/V vectors at their slots (in place).

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    key, value: [num_tokens, num_kv_heads, head_dim] (cast to the cache dtype)
    slot_mapping: [num_tokens] int, slot = block_id * block_size + offset; -1 skips the token.
    """
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    slot_mapping = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = key[keep].to(k_cache.dtype)  # (n, kvh, d) into [b, :, o, :]
    v_cache[blocks, :, offsets] = value[keep].to(v_cache.dtype)


def copy_blocks(k_caches, v_caches, block_mapping):
    """Copy whole blocks src -> dst in every layer (copy-on-write).

    k_caches, v_caches: lists (one per layer) of [num_blocks, num_kv_heads, block_size, head_dim]
    block_mapping: [num_pairs, 2] int, rows (src_block, dst_block).
    """
    if len(block_mapping) == 0:
        return
    mapping = torch.as_tensor(block_mapping, dtype=torch.long, device=k_caches[0].device)
    src, dst = mapping[:, 0], mapping[:, 1]
    for k_cache, v_cache in zip(k_caches, v_caches):
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def gather_kv(k_cache, v_cache, block_table, context_len):
    """One sequence's K and V as contiguous tensors.

    block_table: [>= ceil(context_len / block_size)] int; context_len: int.
    Returns k, v: [context_len, num_kv_heads, head_dim] in the cache dtype.
    """
    block_size = k_cache.shape[2]
    pos = torch.arange(context_len, device=k_cache.device)
    table = torch.as_tensor(block_table, dtype=torch.long, device=k_cache.device)
    blocks, offsets = table[pos // block_size], pos % block_size
    return k_cache[blocks, :, offsets], v_cache[blocks, :, offsets]  # (L, kvh, d)


@dataclass
class KVCache:
    """Per-layer K and V pools, allocated once.

    num_layers, num_blocks, num_kv_heads, block_size, head_dim: pool geometry.
    dtype: torch.float16 / torch.bfloat16 / torch.float32; device: "cpu", "cuda", ...
    """

    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    device: str = "cpu"
    k_caches: list = field(init=False, repr=False)
    v_caches: list = field(init=False, repr=False)

    def __post_init__(self):
        for name in ("num_layers", "num_blocks", "num_kv_heads", "block_size", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCache.{name} must be a positive int, got {value!r}")
        if self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"KVCache.dtype must be float16, bfloat16 or float32, got {self.dtype}")
        shape = (self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        # No kernel reads a slot before writing it (tests/test_startup.py fills a pool with NaN to show it), so
        # the CPU pool is not zeroed: its pages are mapped as the sequences first touch them, which makes the
        # engine start faster and keeps the resident memory to what is used. The GPU pool is zeroed (cheap there):
        # CUDA-graph padding rows read block 0.
        alloc = torch.zeros if torch.device(self.device).type == "cuda" else torch.empty
        self.k_caches = [alloc(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_caches = [alloc(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    @staticmethod
    def bytes_per_block_of(num_layers, num_kv_heads, block_size, head_dim, dtype):
        """Bytes one block id costs across all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * block_size * head_dim * itemsize

    @property
    def bytes_per_block(self):
        return self.bytes_per_block_of(self.num_layers, self.num_kv_heads, self.block_size, self.head_dim, self.dtype)

    @property
    def nbytes(self):
        """Total bytes held by the pools."""
        return self.num_blocks * self.bytes_per_block

    def write(self, layer, key, value, slot_mapping):
        write_kv(self.k_caches[layer], self.v_caches[layer], key, value, slot_mapping)

    def copy_blocks(self, block_mapping):
        copy_blocks(self.k_caches, self.v_caches, block_mapping)

    def gather(self, layer, block_table, context_len):
        return gather_kv(self.k_caches[layer], self.v_caches[layer], block_table, context_len)
