"""TorchPagedBackend: paged attention with torch ops, on any device (CPU, and the fallback on GPU).

It gathers each sequence's K/V through its block table into one padded dense tensor and runs
scaled_dot_product_attention with an explicit mask (causal + context length), in float32. Not capturable
(it sizes the gather on the host). The other backends (pagedattn/layers/attention.py, cpu_attention.py)
subclass it and fall back to its pieces for inputs their kernels do not cover.
"""
import math

import torch
import torch.nn.functional as F

from pagedattn.errors import KernelLaunchError
from pagedattn.kv_cache import copy_blocks, write_kv


def _check_inputs(q, k, v, k_cache, v_cache, meta):
    T, H, D = q.shape
    _, Hkv, _, Dc = k_cache.shape
    if k.shape != (T, Hkv, D) or v.shape != (T, Hkv, D):
        raise KernelLaunchError(f"k/v must be [{T}, {Hkv}, {D}] for q {tuple(q.shape)} and the cache, "
                                f"got {tuple(k.shape)} / {tuple(v.shape)}")
    if Dc != D or v_cache.shape != k_cache.shape:
        raise KernelLaunchError(f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match head_dim {D}")
    if H % Hkv != 0:
        raise KernelLaunchError(f"num_heads={H} must be a multiple of num_kv_heads={Hkv}")
    if T != meta.num_tokens:
        raise KernelLaunchError(f"q has {T} tokens but the metadata describes {meta.num_tokens}")


def paged_sdpa(q, q_pos, k_cache, v_cache, block_tables, context_lens, scale, max_q_chunk=512, max_len=None):
    """Attention of padded queries over each sequence's paged K/V, in float32.

    q: [S, Qmax, H, D] (any float dtype); q_pos: [S, Qmax] int64, the position of each query
        (a query sees keys 0..q_pos; rows that are padding should carry a valid position and be ignored).
    k_cache, v_cache: [num_blocks, Hkv, block_size, D]; block_tables: [S, max_blocks] int.
    context_lens: [S] int, keys per sequence. max_len: a host bound >= every context length (default:
    read from context_lens, one device sync). Returns [S, Qmax, H, D] float32.
    """
    S, Qmax, H, D = q.shape
    _, Hkv, block_size, _ = k_cache.shape
    group = H // Hkv
    L = int(context_lens.max()) if max_len is None else max_len
    # Gather through the block tables: key position j of sequence s is in block
    # block_tables[s, j // block_size] at offset j % block_size.
    pos = torch.arange(L, device=q.device)                                           # (L,)
    cols = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables.long()[:, cols]                                            # (S, L)
    offsets = (pos % block_size).expand(S, L)                                        # (S, L)
    valid = pos[None, :] < context_lens.long()[:, None]                              # (S, L)
    # Slots past a sequence's end may hold anything (even NaN); zero them so masked keys stay inert.
    zero = torch.zeros((), dtype=torch.float32, device=q.device)
    k = torch.where(valid[..., None, None], k_cache[blocks, :, offsets].float(), zero)  # (S, L, Hkv, D)
    v = torch.where(valid[..., None, None], v_cache[blocks, :, offsets].float(), zero)
    k, v = k.transpose(1, 2), v.transpose(1, 2)                                      # (S, Hkv, L, D)
    out = torch.empty(S, Qmax, H, D, dtype=torch.float32, device=q.device)
    for start in range(0, Qmax, max_q_chunk):
        qc = q[:, start:start + max_q_chunk].float()                                 # (S, Qc, H, D)
        Qc = qc.shape[1]
        # GQA without copying K/V: the `group` query heads of one KV head become extra query rows.
        qc = qc.reshape(S, Qc, Hkv, group, D).permute(0, 2, 3, 1, 4).reshape(S, Hkv, group * Qc, D)
        mask = (pos[None, None, :] <= q_pos[:, start:start + Qc, None]) & valid[:, None, :]  # (S, Qc, L)
        mask = mask[:, None, None].expand(S, 1, group, Qc, L).reshape(S, 1, group * Qc, L)
        oc = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, scale=scale)   # (S, Hkv, group*Qc, D)
        out[:, start:start + Qc] = oc.reshape(S, Hkv, group, Qc, D).permute(0, 3, 1, 2, 4).reshape(S, Qc, H, D)
    return out


class TorchPagedBackend:
    """Paged attention with torch ops: works on any device (CPU, and the fallback on GPU)."""

    name = "torch"
    validate = True            # accepted for a uniform interface; the torch pieces check shapes only

    def __call__(self, q, k, v, k_cache, v_cache, attn_metadata, scale=None):
        """Write the step's K/V into the pool, then attend.

        q: [T, H, D]; k, v: [T, Hkv, D] (the step's tokens, packed prefills first then decodes).
        k_cache, v_cache: [num_blocks, Hkv, block_size, D] (this layer's pool, written in place).
        attn_metadata: AttentionMetadata of the step. scale: default 1/sqrt(D).
        Returns [T, H, D] in q's dtype.
        """
        _check_inputs(q, k, v, k_cache, v_cache, attn_metadata)
        self.write(k, v, k_cache, v_cache, attn_metadata.slot_mapping)
        return self.attend(q, k_cache, v_cache, attn_metadata, scale=scale)

    forward = __call__

    def write(self, k, v, k_cache, v_cache, slot_mapping):
        """k, v: [T, Hkv, D] into k_cache, v_cache [num_blocks, Hkv, block_size, D] at slot_mapping [T] (-1: skip)."""
        write_kv(k_cache, v_cache, k, v, slot_mapping)

    def attend(self, q, k_cache, v_cache, attn_metadata, out=None, scale=None):
        """Attention of the step's queries over the pool, which already holds the step's K/V.

        q: [T, H, D] (prefill tokens first, then one per decode); k_cache, v_cache: [num_blocks, Hkv,
        block_size, D]; out: optional [T, H, D] in q's dtype (contiguous). Returns out.
        """
        meta = attn_metadata
        if q.shape[0] != meta.num_tokens:
            raise KernelLaunchError(f"q has {q.shape[0]} tokens but the metadata describes {meta.num_tokens}")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        P, Np = meta.num_prefills, meta.num_prefill_tokens
        if P > 0:
            self.prefill(q[:Np], k_cache, v_cache, meta.block_tables[:P], meta.cu_seqlens_q,
                         meta.context_lens[:P], scale, out[:Np], plans=meta.prefill_plans)
        if meta.num_decode_tokens > 0:
            self.decode(q[Np:], k_cache, v_cache, meta.block_tables[P:], meta.context_lens[P:], scale, out[Np:],
                        max_context_len=meta.max_context_len, plans=meta.prefill_plans)
        return out

    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, plans=None):
        """q, out: [Np, H, D]; sequence s owns rows cu_seqlens_q[s]:cu_seqlens_q[s+1]. plans: the step's work
        lists, for a backend whose kernel plans its work (NumbaBackend); unused here."""
        cu = cu_seqlens_q.to(device=q.device, dtype=torch.long)
        ctx = context_lens.to(device=q.device, dtype=torch.long)
        q_lens = cu[1:] - cu[:-1]                                                    # (P,)
        Qmax = int(q_lens.max())
        i = torch.arange(Qmax, device=q.device)
        rows = cu[:-1, None] + i                                                     # (P, Qmax) row of q
        real = i[None, :] < q_lens[:, None]                                          # (P, Qmax)
        rows = torch.where(real, rows, cu[:-1, None])                                # padding repeats row 0
        # Query i of a chunk sits at context_len - q_len + i; padding rows get the last position.
        q_pos = torch.where(real, (ctx - q_lens)[:, None] + i, ctx[:, None] - 1)     # (P, Qmax)
        res = paged_sdpa(q[rows], q_pos, k_cache, v_cache, block_tables.to(q.device), ctx, scale)
        out[rows[real]] = res[real].to(out.dtype)                                    # (Np, H, D)

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len=None,
               plans=None):
        """q, out: [num_decodes, H, D]; each query sees its sequence's context_len tokens.
        max_context_len: a host bound on context_lens (None: read from the device). plans: as prefill's."""
        ctx = context_lens.to(device=q.device, dtype=torch.long)
        res = paged_sdpa(q[:, None], (ctx - 1)[:, None], k_cache, v_cache, block_tables.to(q.device), ctx, scale,
                         max_len=max_context_len)
        out.copy_(res[:, 0])

    def copy_blocks(self, k_caches, v_caches, block_copies):
        """Copy-on-write: block_copies [C, 2] rows (src, dst), copied in every layer's K and V pool."""
        copy_blocks(k_caches, v_caches, block_copies)

    def decode_context_bounds(self, num_seqs, num_kv_heads, group, max_context_len, device):
        """The context bounds <= max_context_len at which the decode kernel of a batch of num_seqs sequences
        runs a launch of its own (one decode graph per bound; a step takes the smallest bound >= its longest
        context). This backend has one: [max_context_len]."""
        return [max_context_len]

    def can_capture(self, dtype, head_dim, block_size):
        """Whether a decode step through this backend can be recorded in a CUDA graph: no, the gather
        is sized on the host (int(context_lens.max())), so float32 / torch steps run eagerly by design."""
        return False

    def ops_table(self, device, dtype, hidden_size, intermediate_size, head_dim, tp_size=1):
        """The model's ops table (pagedattn.layers.ops.make_ops asks the backend): torch ops, this backend's
        K/V write and attention."""
        from pagedattn.layers.ops import torch_ops

        return torch_ops(self)
