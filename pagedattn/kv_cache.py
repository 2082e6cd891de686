"""The physical KV cache: one preallocated pool of K and one of V per layer, and a step's view of it.

Layout, per layer:

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]

so one block of one KV head is a contiguous block_size x head_dim tile (2 KiB in fp16 at
block_size 16, head_dim 64): the unit a kernel loads with wide, coalesced reads. A token's
place in the pool is its *slot*:

    slot = block_id * block_size + offset          (slot -1 = padding, written nowhere)

A step addresses the pool through its AttentionMetadata: where each new token's K/V goes (slot_mapping),
which blocks each sequence reads (block_tables) and how many tokens (context_lens), and where its
prefill chunks start (cu_seqlens_q); the attention backends (pagedattn/layers/attention.py) read nothing else.

The torch functions here are the portable implementations (CPU, and the GPU fallback); the
numba kernels in kernels_numba.cache_ops must match them exactly.
"""
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from pagedattn.errors import KernelLaunchError


def slots_for(block_tables, rows, positions, block_size):
    """Pool slots of tokens: slot = block_tables[row, pos // block_size] * block_size + pos % block_size.

    block_tables: [S, W] int (numpy); rows, positions: [T] int arrays (the token's sequence row, its
    position in that sequence). Returns [T] int64. The one place the slot formula is written.
    """
    positions = np.asarray(positions, dtype=np.int64)
    return block_tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size


@dataclass
class AttentionMetadata:
    num_prefills: int                 # sequences in prefill, first in the batch
    num_prefill_tokens: int           # their tokens, first in the batch
    num_decode_tokens: int            # one per decoding sequence, after them
    slot_mapping: Tensor              # [num_tokens] int64, where each token's new K/V goes (-1 = skip)
    context_lens: Tensor              # [num_seqs] int32, tokens in the cache *after* this step's write
    block_tables: Tensor              # [num_seqs, max_blocks] int32, prefills first then decodes
    cu_seqlens_q: Tensor              # [num_prefills + 1] int32, prefill chunk boundaries
    max_context_len: int | None = None  # host int >= every context_len (eager steps: sizes the decode
                                        # kernel's split-KV plan, spares the torch path a sync); None inside
                                        # CUDA graphs: block-table width x block size
    # The prefill kernel's work lists of this step (kernels_numba.paged_prefill_fa2's plans=): built by the
    # first layer's attention, reused by the others; a new step is a new object, so never a stale plan
    prefill_plans: dict = field(default_factory=dict, repr=False, compare=False)
    # The CPU kernels' work list of this step ((pool geometry, Plan); pagedattn/layers/cpu.py): the same way
    cpu_plan: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        # Shape checks only: they never read tensor data, so they cost no device sync.
        num_seqs = self.num_prefills + self.num_decode_tokens
        num_tokens = self.num_prefill_tokens + self.num_decode_tokens
        checks = [
            (self.slot_mapping.shape[0] == num_tokens, "slot_mapping", (num_tokens,), self.slot_mapping.shape),
            (self.context_lens.shape[0] == num_seqs, "context_lens", (num_seqs,), self.context_lens.shape),
            (self.block_tables.dim() == 2 and self.block_tables.shape[0] == num_seqs,
             "block_tables", (num_seqs, "max_blocks"), self.block_tables.shape),
        ]
        if self.num_prefills > 0:
            n = self.num_prefills + 1
            checks.append((self.cu_seqlens_q.shape[0] == n, "cu_seqlens_q", (n,), self.cu_seqlens_q.shape))
        for ok, name, want, got in checks:
            if not ok:
                raise KernelLaunchError(f"AttentionMetadata.{name} has shape {tuple(got)}, expected {want} "
                                        f"(num_prefills={self.num_prefills}, num_prefill_tokens="
                                        f"{self.num_prefill_tokens}, num_decode_tokens={self.num_decode_tokens})")
        if self.num_prefills > self.num_prefill_tokens:
            raise KernelLaunchError(f"num_prefills={self.num_prefills} > num_prefill_tokens={self.num_prefill_tokens}: "
                                    "every prefill chunk has at least one token")

    @property
    def num_tokens(self):
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_seqs(self):
        return self.num_prefills + self.num_decode_tokens

    @property
    def prefill_only(self):
        return self.num_decode_tokens == 0

    @property
    def decode_only(self):
        return self.num_prefills == 0

    @classmethod
    def build(cls, query_lens, context_lens, block_tables, block_size, num_prefills, device="cpu"):
        """Metadata for a step given per-sequence lists (tests, scripts, simple loops).

        query_lens: [num_seqs] ints, new tokens of each sequence this step (decodes: 1), prefills first.
        context_lens: [num_seqs] ints, tokens in the cache after this step's write (>= query_len).
        block_tables: [num_seqs] lists of physical block ids (enough for context_len tokens).
        block_size: tokens per block; num_prefills: how many leading sequences are prefills.
        The new tokens are the last query_len positions of each sequence; their slots are computed
        from the block tables.
        """
        query_lens, context_lens = [int(x) for x in query_lens], [int(x) for x in context_lens]
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables need one entry per sequence")
        if any(q != 1 for q in query_lens[num_prefills:]):
            raise ValueError(f"decode sequences have query_len 1, got {query_lens[num_prefills:]}")
        for q_len, ctx, table in zip(query_lens, context_lens, block_tables):
            if not 1 <= q_len <= ctx or len(table) * block_size < ctx:
                raise ValueError(f"sequence with query_len={q_len}, context_len={ctx} and "
                                 f"{len(table)} blocks of {block_size} is inconsistent")
        width = max([len(t) for t in block_tables] + [1])
        tables = [list(t) + [0] * (width - len(t)) for t in block_tables]
        rows = np.repeat(np.arange(len(query_lens)), query_lens)                       # (T,) sequence of a token
        positions = np.concatenate([np.arange(c - q, c) for q, c in zip(query_lens, context_lens)] or [[]])
        slots = slots_for(np.asarray(tables, dtype=np.int64).reshape(len(tables), width), rows,
                          positions.astype(np.int64), block_size).tolist()
        cu = [0]
        for q_len in query_lens[:num_prefills]:
            cu.append(cu[-1] + q_len)
        return cls(
            num_prefills=num_prefills,
            num_prefill_tokens=cu[-1],
            num_decode_tokens=len(query_lens) - num_prefills,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device).reshape(len(tables), width),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            max_context_len=max(context_lens, default=0),
        )


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
        # Each of K and V is one allocation, a layer's pool a view of it: kernels that run every layer in one
        # launch (kernels_numba/step.py's v4 and v5) read layer i's pool at an offset from layer 0's.
        alloc = torch.zeros if torch.device(self.device).type == "cuda" else torch.empty
        self.k_caches = list(alloc((self.num_layers, *shape), dtype=self.dtype, device=self.device).unbind(0))
        self.v_caches = list(alloc((self.num_layers, *shape), dtype=self.dtype, device=self.device).unbind(0))

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
